"""What LoRA adapters cost: the base engine, an ``enable_lora`` engine whose requests name no
adapter, and one whose requests name its adapters round-robin, each freshly built (its own
process on a GPU), same weights and same requests: workload A's output tok/s (greedy and sampled),
batch-1 decode ms per step, and the step gaps around an ``unload_lora`` and a load (prepared on a
thread while the workload steps, installed between two steps, as the server's route does) of a
running workload. Prints one markdown table last.

    python -m benchmarks lora                        # qwen3-8b, 128 requests, 8 adapters of rank 16
    python -m benchmarks lora --requests 64 --adapters 4 --rank 8 --json lora.json
    python -m benchmarks lora --smoke                # CPU, tiny model, seconds

Workload A: prompts 100-1,024 tokens, 128 out, at most 128 requests a step (CUDA graphs and
launch-ahead: the engine's defaults). Random adapters on every q/k/v/o/gate/up/down projection,
PEFT scaling (lora_alpha / r = 2). Targets: adapters >= 0.85x base tok/s, no adapter ~1.0x,
batch-1 step <= 1.1x, and no step gap around a load or unload longer than two median steps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.lora_runs import CONFIGS, Plan, run_config  # noqa: E402
from benchmarks.own_process import in_own_process  # noqa: E402
from megatron_async.cli.flags import default_device  # noqa: E402
from megatron_async.cli.workload import WorkloadSpec, synthetic_workload, twin_workload  # noqa: E402
from megatron_async.models.default_model import DEFAULT_CONFIGS  # noqa: E402

TARGETS = {"tok_s": 0.85, "idle": 0.97, "batch1": 1.1, "stall_steps": 1.0}
"""adapters / base tok/s at least; no adapter / base tok/s at least; batch-1 step adapter / base at
most; a gap around a load / unload at most this many median steps over the median."""
SMOKE = {"device": "cpu", "default_model": "tiny", "requests": 8, "serving": 6, "prompt_min": 8, "prompt_max": 40,
         "output_len": 16, "warmup_requests": 2, "batch1_prompt": 16, "batch1_output": 8, "max_requests": 4, "max_tokens": 64}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in --default-model)")
    p.add_argument("--default-model", default="qwen3-8b", choices=sorted(DEFAULT_CONFIGS))
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--requests", type=int, default=128, help="workload A's requests")
    p.add_argument("--adapters", type=int, default=8, help="adapters loaded (InferenceConfig.max_loras)")
    p.add_argument("--rank", type=int, default=16, help="their rank (InferenceConfig.max_lora_rank)")
    p.add_argument("--serving", type=int, default=64, help="requests running while an adapter loads")
    p.add_argument("--prompt-min", type=int, default=100)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-requests", type=int, default=16, help="of the twin warm-up before each timed run")
    p.add_argument("--batch1-prompt", type=int, default=512)
    p.add_argument("--batch1-output", type=int, default=256)
    p.add_argument("--max-requests", type=int, default=128, help="requests a step (InferenceConfig.max_requests)")
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens a step (InferenceConfig.max_tokens)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--grouped-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the LoRA engines group rows by adapter (InferenceConfig.lora_grouped_rows; "
                        "default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every measurement here")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model, a few requests")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)  # replaces defaults, never flags given explicitly
    args = p.parse_args(argv)
    args.device = args.device or default_device()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.adapters < 2 or args.serving > args.requests:
        p.error("--adapters must be >= 2 (one is unloaded while serving) and --serving <= --requests")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    vocab = (json.loads((Path(args.model) / "config.json").read_text()) if args.model
             else DEFAULT_CONFIGS[args.default_model])["vocab_size"]
    workload = synthetic_workload(WorkloadSpec(args.requests, args.prompt_min, args.prompt_max, args.output_len,
                                               args.output_len, 0.0, args.seed), vocab)
    batch1 = synthetic_workload(WorkloadSpec(1, args.batch1_prompt, args.batch1_prompt, args.batch1_output,
                                             args.batch1_output, 0.0, args.seed + 7), vocab)
    cuda = args.device.startswith("cuda")
    return Plan(args.model, args.default_model, args.device, args.dtype, args.adapters, args.rank, args.max_requests,
                args.max_tokens, None if cuda else 0.05, args.seed, workload,
                twin_workload(workload[:args.warmup_requests], vocab, args.seed), batch1, args.serving,
                args.grouped_rows)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    """The summary rows (measure, per-engine values, ratios to base, target, met)."""
    get = lambda cfg, *keys: _dig(rows.get(cfg), keys)  # noqa: E731
    out = []
    for wl in ("greedy", "sampled"):
        vals = [get(c, wl, "tok_s") for c in CONFIGS]
        out.append({"measure": f"workload A {wl}, out tok/s", "values": vals, "fmt": ",.0f",
                    "idle": ratio(vals[1], vals[0]), "adapters": ratio(vals[2], vals[0]),
                    "target": ">= 0.85x (no adapter >= 0.97x)",
                    "met": _met(ratio(vals[2], vals[0]), lambda r: r >= TARGETS["tok_s"])
                    and _met(ratio(vals[1], vals[0]), lambda r: r >= TARGETS["idle"])})
    vals = [get(c, "greedy", "decode_ms") for c in CONFIGS]
    out.append({"measure": "workload A greedy, decode step ms", "values": vals, "fmt": ".2f",
                "idle": ratio(vals[1], vals[0]), "adapters": ratio(vals[2], vals[0]), "target": "-", "met": None})
    vals = [get(c, "batch1", "decode_ms") for c in CONFIGS]
    out.append({"measure": "batch-1 decode, ms per step", "values": vals, "fmt": ".2f",
                "idle": ratio(vals[1], vals[0]), "adapters": ratio(vals[2], vals[0]), "target": "<= 1.1x",
                "met": _met(ratio(vals[2], vals[0]), lambda r: r <= TARGETS["batch1"])})
    serving = get("adapters", "serving") or {}
    for op in ("unload", "load"):
        s = serving.get(op)
        what = "(call ms)" if op == "unload" else "(install ms; prepare ms off the loop)"
        prep = "" if s is None or op == "unload" else f"; {serving['prepare_ms']:.1f}"
        out.append({"measure": f"{op}_lora, {args.serving} running: step gap ms median / longest {what}; "
                               "stall over the median in steps",
                    "values": [None, None, None], "fmt": ".2f",
                    "text": "-" if s is None else (f"{serving['median_gap_ms']:.2f} / {s['longest_gap_ms']:.2f} "
                                                   f"({s['call_ms']:.1f}{prep})"),
                    "idle": None, "adapters": None if s is None else s["stall_steps"], "target": "<= 1 step stall",
                    "met": None if s is None else s["stall_steps"] <= TARGETS["stall_steps"]})
    return out


def _dig(d, keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k)
    return d


def _met(r: float | None, ok) -> bool | None:
    return None if r is None else bool(ok(r))


def checks(rows: dict[str, dict], args: argparse.Namespace) -> dict:
    """That each engine did what its name says: adapters changed the base model's greedy tokens,
    every adapter request was counted, no request of the no-adapter engine named one."""
    base = (rows.get("base") or {}).get("greedy", {}).get("tokens")
    out = {}
    for cfg in ("no-adapter", "adapters"):
        run = (rows.get(cfg) or {}).get("greedy")
        if run is None:
            continue
        out[cfg] = {"lora_requests": run["lora_requests"], "failed": run["failed"],
                    "lora_free": f"{run['lora_free_steps']} of {run['steps']} steps, "
                                 f"{run['lora_free_graph_replays']} graph replays"}
        if base is not None:
            out[cfg]["same_tokens_as_base"] = sum(a == b for a, b in zip(run["tokens"], base))
            out[cfg]["first_request_differs"] = run["tokens"][0] != base[0]
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    plan = make_plan(args)
    rows = {}
    for cfg in args.configs:
        print(f"  running {cfg} ...", file=sys.stderr)
        rows[cfg] = in_own_process(args.device, run_config, cfg, plan)
    summary, checked = table(rows, args), checks(rows, args)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    model = args.model or f"built-in {args.default_model}"
    for cfg, c in checked.items():
        print(f"{cfg}: {c.get('same_tokens_as_base', '-')} of {args.requests} greedy requests with the base model's "
              f"tokens, first request differs: {c.get('first_request_differs', '-')}, lora_requests "
              f"{c['lora_requests']}, failed {c['failed']}; LoRA-free {c['lora_free']}")
    for cfg, r in rows.items():
        print(f"{cfg}: warm-up {r.get('warmup_graphs')} graphs in {r.get('warmup_s', 0):.1f} s, build {r['build_s']:.1f} s")
    if "adapters" in rows:
        r = rows["adapters"]
        print(f"adapters: the adapter loaded while serving answers unlike the base model: "
              f"{r['serving']['fresh_differs_from_base']}; graph captures / Triton builds after warm-up "
              f"{r['graph_captures_after_warmup']} / {r['triton_builds_after_warmup']}")
    print(f"\n{device}, {model} ({args.dtype}); workload A {args.requests} requests, prompts {args.prompt_min}-"
          f"{args.prompt_max}, {args.output_len} out; {args.adapters} adapters of rank {args.rank} round-robin")
    print("| measure | base | lora, no adapter | lora, adapters | no adapter / base | adapters / base | target | met |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for row in summary:
        vals = " | ".join(fmt(v, row["fmt"]) for v in row["values"])
        if "text" in row:
            vals = f"- | - | {row['text']}"
        met = "-" if row["met"] is None else ("yes" if row["met"] else "NO")
        unit = " steps" if "text" in row else "x"
        adapters = fmt(row["adapters"], ".2f") + ("" if row["adapters"] is None else unit)
        idle = fmt(row["idle"], ".3f") + ("" if row["idle"] is None else "x")
        print(f"| {row['measure']} | {vals} | {idle} | {adapters} | {row['target']} | {met} |")
    serving = (rows.get("adapters") or {}).get("serving")
    if serving:
        load = serving["load"]
        print(f"load gaps: longest {fmt(load.get('prepare_gap_ms'), '.2f')} ms while preparing "
              f"({serving['prepare_steps']} steps), {load['install_gap_ms']:.2f} ms around the install")
        for op, ms in serving["phases_ms"].items():  # host time by phase (LoRAAdapters.last_lora_ms)
            print(f"{op} phases, host ms: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    result = {"device": device, "model": model, "args": vars(args), "rows": rows, "summary": summary,
              "checks": checked}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
