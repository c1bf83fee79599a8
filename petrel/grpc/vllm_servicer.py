"""smg's vLLM-protocol service (`vllm.grpc.engine.VllmEngine`) over one petrel LLM: the service the gateway
drives prefill-decode disaggregation through. GetServerInfo names petrel's KV connector and the worker's role;
the gateway then sends the prefill leg to a 'prefill' worker (context-only: prompt KV pinned, first token, the
DisaggregatedParams back as kv_transfer_params_json) and relays that JSON to a 'decode' worker (generation-only:
it fetches the KV over petrel's own transfer, petrel/disagg/)."""

from __future__ import annotations

import functools
import time
from collections import Counter

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

import petrel
from petrel.grpc.vllm_responses import VllmResponseBuilder
from petrel.grpc.vllm_sampling import check_sizes, prepares_slowly, vllm_generate_args
from petrel.grpc.worker import WorkerBase
from petrel.serve import worker_info

KV_CONNECTOR = "PetrelConnector"  # any name but Mooncake / NIXL: the gateway relays kv_transfer_params_json as is
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


class VllmServicer(WorkerBase, vpb_grpc.VllmEngineServicer):
    """`pd_role` ('prefill' | 'decode'): the role this service announces and plays, by default the engine's
    kv_transfer_role (an engine with role 'both' can serve a prefill and a decode service, one port each)."""

    def __init__(self, *args, pd_role: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.started = time.time()
        self.pd_role = pd_role or self.llm.config.kv_transfer_role
        self.request_types: Counter = Counter()  # DisaggregatedParams.request_type (None: whole) -> requests

    def _args(self, request):
        args = vllm_generate_args(request, self.limits, self.pd_role)
        dp = args.options.get("disaggregated_params")
        self.request_types[dp.request_type if dp is not None else None] += 1
        return args

    def add_to_server(self, server) -> None:
        vpb_grpc.add_VllmEngineServicer_to_server(self, server)

    async def HealthCheck(self, request, context):
        error = await self.health_error()
        return vpb.HealthCheckResponse(healthy=error is None, message=error or "OK")

    async def GetModelInfo(self, request, context):
        info = worker_info.model_info(self.llm, self.model_name)
        tok = self.llm.tokenizer
        return vpb.GetModelInfoResponse(
            model_path=self.model_name,  # not a path on the gateway's host: it asks GetTokenizer
            served_model_name=self.model_name,
            is_generation=True,
            max_context_length=info["max_model_len"],
            max_req_input_len=info["max_model_len"] - 1,
            vocab_size=info["vocab_size"],
            eos_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else [],
            bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else -1,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else -1,
        )

    async def GetServerInfo(self, request, context):
        info = worker_info.server_info(self.llm, self.model_name)
        role = self.pd_role
        return vpb.GetServerInfoResponse(
            active_requests=len(self.in_flight),
            uptime_seconds=time.time() - self.started,
            server_type=f"petrel-grpc {petrel.__version__}",
            kv_connector=KV_CONNECTOR if role else "",
            kv_role=KV_ROLES.get(role, ""),
            data_parallel_size=1,
            kv_cache_dtype=info["kv_cache_dtype"],
            block_size=info["block_size"],
            model_dtype=info["dtype"],
        )

    async def GetLoads(self, request, context):
        load = await self.kv_events.engine_load()
        snapshot = worker_info.loads_response(load, self.llm.config.max_num_seqs)["loads"][0]
        fields = {f.name for f in vpb.SchedulerLoad.DESCRIPTOR.fields}
        return vpb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            dp_rank_count=1,
            loads=[vpb.SchedulerLoad(**{k: v for k, v in snapshot.items() if k in fields})],
        )

    async def GetTokenizer(self, request, context):
        for data, digest in await self.tokenizer_chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)

    async def SubscribeKvEvents(self, request, context):
        async for batch in self.kv_events.subscribe(request, context):
            yield batch

    async def Embed(self, request, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "petrel serves generation models over this service: Embed is not implemented"
        )

    async def Abort(self, request, context):
        for request_id in request.request_ids:
            self.abort(request_id)
        return vpb.AbortResponse()

    async def Generate(self, request, context):
        await self.check_sizes(check_sizes, request, context)
        sp = request.sampling_params
        builder = VllmResponseBuilder(
            request.request_id, request.stream, sp.HasField("logprobs"), self.llm.kv_transfer_endpoint
        )
        make_args = functools.partial(self._args, request)
        async for response in self.run(request.request_id, make_args, builder, context, prepares_slowly(request)):
            yield response
