"""petrel as a gRPC worker: smg-grpc-proto's `trtllm.TrtllmService` (the TensorRT-LLM worker service the Shepherd
Model Gateway drives) over one LLM. Needs the `grpc` extra (grpcio, smg-grpc-proto).

servicer.py: the RPCs; sampling.py: GenerateRequest -> SamplingParams (and the limits); responses.py: OutputChunks
-> GenerateStreamChunk / GenerateComplete; kv_events.py: SubscribeKvEvents; tokenizer_bundle.py: GetTokenizer's
zip; server.py: the grpc.aio server in a thread; auth.py: the API key; worker.py: what both services share;
prepare_pool.py: where large requests are prepared; vllm_servicer.py, vllm_sampling.py, vllm_responses.py: smg's
vLLM-protocol service, for prefill-decode disaggregation."""

from __future__ import annotations

SERVICES = ("trtllm", "vllm")


def build_grpc_server(
    llm,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    service: str = "trtllm",
    api_key: str | None = None,
    max_request_bytes: int | None = None,
    **servicer_options,
):
    """A GrpcServer (not started) serving `service` over `llm`: 'trtllm' (trtllm.TrtllmService) or 'vllm'
    (vllm.grpc.engine.VllmEngine, for prefill-decode disaggregation through the gateway); servicer_options go
    to the servicer (petrel/grpc/worker.py WorkerBase). api_key: required on every call but HealthCheck
    (petrel/grpc/auth.py); max_request_bytes: the largest request message (default: HTTP's body limit)."""
    from petrel.grpc.server import GrpcServer

    if service == "trtllm":
        from petrel.grpc.servicer import TrtllmServicer as servicer
    elif service == "vllm":
        from petrel.grpc.vllm_servicer import VllmServicer as servicer
    else:
        raise ValueError(f"grpc service must be one of {list(SERVICES)}, got {service!r}")
    sizes = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
    return GrpcServer(servicer(llm, served_model_name, **servicer_options), host, port, api_key, **sizes)
