"""petrel: a fast LLM inference engine and server."""
from petrel.config import EngineConfig
from petrel.disagg import DisaggregatedParams
from petrel.guided_decoding import GuidedDecodingParams
from petrel.llm import LLM, RequestFuture
from petrel.lora import LoRARequest
from petrel.outputs import (CompletionOutput, FinishDetails, Logprob, OutputChunk, RequestOutput,
                            RequestPerfMetrics)
from petrel.sampling_params import SamplingParams
from petrel.text_request import TextGenerationRequest

__all__ = ["LLM", "RequestFuture", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "Logprob", "OutputChunk", "FinishDetails", "RequestPerfMetrics", "TextGenerationRequest",
           "GuidedDecodingParams", "LoRARequest", "DisaggregatedParams"]
__version__ = "0.1.0"
