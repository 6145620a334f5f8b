"""The main job: build the engine from flags, run a workload with arrivals, print a summary,
optionally write every request's tokens/text plus the stats to JSON."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from megatron_async import LLM
from megatron_async.cli import flags
from megatron_async.cli.driver import WorkloadRun, run_workload
from megatron_async.cli.progress import ProgressBar
from megatron_async.cli.summary import (
    RunSummary, StartupTimes, format_startup, format_summary, seconds_since_process_start, summarize,
)
from megatron_async.cli.text_prompts import read_prompt_file, text_workload
from megatron_async.cli.workload import WorkloadRequest, synthetic_workload
from megatron_async.inference.communication.zmq_transport import LeaderEnded
from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_async.inference.request import SamplingParams

MAX_REASONS_PRINTED = 10


def build_parser(description: str, require_model: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=flags.HelpFormatter)
    flags.add_model_args(p, require_model)
    flags.add_parallel_args(p)
    flags.add_engine_args(p)
    flags.add_workload_args(p)
    flags.add_sampling_args(p)
    p.add_argument("--output-path", default=None, help="write per-request results, stats and the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


class FollowerEngine:
    """The engine as a tensor-parallel rank > 0 sees it while running the same driver as
    rank 0 (so every rank makes the same collective calls). Requests really come from rank 0
    at each step; ``add_request`` only mirrors rank 0's answer: the same validation error,
    or the id rank 0 assigns (sequential, as the driver passes no ids)."""

    def __init__(self, engine: DynamicInferenceEngine):
        self._engine = engine
        self._next_id = 0

    def add_request(self, prompt_tokens: list[int] | str, sampling_params: SamplingParams) -> int:
        self._engine.validator.check(prompt_tokens, sampling_params)  # raises as rank 0 does
        self._next_id += 1
        return self._next_id - 1

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def workload_tokenizer(llm: LLM, args: argparse.Namespace):
    """The checkpoint's tokenizer; the built-in tiny model shares the tiny test tokenizer's vocabulary."""
    if llm.tokenizer is not None or args.model is not None or args.default_model != "tiny":
        return llm.tokenizer
    from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer
    from megatron_async.models.tokenizer import Tokenizer

    return Tokenizer(train_tiny_tokenizer(llm.model.vocab_size), EOS_TOKEN_ID)


def build_workload(llm: LLM, args: argparse.Namespace) -> list[WorkloadRequest]:
    spec = flags.workload_spec_from_args(args)
    if not flags.has_text_prompts(args):
        return synthetic_workload(spec, llm.model.vocab_size)
    texts = args.prompts or read_prompt_file(args.prompt_file)
    if args.prompt_limit is not None:  # an explicit --num-requests caps the prompts used
        texts = texts[: args.prompt_limit]
    template = None
    if args.chat:
        from megatron_async.models.chat_template import load_chat_template

        template = load_chat_template(args.model) if args.model else None
        if template is None:
            raise ValueError(f"--chat: {args.model or 'the built-in model'} has no chat template "
                             "(chat_template.jinja or tokenizer_config.json's chat_template)")
    return text_workload(texts, workload_tokenizer(llm, args), spec, template, llm.config.max_sequence_length)


def print_answers(requests: list[WorkloadRequest], run: WorkloadRun, tokenizer, limit: int = 8) -> None:
    """Text prompts: show the first few prompts and answers (all of them go to --output-path)."""
    for req, out in list(zip(requests, run.outputs))[:limit]:
        if out is None or out.finish_reason == "error":
            continue
        text = out.generated_text if out.generated_text is not None else tokenizer.decode(out.generated_tokens)
        print(f"prompt: {req.prompt_text!r}\nanswer ({out.finish_reason}, {len(out.generated_tokens)} tokens): {text!r}")


def results_json(args, requests: list[WorkloadRequest], run: WorkloadRun, llm: LLM, summary: RunSummary) -> dict:
    tokenizer = workload_tokenizer(llm, args)
    items = []
    for req, out in zip(requests, run.outputs):
        if out is None:
            items.append({"prompt_tokens": req.prompt, "finish_reason": "unfinished"})
            continue
        text = out.generated_text
        if text is None and tokenizer is not None:
            text = tokenizer.decode(out.generated_tokens)
        items.append({
            "request_id": out.request_id, "prompt_text": req.prompt_text, "prompt_tokens": out.prompt_tokens,
            "generated_tokens": out.generated_tokens, "generated_text": text, "finish_reason": out.finish_reason,
            "generated_log_probs": out.generated_log_probs,
            "generated_top_n_logprobs": out.generated_top_n_logprobs, "error": out.error,
        })
    return {"args": vars(args), "summary": summary.as_dict(), "stats": llm.engine.stats.as_dict(), "requests": items}


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse and check flag combinations (argparse errors, exit code 2)."""
    args = parser.parse_args(argv)
    args.prompt_limit = args.num_requests  # before the device defaults fill --num-requests in
    if args.chat and not flags.has_text_prompts(args):
        parser.error("--chat needs --prompts or --prompt-file")
    if args.output_len_min and args.output_len_max and args.output_len_min > args.output_len_max:
        parser.error(f"--output-len-min {args.output_len_min} > --output-len-max {args.output_len_max}")
    if args.prompt_len_min and args.prompt_len_max and args.prompt_len_min > args.prompt_len_max:
        parser.error(f"--prompt-len-min {args.prompt_len_min} > --prompt-len-max {args.prompt_len_max}")
    return args


