"""Expert parallelism side by side: one workload through EP=1, 2, 4 data-parallel engines (one GPU
per rank, ranks spawned here), greedy and sampled, output tok/s on the same global batch.

Model: the built-in Qwen3-30B-A3B shape (hidden 2048, 128 experts, top-8, moe_intermediate 768,
32 / 4 heads, bf16 random weights) with ``--layers`` decoder layers (48 in the real model; fewer
to fit the device call, and every layer is the same, so per-layer costs scale). ``--smoke``: the
built-in tiny-moe on the CPU (gloo), a few requests, EP 1 and 2 (the test runs it).

    python -m benchmarks moe-ep --ep 1 2 4 --layers 12 [--cuda-graphs] [--num-requests 256]
    python -m benchmarks moe-ep --smoke

Every EP size runs a short warm-up workload first (compiles, graph captures), then the timed one;
rank 0's wall time of ``LLM.generate`` gives tok/s. The last column compares each request's
tokens with EP=1's (float32 on the CPU: all equal; bf16 on GPUs: the exchange changes sums)."""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.models.default_model import DEFAULT_CONFIGS  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WORKLOADS = ("greedy", "sampled")


def model_name(base: str, layers: int | None) -> str:
    """Registers ``base`` with ``layers`` decoder layers (in this process) and returns its name."""
    if layers is None:
        return base
    name = f"{base}-{layers}l"
    DEFAULT_CONFIGS[name] = {**DEFAULT_CONFIGS[base], "num_hidden_layers": layers}
    return name


def workload(args, seed: int) -> tuple[list[list[int]], dict[str, list[SamplingParams]]]:
    rng = random.Random(seed)
    n = args.num_requests
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(args.prompt_len_min, args.prompt_len_max))]
               for _ in range(n)]
    lens = [rng.randint(args.output_len_min, args.output_len_max) for _ in range(n)]
    params = {
        "greedy": [SamplingParams(top_k=1, num_tokens_to_generate=m, ignore_eos=True) for m in lens],
        "sampled": [SamplingParams(temperature=0.8, top_p=0.95, num_tokens_to_generate=m, ignore_eos=True,
                                   seed=seed * 100_000 + i) for i, m in enumerate(lens)],
    }
    return prompts, params


