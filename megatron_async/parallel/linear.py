"""Tensor-parallel linear layers (Megatron-Core / nano-vllm shapes) that own their weight
loaders and shard from full Hugging Face tensors.

Column-parallel: the output features are split (input replicated, output sharded, no
communication). Row-parallel: the input features are split and the partial products are
summed over the TP group; the bias is added once after the sum. At tp_size 1 every layer is
exactly ``F.linear`` with no collective, so single-GPU numerics are unchanged. Every forward
takes ``batch_invariant`` (the step's ``ForwardBatch.batch_invariant``): the fixed-tile Triton
matmul and the rank-ordered TP sum instead (see kernels/linear_op.py).

Expert parallelism extends ``ParallelLinear``: an expert-sharded linear holds
[num_local_experts, out, in] weights for the experts of ``parallel.ep_rank`` and its
``weight_loader(param, loaded, shard_id=(expert_id, part))`` keeps only local experts (and,
with TP inside, their column / row slices through ``Sharding``); the model's stacked-params
mapping emits one (param, (expert, part)) target per HF expert tensor, so checkpoint loading
needs no new code path.

FP8 (``fp8=True``): ``weight`` is e4m3 and ``weight_scale_inv`` holds its 128 x 128 block scales
(``parallel/fp8_sharding.py``: they load from e4m3 checkpoints with their grids, or quantize float
tensors on arrival); the forward is the W8A8 block-scaled linear (kernels/linear_op.py). The bias,
if any, stays in the model dtype."""
from __future__ import annotations

import torch
from torch import nn

from megatron_async.kernels import fused_ops
from megatron_async.kernels.linear_op import linear
from megatron_async.parallel.communication import PendingSum, tp_all_reduce
from megatron_async.parallel.fp8_sharding import fp8_params
from megatron_async.parallel.lora_slots import LoRASlots
from megatron_async.parallel.sharding import REPLICATED, Sharding, ShardId, sharded_param
from megatron_async.parallel.state import ParallelState


