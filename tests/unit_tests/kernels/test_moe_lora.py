"""Routed experts with LoRA adapters (``kernels/moe_lora.py``) against the experts with each
adapter merged into their weights: every (token, expert) pair takes its token's adapter for that
expert, rows of the base model none; the torch path and the Triton LoRA pair (interpreted on
CPU, as on CUDA) alike."""
from types import SimpleNamespace

import pytest
import torch

from megatron_async.kernels.moe_lora import fused_experts_lora, grouped_linear, row_entries
from megatron_async.kernels.moe_grouped_mm import plan_rows
from megatron_async.kernels.moe_torch import fused_experts_torch
from megatron_async.parallel.expert_lora_slots import ExpertLoRASlots
from megatron_async.parallel.sharding import Sharding

E, K, I, TOP_K, R = 4, 16, 12, 2, 4


def _slots(num_local, first, parts, out, k, max_loras=3):
    """ExpertLoRASlots of a stand-in expert linear (only its weight's shape and sharding are read)."""
    inner = SimpleNamespace(shard_ids=tuple(range(len(parts))) if len(parts) > 1 else ())
    weight = torch.zeros(num_local, out, k)
    weight.sharding = SimpleNamespace(inner=inner)
    linear = SimpleNamespace(weight=weight, first_expert=first)
    return ExpertLoRASlots(linear, parts, max_loras, R)


def _case(gated: bool, seed: int, E: int = E, K: int = K, I: int = I):
    g = torch.Generator().manual_seed(seed)
    N = 2 * I if gated else I
    w13, w2 = torch.randn(E, N, K, generator=g) * 0.3, torch.randn(E, K, I, generator=g) * 0.3
    s13 = _slots(E, 0, [I, I] if gated else [I], N, K)
    s2 = _slots(E, 0, [K], K, I)
    merged = {}  # adapter slot -> (w13, w2) with that adapter merged
    for slot, (rank, scale) in {0: (R, 2.0), 2: (2, 0.5)}.items():
        m13, m2 = w13.clone(), w2.clone()
        for e in range(E):
            if e == 3 and slot == 2:  # an expert this adapter leaves alone
                continue
            for j, (lo, hi) in enumerate(s13.slices):
                a, b = torch.randn(rank, K, generator=g), torch.randn(hi - lo, rank, generator=g)
                s13.write(slot, (e, j), a, b, scale)
                m13[e, lo:hi] += scale * b @ a
            a, b = torch.randn(rank, I, generator=g), torch.randn(K, rank, generator=g)
            s2.write(slot, (e, 0), a, b, scale)
            m2[e] += scale * b @ a
        merged[slot] = (m13, m2)
    return w13, w2, s13, s2, merged


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_each_pair_takes_its_tokens_adapter(gated, batch_invariant):
    w13, w2, s13, s2, merged = _case(gated, seed=1)
    g = torch.Generator().manual_seed(2)
    M = 9
    x = torch.randn(M, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(M)]).to(torch.int32)
    ids[4, 1] = E  # a pair of no expert (another EP rank's, or padding)
    weights = torch.rand(M, TOP_K, generator=g)
    token_slots = torch.tensor([0, -1, 2, 0, 2, -1, 0, 2, -1], dtype=torch.int32)
    out = fused_experts_lora(x, w13, w2, ids, weights, gated, token_slots, s13, s2, batch_invariant)
    for t in range(M):
        slot = int(token_slots[t])
        m13, m2 = (w13, w2) if slot < 0 else merged[slot]
        want = fused_experts_torch(x[t:t + 1], m13, m2, ids[t:t + 1], weights[t:t + 1], gated)
        torch.testing.assert_close(out[t:t + 1], want, atol=1e-4, rtol=1e-4)
    base = fused_experts_torch(x, w13, w2, ids, weights, gated)
    assert not torch.allclose(out[0], base[0], atol=1e-3)  # the adapters moved the rows they serve
    torch.testing.assert_close(out[token_slots < 0], base[token_slots < 0], atol=1e-5, rtol=1e-5)


