"""Routing replay (``SamplingParams.return_routed_experts`` -> ``RequestOutput.routed_experts``) on
CPU: each token's top-k experts per MoE layer equal the ones Hugging Face's router picks when it
runs the whole sequence (prompt + generated tokens but the last), through chunked prefill,
launch-ahead (async == serial), evictions, speculative decoding (accepted tokens only),
emulated CUDA graphs, expert parallelism (global ids) and prefix caching; requests that do not ask get None and cost nothing; a
dense model refuses the request alone."""
import numpy as np
import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.speculative.oracle import OracleDrafter
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from tests.helpers.emulated_graphs import EmulatedGraphRunner
from tests.helpers.engine_harness import count_replays_by_variant, make_llm, random_prompts
from tests.helpers.hf_models import load_hf_reference
from tests.helpers.hf_moe_models import make_tiny_moe_checkpoint
from tests.helpers.multiprocess import run_ranks

NEW = 6
ASK = dict(num_tokens_to_generate=NEW, ignore_eos=True, return_routed_experts=True)
GREEDY = SamplingParams(top_k=1, **ASK)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, **ASK)


@pytest.fixture(scope="module", params=["Qwen3MoeForCausalLM", "MixtralForCausalLM", "NemotronHForCausalLM"])
def ckpt(request, tmp_path_factory):
    """Qwen3-MoE: MoE layers 0 and 2 around a dense layer 1 (the MoE index skips it); NemotronH:
    Mamba, MoE (sigmoid, grouped top-k: the torch router's path), attention, MoE."""
    return make_tiny_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def hf_routing(ref, seq: list[int]) -> list[list[list[int]]]:
    """[token][moe_layer] -> the experts HF's routers (``*Router`` modules, in layer order)
    pick, sorted, for ``seq`` run at once."""
    picked = []
    hooks = [m.register_forward_hook(lambda mod, args, out: picked.append(out[2].view(len(seq), -1)))
             for m in ref.modules() if type(m).__name__.endswith("Router")]
    try:
        with torch.no_grad():
            ref(torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    assert picked
    return [[sorted(layer[t].tolist()) for layer in picked] for t in range(len(seq))]


def as_sets(routed) -> list[list[list[int]]]:
    return [[sorted(ids) for ids in token] for token in routed.tolist()]


def same(a, b) -> bool:
    """Equal routing outputs (None or arrays)."""
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def covered(out) -> list[int]:
    """The tokens ``routed_experts`` covers: the prompt and every generated token but the last."""
    return out.prompt_tokens + out.generated_tokens[:-1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_routing_equals_hf_with_chunked_prefill_and_evictions(ckpt, async_scheduling):
    ref = load_hf_reference(ckpt)
    prompts = random_prompts(5, 3, 30, ref.config.vocab_size, seed=2)
    params = [GREEDY, SEEDED, SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True)] * 2
    llm = make_llm(ckpt, max_tokens=16, num_kv_blocks=16, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, params[:len(prompts)])
    st = llm.engine.stats
    assert max(map(len, prompts)) > 16 and st.evicted > 0, st.as_dict()  # chunked prompts, recomputed ones
    if async_scheduling:
        assert st.overlapped_steps > 0, st.as_dict()
    for p, o in zip(params, outs):
        if not p.return_routed_experts:
            assert o.routed_experts is None
            continue
        assert len(o.generated_tokens) == NEW and len(o.routed_experts) == len(o.prompt_tokens) + NEW - 1
        assert as_sets(o.routed_experts) == hf_routing(ref, covered(o))


def _graph_llm(graphs: bool, async_scheduling: bool = True, drafter=None, **cfg) -> LLM:
    config = dict(block_size_tokens=4, num_kv_blocks=256, max_requests=6, max_tokens=24, max_sequence_length=96)
    config.update(cfg)
    llm = LLM(None, default_model="tiny-moe",
              inference_config=InferenceConfig(**config, async_scheduling=async_scheduling), drafter=drafter)
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config, mixed=True, emulate=True)
        llm.engine.warmup()
    return llm


PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9] * 9]


