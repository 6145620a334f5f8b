"""Speculative decoding benchmark: output tok/s against plain decoding, side by side in one
process, for an oracle drafter at chosen acceptance rates (k drafts, batch sizes), and for the
n-gram drafter on a repetitive workload. Every speculative run's tokens are compared with the
plain run's. ``--smoke`` runs in seconds on the CPU (tiny model).

The oracle drafter proposes the plain run's continuation with tokens corrupted at rate
1 - acceptance, so its acceptance is only what it says while the speculative run's tokens
equal the plain run's: on a GPU in bf16 a (k + 1)-token row's logits differ in the last bits
from a 1-token row's, near-ties then flip, and a flipped request leaves the oracle's script.
``--batch-invariant`` (default on CUDA) makes the two bit-identical.

``--quick``: only batch 128 at 0 % acceptance, plain against the default switch-off policy
(k = 3), with CUDA graphs: two engines, graphs of batch 128 only, captured by an untimed run of
the same workload instead of a startup warm-up; about a minute on one GPU, the row printed as
soon as it is measured (the target: >= 0.9x plain at batch 128 / 0 %)."""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from benchmarks.gpu_idle import profile_run
from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.speculative.oracle import OracleDrafter
from megatron_async.inference.speculative.step_cost import bucket
from megatron_async.models.default_model import DEFAULT_CONFIGS


