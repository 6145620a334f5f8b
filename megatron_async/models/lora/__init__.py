"""LoRA adapters served beside the base model: PEFT's format (peft_format.py) and the slots a model
holds them in (adapters.py; the per-linear storage is ``parallel/lora_slots.py``)."""
from megatron_async.models.lora.adapters import LoRAAdapters
from megatron_async.models.lora.peft_format import AdapterConfig, LoRAError, read_adapter

__all__ = ["AdapterConfig", "LoRAAdapters", "LoRAError", "read_adapter"]
