"""The Triton kernels an engine compiled, read from Triton's caches (``python -m benchmarks
kernel-occupancy``): launch settings, registers, spills and shared memory of each binary."""
from __future__ import annotations

import sys

KERNEL_PACKAGE = "megatron_async.kernels"


def jit_functions() -> list[tuple[str, object]]:
    """(module.name, JITFunction) of every Triton kernel the package's kernel modules define (an
    autotuner or heuristics wrapper unwrapped), each once."""
    found: dict[int, tuple[str, object]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(KERNEL_PACKAGE) or module is None:
            continue
        for attr, obj in vars(module).items():
            fn = obj
            while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):
                fn = fn.fn
            if hasattr(fn, "device_caches") and id(fn) not in found:
                found[id(fn)] = (f"{name.rsplit('.', 1)[-1]}.{attr}", fn)
    return list(found.values())


def compiled_kernels() -> set[tuple]:
    """(kernel, warps, stages, registers, spills, shared bytes, register cap) of every binary the
    kernels' caches hold."""
    rows = set()
    for name, fn in jit_functions():
        for entry in fn.device_caches.values():
            for kernel in (entry[0] if isinstance(entry, tuple) else entry).values():
                kernel._init_handles()  # loads the binary: its register and spill counts
                md = kernel.metadata
                rows.add((name, md.num_warps, md.num_stages, kernel.n_regs, kernel.n_spills, md.shared,
                          getattr(md, "maxnreg", None) or 0))
    return rows


def one_model(model: str, quantization: str | None, prompts: int) -> set[tuple]:
    import torch

    from megatron_async import LLM, InferenceConfig, SamplingParams

    llm = LLM(None, "cuda", "bfloat16", InferenceConfig(max_requests=128, max_tokens=8192), default_model=model,
              quantization=quantization)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 1025, (prompts,), generator=gen).tolist()
    vocab = llm.model.vocab_size
    llm.generate([torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens],
                 SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True))
    rows = compiled_kernels()
    llm.close()
    return rows
