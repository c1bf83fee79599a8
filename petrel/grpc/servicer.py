"""trtllm.TrtllmService over one petrel LLM (grpc.aio): token ids in, per-step delta chunks out, so the smg gateway
(or any client of smg-grpc-proto's stubs) drives petrel as a TensorRT-LLM worker."""

from __future__ import annotations

import functools

import grpc
from smg_grpc_proto import trtllm_service_pb2 as pb
from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from petrel.grpc.responses import ResponseBuilder
from petrel.grpc.sampling import check_sizes, generate_args, prepares_slowly
from petrel.grpc.worker import WorkerBase
from petrel.serve import worker_info

SUPPORTED_FEATURES = ["logprobs", "prompt_logprobs", "guided_decoding", "lora", "beam_search", "kv_events"]


class TrtllmServicer(WorkerBase, pb_grpc.TrtllmServiceServicer):
    """The RPCs; the options are WorkerBase's (a request picks a LoRA adapter by lora_config.task_id)."""

    def add_to_server(self, server) -> None:
        pb_grpc.add_TrtllmServiceServicer_to_server(self, server)

    async def HealthCheck(self, request, context):
        error = await self.health_error()
        if error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, error)
        return pb.HealthCheckResponse(status="OK")

    async def GetModelInfo(self, request, context):
        info = worker_info.model_info(self.llm, self.model_name)
        return pb.GetModelInfoResponse(
            model_id=self.model_name,
            max_input_len=info["max_model_len"] - 1,
            max_seq_len=info["max_model_len"],
            max_batch_size=self.llm.config.max_num_seqs,
            vocab_size=info["vocab_size"],
            hidden_size=info["hidden_size"],
            num_layers=info["num_layers"],
            num_heads=info["num_heads"],
            supported_features=SUPPORTED_FEATURES,
        )

    async def GetServerInfo(self, request, context):
        info = worker_info.server_info(self.llm, self.model_name)
        return pb.GetServerInfoResponse(
            version=info["version"],
            backend=info["backend"],
            tensor_parallel_size=info["tp_size"],
            pipeline_parallel_size=1,
            context_parallel_size=1,
            world_size=info["tp_size"],
        )

    async def GetTokenizer(self, request, context):
        for data, digest in await self.tokenizer_chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)

    async def Embed(self, request, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "petrel serves generation models over this service: Embed is not implemented"
        )

    async def SubscribeKvEvents(self, request, context):
        async for batch in self.kv_events.subscribe(request, context):
            yield batch

    async def Abort(self, request, context):
        if not self.abort(request.request_id):
            return pb.AbortResponse(success=False, message=f"no request {request.request_id!r} in flight")
        return pb.AbortResponse(success=True, message="aborted")

    async def Generate(self, request, context):
        await self.check_sizes(check_sizes, request, context)
        builder = ResponseBuilder(request.request_id, request.streaming, request.include_stop_token_in_output)
        make_args = functools.partial(generate_args, request, self.limits)
        async for response in self.run(request.request_id, make_args, builder, context, prepares_slowly(request)):
            yield response
