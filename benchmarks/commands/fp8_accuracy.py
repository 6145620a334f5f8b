"""FP8 accuracy of the engine against bf16 on the same checkpoint: greedy agreement, log-prob
differences and perplexity of FP8 weights, the FP8 KV cache, and both.

    python -m benchmarks fp8-accuracy --model DIR [--device cpu] [--tokens 64] [--prompts 8]

On a CPU the FP8 linears run their emulated math (the same quantization rules as the GPU kernels),
so a real checkpoint such as SmolLM2-135M-Instruct (scripts/fetch_smollm2.py) gives the numbers
without a GPU. Every configuration is the engine (``LLM(quantization=..., kv_cache_dtype=...)``).
Metrics against bf16:
  greedy agreement   share of the first N greedy tokens equal before the first difference (mean)
                     and how many of the prompts' continuations are identical
  log-prob diff      mean / max |log P(t)| difference over bf16's greedy tokens, scored by each
                     configuration as a prompt (teacher-forced: defined after a divergence)
  perplexity         of a long English text shipped in an installed package (typing_extensions'
                     LICENSE, the PSF license and Python's history), windows scored from a fresh start
The table prints last; ``--out`` writes the JSON."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import time
from pathlib import Path

PROMPTS = [
    "What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis in simple terms.",
    "List three uses of a paperclip.", "How do I sort a list in Python?", "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.", "Why is the sky blue?",
]
CONFIGS = {"bf16": (None, "auto"), "fp8 weights": ("fp8", "auto"), "fp8 KV": (None, "fp8_e4m3"),
           "fp8 weights + KV": ("fp8", "fp8_e4m3")}


def package_text(dist: str) -> str:
    """The LICENSE file of an installed distribution (found through its metadata)."""
    files = importlib.metadata.files(dist) or []
    lic = [f for f in files if Path(str(f)).name.upper().startswith(("LICENSE", "COPYING"))]
    if not lic:
        raise FileNotFoundError(f"{dist} ships no LICENSE file")
    return Path(lic[0].locate()).read_text()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks fp8-accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint dir with a tokenizer (a trained model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--ppl-tokens", type=int, default=2048, help="tokens of the text scored")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset (bf16 always runs)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def run_config(args, quantization, kv_cache_dtype, prompts, text_ids, reference) -> dict:
    from megatron_async import LLM, InferenceConfig, SamplingParams

    cfg = InferenceConfig(max_requests=len(prompts), max_tokens=max(args.window, 256), kv_cache_dtype=kv_cache_dtype,
                          max_sequence_length=max(args.window, max(map(len, prompts)) + args.tokens) + 16)
    llm = LLM(args.model, args.device, args.dtype, cfg, quantization=quantization)
    t0 = time.perf_counter()
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=args.tokens, ignore_eos=True)
    gens = [o.generated_tokens for o in llm.generate(prompts, greedy)]
    score = SamplingParams(num_tokens_to_generate=0, return_prompt_log_probs=True)
    ref_gens = reference["gens"] if reference else gens
    scored = llm.generate([p + g for p, g in zip(prompts, ref_gens)], score)
    lps = [o.prompt_log_probs[-args.tokens:] for o in scored]
    windows = [text_ids[s:s + args.window] for s in range(0, len(text_ids) - 1, args.window)]
    nll = [-x for o in llm.generate([w for w in windows if len(w) > 1], score) for x in o.prompt_log_probs]
    out = {"ppl": math.exp(sum(nll) / len(nll)), "seconds": round(time.perf_counter() - t0, 1), "gens": gens,
           "lps": lps, "nll": nll}
    if reference:
        agree = [next((i for i, (a, b) in enumerate(zip(g, rg)) if a != b), len(g)) for g, rg in zip(gens, ref_gens)]
        diffs = [abs(a - b) for x, y in zip(lps, reference["lps"]) for a, b in zip(x, y)]
        out.update(mean_prefix_agreement=sum(agree) / (args.tokens * len(agree)),
                   identical=sum(a == args.tokens for a in agree), mean_abs_logprob_diff=sum(diffs) / len(diffs),
                   max_abs_logprob_diff=max(diffs),
                   text_mean_abs_nll_diff=sum(abs(a - b) for a, b in zip(nll, reference["nll"])) / len(nll))
    del llm
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    from megatron_async.models import load_tokenizer
    from megatron_async.models.chat_template import load_chat_template

    tok, template = load_tokenizer(args.model), load_chat_template(args.model)
    prompts = [tok.encode(template.render([{"role": "user", "content": p}]), add_special_tokens=False)
               if template is not None else tok.encode(p) for p in PROMPTS[:args.prompts]]
    text_ids = tok.encode(package_text("typing_extensions"))[:args.ppl_tokens]
    wanted = ["bf16"] + [c for c in args.configs.split(",") if c in CONFIGS and c != "bf16"]
    results, reference = {}, None
    for name in wanted:
        r = run_config(args, *CONFIGS[name], prompts, text_ids, reference)
        reference = reference or r
        results[name] = {k: v for k, v in r.items() if k not in ("gens", "lps", "nll")}
        print(name, json.dumps(results[name]), flush=True)
    meta = {"model": str(args.model), "device": args.device, "dtype": args.dtype, "tokens": args.tokens,
            "prompts": len(prompts), "text": f"typing_extensions LICENSE, {len(text_ids)} tokens, "
                                             f"windows of {args.window}"}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\n{meta['model']} ({args.device}, {args.dtype}): {meta['tokens']} greedy tokens x {meta['prompts']} prompts; "
          f"{meta['text']}")
    print(f"{'config':<18} {'ppl':>7} {'agree':>6} {'same':>5} {'mean|dlp|':>10} {'max|dlp|':>9}")
    for name, r in results.items():
        print(f"{name:<18} {r['ppl']:>7.3f} {r.get('mean_prefix_agreement', 1.0):>6.3f} "
              f"{r.get('identical', len(prompts)):>5} {r.get('mean_abs_logprob_diff', 0.0):>10.4f} "
              f"{r.get('max_abs_logprob_diff', 0.0):>9.4f}")
    return results


if __name__ == "__main__":
    main()