class ParallelLinear(nn.Module):
    """Base: ``weight`` [out_local, in_local] and optional ``bias``, each with its weight_loader;
    FP8: ``weight`` e4m3 and ``weight_scale_inv`` (``fp8_shard_ids``: every shard_id the weight
    loads with, which decide where its scale blocks fall). ``lora``: its adapter slots
    (``add_lora_slots``; None: not adapted), applied where a forward is given per-token slots."""

    lora: LoRASlots | None = None

    def __init__(self, weight_shape: tuple[int, ...], weight_sharding: Sharding, bias_shape: tuple[int, ...] | None,
                 bias_sharding: Sharding, parallel: ParallelState, dtype: torch.dtype, device: torch.device | str,
                 fp8_shard_ids: tuple[ShardId, ...] | None = None):
        super().__init__()
        self.parallel = parallel
        self.weight_scale_inv, self.scale_block_n = None, 0
        if fp8_shard_ids is None:
            self.weight = sharded_param(weight_shape, weight_sharding, dtype, device)
        else:
            self.weight, self.weight_scale_inv, self.scale_block_n = fp8_params(weight_sharding, weight_shape,
                                                                                fp8_shard_ids, device)
        self.bias = None if bias_shape is None else sharded_param(bias_shape, bias_sharding, dtype, device)
        self._prequantizes: dict[tuple[int, torch.dtype, torch.device], bool] = {}

    def quantizes_rows_itself(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this FP8 linear would quantize ``rows`` CUDA input rows of ``dtype`` in a pass of
        its own (``triton_fp8_gemm.fp8_linear_prequantizes``), so their producer should hand them over
        quantized; False for a bf16 weight. A function of the shapes and the weight's layout only:
        kept per (rows, dtype, device)."""
        if self.weight_scale_inv is None:
            return False
        key = (rows, dtype, device)
        if key not in self._prequantizes:
            from megatron_async.kernels.triton_fp8_gemm import fp8_linear_prequantizes

            self._prequantizes[key] = fp8_linear_prequantizes(rows, dtype, device, self.weight,
                                                              self.weight_scale_inv, self.scale_block_n)
        return self._prequantizes[key]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, batch_invariant: bool) -> torch.Tensor:
        """``x @ weight.T + bias`` (this rank's part) in either precision."""
        return linear(x, self.weight, bias, batch_invariant, self.weight_scale_inv, self.scale_block_n)


class ReplicatedLinear(ParallelLinear):
    """Every rank holds the whole weight (e.g. a MoE router)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__((out_features, in_features), REPLICATED, (out_features,) if bias else None, REPLICATED,
                         parallel, dtype, device)

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        return self.matmul(x, self.bias, batch_invariant)


class MergedColumnParallelLinear(ParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up, Mamba's z/x/B/C/dt): each part is
    split across ranks separately, so this rank's output is [part0_local | part1_local | ...].
    ``shard_ids`` name the parts (the HF tensors stacked here); a checkpoint that stores them
    already concatenated loads with shard_id None."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device | str, what: str = "output features",
                 shard_ids: tuple[ShardId, ...] | None = None, fp8: bool = False):
        ids = tuple(range(len(output_sizes))) if shard_ids is None else tuple(shard_ids)
        w = Sharding.split(0, tuple(output_sizes), parallel, what, ids)
        self.output_sizes = [s // parallel.tp_size for s in output_sizes]
        out = sum(self.output_sizes)
        loads = tuple(dict.fromkeys((*ids, None))) if fp8 else None  # by part, or stacked whole
        super().__init__((out, in_features), w, (out,) if bias else None, w, parallel, dtype, device, loads)

    def add_lora_slots(self, max_loras: int, max_rank: int) -> None:
        """Adapter slots, one part per stacked projection (its shard id), sharded like the weight."""
        ids = self.weight.sharding.shard_ids or (None,)
        self.lora = LoRASlots(self.weight, ids, self.output_sizes, max_loras, max_rank, self.weight.dtype,
                              self.weight.device)

    def forward(self, x: torch.Tensor, batch_invariant: bool = False,
                lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``lora_slots``: each token's adapter slot (``ForwardBatch.lora_slots``; None: no adapters)."""
        out = self.matmul(x, self.bias, batch_invariant)
        if lora_slots is not None and self.lora is not None:
            self.lora.apply(x, out, lora_slots, batch_invariant)
        return out


class ColumnParallelLinear(MergedColumnParallelLinear):
    """One column-parallel output (this rank's ``out_features / tp`` rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device | str, what: str = "output features", fp8: bool = False):
        super().__init__(in_features, [out_features], bias, parallel, dtype, device, what, shard_ids=(None,), fp8=fp8)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection; each rank owns whole query and KV heads (shard ids "q", "k", "v").
    GQA: KV heads must divide the TP size (no KV-head replication)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 parallel: ParallelState, dtype: torch.dtype, device: torch.device | str, fp8: bool = False):
        self.num_heads = parallel.tp_divide(num_heads, "num_attention_heads")
        self.num_kv_heads = parallel.tp_divide(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, bias, parallel, dtype, device, "attention heads", shard_ids=("q", "k", "v"),
                         fp8=fp8)

    def tp_split(self, x: torch.Tensor, split_k: bool = True):
        """On a TP rank at decode sizes, and at TP=1 for one row (batch 1, where a GEMV writes them):
        this rank's q / k / v as float32 K-split partials (``triton_split_linear.PendingSplitSum``)
        for the q/k norm + rope kernel to sum, where cuBLAS would run a split-K GEMM plus a reduce
        kernel of its own (Qwen3-8B at TP=4: N = 1,536) or, at one row, read the weight slower
        (Qwen3-0.6B's qkv 5.3 against 4.1 us, the 8B's 15.4 against 14.0 on an H200); None for more
        rows at TP=1, for an FP8 weight or with a bias (the caller keeps adapter rows and
        batch-invariant steps off it)."""
        one_row = x.shape[0] == 1
        if (self.parallel.tp_size == 1 and not one_row) or self.weight_scale_inv is not None or self.bias is not None:
            return None
        return fused_ops.split_linear(x, self.weight, None, split_k, tp_rank=True)


class RowParallelLinear(ParallelLinear):
    """Input features split; the output is summed over the TP group (full on every rank).

    ``defer_reduction`` (set by ``Block`` on a mixer's output projection, whose output goes
    straight into the next norm): when the TP group's P2P reducer fuses the sum with the
    residual add and RMSNorm, return a ``PendingSum`` instead of summing here (at decode sizes
    holding this rank's K-split partials, which that kernel sums first). Never with a
    bias (added after the sum), in batch-invariant mode, or on NCCL / gloo. At TP=1 a
    decode-size product may leave its split-K sum to that norm instead
    (``fused_ops.split_linear``)."""

    defer_reduction = False

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device | str, what: str = "input features", fp8: bool = False):
        w = Sharding.split(1, in_features, parallel, what)
        local_in = in_features // parallel.tp_size
        super().__init__((out_features, local_in), w, (out_features,) if bias else None, REPLICATED,
                         parallel, dtype, device, (None,) if fp8 else None)

    def add_lora_slots(self, max_loras: int, max_rank: int) -> None:
        """Adapter slots: A cut on its input like the weight, B whole (their product is a partial sum)."""
        self.lora = LoRASlots(self.weight, (None,), [self.weight.shape[0]], max_loras, max_rank, self.weight.dtype,
                              self.weight.device)

    def forward(self, x: torch.Tensor, batch_invariant: bool = False, split_k: bool = True,
                lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``split_k``: the model's ``KernelBackends.split_k`` (whether the split-K sum may run);
        ``lora_slots``: each token's adapter slot (None: no adapters), whose product joins this
        rank's partial sum before the TP sum."""
        adapted = lora_slots is not None and self.lora is not None
        if self.parallel.tp_size == 1:
            if self.defer_reduction and not batch_invariant and self.weight_scale_inv is None and not adapted:
                pending = fused_ops.split_linear(x, self.weight, self.bias, split_k)
                if pending is not None:
                    return pending
            out = self.matmul(x, self.bias, batch_invariant)
            if adapted:
                self.lora.apply(x, out, lora_slots, batch_invariant)
            return out
        reducer = self.parallel.tp_reducer
        fuse = self.defer_reduction and self.bias is None and not batch_invariant and reducer is not None
        if (fuse and not adapted and self.weight_scale_inv is None
                and reducer.fuses_rows(x.shape[0], self.weight.shape[0], x.dtype)):
            split = fused_ops.split_linear(x, self.weight, None, split_k, tp_rank=True)  # no cuBLAS reduce kernel
            if split is not None:
                return PendingSum(split, self.parallel)
        partial = self.matmul(x, None, batch_invariant)
        if adapted:
            self.lora.apply(x, partial, lora_slots, batch_invariant)
        if fuse and reducer.fuses_norm(partial):
            return PendingSum(partial, self.parallel)
        out = tp_all_reduce(partial, self.parallel, batch_invariant)
        return out if self.bias is None else out + self.bias
