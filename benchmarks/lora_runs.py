"""One engine of the LoRA benchmark (``python -m benchmarks lora``), run in a process of its own
on a GPU: the base engine, an ``enable_lora`` engine whose requests name no adapter, or one whose
requests name its adapters round-robin. Each times workload A (greedy, then sampled) after a twin
warm-up and a batch-1 decode; the adapters' engine also unloads an adapter between the steps of a
running workload and loads one (prepared on another thread while the loop steps, installed between
two steps), and keeps every step's end time."""
from __future__ import annotations

import json
import math
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.side_by_side import params_factory
from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.driver import StatsWindow, run_workload
from megatron_async.cli.summary import summarize
from megatron_async.cli.workload import WorkloadRequest

CONFIGS = ("base", "no-adapter", "adapters")
"""The engines, in the order they run: enable_lora off; on with adapters loaded and no request
naming one; on with every request naming one."""
ALPHA_PER_RANK = 2.0
"""PEFT scaling lora_alpha / r of the random adapters."""
B_STD = 0.05
"""Spread of the random lora_B entries (lora_A's rows have unit norm): enough to move greedy tokens
of a random-weight model, small enough to keep its activations finite in bf16."""
GAP_WINDOW = 3
"""Steps from a load / unload on whose gaps the call may show (the call itself, a landing it waited
for, the launch after it)."""


@dataclass(frozen=True)
class Plan:
    """What every engine of one benchmark runs (picklable: it crosses into a spawned process)."""

    model: str | None
    default_model: str
    device: str
    dtype: str
    adapters: int
    rank: int
    max_requests: int
    max_tokens: int
    buffer_size_gb: float | None
    seed: int
    workload: list[WorkloadRequest]
    warmup: list[WorkloadRequest]
    batch1: list[WorkloadRequest]
    serving: int
    """Requests of the workload running while an adapter is loaded and another unloaded."""
    grouped_rows: bool | None = None
    """InferenceConfig.lora_grouped_rows of the LoRA engines (None: the config's default)."""


def adapter_names(plan: Plan) -> list[str]:
    return [f"adapter{i}" for i in range(plan.adapters)]


