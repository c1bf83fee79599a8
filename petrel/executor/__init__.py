"""The Executor API: token ids in, Responses out, with in-flight batching (TensorRT-LLM's executor, in Python)."""

from petrel.executor.executor import Executor
from petrel.executor.types import (
    AdditionalModelOutput,
    AdditionalOutput,
    ExecutorConfig,
    FinishReason,
    GuidedDecodingParams,
    GuideType,
    LogitsPostProcessorConfig,
    OutputConfig,
    Request,
    RequestStage,
    RequestStats,
    Response,
    Result,
    SamplingConfig,
)

__all__ = [
    "Executor",
    "ExecutorConfig",
    "Request",
    "Response",
    "Result",
    "SamplingConfig",
    "OutputConfig",
    "AdditionalModelOutput",
    "AdditionalOutput",
    "FinishReason",
    "GuidedDecodingParams",
    "GuideType",
    "LogitsPostProcessorConfig",
    "RequestStage",
    "RequestStats",
]
