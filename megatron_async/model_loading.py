"""What an ``LLM`` serves, loaded: dtype names, the model and its tokenizer (a checkpoint
directory or a built-in model, checked against the device's memory first on CUDA), the EOS ids
the model can emit, and whether the model can run batch-invariant numerics here."""
from __future__ import annotations

import logging
import os

import torch

from megatron_async.inference.memory_planning import GiB, CudaMemoryReader, MemoryPlanError, check_weights_fit
from megatron_async.inference.memory_profiling import builtin_weight_bytes
from megatron_async.parallel.state import ParallelState

log = logging.getLogger("megatron_async")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def check_batch_invariant(model: torch.nn.Module, device: torch.device) -> None:
    """Batch-invariant numerics run Triton kernels in attention / MLP layers only: say so up front."""
    if not getattr(model, "supports_batch_invariant", False):
        raise ValueError(f"batch_invariant is not supported for {type(model).__name__}: attention + MLP models "
                         "only (dense GPT; not Mamba2 or MoE layers)")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ValueError("batch_invariant needs triton") from e
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("batch_invariant runs Triton kernels: use device='cuda', or set TRITON_INTERPRET=1 on CPU")


def load_model(model: str | None, default_model: str, seed: int, device: torch.device, dtype: torch.dtype,
               parallel: ParallelState, quantization: str | None, reader: CudaMemoryReader | None):
    """(model, tokenizer or None): the checkpoint at ``model``, or the built-in ``default_model``
    (random weights from ``seed``). On CUDA a model whose weights cannot fit fails with the
    numbers, before or instead of a CUDA out-of-memory traceback."""
    from megatron_async.models import build_default_model, load_checkpoint, load_tokenizer

    now = reader.read() if reader else None
    try:
        if model is None:
            if now:
                check_weights_fit(builtin_weight_bytes(default_model, dtype, parallel, quantization), now.total, now.free)
            built = build_default_model(default_model, device, dtype, seed=seed, parallel=parallel,
                                        quantization=quantization)
            tokenizer = None
            if default_model.startswith("tiny"):  # sized to the in-process tiny BPE: text prompts work
                from megatron_async.models import Tokenizer
                from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer

                tokenizer = Tokenizer(train_tiny_tokenizer(), EOS_TOKEN_ID)
        else:
            built, _ = load_checkpoint(model, device, dtype, parallel, quantization)
            tokenizer = load_tokenizer(model)
    except torch.OutOfMemoryError:
        raise MemoryPlanError(f"model does not fit: CUDA out of memory while loading its weights (device had "
                              f"{now.free / GiB:.2f} GiB free of {now.total / GiB:.2f} GiB)") from None
    if device.type == "cuda":  # before any capture, so graphs and eager steps take one path
        from megatron_async.kernels.triton_fp8_gemm import settle_fp8_linears
        settle_fp8_linears(built, device)
    return built, tokenizer


def eos_ids(model: str | None, built: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """The ids that end a request without its own termination id. The tokenizer already holds
    every EOS id of the checkpoint (Tokenizer.from_dir), so the engine stops on exactly the ids
    that every other user of the tokenizer sees."""
    from megatron_async.models.eos_ids import checkpoint_eos_ids

    tok_eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    if model is None:
        ids = tuple(dict.fromkeys(i for i in (*tok_eos, built.eos_token_id) if i is not None))
    else:
        ids = tok_eos if tokenizer is not None else checkpoint_eos_ids(model)
    return in_vocab_eos_ids(ids, built.vocab_size)


def in_vocab_eos_ids(ids, vocab_size: int) -> tuple[int, ...]:
    """EOS ids the model can emit. A config may list ids beyond the (padded) vocabulary; the
    device-side stop masks (min_tokens, penalties) index by id, so such ids are dropped with a
    warning instead of failing every step of the requests that use them."""
    kept = tuple(i for i in ids if 0 <= i < vocab_size)
    if len(kept) != len(ids):
        log.warning("ignoring EOS ids outside the vocabulary (size %d): %s", vocab_size, sorted(set(ids) - set(kept)))
    return kept
