"""Staggered runs of a hybrid (NemotronH-shaped: Mamba2 + attention + MLP) checkpoint in every
CUDA-graph mode, for the hybrid graph tests and ``python -m benchmarks engine-times hybrid-graphs``:
graph tokens must equal eager tokens (serial and launch-ahead), with no Triton build or graph
capture after the startup warm-up, and mixed (prefill-holding) steps replayed from graphs."""
from __future__ import annotations

import random
import time
from pathlib import Path

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint

SIZES = {
    # launch-bound on purpose (the regime where mixed-step graphs matter): 8 layers, 4 Mamba2
    "small": dict(hidden_size=256, hybrid_override_pattern="M-M*M-M*", mamba_num_heads=8, mamba_head_dim=32,
                  ssm_state_size=64, n_groups=2, chunk_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=512, vocab_size=512),
    "tiny": {},  # the CPU tests' model (hidden 32, vocab 128)
}
MODES = {  # name -> (cuda_graphs, cuda_graph_mixed_steps, async_scheduling)
    "eager serial": (False, False, False),
    "decode graphs serial": (True, False, False),
    "mixed graphs serial": (True, True, False),
    "mixed graphs async": (True, True, True),
    "eager async": (False, False, True),
}
REFERENCE = "eager serial"


def checkpoint(size: str, directory: Path) -> str:
    return str(make_tiny_hybrid_checkpoint("NemotronHForCausalLM", directory, **SIZES[size]))


def vocab_size(size: str) -> int:
    return SIZES[size].get("vocab_size", 128)


def arrivals(n: int, vocab: int, new: int = 24, seed: int = 5) -> list[tuple[int, list[int], SamplingParams]]:
    """(arrival step, prompt, params): gaps of 0-2 steps, prompts 8-400 tokens, greedy and seeded
    sampled requests of ``new`` tokens."""
    rng, step, out = random.Random(seed), 0, []
    for i in range(n):
        step += rng.choice((0, 0, 1, 2))
        sp = (SamplingParams(top_k=1, num_tokens_to_generate=new, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=i, num_tokens_to_generate=new, ignore_eos=True))
        out.append((step, [rng.randrange(vocab) for _ in range(rng.randint(8, 400))], sp))
    return out


def run_mode(path: str, work, graphs: bool, mixed: bool, async_scheduling: bool, max_tokens: int = 256,
             device: str = "cuda") -> dict:
    """One engine through ``work``: tokens by arrival index, its stats, the build time (startup
    warm-up and captures included) and the mixed graph keys it holds. ``device="cpu"``: torch
    backends, graphs emulated (a replay runs the padded step eagerly)."""
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
    runner = llm.runner.graphs
    return dict(tokens=outs, stats=eng.stats, build_s=build_s,
                mixed_keys=sum(not k.decode_only for k in runner.graphs) if runner else 0)


def failures(mode: str, run: dict, reference: dict) -> list[str]:
    """What is wrong with ``mode``'s run against the eager serial run's: empty when nothing."""
    st, (graphs, mixed, _) = run["stats"], MODES[mode]
    out = []
    same = sum(run["tokens"].get(i) == t for i, t in reference["tokens"].items())
    if same != len(reference["tokens"]):
        out.append(f"{mode}: {len(reference['tokens']) - same} requests differ from {REFERENCE}")
    if st.graph_captures_after_warmup or st.triton_builds_after_warmup:
        out.append(f"{mode}: {st.graph_captures_after_warmup} captures / {st.triton_builds_after_warmup} builds "
                   "after warm-up")
    if graphs and mixed and (st.mixed_graph_replays == 0 or run["mixed_keys"] == 0):
        out.append(f"{mode}: no mixed graph replayed")
    return out
