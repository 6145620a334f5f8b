"""The P2P all-reduce (torch symmetric memory, no multicast) against NCCL on N GPUs of one host:
correctness first (fp32 / bf16 sums against a float64 reference and NCCL, the same bits on every
rank, NCCL fallbacks, a CUDA graph replayed on fresh inputs, and with ``--engine`` a tiny fp32
checkpoint under TP=N with CUDA graphs on P2P, token for token against TP=1), then us per bf16
all-reduce for message sizes 8 KB .. 8 MB: inside CUDA graphs (NCCL, one-shot, two-shot) and
eager (NCCL, the default P2P path). The all-reduce fused with the residual add and RMSNorm is
checked against the unfused path (values, ranks' bits, graph replays) and timed per decoder
layer (two all-reduce + add + RMSNorm, bf16, hidden 4096) at ``--fused-rows`` batch rows.

    python -m benchmarks all-reduce [--world 4] [--groups 4 2] [--iters 20] [--engine] [--json F]
        [--fused-rows 1 64 128]

One spawn of ``--world`` ranks (one per GPU) covers every group size (the first g ranks).
Exits 1 if any check fails. NVLink multicast stays off in every process."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.all_reduce_checks import (  # noqa: E402
    ENGINE_CONFIG, NO_MULTICAST_ENV, all_reduce_worker, assert_group_report, engine_outputs)
from tests.helpers.multiprocess import run_ranks  # noqa: E402

SIZES_KB = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def tp1_reference(ckpt: str) -> dict:
    from megatron_async import LLM, InferenceConfig

    llm = LLM(ckpt, device="cuda", dtype="float32", inference_config=InferenceConfig(**ENGINE_CONFIG))
    return engine_outputs(llm)


def check(reports: list[dict], groups: list[int], expected: dict | None) -> list[str]:
    failures = []
    for g in groups:
        for rank in range(g):
            try:
                assert_group_report(reports[rank][g])
            except AssertionError as e:
                failures.append(f"group {g} rank {rank}: {e}")
    if expected is not None:
        for rank, rep in enumerate(reports):
            eng = rep["engine"]
            if eng["outputs"] != expected:
                failures.append(f"engine rank {rank}: TP={len(reports)} P2P tokens differ from TP=1")
            if not eng["p2p_calls"].get("one_shot") or not eng["graph_replays"]:
                failures.append(f"engine rank {rank}: no P2P call or no graph replay ({eng})")
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=min(4, torch.cuda.device_count()))
    p.add_argument("--groups", type=int, nargs="+", default=None, help="group sizes (default: world, and 2)")
    p.add_argument("--sizes-kb", type=int, nargs="+", default=SIZES_KB)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fused-rows", type=int, nargs="*", default=[1, 16, 64, 128],
                   help="batch rows at which to time fused vs unfused all-reduce + add + RMSNorm (none: skip)")
    p.add_argument("--engine", action="store_true", help="also the TP=world engine check (tiny fp32 checkpoint)")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    os.environ.update(NO_MULTICAST_ENV)
    groups = args.groups or sorted({args.world, 2}, reverse=True)
    ckpt = expected = None
    if args.engine:
        from tests.helpers.hf_models import make_tiny_checkpoint

        ckpt = str(make_tiny_checkpoint("Qwen3ForCausalLM", Path(tempfile.mkdtemp()) / "qwen3",
                                        num_attention_heads=8, num_key_value_heads=4))
        expected = tp1_reference(ckpt)
    sizes = [kb << 10 for kb in args.sizes_kb]
    reports = run_ranks(all_reduce_worker, args.world, groups, sizes, args.iters, 0, ckpt, args.fused_rows,
                        timeout_s=500, env=NO_MULTICAST_ENV)
    failures = check(reports, groups, expected)
    if args.json:
        Path(args.json).write_text(json.dumps({"groups": groups, "reports": reports, "failures": failures},
                                              indent=1, default=str))
    for g in groups:
        rows = reports[0][g]["values"]
        print(f"group {g}: {len(rows)} value cases, worst bf16 rel err "
              f"{max(r['rel_err'] for r in rows if r['dtype'] == 'bfloat16'):.2e} (NCCL "
              f"{max(r['nccl_rel_err'] for r in rows if r['dtype'] == 'bfloat16'):.2e}), fp32 "
              f"{max(r['rel_err'] for r in rows if r['dtype'] == 'float32'):.2e}; graph replay "
              f"{max(reports[0][g]['graph_errors']):.2e}; calls {reports[0][g]['calls']}")
        fused = [r for r in reports[0][g]["fused_values"] if r["fused"]]
        print(f"group {g}: fused norm vs unfused, fp32 out rel err "
              f"{max(r['out_rel'] for r in fused if r['dtype'] == 'float32'):.1e} (residual equal: "
              f"{all(r['residual_equal'] for r in fused if r['dtype'] == 'float32')}), bf16 "
              f"{max(r['out_rel'] for r in fused if r['dtype'] == 'bfloat16'):.1e}; ranks equal "
              f"{all(r['ranks_equal'] for r in fused)}; graph replays {reports[0][g]['fused_replays']}")
    if expected is not None:
        print(f"engine TP={args.world} P2P + graphs vs TP=1: "
              f"{'equal' if all(r['engine']['outputs'] == expected for r in reports) else 'DIFFERENT'}; "
              f"rank 0 {reports[0]['engine']['p2p_calls']}, {reports[0]['engine']['graph_replays']} replays")
    print("\n| GPUs | bytes | NCCL graph us | one-shot us | two-shot us | best P2P / NCCL | NCCL eager us | P2P eager us |")
    print("|---|---|---|---|---|---|---|---|")
    for g in groups:
        for r in reports[0][g]["times"]:
            best = min(r["one_shot_graph_us"], r["two_shot_graph_us"])
            print(f"| {g} | {r['bytes'] >> 10} KB | {r['nccl_graph_us']:.1f} | {r['one_shot_graph_us']:.1f} | "
                  f"{r['two_shot_graph_us']:.1f} | {best / r['nccl_graph_us']:.2f} | {r['nccl_eager_us']:.1f} | "
                  f"{r['p2p_eager_us']:.1f} |")
    print("\n| GPUs | rows | bytes | unfused us / layer | fused us / layer | saved us / layer | fused / unfused |")
    print("|---|---|---|---|---|---|---|")
    for g in groups:
        for r in reports[0][g]["fused_times"]:
            print(f"| {g} | {r['rows']} | {r['bytes'] >> 10} KB | {r['unfused_layer_us']:.1f} | "
                  f"{r['fused_layer_us']:.1f} | {r['unfused_layer_us'] - r['fused_layer_us']:.1f} | "
                  f"{r['fused_layer_us'] / r['unfused_layer_us']:.2f} |")
    print("\n" + ("ALL CHECKS PASSED" if not failures else "CHECKS FAILED:\n" + "\n".join(failures)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
