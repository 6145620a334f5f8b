"""The modes of ``InferenceConfig``: ``str`` enums, so a mode given as its string (CLI, JSON)
becomes its member, and an unknown one is a ValueError."""
from __future__ import annotations

from enum import Enum


class AttentionBackend(str, Enum):
    """Which attention implementation the model layers call. It also picks the MoE experts'
    kernels (``kernels/moe_experts.py``): TRITON = the fused Triton MoE, TORCH = the reference loop."""

    TORCH = "torch"  # pure-torch reference (CPU and CUDA)
    TRITON = "triton"  # Triton paged kernels (CUDA, or CPU with TRITON_INTERPRET=1)
    AUTO = "auto"  # triton on CUDA when importable, else torch


class SamplingBackend(str, Enum):
    """Which sampler draws the tokens (both give the same tokens; see sampling.py)."""

    TORCH = "torch"  # the pure-torch reference (full-vocabulary sorts when filtering)
    TRITON = "triton"  # sort-free Triton kernels (CUDA, or CPU with TRITON_INTERPRET=1)
    AUTO = "auto"  # triton on CUDA when importable, else torch


class ExpertExchange(str, Enum):
    """How MoE layers move tokens to the experts of other expert-parallel ranks."""

    ALL_GATHER = "all_gather"  # every rank's padded tokens to all, reduce-scatter back: no host sync, graph-safe
    ALL_TO_ALL = "all_to_all"  # each token only to the ranks of its experts: fewer bytes at large EP, but the
    # split sizes come back to the host (one sync per MoE layer): eager only


class AllReduceBackend(str, Enum):
    """How the tensor-parallel all-reduce of activations runs on GPUs (``parallel/p2p_all_reduce.py``)."""

    AUTO = "auto"  # P2P for messages up to p2p_all_reduce_max_bytes when the TP group's GPUs can map each
    # other's memory (CUDA, fp32 / bf16), NCCL otherwise; CPU (gloo) always uses the process group
    NCCL = "nccl"  # always the process group's collective (NCCL on CUDA, gloo on CPU)
    P2P = "p2p"  # like AUTO, but an error at load when the P2P buffers cannot be set up


class MambaBackend(str, Enum):
    """Which SSM / conv1d implementation the Mamba mixers call."""

    TORCH = "torch"  # pure-torch reference (CPU and CUDA)
    TRITON = "triton"  # in-repo Triton kernels (CUDA, or CPU with TRITON_INTERPRET=1)
    MAMBA_SSM = "mamba_ssm"  # only on request: needs the mamba_ssm + causal_conv1d packages (CUDA); runs the
    # in-repo Triton kernels (the engine calls no op of those packages)
    AUTO = "auto"  # CUDA: triton when importable, else torch; CPU: torch


class SpeculativeMethod(str, Enum):
    """Where speculative decoding's draft tokens come from (docs/SPECULATIVE.md)."""

    MTP = "mtp"  # multi-token-prediction heads of the checkpoint
    NGRAM = "ngram"  # prompt lookup: the tokens that followed the latest earlier match of the last n tokens


class DpRouting(str, Enum):
    """How the data-parallel coordinator picks the engine of a new request (docs/PARALLEL.md,
    "Engines behind a coordinator"). Every tie goes to the engine registered first."""

    LOAD_BALANCED = "load_balanced"  # most free request slots (as a share of the engine's max_requests)
    FIRST_PREFIX_BLOCK = "first_prefix_block"  # among engines holding the prompt's first block, the most free
    LONGEST_PREFIX = "longest_prefix"  # among engines holding the most leading blocks of the prompt, the most free
    SCORED = "scored"  # best alpha * held share of the prompt's blocks + (1 - alpha) * free share of its slots
