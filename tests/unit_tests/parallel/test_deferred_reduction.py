"""Deferred TP reduction (the fused all-reduce + add + RMSNorm's wiring), one process: a
row-parallel layer hands its partial product over as a ``PendingSum`` exactly when it is a
block mixer's output projection, without bias, outside batch-invariant mode and when the
group's reducer fuses that shape; the norm then takes the fused result, or reduces first when
the reducer declines, matching the unfused path. The reducer here is a stand-in that records
calls (TP=2 without a process group: its "sum" is the identity)."""
from __future__ import annotations

import pytest
import torch

from megatron_async.models.layers.block import Block
from megatron_async.models.layers.mlp import SwiGLUMLP
from megatron_async.models.layers.norm import NemotronRMSNorm, RMSNorm
from megatron_async.parallel import linear as linear_module
from megatron_async.parallel.communication import PendingSum
from megatron_async.parallel.linear import RowParallelLinear
from megatron_async.parallel.state import ParallelState


class _Reducer:
    def __init__(self, fuses: bool = True, fused_result: bool = True):
        self.fuses, self.fused_result, self.log = fuses, fused_result, []

    def accepts(self, x: torch.Tensor) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append("all_reduce")
        return x

    def fuses_norm(self, partial: torch.Tensor) -> bool:
        return self.fuses

    def fuses_rows(self, rows: int, hidden: int, dtype: torch.dtype) -> bool:
        return self.fuses

    def add_rms_norm(self, partial, residual, weight, eps, cast_before_weight):
        self.log.append("fused")
        if not self.fused_result:
            return None
        return torch.full_like(partial, 7.0), partial + residual


def _layer(reducer: _Reducer, bias: bool = False, defer: bool = True) -> RowParallelLinear:
    layer = RowParallelLinear(8, 6, bias, ParallelState(tp_rank=0, tp_size=2, tp_reducer=reducer), torch.float32, "cpu")
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    layer.defer_reduction = defer
    return layer


def test_output_projection_defers_only_when_every_condition_holds(monkeypatch):
    x = torch.randn(3, 4)
    assert isinstance(_layer(_Reducer())(x), PendingSum)
    assert isinstance(_layer(_Reducer(), defer=False)(x), torch.Tensor)  # not a block's output projection
    assert isinstance(_layer(_Reducer(), bias=True)(x), torch.Tensor)  # bias goes after the sum
    assert isinstance(_layer(_Reducer(fuses=False))(x), torch.Tensor)  # e.g. a prefill-sized message
    monkeypatch.setattr(linear_module, "tp_all_reduce", lambda t, p, inv=False: t)  # no group for the gather
    monkeypatch.setattr(linear_module, "linear", lambda x, w, b, inv, *fp8: torch.nn.functional.linear(x, w, b))  # no Triton
    assert isinstance(_layer(_Reducer())(x, batch_invariant=True), torch.Tensor)
    no_reducer = RowParallelLinear(8, 6, False, ParallelState(tp_rank=0, tp_size=2), torch.float32, "cpu")
    no_reducer.defer_reduction = True
    assert isinstance(no_reducer(x), torch.Tensor)  # NCCL / gloo groups


@pytest.mark.parametrize("norm_cls", [RMSNorm, NemotronRMSNorm])
def test_norm_takes_the_fused_result_or_reduces_first(norm_cls):
    norm = norm_cls(6, 1e-6, torch.float32, "cpu")
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(3, 4), torch.randn(3, 6)
    fused = _Reducer()
    out, new_res = norm.add_and_norm(_layer(fused)(x), residual)
    assert fused.log == ["fused"] and torch.equal(out, torch.full((3, 6), 7.0))
    declined = _Reducer(fused_result=False)
    layer = _layer(declined)
    out, new_res = norm.add_and_norm(layer(x), residual)
    assert declined.log == ["fused", "all_reduce"]  # asked, declined, then the plain all-reduce
    want_out, want_res = norm.add_and_norm(x @ layer.weight.t(), residual)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)


def test_block_marks_the_mixers_output_projection_only():
    p = ParallelState(tp_rank=0, tp_size=2)
    mlp = SwiGLUMLP(8, 16, False, p, torch.float32, "cpu")
    Block(RMSNorm(8, 1e-6, torch.float32, "cpu"), mlp)
    assert mlp.down_proj.defer_reduction and not RowParallelLinear.defer_reduction
    loose = RowParallelLinear(8, 8, False, p, torch.float32, "cpu")  # not inside a block
    assert not loose.defer_reduction


def test_decode_size_projection_hands_its_k_split_partials_to_the_fused_sum(monkeypatch):
    """Where the row-parallel split tiles take the shape (``fused_ops.split_linear(..., tp_rank=True)``), the
    layer hands this rank's float32 partials on: the fused kernel gets them as they are, and the
    plain path sums them locally before the all-reduce."""
    from dataclasses import dataclass

    from megatron_async.kernels.deferred_sum import DeferredSum

    @dataclass(frozen=True)
    class _Split(DeferredSum):
        parts: torch.Tensor
        bias: None = None
        dtype: torch.dtype = torch.float32

        def reduce(self) -> torch.Tensor:
            return self.parts.sum(0)

    x = torch.randn(3, 4)
    asked, made = [], []
    monkeypatch.setattr(linear_module.fused_ops, "split_linear", lambda x, w, bias, enabled, tp_rank=False:
                        asked.append((bias, enabled, tp_rank))
                        or made.append(torch.stack([x @ w.t() / 2] * 2)) or _Split(made[-1]))
    pending = _layer(_Reducer())(x, split_k=False)
    assert isinstance(pending, PendingSum) and asked == [(None, False, True)]  # the model's split_k switch passed on
    norm = RMSNorm(6, 1e-6, torch.float32, "cpu")
    fused = _Reducer()
    seen = []
    fused.add_rms_norm = lambda partial, *rest: seen.append(partial) or None  # declines: reduce() follows
    layer = _layer(fused)
    out, new_res = norm.add_and_norm(layer(x), torch.zeros(3, 6))
    assert seen[0] is made[-1] and fused.log == ["all_reduce"]
    torch.testing.assert_close(new_res, x @ layer.weight.t())


def test_a_tp_ranks_qkv_asks_for_split_partials_only_at_tp_without_bias_or_fp8(monkeypatch):
    """``QKVParallelLinear.tp_split``: the TP rank's tiles asked for (the model's split_k switch
    passed on) at TP > 1 on a bf16 weight without bias, and at TP=1 for one row (the GEMV's
    partials); None for more rows at TP=1 or with a bias."""
    from megatron_async.parallel.linear import QKVParallelLinear

    asked = []
    monkeypatch.setattr(linear_module.fused_ops, "split_linear", lambda x, w, bias, enabled, tp_rank=False:
                        asked.append((tuple(w.shape), bias, enabled, tp_rank)) or "parts")
    x = torch.randn(2, 16)

    def qkv(tp_size: int, bias: bool = False) -> QKVParallelLinear:
        return QKVParallelLinear(16, 4, 4, 2, bias, ParallelState(tp_rank=0, tp_size=tp_size), torch.float32, "cpu")

    assert qkv(2).tp_split(x, split_k=False) == "parts" and asked == [((16, 16), None, False, True)]
    assert qkv(1).tp_split(x) is None and qkv(2, bias=True).tp_split(x) is None and len(asked) == 1
    assert qkv(1).tp_split(x[:1]) == "parts" and asked[-1] == ((32, 16), None, True, True)  # every head at TP=1
