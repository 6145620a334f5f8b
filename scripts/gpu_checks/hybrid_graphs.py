"""CUDA check of mixed-step CUDA graphs on a hybrid (NemotronH-shaped, Mamba2 + attention + MLP)
model, float32, staggered arrivals with chunked prefill:
- graph tokens == eager tokens (serial and launch-ahead), every request;
- 0 Triton builds and 0 graph captures after the startup warm-up; mixed graph replays > 0;
- mean mixed (prefill-holding) step and decode step wall time in serial mode: eager, graphs for
  decode only (``cuda_graph_mixed_steps=False``, the state before hybrid mixed graphs), graphs
  for mixed steps too.
Prints a table and a verdict last; exits 1 when a check fails. About a minute on an H100:
    python scripts/gpu_check.py hybrid-graphs [--requests 48] [--size small|tiny]"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint

SIZES = {
    # launch-bound on purpose (the regime where mixed-step graphs matter): 8 layers, 4 Mamba2
    "small": dict(hidden_size=256, hybrid_override_pattern="M-M*M-M*", mamba_num_heads=8, mamba_head_dim=32,
                  ssm_state_size=64, n_groups=2, chunk_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=512, vocab_size=512),
    "tiny": {},  # the CPU tests' model (hidden 32)
}
MODES = {  # name -> (cuda_graphs, cuda_graph_mixed_steps, async_scheduling)
    "eager serial": (False, False, False),
    "decode graphs serial": (True, False, False),
    "mixed graphs serial": (True, True, False),
    "mixed graphs async": (True, True, True),
    "eager async": (False, False, True),
}


def arrivals(n: int, vocab: int, new: int = 24, seed: int = 5) -> list[tuple[int, list[int], SamplingParams]]:
    """Gaps of 0-2 steps, prompts 8-400 tokens, greedy and seeded sampled requests of ``new`` tokens."""
    rng, step, out = random.Random(seed), 0, []
    for i in range(n):
        step += rng.choice((0, 0, 1, 2))
        sp = (SamplingParams(top_k=1, num_tokens_to_generate=new, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=i, num_tokens_to_generate=new, ignore_eos=True))
        out.append((step, [rng.randrange(vocab) for _ in range(rng.randint(8, 400))], sp))
    return out


def run_mode(path: str, work, graphs: bool, mixed: bool, async_scheduling: bool, max_tokens: int = 256,
             device: str = "cuda"):
    """``device="cpu"``: a smoke run (torch backends; graphs emulated: a replay runs the padded step eagerly)."""
    backend = "triton" if device == "cuda" else "torch"
    cfg = InferenceConfig(block_size_tokens=16, max_requests=32, max_tokens=max_tokens, max_sequence_length=512,
                          num_kv_blocks=1200, cuda_graphs=graphs, cuda_graph_mixed_steps=mixed,
                          async_scheduling=async_scheduling, attention_backend=backend, mamba_backend=backend)
    t0 = time.perf_counter()
    llm = LLM(path, device=device, dtype="float32", inference_config=cfg)  # warms up (and captures) here on CUDA
    if graphs and device != "cuda":
        from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner

        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=mixed, emulate=True)
        llm.runner.graphs.warmup()
    build_s = time.perf_counter() - t0
    eng, pending, ids, outs, steps = llm.engine, list(work), {}, {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= steps:
            _, prompt, sp = pending.pop(0)
            ids[eng.add_request(prompt, sp)] = len(ids)
        for o in eng.step().finished:
            outs[ids[o.request_id]] = o.generated_tokens
        steps += 1
    st = eng.stats
    runner = llm.runner.graphs
    return dict(tokens=outs, stats=st, build_s=build_s, mixed_keys=sum(not k.decode_only for k in runner.graphs) if runner else 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (emulated graphs)")
    a = p.parse_args(argv)
    path = str(make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tempfile.mkdtemp(prefix="nh_graphs_"), **SIZES[a.size]))
    vocab = SIZES[a.size].get("vocab_size", 128)
    work = arrivals(a.requests, vocab, a.output_len)
    res = {name: run_mode(path, work, *flags, device=a.device) for name, flags in MODES.items()}
    ref = res["eager serial"]["tokens"]
    print(f"{'mode':<22} {'build s':>8} {'mixed ms':>9} {'decode ms':>10} {'steps':>6} {'mixed':>6} {'replays':>8} "
          f"{'mixed replays':>13} {'captures*':>9} {'builds*':>7} {'=eager':>7}")
    failures = []
    for name, r in res.items():
        st, graphs = r["stats"], MODES[name][0]
        same = sum(r["tokens"].get(i) == t for i, t in ref.items())
        print(f"{name:<22} {r['build_s']:>8.1f} {st.mean_prefill_step_ms:>9.2f} {st.mean_decode_step_ms:>10.2f} "
              f"{st.steps:>6} {st.prefill_steps:>6} {st.graph_replays:>8} {st.mixed_graph_replays:>13} "
              f"{st.graph_captures_after_warmup:>9} {st.triton_builds_after_warmup:>7} {same:>3}/{len(ref)}")
        if same != len(ref):
            failures.append(f"{name}: {len(ref) - same} requests differ from eager serial")
        if st.graph_captures_after_warmup or st.triton_builds_after_warmup:
            failures.append(f"{name}: captures / builds after warm-up")
        if graphs and MODES[name][1] and (st.mixed_graph_replays == 0 or r["mixed_keys"] == 0):
            failures.append(f"{name}: no mixed graph replayed")
    print("(* after the startup warm-up; ms: mean host wall time per step, serial = device-inclusive)")
    e, d, m = (res[k]["stats"].mean_prefill_step_ms for k in ("eager serial", "decode graphs serial", "mixed graphs serial"))
    print(f"mixed step: eager {e:.2f} ms, decode-only graphs {d:.2f} ms, mixed graphs {m:.2f} ms "
          f"({d / max(m, 1e-9):.2f}x faster than eager mixed steps)")
    print("VERDICT:", "PASS" if not failures else "FAIL: " + "; ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
