"""Speculative decoding with CUDA graphs, emulated on the CPU (a replay runs the padded step
eagerly, as cuda_graphs.py's ``emulate`` mode does): verify steps (decode rows with drafts) are
laid out W tokens per row (the narrowest captured width holding the most drafted row: with
K = 2 and the default widths, 2 and 3) and replay verify graphs, rows with fewer drafts (length limits,
penalty rows that never draft, rows switched off by acceptance) padded inside the row;
steps without drafts replay decode graphs, prefill chunks mixed graphs (GPT). Tokens, finish
reasons and log-probs equal plain eager decoding's, serial and launch-ahead, GPT and hybrid
models, oracle and n-gram drafters; a startup warm-up covers every key (0 captures after it)."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported: the Triton variant interprets
    os.environ["TRITON_INTERPRET"] = "1"

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner  # noqa: E402
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals  # noqa: E402
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint  # noqa: E402
from tests.helpers.spec_harness import assert_same_outputs, oracle_for  # noqa: E402

K = 2
CFG = dict(max_requests=6, max_tokens=32)
PARAMS = [
    SamplingParams(top_k=1, num_tokens_to_generate=14, return_log_probs=True),
    SamplingParams(temperature=0.8, top_k=20, seed=11, num_tokens_to_generate=13, return_log_probs=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12, num_tokens_to_generate=11),
    # penalties: never drafts, so its rows are padded to K + 1 inside verify graphs (FULL variant)
    SamplingParams(top_k=1, presence_penalty=0.7, num_tokens_to_generate=9, return_log_probs=True),
]


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    return make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path_factory.mktemp("nemotron_h"))


@pytest.fixture(scope="module")
def two_layer_hybrid_ckpt(tmp_path_factory):
    """One Mamba layer, then one attention layer (the tiny NemotronH: M*M-): the interpreted Mamba
    kernels of the Triton case run once per step instead of twice."""
    return make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path_factory.mktemp("nemotron_h_2"),
                                       hybrid_override_pattern="M*")


def _arrivals(vocab: int, seed: int) -> list[Arrival]:
    prompts = random_prompts(7, 3, 30, vocab, seed=seed)
    return [Arrival(3 * (i // 2), p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(prompts)]


def _spec_llm_with_graphs(path, drafter, async_scheduling: bool, mixed: bool, **cfg):
    llm = make_llm(path, drafter, async_scheduling=async_scheduling, num_speculative_tokens=K, **CFG, **cfg)
    runner = llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=mixed, emulate=True)
    llm.engine.warmup()  # eager pass + every key, on padding: the speculative state stays intact
    lookups = []
    lookup = runner.lookup

    def logged(shape, min_rows=0, min_variant=0, spec=None):
        step = lookup(shape, min_rows, min_variant, spec)
        lookups.append((shape, step))
        return step

    runner.lookup = logged
    return llm, runner, lookups


def _assert_verify_steps_replayed(llm, runner, lookups) -> set[int]:
    """Returns the verify widths replayed."""
    st = llm.engine.stats
    verify = [(shape, step) for shape, step in lookups if shape.num_samples > shape.num_rows or shape.verify_width]
    assert verify and st.spec_verify_rows > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
    uniform = [(shape, step) for shape, step in verify if shape.verify_width]
    # every all-decode verify step took the uniform layout of the narrowest width holding its
    # most drafted row (widths 2 .. K + 1 here) and replayed a verify graph of that width
    assert uniform and all(step is not None and step.key.verify_width == shape.verify_width == 1 + max(shape.num_drafts)
                           for shape, step in uniform)
    assert any(min(shape.num_drafts) < shape.verify_width - 1 for shape, _ in uniform), "no row padded inside"
    assert st.spec_graph_replays == len(uniform) == runner.num_verify_replays
    assert st.graph_captures_after_warmup == 0 and st.warmup_graphs == len(runner.plan.keys())
    assert llm.context.gpu_view.num_copies == st.steps  # still one H2D copy per step
    return {step.key.verify_width for _, step in uniform}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpt_verify_steps_replay_graphs(qwen3_ckpt, async_scheduling):
    arrivals = _arrivals(256, seed=31)
    plain = run_arrivals(make_llm(qwen3_ckpt, async_scheduling=async_scheduling, **CFG), arrivals)
    llm, runner, lookups = _spec_llm_with_graphs(qwen3_ckpt, oracle_for(plain, arrivals, 0.3), async_scheduling,
                                                 mixed=True, speculative_min_acceptance=0.0)
    assert_same_outputs(plain, run_arrivals(llm, arrivals))
    _assert_verify_steps_replayed(llm, runner, lookups)
    st = llm.engine.stats
    assert st.spec_off_rows["penalties"] > 0 and st.mixed_graph_replays > 0
    if async_scheduling:
        assert st.overlapped_steps > 0.5 * st.steps, st.as_dict()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hybrid_verify_steps_replay_graphs(hybrid_ckpt, async_scheduling):
    """Mamba windows of W tokens for every row (rows without drafts too: they commit the
    state after their one real token), mixed steps eager as on the GPU."""
    probe = make_llm(hybrid_ckpt, **CFG)
    arrivals = _arrivals(probe.model.vocab_size, seed=32)
    plain = run_arrivals(make_llm(hybrid_ckpt, async_scheduling=async_scheduling, **CFG), arrivals)
    oracle = oracle_for(plain, arrivals, 0.3, vocab=probe.model.vocab_size)
    llm, runner, lookups = _spec_llm_with_graphs(hybrid_ckpt, oracle, async_scheduling, mixed=False,
                                                 speculative_min_acceptance=0.0)
    assert_same_outputs(plain, run_arrivals(llm, arrivals), log_prob_tol=1e-5)
    _assert_verify_steps_replayed(llm, runner, lookups)


def test_ngram_with_acceptance_switch_and_plain_decode_graphs(qwen3_ckpt):
    """The n-gram drafter on repetitive prompts, with the acceptance switch on (rows switched
    off sit beside drafting rows in verify graphs) and a batch limit (steps past it run plain
    decode graphs)."""
    prompts = [(p * 6)[:24] for p in random_prompts(6, 2, 4, 256, seed=12)]
    arrivals = [Arrival(2 * i, p, PARAMS[i % 3]) for i, p in enumerate(prompts)]
    plain = run_arrivals(make_llm(qwen3_ckpt, **CFG), arrivals)
    llm, runner, lookups = _spec_llm_with_graphs(qwen3_ckpt, None, True, mixed=True, speculative_method="ngram",
                                                 speculative_min_acceptance=0.5, speculative_probe_interval=2,
                                                 speculative_max_batch_size=4)
    assert_same_outputs(plain, run_arrivals(llm, arrivals))
    widths = _assert_verify_steps_replayed(llm, runner, lookups)
    st = llm.engine.stats
    assert st.spec_off_rows["batch"] > 0 and st.spec_off_rows["acceptance"] > 0, st.as_dict()
    assert widths == {2, K + 1}, widths  # probe-only steps replayed the narrow graphs
    assert any(step is not None and step.key.decode_only for _, step in lookups)  # plain decode graphs too


def test_mtp_drafts_inside_verify_graphs_equal_eager_drafts(tmp_path):
    """The MTP heads' teacher-forced pass and chained drafts run inside the verify graph, over
    the padded layout: tokens equal plain decoding's and the drafts equal the eager speculative
    run's (same acceptance, step for step: serial mode, same schedules)."""
    from tests.helpers.hf_models import make_tiny_checkpoint
    from tests.helpers.mtp_heads import add_mtp_heads

    base = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "base", seed=1)
    ckpt = add_mtp_heads(base, tmp_path / "mtp", init="copy_next", scale_layers=0.01)
    arrivals = _arrivals(256, seed=33)
    plain = run_arrivals(make_llm(ckpt, async_scheduling=False, **CFG), arrivals)
    cfg = dict(speculative_method="mtp", speculative_min_acceptance=0.0)
    eager = make_llm(ckpt, async_scheduling=False, num_speculative_tokens=K, **CFG, **cfg)
    assert_same_outputs(plain, run_arrivals(eager, arrivals))
    llm, runner, lookups = _spec_llm_with_graphs(ckpt, None, False, mixed=True, **cfg)
    assert_same_outputs(plain, run_arrivals(llm, arrivals))
    _assert_verify_steps_replayed(llm, runner, lookups)
    a, b = eager.engine.stats, llm.engine.stats
    assert (a.spec_draft_tokens_per_depth, a.spec_accepted_tokens_per_depth) == \
        (b.spec_draft_tokens_per_depth, b.spec_accepted_tokens_per_depth)


