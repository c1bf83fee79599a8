"""LoRARequest: which LoRA adapter a request runs with (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).

    lora_int_id identifies the adapter (>= 1, unique per adapter): it keys the engine's adapter cache and slots,
    and goes into the prefix-cache root hash, so two adapters never share KV blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must be a directory path, got {self.lora_path!r}")
