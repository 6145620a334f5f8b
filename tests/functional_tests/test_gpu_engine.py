"""CUDA: reference parity, async == serial, graphs == eager, and no host sync in steady
launch-ahead decode. Skipped without a GPU (run through the device tool)."""
import pytest

from megatron_async import SamplingParams
from tests.helpers.engine_harness import (Arrival, decode_steps_without_host_sync, make_llm, random_prompts,
                                                    run_arrivals, tokens_of)
from tests.helpers.hf_models import GPT_ARCHS, hf_greedy, load_hf_reference, make_tiny_checkpoint

pytestmark = pytest.mark.gpu
NEW = 12


@pytest.fixture(scope="module", params=GPT_ARCHS)
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def cuda_llm(path, **cfg):
    """An LLM on CUDA (float32); what ``cfg`` leaves out is CUDA's default (graphs on)."""
    return make_llm(path, device="cuda", **cfg)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_matches_hf(ckpt, backend, async_scheduling):
    """The default GPU mode (CUDA graphs on, nothing said about them) against HF."""
    ref = load_hf_reference(ckpt)
    prompts = random_prompts(8, 2, 40, 256, seed=1)
    expected = [hf_greedy(ref, p, NEW) for p in prompts]
    llm = cuda_llm(ckpt, max_tokens=24, num_kv_blocks=40, attention_backend=backend, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW))
    assert [o.generated_tokens for o in outs] == expected
    assert llm.engine.stats.paused > 0
    assert llm.config.cuda_graphs and llm.runner.graphs is not None and llm.runner.graphs.num_replays > 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_cuda_graphs_equal_eager(ckpt, sampling):
    sp = SamplingParams(top_k=1, num_tokens_to_generate=20) if sampling == "greedy" else SamplingParams(
        temperature=0.9, top_k=40, top_p=0.95, seed=3, num_tokens_to_generate=20, return_log_probs=True)
    arr = [Arrival(2 * i, p, sp) for i, p in enumerate(random_prompts(12, 3, 30, 256, seed=2))]
    res = {}
    for graphs in (False, True):
        llm = cuda_llm(ckpt, cuda_graphs=graphs, attention_backend="triton", max_requests=16)
        outs = run_arrivals(llm, arr)
        res[graphs] = (outs, llm)
    assert tokens_of(res[True][0]) == tokens_of(res[False][0])
    for i, o in res[False][0].items():  # seeded: log-probs too (graph padding changes GEMM shapes: float32 rounding)
        if o.generated_log_probs is not None:
            assert res[True][0][i].generated_log_probs == pytest.approx(o.generated_log_probs, abs=1e-4), i
    assert sampling == "greedy" or all(o.generated_log_probs for o in res[True][0].values())
    runner = res[True][1].runner.graphs
    assert runner is not None and runner.num_replays > 0 and len(runner.graphs) > 0


def test_no_host_sync_in_steady_async_decode(ckpt):
    llm = cuda_llm(ckpt, attention_backend="triton", max_requests=16, cuda_graphs=False)
    eng = llm.engine
    for p in random_prompts(8, 5, 20, 256, seed=4):
        eng.add_request(p, SamplingParams(temperature=1.0, top_k=20, seed=1, num_tokens_to_generate=40))
    decoded = decode_steps_without_host_sync(eng, 20)
    assert decoded == 20 and eng.stats.overlap_ratio > 0.9


@pytest.fixture(scope="module", params=["NemotronHForCausalLM", "BambaForCausalLM"])
def hybrid_ckpt(request, tmp_path_factory):
    from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint

    return make_tiny_hybrid_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_hybrid_cuda_matches_hf_async_and_graphs(hybrid_ckpt):
    ref = load_hf_reference(hybrid_ckpt)
    prompts = random_prompts(6, 2, 30, ref.config.vocab_size, seed=1)
    expected = [hf_greedy(ref, p, NEW) for p in prompts]
    for async_scheduling, graphs in ((False, False), (True, False), (True, True)):
        llm = cuda_llm(hybrid_ckpt, max_tokens=16, num_kv_blocks=40, async_scheduling=async_scheduling, cuda_graphs=graphs)
        # HF's reference ignores EOS (eos_token_id=None), so must we
        outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True))
        assert [o.generated_tokens for o in outs] == expected, (async_scheduling, graphs)
        if graphs:
            assert llm.runner.graphs.num_replays > 0
