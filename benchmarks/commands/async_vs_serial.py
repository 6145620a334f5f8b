#!/usr/bin/env python
"""Why does launch-ahead (async) give other tokens than the serial engine?

Runs one workload through a serial and an async engine built with the same weights and the
same KV pool, and reports:
1. the first launch whose schedule differs (rows, chunk offsets / lengths) and why;
2. kernel determinism: in the serial run, selected launches (the first mixed and the first
   decode-only step, or --repeat-launches) are rerun twice on identical inputs and every
   tapped kernel's output bits compared; plus a probe of whether a GEMM row's bits depend on
   the number of rows in the launch;
3. the first (request, position) whose logits bits differ between the modes, and whether the
   schedules were still identical up to that launch.

    python -m benchmarks async-vs-serial --device cuda --num-requests 32 \\
        --prompt-len-min 8192 --prompt-len-max 16384 --output-len 64 --max-sequence-length 16500
    python -m benchmarks async-vs-serial --smoke          # CPU, tiny model, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.determinism import batch_invariance_probe, repeat_step
from benchmarks.schedule_trace import ScheduleRecorder, first_logit_difference, first_schedule_difference
from megatron_async import LLM, InferenceConfig, SamplingParams

KV_FRACTION = 0.5
"""CUDA without --buffer-size-gb: the KV pool is this share of the memory free at start, the same for both modes."""
SMOKE = dict(device="cpu", dtype="float32", default_model="tiny", num_requests=6, prompt_len_min=40,
             prompt_len_max=120, output_len=12, max_tokens=64, max_requests=8, num_kv_blocks=60, block_size=16,
             max_sequence_length=256)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--default-model", default=None, help="built-in model (default: qwen3-0.6b on cuda, tiny on cpu)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len-min", type=int, default=8192)
    p.add_argument("--prompt-len-max", type=int, default=16384)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-requests", type=int, default=128, help="the main job's CUDA default")
    p.add_argument("--max-tokens", type=int, default=8192, help="the main job's CUDA default")
    p.add_argument("--max-sequence-length", type=int, default=16500)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--buffer-size-gb", type=float, default=None,
                   help=f"KV pool (default: {KV_FRACTION * 100:.0f}%% of free memory, taken once for both modes)")
    p.add_argument("--repeat-launches", default="auto",
                   help="serial launches rerun for the determinism check: comma list, 'auto' (first mixed + first decode) or 'none'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--against", choices=("async", "serial"), default="async",
                   help="the second run: launch-ahead, or the serial engine again (is the serial run deterministic?)")
    p.add_argument("--graphs", choices=("default", "off", "decode"), default="default",
                   help="CUDA graphs for both modes: the device default (on with CUDA), off, or decode steps only")
    p.add_argument("--no-old-async", action="store_true",
                   help="skip the second async run with Scheduler.release_finishing disabled (the engine before the fix)")
    p.add_argument("--output", default=None, help="write the full records as JSON")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (seconds)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.default_model = args.default_model or ("qwen3-0.6b" if args.device.startswith("cuda") else "tiny")
    return args


def build_config(args: argparse.Namespace, async_scheduling: bool) -> InferenceConfig:
    return InferenceConfig(block_size_tokens=args.block_size, num_kv_blocks=args.num_kv_blocks,
                           buffer_size_gb=args.buffer_size_gb, max_requests=args.max_requests, max_tokens=args.max_tokens,
                           max_sequence_length=args.max_sequence_length, async_scheduling=async_scheduling,
                           seed=args.seed, cuda_graphs=None if args.graphs == "default" else args.graphs == "decode",
                           cuda_graph_mixed_steps=args.graphs != "decode")


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.prompt_len_min, args.prompt_len_max + 1, size=args.num_requests)
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lens]


def run_mode(args, prompts, async_scheduling: bool, repeat: str, release_ahead: bool = True) -> dict:
    llm = LLM(None, args.device, args.dtype, build_config(args, async_scheduling), default_model=args.default_model,
              seed=args.seed)
    eng = llm.engine
    if not release_ahead:  # the engine before the fix: finishing requests hold their blocks one step longer
        eng.scheduler.release_finishing = lambda: None
    rec = ScheduleRecorder(record_logits=True).install(eng)
    reports = []
    if repeat != "none" and not async_scheduling:
        wanted = None if repeat == "auto" else {int(x) for x in repeat.split(",")}
        seen = set()

        def check(engine, plan, shape, pending):
            i = len(rec.launches) - 1
            kind = "decode" if shape.is_decode_only else "mixed"
            if (wanted is None and kind not in seen) or (wanted is not None and i in wanted):
                seen.add(kind)
                reports.append(repeat_step(engine, shape, pending, i))

        rec.after_launch.append(check)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=args.output_len, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    outs = {o.request_id: o.generated_tokens for o in eng.run_until_done()}
    st = eng.stats
    probe = batch_invariance_probe(llm.model, llm.device, llm.dtype) if not async_scheduling else []
    digest = float(sum(p.float().abs().sum() for p in llm.model.parameters()))
    result = {"tokens": [outs[i] for i in ids], "launches": rec.launches, "logits": rec.logits, "repeats": reports,
              "probe": probe, "weights_checksum": digest, "num_kv_blocks": llm.context.num_kv_blocks,
              "stats": {k: getattr(st, k) for k in ("steps", "decode_steps", "prefill_steps", "overlapped_steps",
                                                     "paused", "evicted", "rejected_launches", "drains")}}
    del llm, eng, rec
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device.startswith("cuda") and args.buffer_size_gb is None and args.num_kv_blocks is None:
        free, _ = torch.cuda.mem_get_info()
        args.buffer_size_gb = KV_FRACTION * free / 1e9  # once: both modes get the same pool
    from megatron_async.models.default_model import DEFAULT_CONFIGS

    prompts = workload(args, DEFAULT_CONFIGS[args.default_model]["vocab_size"])
    if args.repeat_launches != "none" and args.device.startswith("cuda") and args.graphs != "off":
        # a repeat runs the step eagerly and rewrites the KV its graph wrote with eager bits: the
        # serial run would no longer be the serial engine's
        print("launch repeats skipped: with CUDA graphs they would change the serial run (use --graphs off)")
        args.repeat_launches = "none"
    print(f"diagnose: {args.num_requests} requests, prompts {args.prompt_len_min}-{args.prompt_len_max}, "
          f"{args.output_len} greedy tokens, {args.default_model} {args.dtype} on {args.device}, graphs {args.graphs}, max_tokens "
          f"{args.max_tokens}, KV pool {args.num_kv_blocks or f'{args.buffer_size_gb:.2f} GB'}", flush=True)
    serial = run_mode(args, prompts, False, args.repeat_launches)
    print(f"serial stats {serial['stats']}")
    print("determinism (serial run, each launch repeated twice on identical inputs):")
    for rep in serial["repeats"]:
        print(f"   {rep.describe()}")
    variant = [f"{p.kernel}@{p.rows}" for p in serial["probe"] if not p.same_bits_as_one_row]
    print(f"   batch invariance probe: row 0 alone vs inside M rows, bits differ for: {', '.join(variant) or 'none'}")
    report = {"kv_blocks": serial["num_kv_blocks"], "serial_stats": serial["stats"],
              "repeats": [asdict(r) for r in serial["repeats"]], "batch_variant": variant}
    runs = {args.against: run_mode(args, prompts, args.against == "async", "none")}
    if not args.no_old_async and args.against == "async":
        runs["async_without_release_ahead"] = run_mode(args, prompts, True, "none", release_ahead=False)
    for name, other in runs.items():
        report[name] = compare(serial, other, name)
    if args.output:
        out = {"args": vars(args), "report": report,
               "serial_launches": [asdict(r) for r in serial["launches"]],
               **{f"{k}_launches": [asdict(r) for r in v["launches"]] for k, v in runs.items()}}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=0, default=str))
    return report


def compare(serial: dict, other: dict, name: str) -> dict:
    """Tokens, first schedule difference and first logits difference of one mode against serial."""
    same = [a == b for a, b in zip(serial["tokens"], other["tokens"])]
    first = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if a != b and len(a) == len(b) else None
             for a, b in zip(serial["tokens"], other["tokens"])]
    if not all(same):
        print(f"   differing requests (index: first differing output position): "
              f"{', '.join(f'{i}: {f}' for i, f in enumerate(first) if not same[i])}")
    rep = {"requests_equal": sum(same), "requests": len(same), "stats": other["stats"],
           "same_weights": serial["weights_checksum"] == other["weights_checksum"]}
    print(f"== {name}: tokens equal serial for {sum(same)}/{len(same)} requests (same weights: {rep['same_weights']}, "
          f"KV blocks {other['num_kv_blocks']}); stats {other['stats']}")
    sdiff = first_schedule_difference(serial["launches"], other["launches"])
    rep["first_schedule_difference"] = None if sdiff is None else sdiff.index
    if sdiff is None:
        print(f"   schedules: identical over {len(serial['launches'])} launches")
    else:
        print(f"   schedules: first difference at launch {sdiff.index} of {len(serial['launches'])}/"
              f"{len(other['launches'])}: {sdiff.reason}")
        for label, rec in (("serial", sdiff.serial), (name, sdiff.other)):
            print(f"     {label}: {rec.describe()[:600] if rec else '-'}")
        rep["schedule_difference_reason"] = sdiff.reason
    ldiff, common, ndiff = first_logit_difference(serial["logits"], other["logits"])
    rep["logit_keys"], rep["logit_keys_differing"] = common, ndiff
    if ldiff is None:
        print(f"   logits: all {common} common (request, position) rows bit-identical")
    else:
        before = sdiff is None or sdiff.index > max(ldiff.serial.launch, ldiff.other.launch)
        print(f"   logits: {ndiff}/{common} rows differ; first: {ldiff.describe()}; schedules identical up to there: {before}")
        rep["first_logit_difference"] = {"key": list(ldiff.key), "serial_launch": ldiff.serial.launch,
                                         "other_launch": ldiff.other.launch, "schedules_identical_before": before}
    return rep


if __name__ == "__main__":
    main()
