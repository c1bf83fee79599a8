"""DisaggregatedParams: what a context-only request returns and a generation-only request carries.

The names are TensorRT-LLM's (`tensorrt_llm.llmapi.DisaggregatedParams`). `opaque_state` is the KV transfer
handle (a string, so that it travels in JSON as it is); `ctx_info_endpoint` is the context instance's KV
transfer server, "host:port".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")


@dataclass(kw_only=True)
class DisaggregatedParams:
    request_type: str | None = None  # "context_only" | "generation_only" | "context_and_generation"
    first_gen_tokens: list[int] | None = None  # the token(s) the context instance sampled
    ctx_request_id: int | str | None = None  # the context request's id
    opaque_state: str | None = None  # the handle of the pinned prompt KV on the context instance
    draft_tokens: list[int] | None = None  # not supported (must be empty)
    ctx_info_endpoint: str | None = None  # "host:port" of the context instance's KV transfer server

    @property
    def is_context_only(self) -> bool:
        return self.request_type == "context_only"

    @property
    def is_generation_only(self) -> bool:
        return self.request_type == "generation_only"

    def validate(self, vocab_size: int | None = None) -> None:
        """ValueError naming disaggregated_params.<field> for a request this engine cannot run."""
        if self.request_type not in REQUEST_TYPES:
            raise ValueError(
                f"disaggregated_params.request_type must be one of {list(REQUEST_TYPES)}, got {self.request_type!r}"
            )
        if self.draft_tokens:
            raise ValueError("disaggregated_params.draft_tokens are not supported")
        if not self.is_generation_only:
            return
        tokens = self.first_gen_tokens
        if (
            not isinstance(tokens, list)
            or len(tokens) != 1
            or not isinstance(tokens[0], int)
            or (vocab_size is not None and not 0 <= tokens[0] < vocab_size)
        ):
            raise ValueError(
                "disaggregated_params.first_gen_tokens must be the one token id the context "
                f"instance sampled, got {tokens!r}"
            )
        if not isinstance(self.opaque_state, str) or not self.opaque_state:
            raise ValueError(
                "disaggregated_params.opaque_state (the KV transfer handle the context instance "
                "returned) is needed for a generation_only request"
            )
        host, sep, port = (self.ctx_info_endpoint or "").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                "disaggregated_params.ctx_info_endpoint must be the context instance's KV transfer "
                f"server as host:port, got {self.ctx_info_endpoint!r}"
            )

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> DisaggregatedParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"disaggregated_params has unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


class KVTransferBusy(Exception):
    """Disaggregated serving is at its limit (prompts pinned, fetches at once): retry later (HTTP 429)."""


@dataclass
class KVTransferStats:
    """One generation-only request's fetch of its prompt's KV: how much, and how long it took."""

    num_bytes: int
    seconds: float
    num_tokens: int
    endpoint: str

    def to_dict(self) -> dict:
        return {"bytes": self.num_bytes, "seconds": round(self.seconds, 6), "tokens": self.num_tokens}
