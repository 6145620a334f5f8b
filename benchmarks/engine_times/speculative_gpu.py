"""Speculative decoding on a GPU against plain decoding, side by side in one process: a
Qwen3-0.6B-shaped bf16 model, k = 3, an oracle drafter at 80 % per-token acceptance (forced: always
drafting) at each batch size, and at 0 % with the default switch-off policy at the largest; CUDA
graphs on: speculative vs plain decode step time and tok/s, the measured acceptance and what the
step times give at the target acceptance. The tokens-equal column is for orientation: the
assertions (speculative == plain, exactly) are tests/functional_tests/test_gpu_speculative.py's.

``--split``: only batch 128 at 0 % acceptance (k = 3, the default switch-off policy, graphs with
mixed graphs, bf16 Qwen3-0.6B shape, the speculative benchmark's 128-token prompts and 2,048-token
steps), plain and speculative engines side by side, every step split by kind: prefill / mixed
steps (with the speculative machinery, or plain), verify steps, decode steps with the drafter
(before / after a probe), plain steps (no drafter: speculative/plain_steps.py); device ms per step
(CUDA events), host ms per step and the host's wait for the device, step counts, lazy captures
(~1 min on an H100).

    python -m benchmarks engine-times speculative-gpu [--batches 1 128]
    python -m benchmarks engine-times speculative-gpu --split
    python -m benchmarks engine-times speculative-gpu --device cpu      # a dry run: tiny model, emulated graphs"""
from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.speculative.oracle import OracleDrafter
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from megatron_async.models.default_model import DEFAULT_CONFIGS

DEVICE = "cuda"
K = 3


def _with_graphs(llm: LLM) -> LLM:
    """On the CPU (dry run): emulated graphs."""
    if DEVICE == "cpu" and llm.config.cuda_graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=llm.context.mamba is None,
                                            emulate=True)
        llm.engine.warmup()
    return llm


def timing(batches=(1, 128), prompt_len: int = 64, output_len: int = 64, accept: float = 0.8) -> list[str]:
    """Plain vs speculative decode on the bf16 Qwen3-0.6B shape, graphs on, k = K, the oracle at
    ``accept`` per-token acceptance (forced: always drafting) at every batch size, and at 0% with
    the default switch-off policy at the largest. The verify graph's step time does not depend
    on acceptance; tokens per step do. In bf16 a (k + 1)-token row's logits differ in the last
    bits from a 1-token row's, so a request can leave the oracle's script at a near-tie: the
    measured acceptance is printed next to the target, and "at target" scales the step times by
    the tokens per row ``accept`` brings (1 + a + a^2 + a^3)."""
    cuda = DEVICE == "cuda"
    model, dtype = ("qwen3-0.6b", "bfloat16") if cuda else ("tiny", "float32")
    B = max(batches)
    base = dict(max_requests=B, max_tokens=max(1024, B * (K + 1)), max_sequence_length=prompt_len + output_len + 8,
                buffer_size_gb=2.0 if cuda else 0.05, cuda_graphs=True, cuda_graph_batch_sizes=tuple(batches),
                cuda_graph_mixed_steps=False, startup_warmup=False)  # the first (untimed) run compiles + captures
    vocab = DEFAULT_CONFIGS[model]["vocab_size"]

    def llm(drafter=None, **cfg) -> LLM:
        return _with_graphs(LLM(None, DEVICE, dtype, InferenceConfig(**base, **cfg), default_model=model,
                                drafter=drafter))

    plain = llm()
    params = SamplingParams(top_k=1, num_tokens_to_generate=output_len, ignore_eos=True)
    prompts, refs, cont = {}, {}, {}
    for b in batches:
        rng = random.Random(b)
        prompts[b] = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(b)]
        refs[b] = plain.generate(prompts[b], params)  # untimed: compiles and captures
        cont.update({tuple(p): o.generated_tokens for p, o in zip(prompts[b], refs[b])})
    # the drafters know every batch's continuation before the first capture (graphs read their tables)
    forced = llm(OracleDrafter(cont, 1.0 - accept, vocab, output_len + 1), num_speculative_tokens=K,
                 speculative_min_acceptance=0.0)
    auto = llm(OracleDrafter(cont, 1.0, vocab, output_len + 1), num_speculative_tokens=K)
    runs = [(b, forced, f"oracle {accept:.0%} forced") for b in batches] + [(B, auto, "oracle 0% auto policy")]
    per_row_at_target = sum(accept ** i for i in range(K + 1))
    lines = []
    for b, spec, what in runs:
        spec.generate(prompts[b], params)  # untimed: compiles and captures
        p, s = _timed(plain, prompts[b], params), _timed(spec, prompts[b], params)
        same = sum(o.generated_tokens == r.generated_tokens for o, r in zip(s["outs"], refs[b]))
        target = f" | at target: {per_row_at_target * p['ms'] / s['ms']:.2f}x" if spec is forced else ""
        lines.append(f"timing batch={b} k={K} {what}, graphs: plain {p['ms']:.2f} ms/step {p['tps']:,.0f} tok/s | "
                     f"spec {s['ms']:.2f} ms/step {s['tps']:,.0f} tok/s ({s['tps'] / p['tps']:.2f}x), acceptance "
                     f"{s['acceptance']:.2f}, verify graph replays {s['verify']}/{s['steps']} decode steps, off rows "
                     f"{s['off']}, same tokens {same}/{b}{target}")
    return lines


