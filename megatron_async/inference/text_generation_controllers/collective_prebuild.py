"""The start-up dry pass of data-parallel engines under expert parallelism.

A one-GPU engine finds its warm-up's Triton kernels by capturing its shapes dry and builds them
at once (kernel_prebuild.py). Engines under expert parallelism capture only the collective
graph runner's plan (decode graphs of every variant, the collective mixed graphs), every rank at
once, because the MoE exchanges inside need every rank. Without a dry pass each rank built its
kernels one after another inside those captures (93 builds in 47 s, Qwen3-30B-A3B on four
GPUs). Here each rank captures the plan's shapes dry on its own, the EP exchange replaced by
local stand-ins of the same shapes, strides and alignment (``parallel/dry_exchange.py``: no
collective issued, no rank waits on another), and the host's ranks split the recorded builds
(``host_builds.py``: one compile per kernel per host, then a barrier, then loads).

The stand-ins are the modules' only for the dry pass: the real captures that follow see the
engine's exchange again. After a whole pass on every rank they capture without running each
graph's step first; a capture that fails so is captured again after an eager run by every rank
together (capture_agreement.py): correctness never depends on the dry pass having met everything."""
from __future__ import annotations

from megatron_async.inference.text_generation_controllers.kernel_list import build_share, prebuild_listed
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport
from megatron_async.parallel.dry_exchange import can_stand_in, ep_state, local_exchange
from megatron_async.step_shape import StepShape


def collective_shapes(graphs) -> list[tuple[StepShape, int]]:
    """The shapes a collective graph runner captures (its whole plan but the tails' forwards: a
    tail's whole step holds its forward's kernels), with their verify widths."""
    return [(graphs.capture_shape(key), key.verify_width) for key in graphs.plan.keys() if not key.logits_only]


def wants_collective_prebuild(runner) -> bool:
    """Whether ``runner`` captures collective graphs whose exchanges a dry pass can stand in for
    (the same answer on every rank: it depends only on the configuration)."""
    graphs = runner.graphs
    return (graphs is not None and graphs.collective and not graphs.emulate and ep_state(runner.model) is not None
            and can_stand_in(runner.model))


def prebuild_collective(runner, threads: int) -> PrebuildReport:
    """Capture the collective graph plan's shapes dry with the EP exchange stood in for, and
    build their kernels on ``threads`` threads, the host's ranks splitting the builds. Every rank
    of the job calls it at once (the split's barrier)."""
    with local_exchange(runner.model):
        return prebuild_listed(runner, collective_shapes(runner.graphs), threads, share=build_share(runner))
