"""The part of ``InferenceConfig`` that sizes the LoRA adapter slots (``InferenceConfig.lora()``):
how many adapters the model holds at once and their largest rank. Field meanings:
``InferenceConfig``'s docstrings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRASizing:
    enable_lora: bool
    max_loras: int
    max_lora_rank: int

    def validate(self) -> None:
        """Raise ValueError on sizes that cannot work (changes nothing)."""
        if self.enable_lora and self.max_loras <= 0:
            raise ValueError(f"InferenceConfig.max_loras must be positive, got {self.max_loras}")
        if self.enable_lora and self.max_lora_rank <= 0:
            raise ValueError(f"InferenceConfig.max_lora_rank must be positive, got {self.max_lora_rank}")
