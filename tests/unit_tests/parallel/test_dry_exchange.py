"""The dry pass's stand-ins for the EP exchange (parallel/dry_exchange.py): over two gloo ranks,
a MoE layer's forward with the stand-ins issues no collective, and every tensor a kernel
reads after the exchange (the experts' inputs, the reduce-scatter's result, the layer's output)
has the shape, dtype, strides and 16-byte alignment of the real exchange's, the situation
Triton specializes on. The modules hold their own exchange again after the block (and a P2P
exchanger its call counts); the all-to-all exchange gets no stand-in."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async.config import ExpertExchange  # noqa: E402
from megatron_async.models.layers.block import StepInputs  # noqa: E402
from megatron_async.parallel import communication  # noqa: E402
from megatron_async.parallel.dry_exchange import LocalExchange, can_stand_in, local_exchange  # noqa: E402
from megatron_async.parallel.state import ParallelState  # noqa: E402
from tests.helpers.exchange_signatures import no_collectives, recording, signature  # noqa: E402
from tests.helpers.moe_layers import MOE_CONFIGS, build_moe_layer  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402

HIDDEN = 16


def _signatures(layer, x: torch.Tensor, agreed: int) -> list:
    with recording() as seen:
        out = layer(x, StepInputs(batch=None, rope=None, mamba_plan=None, ep_num_tokens=agreed))
    return seen + [("out", signature(out))]


def _worker(rank: int, world: int, kind: str) -> tuple[list, list]:
    parallel = ParallelState.from_torchrun(1, "cpu", expert_parallel_size=world)
    try:
        layer = build_moe_layer(MOE_CONFIGS[kind], HIDDEN, parallel)
        x = torch.randn(3 + rank, HIDDEN, generator=torch.Generator().manual_seed(rank))
        real = _signatures(layer, x, 6)
        with no_collectives(), local_exchange(layer) as swapped:
            assert swapped >= 1 and isinstance(layer.experts.parallel.ep_exchanger, LocalExchange)
            dry = _signatures(layer, x, 6)
        assert layer.experts.parallel is parallel  # the real exchange again
        return real, dry
    finally:
        parallel.destroy()


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_the_stand_ins_give_the_real_exchanges_tensors_without_a_collective(kind):
    for real, dry in run_ranks(_worker, 2, kind, timeout_s=120):
        assert [s[0] for s in real].count("experts") == 1 and len(real) == 4
        assert dry == real


class _P2P:
    def __init__(self):
        self.calls = Counter(all_gather=3)

    def accepts(self, x, gather):
        return True

    def all_gather(self, x):
        raise AssertionError("a P2P kernel outside a capture would run")


def test_outside_a_capture_no_p2p_kernel_runs_and_its_counts_stay():
    p2p = _P2P()
    parallel = ParallelState(ep_rank=1, ep_size=2, ep_exchanger=p2p)
    layer = build_moe_layer(MOE_CONFIGS["softmax"], HIDDEN, parallel)
    with local_exchange(layer):
        out = communication.ep_all_gather(torch.zeros(3, 5), layer.experts.parallel)
        p2p.calls["all_gather"] += 1  # as a captured launch would count
        scattered = communication.ep_reduce_scatter(torch.arange(8.0).view(4, 2), layer.experts.parallel)
    assert out.shape == (6, 5) and torch.equal(scattered, torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert p2p.calls == Counter(all_gather=3) and layer.experts.parallel is parallel


def test_the_all_to_all_exchange_gets_no_stand_in():
    layer = build_moe_layer(MOE_CONFIGS["softmax"], HIDDEN,
                            ParallelState(ep_rank=0, ep_size=2, ep_exchange=ExpertExchange.ALL_TO_ALL))
    assert not can_stand_in(layer)
    with pytest.raises(ValueError, match="all-to-all"):
        with local_exchange(layer):
            pass
