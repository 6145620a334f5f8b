"""Host (CPU) time per decode step, by stage, on the built-in tiny model or ``--model`` (CPU, float32;
``--cuda``: the GPU).

Launch-ahead hides the host only while its time per step stays below the device step, so this
is the number that decides whether small or sharded models are host-bound. Runs
``LLM.generate`` (async scheduling) at several row counts, greedy and sampled (temperature +
top-p, seeded), and wraps each stage with ``perf_counter``. Only steps that bookkeep a decode
launch and launch a decode step are counted (the prefill steps are left out). Stages:

- schedule: ``Scheduler.schedule``
- init_attn: ``DynamicInferenceContext.initialize_attention_state``
- land: ``ModelRunner.collect`` + ``RequestBook.land`` (samples to host lists; tokens appended, stops, blocks)
- text_updates: ``DynamicInferenceRequest.take_update`` (new tokens and text deltas per request)
- engine_rest: the rest of ``DynamicInferenceEngine._bookkeep`` (stats, finished outputs)
- h2d: ``transfer_bookkeeping_to_gpu``
- launch_rest: the rest of ``DynamicInferenceEngine.launch_plan`` (the book's commit, graph
  choice, sample copies, the PendingLaunch record), the forward excluded
- host total: ``engine.step`` minus the forward (``compute_step``)

Times are this thread's CPU time by default (``--clock cpu``): on a shared box, wall time also
counts the moments another process holds the core, which say nothing about the host's work.

``--stream`` drives ``engine.step()`` the way the server's engine loop does (every request's
``RequestUpdate`` with its text delta is read each step) instead of ``LLM.generate``.

``--spec K``: a speculative engine (k = K, the default switch-off policy) with an oracle
drafter at 0 % acceptance (batch 128 / 0 % must cost what plain decoding costs), its
host time also split by the kind of step launched: "plain" (the plain engine's step:
speculative/plain_steps.py), "drafter" (no drafts, the speculative machinery runs), "verify"
(some row has drafts). ``--spec 0`` with ``--kinds`` prints the same split for a plain engine. The line of each setting
also gives the host time of the whole run by the kind of step launched, "mixed" (prefill
chunks) included, and of it the schedule and init_attn stages; ``--prompt-len 128 --max-tokens
2048`` gives those steps the speculative benchmark's sizes.

``--model CKPT``: an HF checkpoint instead of the built-in tiny model (a tiny one of a hybrid's layer
pattern: the host's work per step follows the layers' kinds and count, not their widths; its
vocabulary must hold the prompts' token ids, 5-999).

``--cuda``: the engine on the GPU in bfloat16 with its defaults (CUDA graphs, launch-ahead), so
the host's work is timed with the device's launch path (stream switches, copies, graph replays,
events); "forward" is then the eager steps' only (graphs replay inside launch_rest). A waiting
thread sleeps on launches made ahead, so its CPU time leaves the wait out: a host total above
the device's step time means the step is host-bound.

Usage: ``OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks host-step [--rows 64 128 256] [--stream]``
(the last thing printed is a markdown table, ms per decode step)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.inference import request as rq  # noqa: E402
from megatron_async.inference.contexts import dynamic_context as dc  # noqa: E402
from megatron_async.inference.engines import dynamic_engine as de  # noqa: E402
from megatron_async.inference.engines import scheduler as sch  # noqa: E402
from megatron_async.inference.engines import request_book as rb  # noqa: E402
from megatron_async.inference.speculative.oracle import OracleDrafter  # noqa: E402
from megatron_async.inference.text_generation_controllers import model_runner as mr  # noqa: E402

STAGES = ["schedule", "init_attn", "h2d", "launch_rest", "land", "text_updates", "engine_rest"]


class StageTimer:
    """Wraps methods with ``clock``; per-step sums, kept only for decode steps."""

    def __init__(self, clock):
        self.clock = clock
        self.cur: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.launched_decode = True
        self.run_host = 0.0
        """Host time of every step of the run (prefill included), the forwards excluded."""
        self.run_by_kind: dict[str, float] = {}
        self.run_steps: dict[str, int] = {}
        """Host time and ``engine.step()`` calls of the whole run by the kind of step each launched."""
        self.run_stages: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        """Their ``schedule`` and ``init_attn`` stages by kind."""
        self._undo = []

    def wrap(self, cls, name: str, label: str, after=None):
        f = getattr(cls, name)

        def timed(*a, **k):
            t = self.clock()
            try:
                res = f(*a, **k)
            finally:
                self.cur[label] += self.clock() - t
            if after is not None:
                after(res)
            return res

        setattr(cls, name, timed)
        self._undo.append((cls, name, f))

    def install(self):
        self.wrap(sch.Scheduler, "schedule", "schedule")
        self.wrap(dc.DynamicInferenceContext, "initialize_attention_state", "init_attn", after=self._note_shape)
        self.wrap(dc.DynamicInferenceContext, "transfer_bookkeeping_to_gpu", "h2d")
        self.wrap(mr.ModelRunner, "collect", "land")
        self.wrap(rb.RequestBook, "land", "land")
        self.wrap(mr.ModelRunner, "compute_step", "forward")
        self.wrap(de.DynamicInferenceEngine, "launch_plan", "launch")
        self.wrap(de.DynamicInferenceEngine, "_bookkeep", "bookkeep")
        self.wrap(rq.DynamicInferenceRequest, "take_update", "text_updates")
        step = de.DynamicInferenceEngine.step

        def timed_step(engine):
            self.cur, self.launched_decode = defaultdict(float), True
            t = self.clock()
            res = step(engine)
            self.cur["wall"] = self.clock() - t
            host = self.cur["wall"] - self.cur.get("forward", 0.0)
            self.run_host += host
            for kind in ("mixed",) + KINDS:  # a call that launched a mixed step (and another) counts as mixed
                if self.cur.get("kind:" + kind):
                    self.run_by_kind[kind] = self.run_by_kind.get(kind, 0.0) + host
                    self.run_steps[kind] = self.run_steps.get(kind, 0) + 1
                    for stage in ("schedule", "init_attn"):
                        self.run_stages[kind][stage] += self.cur.get(stage, 0.0)
                    break
            if res.is_decode_only and self.launched_decode:
                self.steps.append(dict(self.cur))
            return res

        de.DynamicInferenceEngine.step = timed_step
        self._undo.append((de.DynamicInferenceEngine, "step", step))

    def _note_shape(self, shape):
        self.launched_decode &= shape.is_decode_only

    def tag_kinds(self, engine) -> None:
        """Label each step by the kind of decode step it launched (plain / drafter / verify)."""
        runner, launch = engine.runner, engine.launch_plan

        def tagged(plan, *a, **k):
            before = runner.spec_steps.plain_steps if runner.spec_steps is not None else 0
            res = launch(plan, *a, **k)
            if not plan.is_all_decode:
                self.cur["kind:mixed"] = 1
            elif any(r.num_drafts for r in plan.rows):
                self.cur["kind:verify"] = 1
            elif runner.spec_steps is None or runner.spec_steps.plain_steps > before:
                self.cur["kind:plain"] = 1
            else:
                self.cur["kind:drafter"] = 1
            return res

        engine.launch_plan = tagged
        self._undo.append((engine, "launch_plan", launch))

    def uninstall(self):
        for cls, name, f in reversed(self._undo):
            if isinstance(cls, type):
                setattr(cls, name, f)
            else:  # an instance attribute
                delattr(cls, name)

    def summary(self) -> dict[str, float]:
        """Median ms per decode step of every stage, plus host total (medians: on a shared
        box a step now and then loses the core to another process, which says nothing about
        the host work of a step)."""
        for st in self.steps:
            st["engine_rest"] = st.get("bookkeep", 0.0) - st.get("land", 0.0) - st.get("text_updates", 0.0)
            st["host"] = st["wall"] - st.get("forward", 0.0)
            st["launch_rest"] = st.get("launch", 0.0) - st.get("init_attn", 0.0) - st.get("h2d", 0.0) - st.get("forward", 0.0)
        out = {s: 1e3 * statistics.median(st.get(s, 0.0) for st in self.steps) for s in STAGES + ["forward", "host"]}
        out["host_mean"] = 1e3 * statistics.fmean(st["host"] for st in self.steps)
        out["steps"] = len(self.steps)
        out["run_host"] = 1e3 * self.run_host
        out["run_by_kind"] = {k: (self.run_steps[k], round(1e3 * v, 2)) for k, v in self.run_by_kind.items()}
        out["run_stages"] = {k: {s: round(1e3 * v, 2) for s, v in d.items()} for k, d in self.run_stages.items()}
        for kind in KINDS:
            of_kind = [st for st in self.steps if st.get("kind:" + kind)]
            out["n:" + kind] = len(of_kind)
            out["host:" + kind] = 1e3 * statistics.median(st["host"] for st in of_kind) if of_kind else float("nan")
        return out


KINDS = ("plain", "drafter", "verify")


def _stream(llm: LLM, prompts, sp) -> None:
    """What the server's engine loop does: add, step, read every update's tokens and text."""
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, sp)
    chars = 0
    while eng.has_unfinished_requests():
        for upd in eng.step().updates:
            chars += len(upd.new_text or "") + len(upd.new_tokens)
    assert chars > 0


LOG_PROBS = {"off": {}, "log-probs": {"return_log_probs": True},
             "top-5": {"return_log_probs": True, "top_n_logprobs": 5}}


def run(rows: int, sampled: bool, tokens: int, repeats: int, stream: bool, clock, spec: int = 0,
        kinds: bool = False, log_probs: str = "off", prompt_len: int = 0, max_tokens: int = 4096,
        model: str | None = None, cuda: bool = False) -> dict[str, float]:
    blocks = rows * max(40, (prompt_len + tokens) // 16 + 2)  # (the default KV block of 16 tokens)
    cfg = InferenceConfig(max_requests=rows, max_tokens=max_tokens, num_kv_blocks=blocks, async_scheduling=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(prompt_len or rng.randrange(8, 16))] for _ in range(rows)]
    if sampled:
        sp = SamplingParams(num_tokens_to_generate=tokens, temperature=0.8, top_p=0.95, ignore_eos=True, seed=1,
                            **LOG_PROBS[log_probs])
    else:
        sp = SamplingParams(num_tokens_to_generate=tokens, top_k=1, ignore_eos=True, **LOG_PROBS[log_probs])
    device = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    llm = LLM(model, *device, inference_config=cfg)
    if spec:  # every draft wrong: the oracle corrupts each true next token
        cont = {tuple(p): o.generated_tokens for p, o in zip(prompts, llm.generate(prompts, sp))}
        drafter = OracleDrafter(cont, 1.0, llm.model.vocab_size, tokens + 1)
        llm = LLM(model, *device, inference_config=dataclasses.replace(cfg, num_speculative_tokens=spec), drafter=drafter)
    llm.generate(prompts[:8], sp)  # warm-up
    best = None
    for _ in range(repeats):  # the box is shared: keep the quietest run
        timer = StageTimer(clock)
        timer.install()
        if spec or kinds:
            timer.tag_kinds(llm.engine)
        try:
            _stream(llm, prompts, sp) if stream else llm.generate(prompts, sp)
        finally:
            timer.uninstall()
        s = timer.summary()
        if best is None or s["host"] < best["host"]:
            best = s
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting; the fastest host time is kept")
    ap.add_argument("--stream", action="store_true", help="step the engine and read every update (server path)")
    ap.add_argument("--spec", type=int, default=0, metavar="K",
                    help="a speculative engine, k = K, oracle drafter at 0%% acceptance (host time by step kind too)")
    ap.add_argument("--kinds", action="store_true", help="print the host time by step kind (implied by --spec)")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="tokens per prompt (0: 8-15 at random); with --max-tokens, the prefill steps' sizes")
    ap.add_argument("--max-tokens", type=int, default=4096, help="the step's token budget")
    ap.add_argument("--greedy-only", action="store_true", help="skip the sampled runs")
    ap.add_argument("--log-probs", nargs="+", choices=list(LOG_PROBS), default=["off"],
                    help="what each request asks for: no log-probs, its tokens' log-probs, or those and the top 5")
    ap.add_argument("--model", default=None, metavar="CKPT", help="an HF checkpoint (default: the built-in tiny model)")
    ap.add_argument("--cuda", action="store_true", help="the engine on the GPU (bfloat16, graphs, launch-ahead)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: this thread's CPU time (time.thread_time: what the host works, whatever else "
                         "runs on the box); wall: perf_counter")
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    results = []
    for rows in args.rows:
        for sampled, lp in [(x, lp) for x in ((False,) if args.greedy_only else (False, True)) for lp in args.log_probs]:
            s = run(rows, sampled, args.tokens, args.repeats, args.stream, clock, args.spec, args.kinds, lp,
                    args.prompt_len, args.max_tokens, args.model, args.cuda)
            mode = ("sampled" if sampled else "greedy") + ("" if lp == "off" else f" + {lp}")
            results.append((rows, mode, s))
            print(f"rows={rows} {mode}: host {s['host']:.3f} ms/step "
                  f"(mean {s['host_mean']:.3f}; forward {s['forward']:.1f} ms, {s['steps']} decode steps; host of the "
                  f"whole run {s['run_host']:.1f} ms; by kind (calls, ms): {s['run_by_kind']}, of which {s['run_stages']})",
                  flush=True)
    print()
    print(f"{'engine.step() + every update read (server path)' if args.stream else 'LLM.generate'}, "
          f"median {args.clock} ms per decode step (best of --repeats runs):")
    print("| rows | sampling | " + " | ".join(STAGES) + " | host total | forward |")
    print("|---:|---|" + "---:|" * (len(STAGES) + 2))
    for rows, mode, s in results:
        stages = " | ".join(f"{s[k]:.3f}" for k in STAGES)
        print(f"| {rows} | {mode} | {stages} | **{s['host']:.3f}** | {s['forward']:.1f} |")
    if args.spec or args.kinds:
        print()
        print(f"{'speculative engine, k = %d, oracle 0 %%' % args.spec if args.spec else 'plain engine'}: median host "
              f"ms per decode step by the kind of step launched (steps)")
        print("| rows | sampling | " + " | ".join(KINDS) + " |")
        print("|---:|---|" + "---:|" * len(KINDS))
        for rows, mode, s in results:
            cells = " | ".join(f"{s['host:' + k]:.3f} ({s['n:' + k]})" for k in KINDS)
            print(f"| {rows} | {mode} | {cells} |")


if __name__ == "__main__":
    main()
