#!/usr/bin/env python
"""Decode step time of this engine vs Hugging Face ``generate`` on the same batch, same process,
interleaved runs (CPU by default; the real SmolLM2 checkpoint from scripts/fetch_smollm2.py).

A decode step's time is measured the same way for both: (time to generate 1 + N tokens - time to
generate 1 token) / N, so prompt processing cancels out. Greedy, EOS ignored, float32.

    OMP_NUM_THREADS=1 python scripts/compare_hf_decode.py --model $(python scripts/fetch_smollm2.py)
"""
import argparse
import json
import statistics
import time

import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.models.chat_template import load_chat_template
from megatron_async.tools.cli import POSITIVE_INT, HelpFormatter

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
             "List three primary colors.", "How do airplanes fly?", "Name a famous painter.",
             "What is 12 times 7?", "Give me a tip for learning Python."]


def hf_generate_seconds(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    assert out.shape[1] == width + new_tokens
    return time.perf_counter() - t0


def engine_generate_seconds(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    sp = SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    assert all(len(o.generated_tokens) == new_tokens for o in outs)
    return time.perf_counter() - t0


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
    engine_generate_seconds(llm, prompts, 2)  # warm-up of both
    hf_generate_seconds(hf, prompts, 2, pad)
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append((engine_generate_seconds(llm, prompts, n + 1) - engine_generate_seconds(llm, prompts, 1)) / n)
        theirs.append((hf_generate_seconds(hf, prompts, n + 1, pad) - hf_generate_seconds(hf, prompts, 1, pad)) / n)
    res = {"batch": args.batch, "prompt_tokens": [len(x) for x in prompts], "new_tokens": n,
           "threads": torch.get_num_threads(), "engine_step_ms": 1e3 * statistics.median(ours),
           "hf_step_ms": 1e3 * statistics.median(theirs), "engine_runs_ms": [1e3 * x for x in ours],
           "hf_runs_ms": [1e3 * x for x in theirs]}
    res["ratio_engine_over_hf"] = res["engine_step_ms"] / res["hf_step_ms"]
    print(f"batch {args.batch}, {n} decode steps, {res['threads']} thread(s): engine {res['engine_step_ms']:.1f} ms/step, "
          f"HF generate {res['hf_step_ms']:.1f} ms/step, ratio {res['ratio_engine_over_hf']:.2f}")
    if args.output_path:
        with open(args.output_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
