"""The main job's start-up, cold and warm: seconds from the process's start to an engine ready
and to the first token, and where they went (load, memory profile, engine, kernel builds,
eager steps, graph captures), with the warm-up's kernels built one by one, or at once: compiled in
worker processes and loaded on threads (the default), or compiled on threads alone ("no-workers").

Each case is a fresh process of ``examples/gpt_dynamic_inference.py`` (the main job's defaults,
a small workload: 8 requests, 16 output tokens) with its own Triton cache directory
(``--kernel-cache-dir``): "cold" is an empty one, "warm" the same directory again, the way a
restarted engine on the same machine finds it. CUDA graphs cannot be kept between processes:
every case captures its graphs. An untimed ``import torch`` + CUDA init first reads the
libraries into the OS page cache, so that the first case does not pay for it alone, and the
package is byte-compiled first, as ``pip install`` leaves it (and as Python's own ``__pycache__``
does after a first run): where ``PYTHONDONTWRITEBYTECODE`` is set, as on the GPU machines these
numbers come from, every process would otherwise compile the package's ~250 modules from source.
There the libraries the job imports (torch, triton, ..., and Python's standard library) come without
byte code too (~860 of torch's modules and ~215 of the standard library's compiled from source in
every process): they are
byte-compiled once into a ``PYTHONPYCACHEPREFIX`` directory that every case reads, as a
``pip install`` would have left them; ``--as-image`` skips that (the image as it is).

    python -m benchmarks startup                  # one GPU, ~5 minutes on an H100
    python -m benchmarks startup --cases cold-threads warm-threads eager-cold-threads
    python -m benchmarks startup --smoke          # CPU, tiny model (no Triton, no graphs)
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NO_WORKERS = ["--no-compile-workers"]
"""The warm-up's kernels compiled on threads only, without the compile workers (triton_workers.py)."""
# name -> (main job flags, cache directory label: cases with the same label share a directory, in order)
CASES = {
    "cold-one-by-one": (["--startup-build-threads", "0"], "a"),
    "warm-one-by-one": (["--startup-build-threads", "0"], "a"),
    "cold-threads": ([], "b"),
    "warm-threads": ([], "b"),
    "cold-threads-no-workers": (NO_WORKERS, "e"),
    "eager-cold-one-by-one": (["--eager", "--startup-build-threads", "0"], "c"),
    "eager-cold-threads": (["--eager"], "d"),
    "eager-warm-threads": (["--eager"], "d"),
    "eager-cold-threads-no-workers": (["--eager", *NO_WORKERS], "f"),
}
PHASES = ("load", "memory profile", "engine", "kernel builds", "eager steps", "graph captures")


def run_case(name: str, flags: list[str], cache: Path, out: Path, smoke: bool, timeout: float, env: dict) -> dict:
    result = out / f"{name}.json"
    cmd = [sys.executable, "examples/gpt_dynamic_inference.py", "--quiet", "--num-requests", "8",
           "--output-len-min", "16", "--output-len-max", "16", "--kernel-cache-dir", str(cache),
           "--output-path", str(result), *flags]
    if smoke:
        cmd += ["--device", "cpu", "--prompt-len-min", "8", "--prompt-len-max", "16"]
    t0 = time.perf_counter()
    with (out / f"{name}.log").open("w") as log:
        done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **env})
    if done.returncode:
        raise SystemExit(f"{name} failed (rc {done.returncode}): see {out / (name + '.log')}")
    startup = json.loads(result.read_text())["startup"]
    startup["process_seconds"] = time.perf_counter() - t0
    return startup


def row(name: str, s: dict) -> str:
    def at(x):
        return "-" if x is None else f"{x:.1f}"

    phases = s["phases"]
    cells = [at(phases[p]["seconds"]) + (f" ({phases[p]['builds']})" if phases[p]["builds"] else "")
             if p in phases else "-" for p in PHASES]
    builds = sum(p["builds"] for p in phases.values())
    return (f"| {name} | {at(s['entered_s'])} | {at(s['ready_s'])} | **{at(s['first_token_s'])}** | "
            + " | ".join(cells) + f" | {builds} |")


def table(rows: dict[str, dict]) -> str:
    head = ("| case | job code s | ready s | first token s | " + " | ".join(f"{p} s (builds)" for p in PHASES)
            + " | Triton builds |")
    lines = [head, "|" + "---|" * (5 + len(PHASES))]
    lines += [row(name, s) for name, s in rows.items()]
    return "\n".join(lines)


LIBRARIES = ("torch", "triton", "numpy", "safetensors", "tokenizers", "zmq", "megatron_async", "torchgen",
             "opt_einsum", "tqdm", "msgpack", "certifi", "sympy", "mpmath")
"""What the main job imports (with Python's standard library; sympy and mpmath under TP / EP,
through torch's symmetric memory), byte-compiled where the environment keeps Python from writing
byte code (the GPU machines' standard library has none either)."""


def byte_compile_libraries() -> dict[str, str]:
    """Byte-compile ``LIBRARIES`` into a fresh ``PYTHONPYCACHEPREFIX`` directory (all cores) and return
    the environment that makes a process read it."""
    import importlib.util

    prefix = tempfile.mkdtemp(prefix="startup-pycache-")
    dirs = [sysconfig.get_paths()["stdlib"]] + [
        d for name in LIBRARIES if (spec := importlib.util.find_spec(name)) is not None
        for d in (spec.submodule_search_locations or [])]
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], check=False,
                   stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPYCACHEPREFIX": prefix})
    print(f"byte-compiled {', '.join(LIBRARIES)} into {prefix} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return {"PYTHONPYCACHEPREFIX": prefix}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--out", default="startup_runs", help="logs and each case's JSON")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    p.add_argument("--as-image", action="store_true",
                   help="where PYTHONDONTWRITEBYTECODE is set, leave the libraries without byte code")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        subprocess.run([sys.executable, "-c", "import torch, triton; torch.zeros(1, device='cuda')"], check=True)
    byte_code = {} if args.as_image or not sys.flags.dont_write_bytecode else byte_compile_libraries()
    if not byte_code:  # (the prefix holds the package's byte code too)
        compileall.compile_dir(str(ROOT / "megatron_async"), quiet=1)
    caches = tempfile.mkdtemp(prefix="startup-triton-")
    rows = {}
    for name in args.cases:
        flags, label = CASES[name]
        rows[name] = run_case(name, flags, Path(caches) / label, out, args.smoke, args.timeout, byte_code)
        print(row(name, rows[name]), file=sys.stderr, flush=True)
    print(table(rows))
    (out / "startup.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
