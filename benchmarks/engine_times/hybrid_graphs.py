"""Mixed-step CUDA graphs of a hybrid (NemotronH-shaped, Mamba2 + attention + MLP) model, float32,
staggered arrivals with chunked prefill (tests/helpers/hybrid_graph_runs.py): per graph mode the
build time (startup warm-up and captures), mean mixed (prefill-holding) step and decode step wall
time, steps, replays, captures and builds after the warm-up, and requests equal to eager serial;
then the mixed step eager, with graphs for decode only (``cuda_graph_mixed_steps=False``) and with
mixed-step graphs. The assertions are tests/functional_tests/test_gpu_hybrid_graphs.py's. About a
minute on an H100; ``--device cpu`` runs it on the CPU with emulated graphs.

    python -m benchmarks engine-times hybrid-graphs [--requests 48] [--size small|tiny] [--output-len 24]"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.helpers.hybrid_graph_runs import MODES, REFERENCE, SIZES, arrivals, checkpoint, failures, run_mode, vocab_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--device", default="cuda", help="cpu: emulated graphs, torch kernels")


def run(args: argparse.Namespace) -> None:
    path = checkpoint(args.size, Path(tempfile.mkdtemp(prefix="nh_graphs_")))
    work = arrivals(args.requests, vocab_size(args.size), args.output_len)
    res = {name: run_mode(path, work, *flags, device=args.device) for name, flags in MODES.items()}
    ref = res[REFERENCE]["tokens"]
    print(f"{'mode':<22} {'build s':>8} {'mixed ms':>9} {'decode ms':>10} {'steps':>6} {'mixed':>6} {'replays':>8} "
          f"{'mixed replays':>13} {'captures*':>9} {'builds*':>7} {'=eager':>7}")
    problems = []
    for name, r in res.items():
        st = r["stats"]
        same = sum(r["tokens"].get(i) == t for i, t in ref.items())
        print(f"{name:<22} {r['build_s']:>8.1f} {st.mean_prefill_step_ms:>9.2f} {st.mean_decode_step_ms:>10.2f} "
              f"{st.steps:>6} {st.prefill_steps:>6} {st.graph_replays:>8} {st.mixed_graph_replays:>13} "
              f"{st.graph_captures_after_warmup:>9} {st.triton_builds_after_warmup:>7} {same:>3}/{len(ref)}")
        problems += failures(name, r, res[REFERENCE])
    print("(* after the startup warm-up; ms: mean host wall time per step, serial = device-inclusive)")
    e, d, m = (res[k]["stats"].mean_prefill_step_ms for k in ("eager serial", "decode graphs serial", "mixed graphs serial"))
    print(f"mixed step: eager {e:.2f} ms, decode-only graphs {d:.2f} ms, mixed graphs {m:.2f} ms "
          f"({d / max(m, 1e-9):.2f}x faster than eager mixed steps)")
    if problems:
        print("differences from eager serial (the gpu tests fail on these): " + "; ".join(problems))
