"""Speculative decoding on CUDA equals plain decoding, token for token and log-prob for log-prob
(within 1e-3: a (k + 1)-token row's GEMMs round otherwise than a 1-token row's): a tiny float32
Qwen3 checkpoint, greedy and seeded sampled requests arriving over time, an oracle drafter whose
drafts are wrong 30 % and 90 % of the time, k = 3, serial and launch-ahead, eager and with CUDA
graphs (verify steps replay verify graphs; 0 captures and 0 Triton builds after the startup
warm-up); a tiny NemotronH hybrid with graphs; and no host sync in steady speculative decode,
eager and with graphs. The plain run of each case runs the same engine mode. Times: ``python -m
benchmarks engine-times speculative-gpu [--split]``. Skipped without a GPU."""
from __future__ import annotations

import pytest

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, decode_steps_without_host_sync, make_llm, random_prompts, run_arrivals
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint
from tests.helpers.spec_harness import oracle_for

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
K = 3
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=24, return_log_probs=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, num_tokens_to_generate=24, return_log_probs=True)
MODES = {
    "serial": dict(async_scheduling=False, cuda_graphs=False),
    "async": dict(async_scheduling=True, cuda_graphs=False),
    "serial-graphs": dict(async_scheduling=False, cuda_graphs=True, speculative_min_acceptance=0.0),
    "async-graphs": dict(async_scheduling=True, cuda_graphs=True, speculative_min_acceptance=0.0),
}


def _arrivals(n: int, max_len: int, vocab: int, seed: int) -> list[Arrival]:
    prompts = random_prompts(n, 4, max_len, vocab, seed)
    return [Arrival(i, p, GREEDY if i % 2 else SAMPLED) for i, p in enumerate(prompts)]


def _speculative_equals_plain(ckpt, arrivals: list[Arrival], rate: float, vocab: int, **cfg) -> None:
    plain_cfg = {k: v for k, v in cfg.items() if not k.startswith("speculative")}
    plain = run_arrivals(make_llm(ckpt, device=DEVICE, **plain_cfg), arrivals)
    llm = make_llm(ckpt, oracle_for(plain, arrivals, rate, vocab=vocab), device=DEVICE, num_speculative_tokens=K,
                   **cfg)
    spec = run_arrivals(llm, arrivals)
    st = llm.engine.stats
    assert plain.keys() == spec.keys()
    for i in plain:
        assert spec[i].generated_tokens == plain[i].generated_tokens, i
        assert max((abs(x - y) for x, y in zip(plain[i].generated_log_probs, spec[i].generated_log_probs)),
                   default=0.0) < 1e-3, i
    assert 0 < st.spec_accepted_tokens <= st.spec_draft_tokens, st.as_dict()
    if cfg.get("cuda_graphs"):
        assert st.spec_graph_replays > 0, st.as_dict()
        assert st.graph_captures_after_warmup == 0 and st.triton_builds_after_warmup == 0, st.as_dict()


@pytest.mark.parametrize("rate", [0.3, 0.9])
@pytest.mark.parametrize("mode", list(MODES))
def test_speculative_equals_plain(qwen3_ckpt, mode, rate):
    _speculative_equals_plain(qwen3_ckpt, _arrivals(12, 40, 256, seed=9), rate, 256, **MODES[mode])


def test_hybrid_speculative_with_graphs_equals_plain(tmp_path):
    ckpt = make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "nemotron_h")
    _speculative_equals_plain(ckpt, _arrivals(8, 30, 128, seed=5), 0.3, 128, **MODES["async-graphs"])


@pytest.mark.parametrize("graphs", [False, True])
def test_steady_speculative_decode_makes_no_host_sync(qwen3_ckpt, graphs):
    """8 sampled requests, k = 3, drafts wrong 30 % of the time: after 4 steps, 6 launch-ahead steps under
    torch's sync debug mode "error"; with graphs each of them replays a verify graph."""
    prompts = random_prompts(8, 5, 20, 256, seed=4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=1, num_tokens_to_generate=40)
    arrivals = [Arrival(0, p, params) for p in prompts]
    plain = run_arrivals(make_llm(qwen3_ckpt, device=DEVICE, cuda_graphs=graphs), arrivals)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arrivals, 0.3), device=DEVICE, num_speculative_tokens=K,
                   speculative_min_acceptance=0.0, cuda_graphs=graphs)
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, params)
    for _ in range(4):
        eng.step()
    replays = eng.stats.spec_graph_replays
    decode_steps_without_host_sync(eng, 6, warm_steps=0)
    assert eng.stats.spec_accepted_tokens > 0, eng.stats.as_dict()
    if graphs:
        assert eng.stats.spec_graph_replays >= replays + 5, eng.stats.as_dict()