def load_llm(args: argparse.Namespace, **config_overrides) -> LLM:
    """The engine from the flags; a checkpoint that cannot be loaded ends the job with one line
    naming the file and the problem, not a traceback."""
    try:
        return LLM(args.model, args.device, args.dtype, flags.inference_config_from_args(args, **config_overrides),
                   default_model=args.default_model, tensor_parallel_size=args.tensor_parallel_size,
                   expert_parallel_size=args.expert_parallel_size, quantization=getattr(args, "quantization", None))
    except Exception as e:  # noqa: BLE001 -- any loader failure is reported the same way
        what = f"model {args.model}" if args.model else f"built-in model {args.default_model}"
        print(f"error: cannot load {what}: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def main(argv: list[str] | None = None, description: str = "megatron_async main job", require_model: bool = False) -> RunSummary:
    """Run the job and return its summary. Exits (SystemExit) on bad flags
    or a model that cannot be loaded; ``cli_main`` turns failed requests into the exit code."""
    return run_job(argv, description, require_model)[0]


def run_job(argv: list[str] | None = None, description: str = "megatron_async main job",
            require_model: bool = False, own_process: bool = False) -> tuple[RunSummary | None, int]:
    """(this rank's summary, the job's exit status). The ranks end together: rank 0 announces its
    status (also when it fails: 1), the others wait for it and take it (``end_job``); a rank still
    waiting for rank 0 in a step when it ends raises ``LeaderEnded``. ``own_process``: the job is
    the process (``flags.own_process``)."""
    entered = seconds_since_process_start()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(description, require_model)
    args = parse_args(parser, argv)
    flags.resolve_device_args(args)
    if own_process:
        flags.own_process(args)
    if args.logging_step_interval:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.perf_counter()
    llm = load_llm(args, stream_text=False)  # texts are decoded once, at the end
    ended = False
    try:
        summary = _run(args, llm, t0, entered)
        status = end_job(llm, exit_status(summary))
        ended = True
        return summary, status
    finally:
        if not ended and llm.is_leader and llm.communicator is not None:
            llm.communicator.announce_end(1)  # rank 0 failed (and says why): the others end with it
        llm.close()


def exit_status(summary: RunSummary | None) -> int:
    """1 when any request failed or the run timed out (None: a data-parallel rank's partial run: 0)."""
    if summary is None:
        return 0
    return 1 if summary.failed_requests or summary.timed_out or summary.finished_requests < summary.requests else 0


def end_job(llm: LLM, status: int) -> int:
    """The job's exit status: rank 0 announces its ``status`` to the other ranks; they wait for it
    (after their last collective) and say on stderr when it is a failure."""
    comm = llm.communicator
    if comm is None or comm.world_size == 1:
        return status
    if llm.is_leader:
        comm.announce_end(status)
        return status
    status = comm.wait_for_end()
    if status:
        print(f"rank {comm.rank}: rank 0 ended the job with exit status {status}", file=sys.stderr)
    return status


def cli_main(description: str, require_model: bool = False) -> int:
    """The examples' entry point: exit code 1 when any request failed or the run timed out; every
    rank exits with rank 0's code, a rank that rank 0 left waiting with one line on stderr."""
    try:
        return run_job(description=description, require_model=require_model, own_process=True)[1]
    except LeaderEnded as e:
        print(e, file=sys.stderr)
        return e.status


def report_failures(requests: list[WorkloadRequest], run: WorkloadRun) -> None:
    """Why each rejected request was rejected (the first few), on stderr."""
    failed = [(i, o) for i, o in enumerate(run.outputs) if o is not None and o.finish_reason == "error"]
    for i, out in failed[:MAX_REASONS_PRINTED]:
        prompt = requests[i].prompt_text
        label = f"request {i}" + (f" ({prompt[:40]!r})" if prompt else f" ({len(requests[i].prompt)} prompt tokens)")
        print(f"rejected: {label}: {out.error}", file=sys.stderr)
    if len(failed) > MAX_REASONS_PRINTED:
        print(f"rejected: ... and {len(failed) - MAX_REASONS_PRINTED} more (see --output-path)", file=sys.stderr)


def wait_for_ranks(llm: LLM) -> float:
    """Seconds this rank waits at a barrier of the job's ranks (0 alone). Each rank ends its
    start-up on its own; without the barrier rank 0's run clock, TTFT and tok/s would hold the
    rest of a slower rank's start-up (its first step waits for that rank's collectives)."""
    comm = llm.communicator
    if comm is None or comm.world_size == 1:
        return 0.0
    t = time.perf_counter()
    comm.barrier()
    return time.perf_counter() - t


def _run(args: argparse.Namespace, llm: LLM, t0: float, entered: float | None = None) -> RunSummary:
    """Every TP rank runs the same (seeded) workload through the driver; only rank 0 reports."""
    try:
        requests = build_workload(llm, args)
    except ValueError as e:  # prompt file, tokenizer or chat template problems: one line, exit 1
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    model_name = args.model or f"built-in {args.default_model}"
    if llm.is_leader:
        mode = ("async" if llm.config.async_scheduling else "serial") + (", CUDA graphs" if llm.config.cuda_graphs else ", eager")
        st = llm.engine.stats
        warm = (f" (warm-up {st.warmup_seconds:.1f} s: {st.warmup_triton_builds} Triton builds, {st.warmup_graphs} CUDA "
                f"graphs, {st.warmup_memory_bytes / 2**30:.2f} GiB)" if st.warmup_seconds else "")
        print(f"model: {model_name} on {args.device} ({args.dtype}, TP {args.tensor_parallel_size}, EP {args.expert_parallel_size}), built in "
              f"{time.perf_counter() - t0:.1f} s{warm}; {len(requests)} requests, {mode} engine", file=sys.stderr)
        if llm.memory_plan is not None:
            print(llm.memory_plan.describe(), file=sys.stderr)
    progress = ProgressBar(len(requests), enabled=not args.quiet and llm.is_leader)
    engine = llm.engine if llm.is_leader else FollowerEngine(llm.engine)
    ready = seconds_since_process_start()
    waited = wait_for_ranks(llm)
    run = run_workload(engine, requests, flags.sampling_factory(args), progress)
    first = run.first_token_s
    times = StartupTimes(entered, ready, ready + waited + first if ready is not None and first is not None else None,
                         waited)
    summary = summarize(run, llm.engine.stats, llm.device)
    if not llm.is_leader:  # data-parallel followers hand their outputs to rank 0: their summary is partial
        return summary if llm.parallel.dp_size == 1 else None
    if flags.has_text_prompts(args):
        print_answers(requests, run, workload_tokenizer(llm, args))
    print(format_summary(summary))
    print(format_startup(times, llm.startup))
    report_failures(requests, run)
    if args.output_path:
        path = Path(args.output_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        results = results_json(args, requests, run, llm, summary)
        results["startup"] = {**vars(times), **llm.startup.as_dict()}
        path.write_text(json.dumps(results, indent=1))
        print(f"wrote {path}", file=sys.stderr)
    return summary
