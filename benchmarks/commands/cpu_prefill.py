#!/usr/bin/env python
"""CPU prefill of the engine against Hugging Face's SDPA forward on the same weights, one thread,
and the decode streams' inter-token gaps while a long prompt is prefilled in chunks.

    python -m benchmarks cpu-prefill prefill                 # 1,500 and 2,048 tokens
    python -m benchmarks cpu-prefill itl --chunks 2048,512,256  # 8 streams + one 1,500-token prompt

Without ``--model``, a random SmolLM2-135M-shaped Llama checkpoint (30 layers, hidden 576, 9 heads /
3 KV heads, vocab 49152, tied embeddings, float32) is built with transformers' ``save_pretrained``
(kept in ``--workdir``). Each measurement is the best of ``--repeats``, engine and HF interleaved,
so that load from other processes on the host hits both alike; times are the process's CPU
seconds (``time.process_time``), which other processes sharing the cores do not inflate.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                     tie_word_embeddings=True, rope_theta=100000.0, initializer_range=0.02)


def checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    from tests.helpers.hf_models import make_tiny_checkpoint

    path = Path(args.workdir) / "smollm2-shape"
    if not (path / "config.json").exists():
        make_tiny_checkpoint("LlamaForCausalLM", path, **SMOLLM2_SHAPE)
    return path


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cpu_seconds(fn) -> float:
    """CPU time of this process during ``fn`` (all its threads): unlike wall
    time, it does not grow when other processes share the cores."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def bench_prefill(args, ckpt: Path) -> None:
    from benchmarks.hf_peers import load_hf_model
    from megatron_async import LLM, InferenceConfig, SamplingParams

    lengths = [int(n) for n in args.lengths.split(",")]
    hf = load_hf_model(ckpt, torch.device("cpu"), torch.float32)
    vocab = hf.config.vocab_size
    llm = LLM(str(ckpt), device="cpu", inference_config=InferenceConfig(
        max_tokens=max(lengths), max_requests=4, max_sequence_length=max(lengths) + 16,
        num_kv_blocks=max(lengths) // 16 + 8))
    one = SamplingParams(num_tokens_to_generate=1, top_k=1)

    def engine_prefill(ids):
        return lambda: llm.generate([ids], one)

    def hf_forward(ids, keep: int):
        x = torch.tensor([ids])
        return lambda: hf(x, logits_to_keep=keep)  # keep 0: logits of every position

    with torch.no_grad():
        warm = prompt(64, vocab, 1)
        engine_prefill(warm)(), hf_forward(warm, 1)(), hf_forward(warm, 0)()
        rows = []
        for n in lengths:
            ids = prompt(n, vocab, n)
            t = {"engine": [], "hf_last": [], "hf_all": []}
            for _ in range(args.repeats):  # interleaved: host load hits all three alike
                t["engine"].append(cpu_seconds(engine_prefill(ids)))
                t["hf_last"].append(cpu_seconds(hf_forward(ids, 1)))
                t["hf_all"].append(cpu_seconds(hf_forward(ids, 0)))
            e, last, full = (min(t[k]) for k in ("engine", "hf_last", "hf_all"))
            rows.append((n, e, last, full))
            print(f"  {n} tokens, CPU s: " + ", ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in t.items()),
                  flush=True)
    print(f"\nCPU prefill, one thread, best of {args.repeats} (CPU s); HF = transformers SDPA forward, logits of the last"
          " position / of all")
    print(f"{'tokens':>7} {'engine':>8} {'HF last':>8} {'HF all':>8} {'eng/HF last':>12} {'eng/HF all':>11}")
    for n, e, last, full in rows:
        print(f"{n:>7} {e:>8.2f} {last:>8.2f} {full:>8.2f} {e / last:>12.2f} {e / full:>11.2f}")


def clock() -> np.ndarray:
    """(wall, process CPU) seconds now: the CPU part is what a step costs on an unshared core."""
    return np.array([time.perf_counter(), time.process_time()])


def stream_gaps(llm, vocab: int, args, chunk: int, with_long: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """``args.streams`` streams decode; after ``args.warm_steps`` steps, a ``args.long``-token prompt
    arrives (``with_long``). Returns the streams' inter-token gaps ([n, 2]: wall and CPU seconds)
    from its arrival until it got its first token plus ``args.after_steps`` steps (without it: as
    many steps as that would take), and its time to first token (wall, CPU)."""
    from megatron_async import SamplingParams

    eng = llm.engine
    params = SamplingParams(num_tokens_to_generate=1_000, top_k=1, ignore_eos=True)
    streams = {eng.add_request(prompt(args.stream_prompt, vocab, 100 + s), params) for s in range(args.streams)}
    last: dict[int, np.ndarray] = {}
    for _ in range(args.warm_steps):
        for u in eng.step().updates:
            last[u.request_id] = clock()
    gaps: list[np.ndarray] = []
    arrival, ttft, long_id, after = clock(), None, None, 0
    if with_long:
        long_id = eng.add_request(prompt(args.long, vocab, 7), SamplingParams(num_tokens_to_generate=1, top_k=1))
    steps = 10_000 if with_long else -(-args.long // max(1, chunk - args.streams)) + args.after_steps
    for _ in range(steps):
        res = eng.step()
        now = clock()
        for u in res.updates:
            if u.request_id in streams:
                if u.request_id in last:
                    gaps.append(now - last[u.request_id])
                last[u.request_id] = now
        if with_long and ttft is None and any(o.request_id == long_id for o in res.finished):
            ttft = now - arrival
        if ttft is not None:
            after += 1
            if after > args.after_steps:
                break
    for rid in streams:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return np.array(gaps), ttft


def bench_itl(args, ckpt: Path) -> None:
    from megatron_async import LLM, InferenceConfig

    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        llm = LLM(str(ckpt), device="cpu", inference_config=InferenceConfig(
            max_tokens=chunk, max_requests=args.streams + 1, max_sequence_length=4096,
            num_kv_blocks=(args.long + args.streams * (args.stream_prompt + 1_000)) // 16 + 16))
        vocab = llm.model.vocab_size
        stream_gaps(llm, vocab, args, chunk, with_long=False)  # warm-up
        base, _ = stream_gaps(llm, vocab, args, chunk, with_long=False)
        mixed, ttft = stream_gaps(llm, vocab, args, chunk, with_long=True)
        rows.append((chunk, base, mixed, ttft))
        print(f"  max_tokens {chunk}: gaps alone p50 {np.median(base[:, 0]):.3f} max {base[:, 0].max():.3f}; with the "
              f"long prompt p50 {np.median(mixed[:, 0]):.3f} max {mixed[:, 0].max():.3f}; its TTFT {ttft[0]:.2f} (wall s)",
              flush=True)
    for col, unit in ((0, "wall"), (1, "CPU")):
        print(f"\n{args.streams} greedy streams, a {args.long}-token prompt arriving: the streams' inter-token gaps "
              f"and the prompt's TTFT ({unit} s)")
        print(f"{'max_tokens':>10} {'alone p50':>10} {'p99':>7} {'long p50':>9} {'p99':>7} {'max':>7} {'long TTFT':>10}")
        for chunk, base, mixed, ttft in rows:
            b, m = base[:, col], mixed[:, col]
            print(f"{chunk:>10} {np.percentile(b, 50):>10.3f} {np.percentile(b, 99):>7.3f} {np.percentile(m, 50):>9.3f} "
                  f"{np.percentile(m, 99):>7.3f} {m.max():>7.3f} {ttft[col]:>10.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["prefill", "itl"])
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: a random SmolLM2-shaped one)")
    p.add_argument("--workdir", default="/tmp/cpu_prefill")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--lengths", default="1500,2048", help="prefill: prompt lengths")
    p.add_argument("--chunks", default="2048,512,256,128", help="itl: max_tokens values to compare")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-prompt", type=int, default=32)
    p.add_argument("--long", type=int, default=1500, help="itl: tokens of the prompt that arrives")
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--after-steps", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ckpt = checkpoint(args)
    (bench_prefill if args.what == "prefill" else bench_itl)(args, ckpt)


if __name__ == "__main__":
    main()
