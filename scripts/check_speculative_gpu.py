#!/usr/bin/env python
"""Speculative decoding on CUDA: equal to plain decoding (tiny float32 Qwen3 checkpoint,
greedy and seeded sampling, serial / launch-ahead / launch-ahead + CUDA graphs, where steps
whose rows all run without drafts replay graphs), and no host sync in steady speculative
decode (``torch.cuda.set_sync_debug_mode("error")``). Prints one line per check; exit 1 on
a failure.

    python scripts/check_speculative_gpu.py
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

from megatron_async import SamplingParams
from megatron_async.testing.hf_models import make_tiny_checkpoint
from tests.functional_tests.engine_harness import Arrival, make_llm, random_prompts, run_arrivals
from tests.functional_tests.spec_harness import oracle_for

DEVICE = os.environ.get("SPEC_CHECK_DEVICE", "cuda")  # "cpu": a dry run of this script


def parity(ckpt, arrivals, rate: float, **cfg) -> str:
    plain = run_arrivals(make_llm(ckpt, device=DEVICE, **{k: v for k, v in cfg.items() if k != "cuda_graphs"}), arrivals)
    llm = make_llm(ckpt, oracle_for(plain, arrivals, rate), device=DEVICE, num_speculative_tokens=3, **cfg)
    spec = run_arrivals(llm, arrivals)
    same = sum(plain[i].generated_tokens == spec[i].generated_tokens for i in plain)
    lp = max((abs(x - y) for i in plain if plain[i].generated_log_probs
              for x, y in zip(plain[i].generated_log_probs, spec[i].generated_log_probs)), default=0.0)
    st = llm.engine.stats
    replays = llm.controller.graphs.num_replays if llm.controller.graphs is not None else 0
    ok = same == len(plain) and lp < 1e-3 and 0 < st.spec_accepted_tokens <= st.spec_draft_tokens
    return (f"{'OK ' if ok else 'BAD'} rate={rate} {cfg}: same tokens {same}/{len(plain)}, max |dlogprob| {lp:.2e}, "
            f"accepted {st.spec_accepted_tokens}/{st.spec_draft_tokens}, steps {st.steps}, overlapped "
            f"{st.overlapped_steps}, graph replays {replays}, off {dict(st.spec_off_rows)}")


def no_sync(ckpt) -> str:
    prompts = random_prompts(8, 5, 20, 256, seed=4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=1, num_tokens_to_generate=40)
    arr = [Arrival(0, p, params) for p in prompts]
    plain = run_arrivals(make_llm(ckpt, device=DEVICE), arr)
    llm = make_llm(ckpt, oracle_for(plain, arr, 0.3), device=DEVICE, num_speculative_tokens=3,
                   speculative_min_acceptance=0.0)
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, params)
    for _ in range(4):
        eng.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    st = eng.stats
    return f"OK  no host sync in 6 steady speculative steps (accepted {st.spec_accepted_tokens}/{st.spec_draft_tokens})"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp)
        greedy = SamplingParams(top_k=1, num_tokens_to_generate=24, return_log_probs=True)
        sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, num_tokens_to_generate=24, return_log_probs=True)
        arr = [Arrival(i, p, greedy if i % 2 else sampled) for i, p in enumerate(random_prompts(12, 4, 40, 256, seed=9))]
        lines = []
        for cfg in (dict(async_scheduling=False), dict(async_scheduling=True),
                    dict(async_scheduling=True, cuda_graphs=True, speculative_min_acceptance=0.5)):
            for rate in (0.3, 0.9):
                try:
                    lines.append(parity(ckpt, arr, rate, **cfg))
                except Exception as e:  # noqa: BLE001 - report and go on with the other checks
                    lines.append(f"BAD rate={rate} {cfg}: {type(e).__name__}: {e}")
                print(lines[-1], flush=True)
        try:
            lines.append(no_sync(ckpt) if DEVICE == "cuda" else "OK  (no-sync check: CUDA only)")
        except Exception as e:  # noqa: BLE001
            lines.append(f"BAD no-sync check: {type(e).__name__}: {e}")
        print(lines[-1], flush=True)
    return 1 if any(line.startswith("BAD") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
