#!/usr/bin/env python
"""Decode step time of this engine vs Hugging Face ``generate`` on the same batch, same process,
interleaved runs (CPU by default; the real SmolLM2 checkpoint from scripts/fetch_smollm2.py).

A decode step's time is measured the same way for both: (time to generate 1 + N tokens - time to
generate 1 token) / N, so prompt processing cancels out. Greedy, EOS ignored, float32. Both wall
time and process CPU time are reported: on a shared machine other processes stretch wall time,
while the CPU time of a single-threaded run (OMP_NUM_THREADS=1) stays close to the work done.

    OMP_NUM_THREADS=1 python -m benchmarks hf-decode --model $(python scripts/fetch_smollm2.py)
"""
import argparse
import json
import statistics
import time

import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.flags import POSITIVE_INT, HelpFormatter
from megatron_async.models.chat_template import load_chat_template

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
             "List three primary colors.", "How do airplanes fly?", "Name a famous painter.",
             "What is 12 times 7?", "Give me a tip for learning Python."]


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - w0, time.process_time() - c0


def per_step(long: tuple[float, float], short: tuple[float, float], n: int) -> tuple[float, float]:
    return (long[0] - short[0]) / n, (long[1] - short[1]) / n


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    assert out.shape[1] == width + new_tokens


def engine_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> None:
    sp = SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert all(len(o.generated_tokens) == new_tokens for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint dir with a chat template")
    p.add_argument("--batch", type=POSITIVE_INT, default=8)
    p.add_argument("--new-tokens", type=POSITIVE_INT, default=32, help="decode steps timed per run")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="interleaved runs of each; medians reported")
    p.add_argument("--output-path", default=None)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, inference_config=InferenceConfig(max_sequence_length=512, stream_text=False))
    template = load_chat_template(args.model)
    chats = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.batch)]
    prompts = [llm.tokenizer.encode(template.render([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in chats]
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pad = hf.generation_config.pad_token_id if hf.generation_config.pad_token_id is not None else 0
    n = args.new_tokens
    engine_generate(llm, prompts, 2)  # warm-up of both
    hf_generate(hf, prompts, 2, pad)
    ours, theirs = [], []  # (wall, cpu) seconds per decode step, one pair per repeat
    for _ in range(args.repeats):
        ours.append(per_step(timed(engine_generate, llm, prompts, n + 1), timed(engine_generate, llm, prompts, 1), n))
        theirs.append(per_step(timed(hf_generate, hf, prompts, n + 1, pad), timed(hf_generate, hf, prompts, 1, pad), n))
    res = {"batch": args.batch, "prompt_tokens": [len(x) for x in prompts], "new_tokens": n,
           "threads": torch.get_num_threads()}
    for k, kind in enumerate(("wall", "cpu")):
        mine, hfs = [1e3 * x[k] for x in ours], [1e3 * x[k] for x in theirs]
        res[kind] = {"engine_step_ms": statistics.median(mine), "hf_step_ms": statistics.median(hfs),
                     "engine_runs_ms": mine, "hf_runs_ms": hfs,
                     "ratio_per_repeat": [a / b for a, b in zip(mine, hfs)]}
        res[kind]["ratio_median"] = statistics.median(res[kind]["ratio_per_repeat"])
        res[kind]["ratio_of_best"] = min(mine) / min(hfs)  # each side's least disturbed run
    print(f"batch {args.batch}, {n} decode steps, {res['threads']} thread(s), median of {args.repeats} interleaved repeats:")
    for kind in ("wall", "cpu"):
        r = res[kind]
        print(f"  {kind:>4}: engine {r['engine_step_ms']:.1f} ms/step, HF generate {r['hf_step_ms']:.1f} ms/step, "
              f"engine/HF {r['ratio_median']:.2f} (per repeat {', '.join(f'{x:.2f}' for x in r['ratio_per_repeat'])}; "
              f"best-of-{args.repeats} {min(r['engine_runs_ms']):.1f} / {min(r['hf_runs_ms']):.1f} = {r['ratio_of_best']:.2f})")
    if args.output_path:
        with open(args.output_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