def test_row_entries_name_slot_and_expert_only_for_adapted_pairs():
    ids = torch.tensor([[0, 2], [1, 4], [2, 3]], dtype=torch.int32)
    row_of_pair, token_of_row, offs = plan_rows(ids, E)
    entries = row_entries(torch.tensor([1, -1, 0], dtype=torch.int32), row_of_pair, token_of_row.long(), offs, E)
    got = {}
    for pair, row in enumerate(row_of_pair.tolist()):
        if row < entries.shape[0]:
            got[pair] = int(entries[row])
    assert got == {0: 1 * E + 0, 1: 1 * E + 2, 2: -1, 4: 0 * E + 2, 5: 0 * E + 3}  # pair 3: no expert
    holds = set(r for r in row_of_pair.tolist() if r < entries.shape[0])
    assert all(int(entries[r]) == -1 for r in range(entries.shape[0]) if r not in holds)  # padding rows


def test_grouped_linear_loop_matches_per_group_products():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(E, 5, K, generator=g)
    offs = torch.tensor([8, 8 + 16, 8 + 16 + 8, 8 + 16 + 8 + 8], dtype=torch.int32)
    rows = torch.randn(48, K, generator=g)
    out = grouped_linear(rows, w, offs)
    start = 0
    for e, end in enumerate(offs.tolist()):
        torch.testing.assert_close(out[start:end], rows[start:end] @ w[e].T)
        start = end
    assert torch.count_nonzero(out[start:]) == 0


def test_slots_keep_only_this_ranks_experts():
    s = _slots(4, first=4, parts=[K], out=K, k=I)
    a, b = torch.ones(R, I), torch.ones(K, R)
    s.write(1, (2, 0), a, b, 1.0)  # expert 2 lives on the other rank
    assert torch.count_nonzero(s.a) == 0 and torch.count_nonzero(s.scale) == 0
    s.write(1, (5, 0), a, b, 1.5)
    assert torch.equal(s.a[1, 1, :R], a) and s.scale[1, 1, 0] == 1.5 and torch.count_nonzero(s.a[:, 0]) == 0
    assert s.full_shapes((5, 0), 3) == ((3, I), (K, 3))


@pytest.mark.gpu
def test_gpu_bf16_graph_replays_any_mix_of_adapters():
    """bf16 on CUDA (torch's grouped GEMM on Hopper, the Triton LoRA pair): close to the fp32 CPU
    result; one captured graph replays new slots and routing as eager computes them."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    E, K, I = 8, 64, 32
    w13, w2, s13, s2, _ = _case(True, seed=4, E=E, K=K, I=I)
    g = torch.Generator().manual_seed(5)
    M = 48
    x = torch.randn(M, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, TOP_K, generator=g)
    slots = torch.randint(-1, 3, (M,), generator=g, dtype=torch.int32)
    want = fused_experts_lora(x, w13, w2, ids, weights, True, slots, s13, s2)
    for s in (s13, s2):
        s.a, s.b, s.scale = s.a.cuda().bfloat16(), s.b.cuda().bfloat16(), s.scale.cuda()
        s.starts = s.starts.cuda()
    dev = [t.cuda() for t in (x, ids, weights, slots)]
    w13c, w2c = w13.cuda().bfloat16(), w2.cuda().bfloat16()
    xb = dev[0].bfloat16()

    def run():
        return fused_experts_lora(xb, w13c, w2c, dev[1], dev[2], True, dev[3], s13, s2)

    eager = run()
    # bf16 rounds every stage of outputs ~6e4 large (unscaled random adapters): within 2 % of the
    # largest output; a row missing its adapter, or taking another's, is off by most of it
    torch.testing.assert_close(eager.float().cpu(), want, atol=0.02 * want.abs().max().item(), rtol=0.02)
    run()  # Triton builds before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    dev[3].copy_(dev[3].flip(0))
    dev[1].copy_(dev[1].roll(1, 1))
    graph.replay()
    torch.testing.assert_close(out, run(), atol=0, rtol=0)
    err = (eager.float().cpu() - want).abs().max().item()
    print(f"\n{'case':>16} {'max abs bf16 - fp32':>20} {'largest output':>15}\n{'M=48 E=8 top-2':>16} {err:>20.4f} "
          f"{want.abs().max().item():>15.1f}")