def test_uniform_verify_steps_without_a_graph_run_eager(qwen3_ckpt):
    """A request asking for more top-n log-probs than a graph computes: its verify steps keep
    the uniform layout (decided before the key) but run eager; tokens, log-probs and top-n
    equal plain decoding's."""
    params = [PARAMS[0], SamplingParams(top_k=1, top_n_logprobs=25, num_tokens_to_generate=10)]
    arrivals = [Arrival(i, p, params[i % 2]) for i, p in enumerate(random_prompts(4, 3, 20, 256, seed=34))]
    plain = run_arrivals(make_llm(qwen3_ckpt, **CFG), arrivals)
    llm, runner, lookups = _spec_llm_with_graphs(qwen3_ckpt, oracle_for(plain, arrivals, 0.3), True, mixed=True,
                                                 speculative_min_acceptance=0.0)
    spec = run_arrivals(llm, arrivals)
    assert_same_outputs(plain, spec)
    for i in plain:
        a, b = plain[i].generated_top_n_logprobs, spec[i].generated_top_n_logprobs
        assert (a is None) == (b is None) and [list(x) for x in a or []] == [list(y) for y in b or []]
    eager_uniform = [s for s, step in lookups if s.verify_width and step is None]
    assert eager_uniform and all(s.max_top_n == 25 for s in eager_uniform)
    assert llm.engine.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_triton_kernels_on_the_padded_verify_layout(qwen3_ckpt, two_layer_hybrid_ckpt, model):
    """The Triton varlen attention and Mamba window kernels (interpreted on the CPU) on verify
    graphs' layouts: padding tokens at a row's last position writing the dummy block, padding
    rows of W tokens on the padding slots. Equal to plain decoding with the same kernels."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the engine runs on the CPU: needs the Triton interpreter (set before triton was imported; "
                    "on a CUDA box the GPU tests cover the compiled kernels)")
    ckpt, vocab = (qwen3_ckpt, 256) if model == "gpt" else (two_layer_hybrid_ckpt, 128)
    cfg = dict(attention_backend="triton", mamba_backend="triton", max_requests=4, max_tokens=16)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True)
    arrivals = [Arrival(i, p, sp) for i, p in enumerate(random_prompts(3, 3, 12, vocab, seed=3))]
    plain = run_arrivals(make_llm(ckpt, **cfg), arrivals)
    llm = make_llm(ckpt, oracle_for(plain, arrivals, 0.3, vocab=vocab), num_speculative_tokens=K,
                   speculative_min_acceptance=0.0, **cfg)
    llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=False, emulate=True)
    assert_same_outputs(plain, run_arrivals(llm, arrivals), log_prob_tol=1e-5)
    st = llm.engine.stats
    assert st.spec_graph_replays > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_verify_steps_replay_captured_graphs(qwen3_ckpt, async_scheduling):
    """Real CUDA graphs (float32): verify steps replay captured verify graphs, and speculative
    decoding still equals plain eager decoding token for token (log-probs up to other GEMM shapes)."""
    arrivals = _arrivals(256, seed=31)
    plain = run_arrivals(make_llm(qwen3_ckpt, device="cuda", async_scheduling=async_scheduling, **CFG), arrivals)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arrivals, 0.3), device="cuda", async_scheduling=async_scheduling,
                   num_speculative_tokens=K, speculative_min_acceptance=0.0, cuda_graphs=True, **CFG)
    assert_same_outputs(plain, run_arrivals(llm, arrivals), log_prob_tol=1e-3)
    st = llm.engine.stats
    assert st.spec_graph_replays > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
    assert st.graph_captures_after_warmup == 0, st.as_dict()
