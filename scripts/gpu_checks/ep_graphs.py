"""Where do expert parallelism and CUDA graphs hang, if they do? Stages on 2 GPUs (NCCL), each in
fresh ranks with its own deadline; a line per stage as it ends (PASS / FAIL / HANG), and a hung
rank's Python stack on stderr just before its deadline.

    python scripts/gpu_check.py ep-graphs [--stages nccl layer engine mixed] [--timeout-scale 1.0]

A stage that hangs is run once more with ``--retry-env`` (default: NCCL's graph buffer
registration and runtime connection off), to tell an NCCL feature from our own bug.

  nccl    all_gather_into_tensor + reduce_scatter_tensor captured in one graph on both ranks
          (after eager warm-up), replayed on new data: NCCL capture itself works
  layer   the MoE layer (all-gather exchange, fused Triton experts) captured and replayed
  engine  LLM tiny-moe EP=2 with cuda_graphs: one long greedy request (the idle rank's dummy
          forwards replay the agreed graph on padding rows), then mixed greedy / sampled,
          async and serial; tokens == EP=1 eager in this process
  mixed   (expected to HANG: the bug fixed) rank 0 replays a graph holding an all-gather while
          rank 1 runs the same all-gather eagerly; NCCL documents that captured-or-not must be
          uniform across the ranks of a launch"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cuda_timing import capture  # noqa: E402
from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
CONFIG = dict(block_size_tokens=16, num_kv_blocks=64, max_requests=8, max_tokens=64, max_sequence_length=128)
LONG = ([3, 17, 42, 9, 100, 7], SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True))
MIXED_PROMPTS = [[25, 1, 2], [5] * 23, [60, 61, 62, 63], [8, 9], [11] * 5]
MIXED = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) if i % 2 else
         SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=n, ignore_eos=True, seed=100 + i)
         for i, n in enumerate((6, 9, 4, 7, 12))]


def _group(rank: int, world: int):
    from megatron_async.parallel.state import ParallelState
    torch.cuda.set_device(rank)
    return ParallelState.from_torchrun(1, "cuda", expert_parallel_size=world)


def _exchange(x: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist
    gathered = torch.empty((world * x.shape[0], x.shape[1]), device=x.device, dtype=x.dtype)
    dist.all_gather_into_tensor(gathered, x)
    out = torch.empty_like(x)
    dist.reduce_scatter_tensor(out, gathered * 2)
    return out


def _captured(x: torch.Tensor, world: int):
    return capture(lambda: _exchange(x, world), error_mode="thread_local")


def _nccl_stage(rank: int, world: int) -> float:
    par = _group(rank, world)
    try:
        x = torch.randn(8, 64, device="cuda")
        graph, out = _captured(x, world)
        err = 0.0
        for i in range(3):
            x.copy_(torch.randn(8, 64, device="cuda") + i)
            graph.replay()
            torch.cuda.synchronize()
            err = max(err, float((out - _exchange(x, world)).abs().max()))
        del graph  # before destroy_process_group: ncclCommDestroy waits for graphs holding NCCL ops
        return err
    finally:
        par.destroy()


def _mixed_stage(rank: int, world: int) -> float:
    par = _group(rank, world)
    try:
        x = torch.randn(8, 64, device="cuda")
        graph, _ = _captured(x, world)
        if rank == 0:
            graph.replay()
        else:
            _exchange(x, world)
        torch.cuda.synchronize()
        return 0.0
    finally:
        par.destroy()


def _layer_stage(rank: int, world: int) -> float:
    from megatron_async.kernels.backends import KernelBackends
    from megatron_async.models.layers.block import StepInputs
    from tests.helpers.moe_layers import MOE_CONFIGS, build_moe_layer
    par = _group(rank, world)
    try:
        layer = build_moe_layer(MOE_CONFIGS["softmax"], 64, par, device="cuda")
        x = torch.randn(5, 64, device="cuda")
        step = StepInputs(None, None, None, ep_num_tokens=8, kernels=KernelBackends(attention="triton"))
        graph, out = capture(lambda: layer(x, step), error_mode="thread_local")
        x.copy_(torch.randn(5, 64, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        err = float((out - layer(x, step)).abs().max())
        del graph
        return err
    finally:
        par.destroy()


def engine_outputs(llm: LLM) -> dict:
    outs = {}
    for mode in ("async", "serial"):
        llm.engine.async_scheduling = mode == "async"
        outs[f"{mode}_idle"] = llm.generate([LONG[0]], LONG[1])[0].generated_tokens
        outs[f"{mode}_mixed"] = [o.generated_tokens for o in llm.generate(MIXED_PROMPTS, MIXED)]
    return outs


def _engine_stage(rank: int, world: int) -> dict:
    llm = LLM(None, device="cuda", inference_config=InferenceConfig(**CONFIG, cuda_graphs=True),
              default_model="tiny-moe", expert_parallel_size=world)
    try:
        outs = engine_outputs(llm)
        g, st = llm.runner.graphs, llm.engine.stats
        outs["counts"] = dict(replays=g.num_replays, padding_replays=g.num_padding_replays, dummy=st.dummy_steps)
        return outs
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="+", default=["nccl", "layer", "engine"],
                    choices=["nccl", "layer", "engine", "mixed"])
    ap.add_argument("--timeout-scale", type=float, default=1.0,
                    help="scales each stage's deadline (nccl 60 s, layer 90 s, engine 180 s, mixed 45 s)")
    ap.add_argument("--retry-env", default="NCCL_GRAPH_REGISTER=0 NCCL_RUNTIME_CONNECT=0",
                    help="KEY=VALUE pairs for one retry of a stage that hung ('' for no retry)")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA devices")
        return 2
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    retry_env = dict(kv.split("=", 1) for kv in args.retry_env.split())
    expected = None
    if "engine" in args.stages:
        expected = engine_outputs(LLM(None, device="cuda", inference_config=InferenceConfig(**CONFIG),
                                      default_model="tiny-moe"))
    bad, hung = 0, False
    for stage in args.stages:
        if hung and stage != "mixed":
            print(f"{stage}: skipped (an earlier stage hung)", flush=True)
            continue
        ok = run_stage(stage, expected, args.timeout_scale, {})
        if ok is None and retry_env:  # hung: once more without the NCCL features most likely to blame
            ok = run_stage(stage, expected, args.timeout_scale, retry_env)
        hung |= ok is None and stage != "mixed"
        bad += not ok and stage != "mixed"
    return 1 if bad else 0


STAGES = {"nccl": (_nccl_stage, 60), "layer": (_layer_stage, 90), "engine": (_engine_stage, 180),
          "mixed": (_mixed_stage, 45)}


def run_stage(stage: str, expected: dict | None, scale: float, extra_env: dict) -> bool | None:
    """Prints the stage's line; True (pass), False (fail) or None (hang)."""
    fn, timeout = STAGES[stage]
    name = f"{stage}" + "".join(f" {k}={v}" for k, v in extra_env.items())
    t0 = time.perf_counter()
    try:
        got = run_ranks(fn, 2, timeout_s=timeout * scale, env={**NCCL_ENV, **extra_env})
    except TimeoutError as e:
        print(f"{name}: HANG after {time.perf_counter() - t0:.0f} s: {str(e).splitlines()[0]}", flush=True)
        return None
    except RuntimeError as e:
        print(f"{name}: FAIL in {time.perf_counter() - t0:.0f} s:\n{e}", flush=True)
        return False
    if stage == "engine":
        counts = [g.pop("counts") for g in got]
        ok = all(g == expected for g in got) and all(c["replays"] > 0 for c in counts)
        detail = f"tokens == EP=1: {[g == expected for g in got]}, counts by rank {counts}"
    else:
        ok, detail = max(got) < 1e-4, f"max error by rank {got}"
    print(f"{name}: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.0f} s ({detail})", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