def test_emulated_graphs_record_what_eager_steps_record():
    """Graphs record always (the padding rows too); only the asking rows' tokens reach them."""
    params = [GREEDY, SamplingParams(top_k=1, num_tokens_to_generate=NEW), SEEDED, GREEDY, SEEDED]
    eager = _graph_llm(graphs=False, async_scheduling=False).generate(PROMPTS, params)
    llm = _graph_llm(graphs=True)
    replays = count_replays_by_variant(llm.runner.graphs)
    got = llm.generate(PROMPTS, params)
    assert sum(replays.values()) > 0, replays
    for p, e, g in zip(params, eager, got):
        assert g.generated_tokens == e.generated_tokens
        assert same(g.routed_experts, e.routed_experts)
        assert (g.routed_experts is None) == (not p.return_routed_experts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_decoding_reports_accepted_tokens_only(async_scheduling):
    """An oracle drafter with corrupted drafts: verify rows keep their input token and their
    accepted drafts (rejected ones ran through the layers too, and must not show)."""
    params = SamplingParams(top_k=1, **dict(ASK, num_tokens_to_generate=12))
    plain_llm = _graph_llm(graphs=False, async_scheduling=async_scheduling)
    plain = plain_llm.generate(PROMPTS, params)
    drafter = OracleDrafter({tuple(p): o.generated_tokens for p, o in zip(PROMPTS, plain)}, 0.3,
                            plain_llm.runner.model.vocab_size, max_generated=64)
    llm = _graph_llm(graphs=False, async_scheduling=async_scheduling, num_speculative_tokens=2,
                     speculative_min_acceptance=0.0, drafter=drafter)
    spec = llm.generate(PROMPTS, params)
    st = llm.engine.stats
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
    for p, s in zip(plain, spec):
        assert s.generated_tokens == p.generated_tokens
        assert same(s.routed_experts, p.routed_experts) and len(s.routed_experts) == len(covered(s))


def test_asking_requests_skip_prefix_hits_and_others_pay_nothing():
    llm = _graph_llm(graphs=False, enable_prefix_caching=True)
    prompt = list(range(20, 40))
    plain = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    buffer = llm.runner.routing.buffer
    buffer.fill_(-1)
    first = llm.generate([prompt], plain)[0]
    assert first.routed_experts is None and (buffer == -1).all()  # eager steps without an asking row record nothing
    hits = llm.engine.stats.prefix_hit_tokens
    asked = llm.generate([prompt], GREEDY)[0]
    assert llm.engine.stats.prefix_hit_tokens == hits  # the cached prompt was run again
    assert len(asked.routed_experts) == len(covered(asked)) and asked.generated_tokens == first.generated_tokens
    llm.generate([prompt], plain)
    assert llm.engine.stats.prefix_hit_tokens > hits  # others still hit the cache


def test_a_dense_model_refuses_the_request_alone():
    llm = LLM(None, inference_config=InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=4,
                                                     max_tokens=16, max_sequence_length=64))
    assert llm.runner.routing is None
    outs = llm.generate([[1, 2, 3], [4, 5, 6]], [GREEDY, SamplingParams(top_k=1, num_tokens_to_generate=NEW)])
    assert outs[0].finish_reason == "error" and "mixture-of-experts" in outs[0].error
    assert len(outs[1].generated_tokens) == NEW and outs[1].routed_experts is None


EP_PARAMS = [GREEDY, SEEDED, SamplingParams(top_k=1, num_tokens_to_generate=NEW), GREEDY, SEEDED]


def _ep_worker(rank: int, world: int) -> dict:
    cfg = InferenceConfig(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16,
                          max_sequence_length=96)
    llm = LLM(None, inference_config=cfg, default_model="tiny-moe", expert_parallel_size=world)
    try:
        graphs = llm.runner.graphs = EmulatedGraphRunner(llm.runner, llm.config, collective=True)
        graphs.warmup()
        outs = llm.generate(PROMPTS, EP_PARAMS)
        return dict(routed=[None if o.routed_experts is None else o.routed_experts.tolist() for o in outs], tokens=[o.generated_tokens for o in outs],
                    served=llm.engine.stats.finished_requests, replays=graphs.num_replays)
    finally:
        llm.close()


def test_expert_parallel_ranks_report_global_ids_through_emulated_graphs():
    """EP=2 (gloo): each rank routes its own requests' tokens before the exchange, so the ids are
    global (experts 4-7 live on rank 1); rank 0 reports every request as one engine does."""
    one = _graph_llm(graphs=False, max_tokens=16, max_requests=4).generate(PROMPTS, EP_PARAMS)
    r0, r1 = run_ranks(_ep_worker, 2, timeout_s=240)
    assert r0["served"] > 0 and r1["served"] > 0 and r0["replays"] > 0 and r1["replays"] > 0
    assert r0["tokens"] == [o.generated_tokens for o in one]
    assert r0["routed"] == [None if o.routed_experts is None else o.routed_experts.tolist() for o in one]
    assert any((o.routed_experts >= 4).any() for o in one if o.routed_experts is not None)