def _rank(rank: int, world: int, args) -> dict:
    name = model_name(args.model, args.layers)
    cfg = InferenceConfig(max_requests=args.max_requests, max_tokens=args.max_tokens,
                          max_sequence_length=args.prompt_len_max + args.output_len_max + 16,
                          block_size_tokens=16, num_kv_blocks=args.num_kv_blocks, cuda_graphs=args.cuda_graphs,
                          ep_p2p_exchange=not args.nccl_exchange)
    llm = LLM(None, device=args.device, dtype=args.dtype, inference_config=cfg, default_model=name,
              expert_parallel_size=world)
    try:
        prompts, params = workload(args, seed=1)
        small = max(2 * world, args.num_requests // 8)
        for wl in args.workloads:  # warm-up: compiles and captures stay out of the timed runs
            llm.generate(prompts[:small], params[wl][:small])
        prompts, params = workload(args, seed=2)
        result = {}
        for wl in args.workloads:
            st = llm.engine.stats
            steps0, wall0, dummy0 = st.decode_steps, st.decode_wall_time, st.dummy_steps
            mixed0, mixed_steps0 = st.prefill_wall_time, st.prefill_steps
            rounds0, cons0 = st.consensus_rounds, st.consensus_time
            st.consensus_latency_seconds.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params[wl])
            wall = time.perf_counter() - t0
            steps = st.decode_steps - steps0
            result[wl] = {
                "wall": wall, "tokens": [o.generated_tokens for o in outs],
                "decode_ms": 1e3 * (st.decode_wall_time - wall0) / steps if steps else 0.0,
                # where the wall went: decode steps, steps with prefill chunks, the rest (host, waits)
                "decode_s": st.decode_wall_time - wall0, "decode_steps": steps,
                "mixed_s": st.prefill_wall_time - mixed0, "mixed_steps": st.prefill_steps - mixed_steps0,
                "dummy": st.dummy_steps - dummy0,
                "consensus_us": 1e6 * (st.consensus_time - cons0) / max(1, st.consensus_rounds - rounds0),
                "latency_us": st.consensus_latency_us(50),
            }
        return result
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (the real model has 48)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--nccl-exchange", action="store_true",
                   help="the MoE exchange over NCCL for every size (default: CUDA P2P kernels for decode sizes)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len-min", type=int, default=64)
    p.add_argument("--prompt-len-max", type=int, default=512)
    p.add_argument("--output-len-min", type=int, default=64)
    p.add_argument("--output-len-max", type=int, default=256)
    p.add_argument("--max-requests", type=int, default=128, help="per rank")
    p.add_argument("--max-tokens", type=int, default=4096, help="per rank and step")
    p.add_argument("--num-kv-blocks", type=int, default=4096, help="per rank")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds per EP size")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-moe, EP 1 2, a few short requests")
    args = p.parse_args(argv)
    if args.smoke:
        args.ep, args.model, args.layers, args.device, args.dtype = [1, 2], "tiny-moe", None, "cpu", "float32"
        args.cuda_graphs, args.num_requests, args.max_requests, args.max_tokens = False, 6, 4, 32
        args.prompt_len_min, args.prompt_len_max, args.output_len_min, args.output_len_max = 4, 12, 3, 8
        args.num_kv_blocks = 64
    env = NCCL_ENV if args.device == "cuda" else {}
    rows, base = [], None
    for ep in args.ep:
        res = run_ranks(_rank, ep, args, timeout_s=args.timeout, env=env)
        for wl in args.workloads:
            r0 = res[0][wl]
            tokens = sum(len(t) for t in r0["tokens"])
            ref = base[wl]["tokens"] if base is not None else r0["tokens"]
            rows.append({
                "ep": ep, "workload": wl, "tok_s": tokens / r0["wall"], "decode_ms": r0["decode_ms"],
                "dummy": [r[wl]["dummy"] for r in res], "consensus_us": [r[wl]["consensus_us"] for r in res],
                "latency_us": [r[wl]["latency_us"] for r in res],
                "equal": sum(a == b for a, b in zip(r0["tokens"], ref)), "n": len(ref),
                "split": [(r[wl]["mixed_steps"], r[wl]["mixed_s"], r[wl]["decode_steps"], r[wl]["decode_s"],
                           r[wl]["wall"]) for r in res],
            })
        base = base or res[0]
        for r in rows[-len(args.workloads):]:  # as each size ends: a cut call keeps what finished
            print(f"[ep={ep}] {r['workload']}: {r['tok_s']:.0f} tok/s, decode {r['decode_ms']:.2f} ms, "
                  f"own cost p50 {r['latency_us']} us, dummy {r['dummy']}", flush=True)
    first = {r["workload"]: r["tok_s"] for r in rows if r["ep"] == args.ep[0]}
    print(f"model {model_name(args.model, args.layers)} ({args.dtype}, {args.device}, graphs {args.cuda_graphs}), "
          f"{args.num_requests} requests, prompts {args.prompt_len_min}-{args.prompt_len_max}, "
          f"outputs {args.output_len_min}-{args.output_len_max}")
    print(f"| EP | workload | output tok/s | vs EP={args.ep[0]} | decode ms / step (rank 0) | dummy steps by rank "
          f"| consensus us / round by rank | its own cost p50 us by rank | tokens == EP={args.ep[0]} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ep']} | {r['workload']} | {r['tok_s']:.0f} | {r['tok_s'] / first[r['workload']]:.2f}x "
              f"| {r['decode_ms']:.2f} | {' / '.join(map(str, r['dummy']))} "
              f"| {' / '.join(f'{c:.0f}' for c in r['consensus_us'])} "
              f"| {' / '.join(f'{c:.0f}' for c in r['latency_us'])} | {r['equal']}/{r['n']} |")
    print("\nwhere each rank's wall went (greedy / sampled rows as above): mixed steps (count, s), decode steps "
          "(count, s), the rest of the rank's generate() wall (host work outside steps, waiting)")
    print("| EP | workload | rank | mixed steps | mixed s | decode steps | decode s | rest s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for rank, (ms, m_s, ds, d_s, wall) in enumerate(r["split"]):
            print(f"| {r['ep']} | {r['workload']} | {rank} | {ms} | {m_s:.3f} | {ds} | {d_s:.3f} | {wall - m_s - d_s:.3f} |")
    return rows


if __name__ == "__main__":
    main()
