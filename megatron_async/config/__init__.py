"""The engine's configuration: ``InferenceConfig`` (every knob, one documented field each,
inference_config.py, with its kernel, communication, speculative and LoRA field groups in
kernel_fields.py, communication_fields.py, speculative_fields.py and lora_fields.py), the ``str``
enums of its modes (modes.py) and the frozen part of it each component is given (parts.py)."""
from megatron_async.config.inference_config import CPU_BUFFER_SIZE_GB, InferenceConfig
from megatron_async.config.modes import (
    AllReduceBackend, AttentionBackend, DpRouting, ExpertExchange, MambaBackend, SamplingBackend, SpeculativeMethod,
)
from megatron_async.config.parts import (
    CacheSizing, Communication, GraphSizing, KernelChoice, LoRASizing, Scheduling, Speculation,
)

__all__ = [
    "CPU_BUFFER_SIZE_GB", "InferenceConfig",
    "AllReduceBackend", "AttentionBackend", "DpRouting", "ExpertExchange", "MambaBackend", "SamplingBackend", "SpeculativeMethod",
    "CacheSizing", "Communication", "GraphSizing", "KernelChoice", "LoRASizing", "Scheduling", "Speculation",
]