def random_adapter(llm: LLM, rank: int, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(PEFT config, PEFT-named tensors) of rank ``rank`` on every module the engine adapts (for a
    dense model q/k/v/o/gate/up/down of every layer), drawn on the model's device and dtype."""
    targets = llm.engine.context.lora.targets
    first = next(iter(targets.values())).slots.a
    gen = torch.Generator(first.device).manual_seed(seed)
    tensors = {}
    for module, target in targets.items():
        shape_a, shape_b = target.slots.full_shapes(target.part, rank)
        a = torch.randn(shape_a, generator=gen, device=first.device) / math.sqrt(shape_a[1])
        b = torch.randn(shape_b, generator=gen, device=first.device) * B_STD
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(first.dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(first.dtype)
    modules = sorted({m.rsplit(".", 1)[-1] for m in targets})
    return {"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA_PER_RANK * rank, "target_modules": modules}, tensors


def save_peft(adapter: tuple[dict, dict[str, torch.Tensor]], out: Path) -> Path:
    """The adapter as PEFT's ``save_pretrained`` leaves it: what a user hands ``load_lora``."""
    from safetensors.torch import save_file

    config, tensors = adapter
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def with_adapters(make, requests: list[WorkloadRequest], names: list[str]):
    """``make``'s SamplingParams with ``lora`` set round-robin over ``names`` by request index."""
    index = {id(r): i for i, r in enumerate(requests)}
    return lambda r: replace(make(r), lora=names[index[id(r)] % len(names)] if names else None)


def build(plan: Plan, lora: bool) -> LLM:
    cfg = InferenceConfig(max_requests=plan.max_requests, max_tokens=plan.max_tokens,
                          buffer_size_gb=plan.buffer_size_gb, enable_lora=lora,
                          max_loras=plan.adapters, max_lora_rank=plan.rank,
                          **({} if plan.grouped_rows is None else {"lora_grouped_rows": plan.grouped_rows}))
    return LLM(plan.model, plan.device, plan.dtype, cfg, default_model=plan.default_model, seed=plan.seed)


def timed(llm: LLM, plan: Plan, requests: list[WorkloadRequest], warmup: list[WorkloadRequest], workload: str,
          names: list[str]) -> dict:
    """Workload ``workload`` after its twin warm-up: tok/s, decode step, what the engine counted."""
    run_workload(llm.engine, warmup, with_adapters(params_factory(workload, plan.seed + 1, warmup), warmup, names))
    window = StatsWindow(llm.engine)
    run = run_workload(llm.engine, requests, with_adapters(params_factory(workload, plan.seed, requests), requests, names))
    st = window.stats()
    s = summarize(run, st, torch.device(plan.device))
    return {"tok_s": s.output_tokens_per_s, "decode_ms": s.mean_decode_step_ms, "tpot_ms": s.tpot_p50_ms,
            "decode_batch": s.mean_decode_batch, "failed": s.failed_requests, "lora_requests": st.lora_requests,
            "graph_replays": st.graph_replays, "lora_free_steps": st.lora_free_steps,
            "lora_free_graph_replays": st.lora_free_graph_replays, "steps": st.steps,
            "tokens": [o.generated_tokens if o is not None else None for o in run.outputs]}


def run_config(name: str, plan: Plan) -> dict:
    """Every measurement of engine ``name`` (one of ``CONFIGS``) on a freshly built engine."""
    assert name in CONFIGS, name
    t0 = time.perf_counter()
    llm = build(plan, lora=name != "base")
    row: dict = {"config": name, "build_s": time.perf_counter() - t0}
    names = adapter_names(plan) if name != "base" else []
    t0 = time.perf_counter()
    adapters = {n: random_adapter(llm, plan.rank, plan.seed + 1000 + i) for i, n in enumerate(names)}
    for n, adapter in adapters.items():
        llm.load_lora(n, adapter)
    row["load_s"] = time.perf_counter() - t0
    use = names if name == "adapters" else []
    for workload in ("greedy", "sampled"):
        row[workload] = timed(llm, plan, plan.workload, plan.warmup, workload, use)
    row["batch1"] = timed(llm, plan, plan.batch1, plan.batch1, "greedy", use[:1])
    if name == "adapters":
        with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
            fresh = save_peft(random_adapter(llm, plan.rank, plan.seed + 2000), Path(tmp) / "fresh")
            row["serving"] = serve_while_loading(llm, plan, names, fresh)
    st = llm.engine.stats
    row["graph_captures_after_warmup"] = st.graph_captures_after_warmup
    row["triton_builds_after_warmup"] = st.triton_builds_after_warmup
    row["warmup_graphs"], row["warmup_s"] = st.warmup_graphs, st.warmup_seconds
    llm.close()
    return row


def serve_while_loading(llm: LLM, plan: Plan, names: list[str], fresh: Path) -> dict:
    """``plan.serving`` greedy requests of the workload on every adapter but the last; between two
    decode steps the last (named by none of them) is unloaded; some steps later ``fresh`` (a PEFT
    directory) is prepared on a thread of its own (read, checked, staged: ``LLM.prepare_lora``,
    as the server's load route does) while the loop steps on, and installed into the freed slot
    (``load_lora`` of the prepared adapter) between the first two steps after it is ready. Each
    step's gap (end of the step before to its own end, host work between them included) from the
    call (the prepare's start) to ``GAP_WINDOW`` steps after the install, against the median decode
    gap; then the new adapter serves a request whose tokens differ from the base model's."""
    engine, keep, spare = llm.engine, names[:-1], names[-1]
    requests = plan.workload[:plan.serving]
    make = with_adapters(params_factory("greedy", plan.seed, requests), requests, keep)
    for r in requests:
        engine.add_request(r.prompt, make(r))
    prefill = math.ceil(sum(len(r.prompt) for r in requests) / plan.max_tokens) + 1
    out = min(r.output_len for r in requests)
    at = {"unload": prefill + out // 4, "load": prefill + out // 2}
    if at["load"] + GAP_WINDOW >= prefill + out:
        raise ValueError(f"outputs of {out} tokens leave no decode steps around the load: ask for longer outputs")
    ends, decode_only, call_s, last = [], [], {}, {"unload": at["unload"]}
    adapters, phases = engine.context.lora, {}
    prepared: dict = {}
    ready = threading.Event()

    def prepare() -> None:
        ts = time.perf_counter()
        try:
            prepared["adapter"] = llm.prepare_lora(fresh)
        finally:
            prepared["prepare_s"] = time.perf_counter() - ts
            ready.set()

    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if at["unload"] == len(ends):
            ts = time.perf_counter()
            llm.unload_lora(spare)
            call_s["unload"] = time.perf_counter() - ts
            phases["unload"] = dict(adapters.last_lora_ms["unload"])
        if at["load"] == len(ends):
            threading.Thread(target=prepare, name="lora-prepare", daemon=True).start()
        if ready.is_set() and "load" not in call_s:
            ts = time.perf_counter()
            llm.load_lora("fresh", prepared["adapter"])  # raises KeyError if the prepare failed (its error printed)
            call_s["load"], last["load"] = time.perf_counter() - ts, len(ends)
            phases["install"] = dict(adapters.last_lora_ms["install"])
            phases["prepare"] = dict(adapters.last_lora_ms["prepare"])
        res = engine.step()
        ends.append(time.perf_counter() - t0)
        decode_only.append(res.is_decode_only)
    if len(call_s) != len(at):
        raise RuntimeError(f"the workload ended after {len(ends)} steps, before {sorted(set(at) - set(call_s))}"
                           " (a prepare longer than the remaining decode: ask for longer outputs)")
    gaps = [None] + [b - a for a, b in zip(ends, ends[1:])]
    near = {i for op, step in at.items() for i in range(step, last[op] + GAP_WINDOW)}
    median = statistics.median(g for i, g in enumerate(gaps) if g is not None and decode_only[i] and i not in near)
    result = {"steps": len(ends), "median_gap_ms": 1e3 * median, "prepare_ms": 1e3 * prepared["prepare_s"],
              "prepare_steps": last["load"] - at["load"], "staged_mb": prepared["adapter"].nbytes / 2**20}
    for op, step in at.items():
        worst = max(g for g in gaps[step:last[op] + GAP_WINDOW] if g is not None)
        result[op] = {"step": step, "call_ms": 1e3 * call_s[op], "longest_gap_ms": 1e3 * worst,
                      "stall_steps": (worst - median) / median}
    # the load's window in two: steps while the prepare ran on its thread, and around the install
    while_preparing = [g for g in gaps[at["load"]:last["load"]] if g is not None]
    result["load"]["prepare_gap_ms"] = 1e3 * max(while_preparing) if while_preparing else None
    around_install = [g for g in gaps[last["load"]:last["load"] + GAP_WINDOW] if g is not None]
    result["load"]["install_gap_ms"] = 1e3 * max(around_install)
    result["phases_ms"] = phases
    prompt = requests[0].prompt
    new = SamplingParams(top_k=1, num_tokens_to_generate=16, ignore_eos=True, lora="fresh")
    outs = llm.generate([prompt, prompt], [new, replace(new, lora=None)])
    result["fresh_differs_from_base"] = outs[0].generated_tokens != outs[1].generated_tokens
    return result
