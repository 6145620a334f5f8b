"""Expert parallelism of the MoE layer: expert-sharded weights load as slices of the full
layer, and the layer sharded over 2 (EP) or 2 x 2 (TP x EP) gloo ranks, each rank with its own
number of tokens (one with none), equals the full layer on that rank's tokens, with the
all-gather and the all-to-all token exchange."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async.config import ExpertExchange  # noqa: E402

from megatron_async.models.layers.block import StepInputs  # noqa: E402
from megatron_async.parallel.state import ParallelState  # noqa: E402
from tests.helpers.moe_layers import MOE_CONFIGS, build_moe_layer  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402

HIDDEN = 16


def _step(ep_num_tokens):
    return StepInputs(batch=None, rope=None, mamba_plan=None, ep_num_tokens=ep_num_tokens)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_shards_are_slices_of_the_full_layer(ep):
    cfg = MOE_CONFIGS["softmax"]
    full = build_moe_layer(cfg, HIDDEN, ParallelState())
    for rank in range(ep):
        part = build_moe_layer(cfg, HIDDEN, ParallelState(ep_rank=rank, ep_size=ep))
        n = cfg.num_experts // ep
        assert part.experts.num_local == n and part.experts.first_expert == rank * n
        assert torch.equal(part.experts.gate_up_proj.weight, full.experts.gate_up_proj.weight[rank * n:(rank + 1) * n])
        assert torch.equal(part.experts.down_proj.weight, full.experts.down_proj.weight[rank * n:(rank + 1) * n])
        assert torch.equal(part.gate.weight, full.gate.weight)


def test_expert_count_must_divide():
    with pytest.raises(ValueError, match=r"routed experts \(8\) must be divisible by expert_parallel_size \(3\)"):
        build_moe_layer(MOE_CONFIGS["softmax"], HIDDEN, ParallelState(ep_rank=0, ep_size=3))


def test_expert_loader_rejects_bad_shard_ids():
    layer = build_moe_layer(MOE_CONFIGS["softmax"], HIDDEN, ParallelState(ep_rank=1, ep_size=2))
    w = layer.experts.down_proj.weight
    with pytest.raises(ValueError, match="one expert at a time"):
        w.weight_loader(w, torch.zeros(HIDDEN, 24))
    with pytest.raises(ValueError, match=r"expert 8 is outside \[0, 8\)"):
        w.weight_loader(w, torch.zeros(HIDDEN, 24), (8, None))
    with pytest.raises(ValueError, match="the model expects"):
        w.weight_loader(w, torch.zeros(HIDDEN, 23), (0, None))  # checked even for another rank's expert


def test_ep_layer_needs_the_agreed_token_count():
    layer = build_moe_layer(MOE_CONFIGS["softmax"], HIDDEN, ParallelState(ep_rank=0, ep_size=2))
    with pytest.raises(ValueError, match="agreed padded token count"):
        layer(torch.randn(3, HIDDEN), _step(None))
    with pytest.raises(ValueError, match="agreed padded token count"):
        layer(torch.randn(3, HIDDEN), _step(2))


# token counts per EP rank in each of three steps; the agreed count is their max + 1 (padding)
COUNTS = [(5, 2), (0, 3), (4, 4)]


def _ep_worker(rank: int, world: int, kinds: tuple[str, ...], tp: int) -> list[float]:
    ep = world // tp
    parallel = ParallelState.from_torchrun(tp, "cpu", expert_parallel_size=ep)
    try:
        assert (parallel.tp_size, parallel.ep_size, parallel.dp_rank) == (tp, ep, parallel.ep_rank)
        assert parallel.global_rank == rank
        errors = []
        for kind in kinds:
            for exchange in ExpertExchange:
                errors += _ep_steps(MOE_CONFIGS[kind], dataclasses.replace(parallel, ep_exchange=exchange))
        return errors
    finally:
        parallel.destroy()


def _ep_steps(cfg, parallel: ParallelState) -> list[float]:
    ep = parallel.ep_size
    full = build_moe_layer(cfg, HIDDEN, ParallelState())
    layer = build_moe_layer(cfg, HIDDEN, parallel)
    errors = []
    for step, counts in enumerate(COUNTS):
        counts = (counts * 2)[:ep]
        # the same tokens on the TP ranks of one replica, different ones per EP rank
        x = torch.randn(counts[parallel.ep_rank], HIDDEN,
                        generator=torch.Generator().manual_seed(100 * step + parallel.ep_rank))
        out = layer(x, _step(max(counts) + 1))
        assert out.shape == x.shape
        errors.append(float((out - full(x)).abs().max()) if x.numel() else 0.0)
    return errors


def test_ep2_layer_with_unequal_token_counts_equals_the_full_layer():
    """Softmax (Qwen3 / Mixtral) and sigmoid-grouped (NemotronH: shared expert, latent) layers."""
    for errors in run_ranks(_ep_worker, 2, ("softmax", "sigmoid"), 1, timeout_s=120):
        assert max(errors) < 1e-5, errors


def test_tp2_x_ep2_layer_equals_the_full_layer():
    for errors in run_ranks(_ep_worker, 4, ("sigmoid",), 2, timeout_s=180):
        assert max(errors) < 1e-5, errors
