"""Is every kernel deterministic? Re-run one engine step on identical inputs and compare bits,
kernel by kernel; and does a row's result depend on how many rows share the launch?

``repeat_step`` reruns ``runner.compute_step(shape)`` twice on the step's GPU view (the
same inputs and shapes as the launch the engine just made: KV writes and ``last_samples``
get the same values again, so the engine's state is unchanged) with taps on the functions
the model calls (GEMMs, attention, norms, RoPE, activation, LM head), and reports, per
kernel, how many calls gave different bits. Only for GPT models in serial mode (the GPU view
must still hold the launch's snapshot)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from benchmarks.schedule_trace import bit_digest

# (module path, attribute, label) of the functions tapped while a step is repeated; every
# linear layer and the LM head are tapped as modules (forward hooks), labelled by their name.
FUNCTION_TAPS = (
    ("megatron_async.models.layers.attention_layer", "attend", "attention"),
    ("megatron_async.kernels.fused_ops", "rms_norm", "rms_norm"),
    ("megatron_async.kernels.fused_ops", "add_rms_norm", "add_rms_norm"),
    ("megatron_async.kernels.fused_ops", "rope_qk", "rope_qk"),
    ("megatron_async.kernels.fused_ops", "silu_and_mul", "silu_and_mul"),
)


def _is_gemm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Linear") or name.endswith("LMHead")


def _digests(out) -> tuple:
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(tuple(bit_digest(t.reshape(t.shape[0], -1))) if t.dim() >= 1 and t.numel() else ()
                 for t in tensors if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def tapped(model: torch.nn.Module, calls: list[tuple[str, tuple]]):
    """Record (label, output digests) of every tapped call made inside the block: the model's
    linear layers and LM head (label ``gemm_<attribute name>``) and FUNCTION_TAPS."""
    import importlib

    saved, hooks = [], []
    for mod_name, attr, label in FUNCTION_TAPS:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, attr, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, _label=label, **kw):
            out = _fn(*a, **kw)
            calls.append((_label, _digests(out)))
            return out

        saved.append((mod, attr, fn))
        setattr(mod, attr, wrap)
    for name, module in model.named_modules():
        if _is_gemm(module):
            label = "gemm_" + name.rsplit(".", 1)[-1]
            hooks.append(module.register_forward_hook(lambda m, i, out, _l=label: calls.append((_l, _digests(out)))))
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()
        for mod, attr, fn in reversed(saved):
            setattr(mod, attr, fn)


@dataclass
class RepeatReport:
    launch: int
    kind: str
    """decode | mixed"""
    num_rows: int
    num_tokens: int
    calls: int = 0
    differing: dict[str, int] = field(default_factory=dict)
    """Kernel label -> calls whose bits differed between the two repeats."""
    tokens_equal_engine: bool = True
    """The repeats' sampled tokens equal the engine's own launch."""

    def describe(self) -> str:
        diff = ", ".join(f"{k}: {v}" for k, v in sorted(self.differing.items())) or "none"
        return (f"launch {self.launch} ({self.kind}, {self.num_rows} rows, {self.num_tokens} tokens): {self.calls} "
                f"kernel calls repeated twice, differing bits: {diff}; repeat tokens == engine tokens: "
                f"{self.tokens_equal_engine}")


@torch.inference_mode()
def repeat_step(engine, shape, pending, launch: int) -> RepeatReport:
    runner = engine.runner
    engine.context.device.synchronize()
    engine_tokens = pending.host_tokens.clone()
    runs = []
    for _ in range(2):
        calls: list = []
        with tapped(runner.model, calls):
            tokens = runner.compute_step(shape)[0].clone()
        runs.append((calls, tokens))
    (a, ta), (b, tb) = runs
    rep = RepeatReport(launch, "decode" if shape.is_decode_only else "mixed", shape.num_rows, shape.num_tokens, len(a))
    for (label, da), (_, db) in zip(a, b):
        if da != db:
            rep.differing[label] = rep.differing.get(label, 0) + 1
    rep.tokens_equal_engine = bool(torch.equal(ta.cpu(), engine_tokens) and torch.equal(tb.cpu(), engine_tokens))
    return rep


@dataclass(frozen=True)
class InvarianceProbe:
    kernel: str
    rows: int
    same_bits_as_one_row: bool


@torch.inference_mode()
def batch_invariance_probe(model, device: torch.device, dtype: torch.dtype,
                           row_counts=(1, 7, 32, 128, 1024, 8192), seed: int = 0) -> list[InvarianceProbe]:
    """Row 0 of a GEMM (the first merged column-parallel layer, e.g. an MLP's gate/up) and of the
    LM head computed inside batches of different sizes, compared bitwise with the same row
    computed alone: shows whether a change of batch mix (another schedule) alone can change a token."""
    gemm = next(m for m in model.modules() if type(m).__name__ == "MergedColumnParallelLinear")
    fns = {"gemm_gate_up": gemm, "lm_head": model.compute_logits}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(row_counts), gemm.weight.shape[1], generator=gen).to(device, dtype)
    out = []
    for name, fn in fns.items():
        alone = fn(x[:1])
        for m in row_counts:
            out.append(InvarianceProbe(name, m, bool(torch.equal(fn(x[:m])[:1], alone))))
    return out
