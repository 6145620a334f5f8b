"""Which kernels a model's layers run: one ``KernelBackends`` per model (``CausalLM.kernels``),
read by its layers at every forward and passed to the kernel entry points as arguments. No
process-wide switch: two models in one process may run different kernels.

The defaults are the pure-torch references, with the fused elementwise Triton kernels on CUDA
tensors; ``resolve`` turns ``InferenceConfig``'s AUTO choices into concrete ones for a device."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_async.config import AttentionBackend, KernelChoice, MambaBackend


@dataclass(frozen=True)
class KernelBackends:
    attention: AttentionBackend = AttentionBackend.TORCH
    """TORCH or TRITON (never AUTO). The MoE experts follow it: TRITON = the fused Triton MoE."""
    mamba: MambaBackend = MambaBackend.TORCH
    """TORCH, TRITON or MAMBA_SSM (never AUTO); MAMBA_SSM runs the Triton kernels too."""
    fused: bool = True
    """The fused Triton kernels for per-layer elementwise work (``fused_ops``), on CUDA tensors."""
    split_linear: bool = True
    """With ``fused``: a block's output projection at decode sizes may leave its K-split sum to the
    next norm (``fused_ops.split_linear``; ``InferenceConfig.split_linear``)."""

    @property
    def split_k(self) -> bool:
        """The output projections' K-split path: ``fused`` and ``split_linear``."""
        return self.fused and self.split_linear

    flashinfer_prefill: bool = False
    """With Triton attention: a long-tile step's long rows on FlashInfer's FA3 kernel
    (``flashinfer_prefill``); set by the engine once the kernel loaded (``InferenceConfig.flashinfer_prefill``)."""
    moe_grouped_mm: bool = True
    """With ``triton_moe``: prefill-size batches may run the experts as grouped GEMMs
    (``moe_experts.fused_experts``; ``InferenceConfig.moe_grouped_mm``)."""
    moe_triton_grouped_gemm: bool = True
    """Large batches may run the grouped experts' GEMMs in Triton (``InferenceConfig.moe_triton_grouped_gemm``)."""

    @property
    def triton_attention(self) -> bool:
        return self.attention == AttentionBackend.TRITON

    @property
    def triton_moe(self) -> bool:
        """The routed experts' kernel: the fused Triton MoE with Triton attention, else the torch loop."""
        return self.attention == AttentionBackend.TRITON

    @property
    def triton_mamba(self) -> bool:
        """The Mamba mixers run this repo's Triton kernels (else the torch reference)."""
        return self.mamba in (MambaBackend.TRITON, MambaBackend.MAMBA_SSM)

    @classmethod
    def resolve(cls, attention: AttentionBackend | str, mamba: MambaBackend | str,
                device: torch.device | str, fused: bool = True) -> KernelBackends:
        return cls(resolve_attention_backend(attention, device), resolve_mamba_backend(mamba, device), fused)

    @classmethod
    def from_choice(cls, choice: KernelChoice, device: torch.device | str) -> KernelBackends:
        """The kernels of a model built from ``InferenceConfig.kernels()`` on ``device``."""
        return replace(cls.resolve(choice.attention_backend, choice.mamba_backend, device),
                       split_linear=choice.split_linear, moe_grouped_mm=choice.moe_grouped_mm,
                       moe_triton_grouped_gemm=choice.moe_triton_grouped_gemm)


def resolve_attention_backend(backend: AttentionBackend | str, device: torch.device | str) -> AttentionBackend:
    """AUTO: Triton on CUDA when importable, else torch."""
    backend = AttentionBackend(backend)
    if backend != AttentionBackend.AUTO:
        return backend
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401

            from megatron_async.kernels import attention_triton  # noqa: F401

            return AttentionBackend.TRITON
        except ImportError:
            pass
    return AttentionBackend.TORCH


def _mamba_ssm_importable() -> bool:
    try:
        import causal_conv1d  # noqa: F401
        import mamba_ssm  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_mamba_usable(on_cuda: bool) -> bool:
    """Triton imports and its kernels can run here: compiled on CUDA, interpreted on CPU (only
    when TRITON_INTERPRET=1 was set before the kernels were decorated)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from megatron_async.kernels import triton_mamba_decode
    except ImportError:
        return False
    return on_cuda or isinstance(triton_mamba_decode._state_update_kernel, InterpretedFunction)


def resolve_mamba_backend(backend: MambaBackend | str, device: torch.device | str) -> MambaBackend:
    """AUTO: TRITON on CUDA when triton imports, else TORCH. MAMBA_SSM is never picked by AUTO:
    only on request, where its packages import."""
    backend = MambaBackend(backend)
    on_cuda = torch.device(device).type == "cuda"
    if backend == MambaBackend.AUTO:
        return MambaBackend.TRITON if on_cuda and _triton_mamba_usable(on_cuda) else MambaBackend.TORCH
    if backend == MambaBackend.MAMBA_SSM and not (on_cuda and _mamba_ssm_importable()):
        raise ValueError("MambaBackend.MAMBA_SSM needs CUDA and the mamba_ssm + causal_conv1d packages")
    if backend == MambaBackend.TRITON and not _triton_mamba_usable(on_cuda):
        raise ValueError("MambaBackend.TRITON needs triton on CUDA, or TRITON_INTERPRET=1 set before import on CPU")
    return backend