@dataclass
class BenchRow:
    workload: str
    batch: int
    k: int
    target_acceptance: float | None
    """Oracle per-token acceptance (None: plain decoding or the n-gram drafter)."""
    policy: str
    """"forced" (min acceptance 0, not adaptive: always drafts) or "auto" (the default policy: on
    CUDA the adaptive per-step rule, speculative/policy.py)."""
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float
    acceptance: float
    """Per-position acceptance: accepted drafts / drafts that were reached (every draft after
    an accepted one, the first of each row), comparable with the oracle's rate."""
    tokens_per_row: float
    """Tokens a decode row brought (1 + accepted drafts per verify row)."""
    steps: int
    off_rows: dict
    same_tokens: float
    """Share of requests whose tokens equal the plain run's."""
    plain_steps: int = 0
    """Decode steps the speculative engine ran as plain steps (no drafter: plain_steps.py)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small sweep")
    p.add_argument("--quick", action="store_true",
                   help="batch 128, k 3, 0%% acceptance, plain vs the switch-off policy, graphs (~1 min on one GPU)")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--model", default=None, help="built-in model (default: qwen3-0.6b on CUDA, tiny on CPU)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--acceptances", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto",
                   help="auto: on with CUDA (bit-identical logits, so the oracle's acceptance holds)")
    p.add_argument("--max-seconds", type=float, default=200.0, help="skip what is left after this")
    p.add_argument("--cuda-graphs", action="store_true", help="plain and speculative engines with CUDA graphs")
    p.add_argument("--idle", action="store_true",
                   help="then one profiled run (largest batch and k, 80%% oracle acceptance): device idle share")
    p.add_argument("--output", default=None, help="write the rows as JSON here")
    return p


class SpecBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = args.model or ("qwen3-0.6b" if self.device == "cuda" else "tiny")
        self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        inv = args.batch_invariant
        self.batch_invariant = inv == "on" or (inv == "auto" and self.device == "cuda")
        self.deadline = time.perf_counter() + args.max_seconds
        self.vocab = DEFAULT_CONFIGS[self.model]["vocab_size"]
        K = max(args.ks)
        B = max(args.batches)
        common = dict(max_requests=B, max_tokens=max(2048, B * (K + 1)), max_sequence_length=args.prompt_len +
                      args.output_len + 8, buffer_size_gb=4.0 if self.device == "cuda" else 0.05,
                      batch_invariant=self.batch_invariant, cuda_graphs=args.cuda_graphs)
        if args.quick:  # graphs of the one batch size, captured by the untimed first run (``warmup``)
            common.update(cuda_graph_batch_sizes=(B,), cuda_graph_mixed_steps=False, startup_warmup=False)
        self.plain = self._llm(InferenceConfig(**common))
        self.spec = self._llm(InferenceConfig(**common, num_speculative_tokens=K, speculative_min_acceptance=0.0),
                              OracleDrafter({}, 1.0, self.vocab, args.output_len + 1))
        self.ngram = None if args.quick else self._llm(
            InferenceConfig(**common, num_speculative_tokens=K, speculative_method="ngram"))
        self.rows: list[BenchRow] = []
        self.decode_ms = self.plain_decode_ms = 0.0
        self.split = self.plain_split = ""
        """The latest timed run's steps that landed prefill chunks (count x mean wall; a speculative
        engine's: how many steps with prefill chunks it launched as plain steps) and its wall
        outside the landing steps' walls; the latest plain run's."""
        """Mean host wall of the latest timed run's decode-only steps (steady launch-ahead: the
        step's time), and of the latest plain run's."""
        self._measured: set[int] = set()
        """Batches at which the speculative engine's adaptive policy has measured its step costs."""

    def _llm(self, cfg: InferenceConfig, drafter=None) -> LLM:
        return LLM(None, self.device, self.dtype, cfg, default_model=self.model, drafter=drafter)

    def time_left(self) -> bool:
        return time.perf_counter() < self.deadline

    def prompts(self, batch: int, repetitive: bool, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        if not repetitive:
            return [[rng.randrange(self.vocab) for _ in range(self.args.prompt_len)] for _ in range(batch)]
        out = []
        for _ in range(batch):  # a random span repeated: prompt lookup finds its continuation
            span = [rng.randrange(self.vocab) for _ in range(rng.randint(4, 12))]
            out.append((span * (self.args.prompt_len // len(span) + 1))[: self.args.prompt_len])
        return out

    def timed(self, llm: LLM, prompts, params) -> tuple[list, float, object]:
        self._sync()
        st = llm.engine.stats
        before, decode = st.steps, (st.decode_wall_time, st.decode_steps)
        prefill = (st.prefill_wall_time, st.prefill_steps, st.spec_plain_mixed_steps)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        self._sync()
        wall = time.perf_counter() - t0
        steps = st.decode_steps - decode[1]
        self.decode_ms = 1e3 * (st.decode_wall_time - decode[0]) / max(steps, 1)
        chunks, chunks_wall = st.prefill_steps - prefill[1], st.prefill_wall_time - prefill[0]
        outside = wall - chunks_wall - (st.decode_wall_time - decode[0])  # a first step lands nothing
        plain = f" ({st.spec_plain_mixed_steps - prefill[2]} launched plain)" if llm.config.num_speculative_tokens else ""
        self.split = f"{chunks} x {1e3 * chunks_wall / max(chunks, 1):.2f} ms{plain}, outside {1e3 * outside:.1f} ms"
        return outs, wall, (st.steps - before)

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def warmup(self) -> None:
        """Compile every kernel shape class once (decode, verify rows, prefill) before timing.
        ``--quick``: the timed workload itself, untimed, in both engines (every graph it replays
        gets captured: wide and probe verify steps, decode steps with and without the drafter)."""
        if self.args.quick:
            B, params = max(self.args.batches), self._params()
            prompts = self.prompts(B, False, seed=B)
            outs = self.plain.generate(prompts, params)
            self._set_oracle(prompts, outs, 0.0, max(self.args.ks))
            self._set_policy(self.spec, "auto")
            self.spec.generate(prompts, params)
            return
        params = SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True)
        prompts = self.prompts(2, False, seed=99)
        outs = self.plain.generate(prompts, params)
        self._set_oracle(prompts, outs, 0.5, max(self.args.ks))
        self.spec.generate(prompts, params)
        self.ngram.generate(self.prompts(2, True, seed=98), params)

    def _set_oracle(self, prompts, plain_outs, acceptance: float, k: int) -> None:
        cont = {tuple(p): o.generated_tokens for p, o in zip(prompts, plain_outs)}
        self.spec.context.spec.drafter.configure(cont, 1.0 - acceptance)  # in place: graphs captured it
        self.spec.engine.scheduler.spec.k = k

    @staticmethod
    def _set_policy(llm, policy: str) -> None:
        """"forced": every row drafts; "auto": the engine's default policy."""
        spec = llm.engine.scheduler.spec
        spec.min_acceptance = 0.0 if policy == "forced" else 0.3
        spec.adaptive = policy == "auto" and llm.config.speculative_adaptive and spec.k > 0

    def _params(self) -> SamplingParams:
        return SamplingParams(top_k=1, num_tokens_to_generate=self.args.output_len, ignore_eos=True)

    def add(self, row: BenchRow) -> None:
        """Keep a row and print it at once (a run cut short still leaves its rows)."""
        self.rows.append(row)
        print(format_table([row]).splitlines()[-1], file=sys.stderr, flush=True)

    def quick(self) -> list[BenchRow]:
        """Batch 128 (the largest of ``--batches``), k = 3, 0 %: plain, then the switch-off policy."""
        batch, k, params = max(self.args.batches), max(self.args.ks), self._params()
        prompts = self.prompts(batch, False, seed=batch)
        captures = self.plain.engine.stats.graph_captures_after_warmup
        plain, wall, steps = self.timed(self.plain, prompts, params)
        self._plain_captures = self.plain.engine.stats.graph_captures_after_warmup - captures
        plain_tps = sum(len(o.generated_tokens) for o in plain) / wall
        self.add(self._row("oracle", batch, 0, None, "plain", plain, wall, steps, plain, plain_tps, None))
        self._set_oracle(prompts, plain, 0.0, k)
        policy, st = self.spec.engine.scheduler.spec, self.spec.engine.stats
        self._set_policy(self.spec, "auto")
        prior, before = policy.recent_acceptance, (st.graph_captures_after_warmup, st.spec_verify_rows,
                                                    (st.spec_draft_tokens_per_depth or [0])[-1])
        self._spec_run(self.spec, "oracle", batch, k, 0.0, "auto", prompts, params, plain, plain_tps)
        captures, verify, wide = (a - b for a, b in zip(
            (st.graph_captures_after_warmup, st.spec_verify_rows, (st.spec_draft_tokens_per_depth or [0])[-1]), before))
        # new requests start from the engine's recent acceptance (speculative/policy.py), here the untimed run's
        print(f"quick: the speculative run started at recent acceptance {prior:.2f}; verify rows {verify} ({wide} "
              f"with {k} drafts); graph captures in the timed runs: plain {self._plain_captures}, speculative "
              f"{captures}", file=sys.stderr, flush=True)
        return self.rows

    def sweep(self) -> list[BenchRow]:
        a = self.args
        params = self._params()
        for batch in a.batches:
            prompts = self.prompts(batch, False, seed=batch)
            plain, plain_wall, steps = self.timed(self.plain, prompts, params)
            self.plain_decode_ms, self.plain_split = self.decode_ms, self.split
            plain_tps = sum(len(o.generated_tokens) for o in plain) / plain_wall
            first = len(self.rows)
            self.add(self._row("oracle", batch, 0, None, "plain", plain, plain_wall, steps, plain, plain_tps, None))
            for k in a.ks:
                for acc in a.acceptances:
                    if not self.time_left():
                        self._replain(first, batch, prompts, params, plain_tps)
                        return self.rows
                    self._set_oracle(prompts, plain, acc, k)
                    for policy in ("forced", "auto"):
                        self._set_policy(self.spec, policy)
                        if policy == "auto" and batch not in self._measured:  # its step costs, untimed
                            self._measured.add(batch)
                            self.spec.generate(prompts, params)
                        self._spec_run(self.spec, "oracle", batch, k, acc, policy, prompts, params, plain, plain_tps)
                        if policy == "auto":
                            self._print_costs(batch, acc)
            self._replain(first, batch, prompts, params, plain_tps)
            if self.time_left():
                self._ngram(batch, params)
        return self.rows

    def _print_costs(self, batch: int, acc: float) -> None:
        """What the adaptive rule measured at ``batch`` (speculative/step_cost.py: steady decode
        steps only) beside the plain engine's decode step: a plain step of the speculative
        engine should cost what the plain engine's does."""
        costs = self.spec.engine.scheduler.spec.costs
        cells = {w: c.seconds * 1e3 for (b, w), c in costs.cells.items() if b == bucket(batch)}
        if 1 not in cells:
            return
        widths = ", ".join(f"width {w} {ms:.2f} ms (R {ms / cells[1]:.2f})" for w, ms in sorted(cells.items()) if w > 1)
        print(f"bench_speculative: batch {batch}, {acc:.0%}: decode step, plain engine {self.plain_decode_ms:.2f} ms; "
              f"the rule's costs: plain {cells[1]:.2f} ms, {widths or 'no verify width measured'}; this run's "
              f"decode steps {self.decode_ms:.2f} ms; steps landing prefill chunks: plain engine {self.plain_split}, "
              f"this run {self.split}", file=sys.stderr, flush=True)

    def _replain(self, first: int, batch: int, prompts, params, before_tps: float) -> None:
        """Times the plain engine again after a batch's speculative rows and rescales those rows
        (``self.rows[first:]``) to the mean of both plain runs, which cancels a steady drift of
        the host or device during the sweep. Prints both plain rates (their gap bounds the noise)."""
        outs, wall, _ = self.timed(self.plain, prompts, params)
        after_tps = sum(len(o.generated_tokens) for o in outs) / wall
        mean = (before_tps + after_tps) / 2
        drift = after_tps / before_tps - 1
        print(f"bench_speculative: plain at batch {batch}: {before_tps:,.0f} tok/s before the speculative rows, "
              f"{after_tps:,.0f} after ({drift:+.0%}); speedups use the mean"
              f"{' (NOISY: over 10 %)' if abs(drift) > 0.1 else ''}", file=sys.stderr, flush=True)
        for i in range(first, len(self.rows)):
            r = self.rows[i]
            tps = mean if r.policy == "plain" else r.tokens_per_s
            self.rows[i] = replace(r, tokens_per_s=tps, plain_tokens_per_s=mean, speedup=tps / mean)

    def idle_run(self) -> str | None:
        """Device idle share (from the profiler's device intervals) of one speculative run: the
        largest batch and k, 80 % oracle acceptance, forced."""
        batch, k = max(self.args.batches), max(self.args.ks)
        params = SamplingParams(top_k=1, num_tokens_to_generate=self.args.output_len, ignore_eos=True)
        prompts = self.prompts(batch, False, seed=batch)
        plain = self.plain.generate(prompts, params)
        self._set_oracle(prompts, plain, 0.8, k)
        self._set_policy(self.spec, "forced")
        _, rep = profile_run(self.spec.engine, lambda: self.spec.generate(prompts, params))
        if rep is None:
            return None
        dec = "n/a" if rep.decode_idle_share is None else f"{rep.decode_idle_share:.1%}"
        return (f"device idle with speculation (batch {batch}, k {k}, oracle 80 %, profiled run): whole run "
                f"{rep.run_idle_share:.1%}, decode windows {dec} ({rep.launches} launches, {rep.snapshot_copies} "
                f"snapshot copies{'; ' + rep.note if rep.note else ''})")

    def _ngram(self, batch: int, params: SamplingParams) -> None:
        prompts = self.prompts(batch, True, seed=1000 + batch)
        plain, wall, _ = self.timed(self.plain, prompts, params)
        plain_tps = sum(len(o.generated_tokens) for o in plain) / wall
        K = max(self.args.ks)
        self.ngram.generate(prompts, params)  # untimed: the policy measures its step costs at this batch
        self._spec_run(self.ngram, "ngram-repetitive", batch, K, None, "auto", prompts, params, plain, plain_tps)

    def _spec_run(self, llm, workload, batch, k, acc, policy, prompts, params, plain, plain_tps) -> None:
        before = _SpecCounts.of(llm.engine.stats)
        outs, wall, steps = self.timed(llm, prompts, params)
        d = _SpecCounts.of(llm.engine.stats).minus(before)
        tps = sum(len(o.generated_tokens) for o in outs) / wall
        self.add(self._row(workload, batch, k, acc, policy, outs, wall, steps, plain, plain_tps, d, tps))

    def _row(self, workload, batch, k, acc, policy, outs, wall, steps, plain, plain_tps, counts=None,
             tps=None) -> BenchRow:
        tps = plain_tps if tps is None else tps
        same = sum(a.generated_tokens == b.generated_tokens for a, b in zip(outs, plain)) / len(outs)
        c = counts or _SpecCounts([0], [0], 0, {})
        rows = max(c.drafted[0], 1)
        return BenchRow(workload, batch, k, acc, policy, tps, plain_tps, tps / plain_tps, c.conditional_acceptance,
                        1 + sum(c.accepted) / rows if c.drafted[0] else 1.0, steps, c.off, same, c.plain_steps)


@dataclass
class _SpecCounts:
    drafted: list[int]  # per depth
    accepted: list[int]
    verify_rows: int
    off: dict
    plain_steps: int = 0

    @classmethod
    def of(cls, st) -> _SpecCounts:
        return cls(list(st.spec_draft_tokens_per_depth) or [0], list(st.spec_accepted_tokens_per_depth) or [0],
                   st.spec_verify_rows, dict(st.spec_off_rows), st.spec_plain_steps)

    def minus(self, o: _SpecCounts) -> _SpecCounts:
        sub = lambda a, b: [x - y for x, y in zip(a, b + [0] * (len(a) - len(b)))]  # noqa: E731
        off = {c: n - o.off.get(c, 0) for c, n in self.off.items() if n - o.off.get(c, 0)}
        return _SpecCounts(sub(self.drafted, o.drafted), sub(self.accepted, o.accepted), self.verify_rows - o.verify_rows,
                           off, self.plain_steps - o.plain_steps)

    @property
    def conditional_acceptance(self) -> float:
        reached = self.drafted[0] + sum(min(self.drafted[d], self.accepted[d - 1]) for d in range(1, len(self.drafted)))
        return sum(self.accepted) / reached if reached else 0.0


def format_table(rows: list[BenchRow]) -> str:
    head = ("| workload | batch | k | oracle acc. | policy | tok/s | plain tok/s | speedup | measured acc. | tokens/row "
            "| steps | plain steps | drafts off | same tokens |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        acc = "-" if r.target_acceptance is None else f"{r.target_acceptance:.0%}"
        off = ", ".join(f"{c} {n}" for c, n in r.off_rows.items()) or "-"
        lines.append(f"| {r.workload} | {r.batch} | {r.k or '-'} | {acc} | {r.policy} | {r.tokens_per_s:,.0f} | "
                     f"{r.plain_tokens_per_s:,.0f} | {r.speedup:.2f}x | {r.acceptance:.0%} | {r.tokens_per_row:.2f} | {r.steps} | "
                     f"{r.plain_steps if r.k else '-'} | {off} | "
                     f"{r.same_tokens:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[BenchRow]:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.batches, args.ks, args.acceptances = [1, 4], [1, 3], [0.0, 0.5, 1.0]
        args.prompt_len, args.output_len, args.device = 12, 12, args.device or "cpu"
    if args.quick:
        args.batches, args.ks, args.acceptances = [max(args.batches)], [3], [0.0]
        args.cuda_graphs = args.cuda_graphs or torch.cuda.is_available() and args.device != "cpu"
    bench = SpecBench(args)
    print(f"bench_speculative: {bench.model} on {bench.device} ({bench.dtype}), batch_invariant="
          f"{bench.batch_invariant}, prompts {args.prompt_len}, outputs {args.output_len}, "
          f"{'CUDA graphs' if args.cuda_graphs else 'eager'}", file=sys.stderr)
    t0 = time.perf_counter()
    bench.warmup()
    print(f"bench_speculative: warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(format_table([]), file=sys.stderr, flush=True)
    rows = bench.quick() if args.quick else bench.sweep()
    print(format_table(rows))
    idle = bench.idle_run() if args.idle else None
    if idle is not None:
        print(idle)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if bench.device == "cuda" else "cpu",
                       "model": bench.model, "dtype": bench.dtype, "batch_invariant": bench.batch_invariant,
                       "args": vars(args), "rows": [asdict(r) for r in rows], "idle": idle}, f, indent=1)
    return rows
