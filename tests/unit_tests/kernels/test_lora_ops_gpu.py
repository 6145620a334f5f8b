"""The split-K LoRA kernels compiled on CUDA at Qwen3-8B shapes (bf16, 8 adapters of rank 16):
close to the float32 reference at decode and prefill row counts, rows of slot -1 untouched bit
for bit, batch-invariant mode's bits of a row the same alone, shuffled and in batches of 64 to
2,048 rows, and a CUDA graph replaying any mix of slots as the eager call computes it. Times:
``python -m benchmarks kernel-times lora``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels.lora_ops import lora_add, lora_add_reference  # noqa: E402
from megatron_async.kernels.triton_lora import PREFILL_ROWS, lora_add_triton  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L, R = 8, 16
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (12288, 12288)), "down": (12288, (4096,))}


def _adapters(k, widths, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    a = (torch.randn(L, len(widths) * R, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = (torch.randn(L, bounds[-1], R, device="cuda", generator=g) * 0.02).bfloat16()
    scale = torch.rand(L, len(widths), device="cuda", generator=g) + 0.5
    starts = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    return a, b, scale, starts, tuple(zip(bounds[:-1], bounds[1:]))


def _rows(t, k, n, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    y = (torch.randn(t, n, device="cuda", generator=g) * 0.1).bfloat16()
    slots = torch.randint(-1, L, (t,), device="cuda", generator=g, dtype=torch.int32)
    return x, y, slots


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("t", [1, 7, 128, PREFILL_ROWS + 300])
def test_close_to_float32_reference(name, t):
    k, widths = SHAPES[name]
    a, b, scale, starts, slices = _adapters(k, widths)
    x, y, slots = _rows(t, k, b.shape[1])
    slots[0] = 3
    ref, got = y.float(), y.clone()
    lora_add_reference(ref, x.float(), a.float(), b.float(), scale, slots, slices)
    lora_add_triton(got, x, a, b, scale, slots, starts)
    delta_ref, delta_got = ref - y.float(), got.float() - y.float()
    err = (delta_got - delta_ref).abs().max().item()
    assert err <= 0.02 * delta_ref.abs().max().item() + 0.02, err  # bf16 roundings of s, the product and y
    base = slots < 0
    assert torch.equal(got[base], y[base])


@pytest.mark.parametrize("name", list(SHAPES))
def test_batch_invariant_bits_across_batch_sizes(name):
    k, widths = SHAPES[name]
    a, b, scale, starts, slices = _adapters(k, widths)
    x, y, slots = _rows(2048, k, b.shape[1])

    def apply(rows):
        out = y[rows].clone()
        lora_add(out, x[rows], a, b, scale, slots[rows], starts, slices, batch_invariant=True)
        return out

    whole = apply(torch.arange(2048, device="cuda"))
    for t in (1, 64, 300):
        rows = torch.randperm(2048, device="cuda")[:t]
        assert torch.equal(apply(rows), whole[rows]), t


def test_graph_replays_any_slot_mix():
    k, widths = SHAPES["qkv"]
    a, b, scale, starts, _ = _adapters(k, widths)
    x, y0, _ = _rows(64, k, b.shape[1])
    slots = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    y = y0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lora_add_triton(y, x, a, b, scale, slots, starts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_add_triton(y, x, a, b, scale, slots, starts)
    for mix in (torch.arange(64) % L, torch.arange(64) % 3 - 1, torch.full((64,), 5)):
        slots.copy_(mix.to(torch.int32))
        y.copy_(y0)
        graph.replay()
        eager = y0.clone()
        lora_add_triton(eager, x, a, b, scale, slots, starts)
        assert torch.equal(y, eager)
