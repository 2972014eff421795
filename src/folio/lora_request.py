"""LoRARequest: which adapter a request runs with (vLLM's fields), offline
`LLM.generate(..., lora_request=LoRARequest(name, id, path))`. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int        # positive, one per adapter: the prefix cache keys blocks by it
    lora_path: str          # a PEFT folder: adapter_config.json + adapter_model.safetensors

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
