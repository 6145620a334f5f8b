"""Mixture-of-experts models (Qwen3-MoE with and without normalised top-k and with dense
layers, Mixtral, NemotronH with MoE layers) vs Hugging Face transformers on tiny random
checkpoints: teacher-forced logits of a ragged packed batch, and greedy tokens of the engine
(ragged batch, chunked prefill, a small KV pool with pauses and evictions, async and serial)
equal to HF ``generate``."""
import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.models import load_checkpoint
from megatron_async.models.model_config import LayerKind
from tests.helpers.engine_harness import make_llm, random_prompts
from tests.helpers.hf_models import hf_greedy, hf_logits, load_hf_reference
from tests.helpers.hf_moe_models import make_tiny_moe_checkpoint
from tests.helpers.simple_session import SimpleSession

NEW = 8
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True)
CASES = {
    # layers: sparse, dense (mlp_only_layers), sparse; top-k weights not renormalised
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=False)),
    # decoder_sparse_step 2: layer 1 sparse, 0 and 2 dense; renormalised top-k
    "qwen3moe-norm-step2": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=True, mlp_only_layers=[],
                                                       decoder_sparse_step=2, num_experts_per_tok=3)),
    "mixtral": ("MixtralForCausalLM", {}),
    # Mamba, MoE (sigmoid, grouped top-k, correction bias, scaling, shared expert), attention, MoE
    "nemotron_h-moe": ("NemotronHForCausalLM", {}),
    # routed experts in a latent space (fc1 / fc2 projections), one group, no renormalisation
    "nemotron_h-moe-latent": ("NemotronHForCausalLM", dict(moe_latent_size=24, n_group=1, topk_group=1,
                                                           norm_topk_prob=False, mlp_bias=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def moe_case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    path = make_tiny_moe_checkpoint(arch, tmp_path_factory.mktemp(request.param), **overrides)
    ref = load_hf_reference(path)
    prompts = random_prompts(6, 2, 30, ref.config.vocab_size, seed=1)
    expected = [hf_greedy(ref, p, NEW) for p in prompts]
    return path, ref, prompts, expected


def test_moe_layers_where_hf_has_them(moe_case):
    path, ref, _, _ = moe_case
    model, _ = load_checkpoint(path, "cpu", torch.float32)
    ours = sum(b.kind == LayerKind.MOE for b in model.spec.blocks)
    theirs = sum(type(m).__name__.endswith(("SparseMoeBlock", "MoE")) for m in ref.modules())
    assert ours == theirs > 0


def test_teacher_forced_logits_match_hf(moe_case):
    path, ref, prompts, _ = moe_case
    model, _ = load_checkpoint(path, "cpu", torch.float32)
    session = SimpleSession(model, max_seqs=len(prompts), max_len=40)
    logits = session.step(list(enumerate(prompts)))  # every prompt packed into one step
    offset = 0
    for prompt in prompts:
        theirs = hf_logits(ref, prompt)
        ours = logits[offset:offset + len(prompt)]
        offset += len(prompt)
        assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ragged_chunked_prefill_matches_hf(moe_case, async_scheduling):
    path, _, prompts, expected = moe_case
    llm = make_llm(path, max_tokens=16, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, GREEDY)
    assert [o.generated_tokens for o in outs] == expected
    st = llm.engine.stats
    assert max(map(len, prompts)) > 16 and st.prefill_steps >= 2, st.as_dict()
    if async_scheduling:
        assert st.overlapped_steps > 0, st.as_dict()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_small_pool_pauses_and_evictions_match_hf(moe_case, async_scheduling):
    path, _, prompts, expected = moe_case
    llm = make_llm(path, async_scheduling=async_scheduling, max_tokens=16, num_kv_blocks=30)
    outs = llm.generate(prompts, GREEDY)
    assert [o.generated_tokens for o in outs] == expected
    st = llm.engine.stats
    assert st.paused > 0 and st.evicted > 0, st.as_dict()
