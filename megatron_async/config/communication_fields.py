"""The communication fields of ``InferenceConfig``: how tensor- and expert-parallel ranks exchange
activations (all-reduce and MoE exchange paths) and agree on each step (the per-step consensus).
``InferenceConfig.communication()`` hands them to the parallel state and the communicator."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_async.config.modes import AllReduceBackend


@dataclass
class CommunicationFields:
    tp_all_reduce: AllReduceBackend = AllReduceBackend.AUTO
    """Tensor-parallel all-reduce of small messages (decode activations). ``auto`` / ``p2p``: one kernel that reads
    every rank's copy through CUDA P2P mappings of a symmetric buffer (torch symmetric memory,
    never NVLink multicast) instead of NCCL's ring / tree round trips; CUDA-graph safe. Larger
    messages, other dtypes and CPU runs use NCCL / gloo. Under ``batch_invariant`` the TP sum
    keeps its fixed-order all-gather either way. Default ``auto``: the P2P path beats NCCL per
    decode all-reduce in graphs and per Qwen3-8B TP=4 decode step (docs/PERFORMANCE.md, "Tensor
    parallelism"). bf16 sums of 3+ ranks then add
    in another order than NCCL's ring, so bf16 tokens can differ from an NCCL run's at near-ties."""

    tp_fused_norm: bool = True
    """With the P2P all-reduce (``tp_all_reduce`` auto / p2p on GPUs): the all-reduce after each
    attention / MLP / Mamba2 output projection runs in one kernel with the residual add and the
    next block's RMSNorm (kernels/triton_fused_all_reduce.py), 2 fewer launches per layer and
    one less trip of the hidden state through memory. Decode-size messages only (larger ones,
    bias, a float32 residual stream, batch-invariant mode: unfused). bf16 partials are summed
    in float32 and rounded once, so bf16 bits can differ from the unfused P2P path (float32:
    the same). False: the unfused all-reduce then add + RMSNorm (A/B)."""

    ep_p2p_exchange: bool = True
    """Expert parallelism on GPUs of one host: the MoE layers' all-gather and reduce-scatter of
    decode-size messages (<= 16 MB) run as one Triton kernel each over symmetric buffers
    (``parallel/p2p_exchange.py``: CUDA P2P, never multicast) instead of NCCL, whose fixed cost
    per collective dominates these; larger ones, CPU / gloo, or a group that fails the load-time
    self-test use NCCL. bf16 partial outputs are summed in float32 in rank order and rounded
    once (NCCL adds in its own order), so bf16 tokens can differ from an NCCL run's at near-ties.
    False: NCCL for every size (A/B)."""

    p2p_all_reduce_max_bytes: int = 8 << 20
    """Largest message (bytes) the P2P all-reduce takes; larger ones go to NCCL. Each rank
    allocates one symmetric buffer of this size. 0 turns the P2P path off."""

    consensus_shared_memory: bool = True
    """Tensor / expert parallel: when every rank runs on one host (decided by all ranks together
    when the engine is built), the per-step consensus moves its ints through a shared-memory slot
    per rank instead of a ZMQ round trip through rank 0 (tens of us instead of hundreds; x86
    only). Ranks on several hosts, or off on any rank: ZMQ. ``LLM.communicator.exchange_path``
    says which is used."""

    consensus_spin_us: float | None = None
    """How long a rank waiting in the shared-memory consensus spins (yielding its core every
    turn) before it sleeps in the kernel (waking costs tens of us more than spinning). None:
    2000 when the host has a spare core per rank (cores >= 1-minute load average + ranks, as
    on a GPU host: a waiting rank has nothing else to do), else 20: on a busy or small host a
    yielding spinner waits behind every other runnable task, while a sleeper woken by its peer
    preempts them (measured on 2 loaded cores: ~1.3 ms vs ~0.24 ms to notice the last rank)."""