def split_timing(batch: int = 128, prompt_len: int = 128, output_len: int = 128) -> list[str]:
    """Plain vs speculative engine at ``batch``, 0 % acceptance (the oracle's drafts all wrong),
    the default switch-off policy, graphs, side by side: where the run's wall time goes.
    Per step kind ("mixed": prefill chunks, "mixed plain" such a step of a speculative engine run
    as the plain engine's; decode steps "plain" (the plain engine's step),
    "drafter" (no drafts, the speculative machinery runs), "verify" (rows with drafts)):
    steps, device period per step from the engine's CUDA events (``logging_step_interval`` 1),
    host ms per ``engine.step()`` call (its wall minus the time it waited for the device: the
    host work; where the wait is ~0 the host, not the device, sets the pace) and the wait.
    Also graph captures and Triton builds inside the timed run (lazy captures cost ms each).
    One untimed run per engine first (compiles, captures the graphs it replays)."""
    cuda = DEVICE == "cuda"
    model, dtype = ("qwen3-0.6b", "bfloat16") if cuda else ("tiny", "float32")
    base = dict(max_requests=batch, max_tokens=max(2048 if cuda else 32, batch * (K + 1)),
                max_sequence_length=prompt_len + output_len + 8, buffer_size_gb=4.0 if cuda else 0.05,
                cuda_graphs=True, cuda_graph_batch_sizes=(batch,), startup_warmup=False, logging_step_interval=1)
    vocab = DEFAULT_CONFIGS[model]["vocab_size"]
    rng = random.Random(batch)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(top_k=1, num_tokens_to_generate=output_len, ignore_eos=True)
    plain = _with_graphs(LLM(None, DEVICE, dtype, InferenceConfig(**base), default_model=model))
    refs = plain.generate(prompts, params)  # untimed
    oracle = OracleDrafter({tuple(p): o.generated_tokens for p, o in zip(prompts, refs)}, 1.0, vocab, output_len + 1)
    spec = _with_graphs(LLM(None, DEVICE, dtype, InferenceConfig(**base, num_speculative_tokens=K), default_model=model,
                            drafter=oracle))
    spec.generate(prompts, params)  # untimed
    p, s = _step_kinds(plain, prompts, params), _step_kinds(spec, prompts, params)
    same = sum(a == b for a, b in zip(s["tokens"], p["tokens"]))
    base_ms = _mean(p["plain"]["device"])
    decode = [t for k in ("plain", "drafter", "verify") for t in s[k]["device"]]
    lines = [f"split batch={batch} k={K} oracle 0% auto policy, graphs; ms per step (device: event period; host: "
             f"engine.step() wall minus its wait for the device)",
             "| engine | kind | steps | device ms | vs plain decode | host ms | wait ms | sum of step() ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, run in (("plain", p), ("spec", s)):
        for kind in KINDS:
            k = run[kind]
            if k["device"] or k["host"]:
                dev = _mean(k["device"])
                lines.append(f"| {name} | {kind} | {len(k['host'])} | {dev:.3f} | {dev / base_ms:.2f}x | "
                             f"{_mean(k['host']):.3f} | {_mean(k['wait']):.3f} | {sum(k['wall']):.1f} |")
        lines.append(f"| {name} | run | {run['steps']} | | | | | wall {1e3 * run['wall']:.1f} ms, "
                     f"captures {run['captures']}, builds {run['builds']}, gc {run['gc_ms']:.1f} ms "
                     f"({run['gc_full']} full) |")
    lines.append(f"split: spec decode steps {_mean(decode):.3f} ms ({_mean(decode) / base_ms:.2f}x "
                 f"plain {base_ms:.3f}) | tok/s {s['tps']:,.0f} vs {p['tps']:,.0f} ({s['tps'] / p['tps']:.2f}x) | same "
                 f"tokens {same}/{batch} | off rows {s['off']} | fast snapshots {s['fast_snapshots']}, fast landings "
                 f"{s['fast_landings']} of {s['steps']} steps")
    return lines


KINDS = ("mixed", "mixed plain", "plain", "drafter", "verify")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _step_kinds(llm: LLM, prompts, params) -> dict:
    """One generate stepped by hand. Each ``engine.step()`` call is filed under the kind of
    step it launched (KINDS; the first call launches two) with its wall, its wait for the device (``wait_host``) and, from
    the step's CUDA events, the device period of that launch. Also tok/s, the run's graph
    captures and Triton builds, and the fast-path counters."""
    ctl, eng, dev = llm.runner, llm.engine, llm.runner.device
    st = eng.stats
    kinds: dict[int, str] = {}
    launch, wait_host = eng.launch_plan, dev.wait_host
    cur = {"kind": None, "wait": 0.0}

    def logged(plan, step_id, overlapped, timed, *agreed):
        sel = ctl.spec_steps
        before = (sel.plain_steps, sel.plain_mixed_steps) if sel is not None else (0, 0)
        pending = launch(plan, step_id, overlapped, timed, *agreed)
        if not plan.is_all_decode:
            kind = "mixed plain" if sel is not None and sel.plain_mixed_steps > before[1] else "mixed"
        elif any(r.num_drafts for r in plan.rows):
            kind = "verify"
        else:
            plain = sel is None or sel.plain_steps > before[0]
            kind = "plain" if plain else "drafter"
        kinds[step_id] = kind
        if not (cur["kind"] or "").startswith("mixed"):  # a call that launched a mixed step (and another): mixed
            cur["kind"] = kind
        return pending

    def waited(event):
        t = time.perf_counter()
        wait_host(event)
        cur["wait"] += time.perf_counter() - t

    gc_time = {"start": 0.0, "ms": 0.0, "full": 0}

    def on_gc(phase, info):  # Python's cyclic collector: pauses the host inside some step
        if phase == "start":
            gc_time["start"] = time.perf_counter()
        else:
            gc_time["ms"] += 1e3 * (time.perf_counter() - gc_time["start"])
            gc_time["full"] += info["generation"] == 2

    eng.launch_plan, dev.wait_host = logged, waited
    gc.callbacks.append(on_gc)
    off0 = dict(st.spec_off_rows)
    before = (st.graph_captures_after_warmup, st.triton_builds_after_warmup, st.fast_decode_snapshots,
              st.fast_landings, st.steps)
    times = {k: {"device": [], "host": [], "wait": [], "wall": []} for k in KINDS}
    ids = [eng.add_request(p, params) for p in prompts]
    outs = {}
    torch.cuda.synchronize() if DEVICE == "cuda" else None
    t0 = time.perf_counter()
    try:
        while eng.has_unfinished_requests():
            cur["kind"], cur["wait"] = None, 0.0
            t = time.perf_counter()
            res = eng.step()
            wall = time.perf_counter() - t
            for o in res.finished:
                outs[o.request_id] = o.generated_tokens
            if res.step_time is not None and res.step_id in kinds:
                times[kinds[res.step_id]]["device"].append(1e3 * res.step_time)
            if cur["kind"] is not None:
                k = times[cur["kind"]]
                k["wall"].append(1e3 * wall)
                k["wait"].append(1e3 * cur["wait"])
                k["host"].append(1e3 * (wall - cur["wait"]))
        wall = time.perf_counter() - t0
    finally:
        del eng.launch_plan, dev.wait_host  # back to the class's methods
        gc.callbacks.remove(on_gc)
    after = (st.graph_captures_after_warmup, st.triton_builds_after_warmup, st.fast_decode_snapshots,
             st.fast_landings, st.steps)
    captures, builds, fast_snapshots, fast_landings, steps = (x - y for x, y in zip(after, before))
    off = {c: n - off0.get(c, 0) for c, n in st.spec_off_rows.items() if n - off0.get(c, 0)}
    return dict(times, tokens=[outs[i] for i in ids], tps=sum(len(outs[i]) for i in ids) / wall, off=off, wall=wall,
                captures=captures, builds=builds, gc_ms=gc_time["ms"], gc_full=gc_time["full"], fast_snapshots=fast_snapshots, fast_landings=fast_landings,
                steps=steps)


def _timed(llm: LLM, prompts, params) -> dict:
    """One generate: ms per decode step and decode tok/s (decode steps are the engine's
    decode-only launches, their tokens all but each request's first), and the speculative
    counters of this run alone."""
    st = llm.engine.stats
    before = (st.decode_steps, st.decode_wall_time, st.spec_accepted_tokens, st.spec_draft_tokens,
              st.spec_graph_replays, sum(st.spec_off_rows.values()))
    outs = llm.generate(prompts, params)
    after = (st.decode_steps, st.decode_wall_time, st.spec_accepted_tokens, st.spec_draft_tokens,
             st.spec_graph_replays, sum(st.spec_off_rows.values()))
    steps, wall, acc, drafted, verify, off = (a - b for a, b in zip(after, before))
    tokens = sum(len(o.generated_tokens) - 1 for o in outs)
    return dict(ms=1e3 * wall / max(steps, 1), tps=tokens / max(wall, 1e-9), outs=outs, steps=steps,
                acceptance=acc / drafted if drafted else 0.0, verify=verify, off=off)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes of the timing (default 1 128 on CUDA, 1 8 on the CPU)")
    parser.add_argument("--split", action="store_true", help="only the per-step-kind split at batch 128")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (tiny model, emulated graphs)")


def run(args: argparse.Namespace) -> None:
    global DEVICE
    DEVICE = args.device
    cuda = DEVICE == "cuda"
    t0 = time.perf_counter()
    if args.split:
        lines = split_timing(128 if cuda else 8, 128 if cuda else 8, 128 if cuda else 40)
    else:
        lines = timing(tuple(args.batches or ((1, 128) if cuda else (1, 8))))
    print("\n".join(lines))
    print(f"total {time.perf_counter() - t0:.0f} s")
