"""Speculation that costs nothing where it does not draft (speculative/plain_steps.py): decode
steps of a speculative engine in which no row drafts, and after which none can, run the plain
engine's step (no spec inputs, no acceptance, no drafter). At 0 % acceptance most steps are
plain (``spec_plain_steps``) and outputs equal the plain engine's, token for token, greedy and
seeded sampling, serial and launch-ahead, oracle, n-gram and MTP drafters, eager and with
(emulated) CUDA graphs; when acceptance recovers, probes switch drafting back on; when a batch
shrinks under ``speculative_max_batch_size``, rows whose drafter did not run wait one step
("stale") and then draft."""
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported: the Triton variant interprets
    os.environ["TRITON_INTERPRET"] = "1"

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner  # noqa: E402
from megatron_async.inference.text_generation_controllers.graph_plan import GraphPlan  # noqa: E402
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals  # noqa: E402
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.mtp_heads import add_mtp_heads  # noqa: E402
from tests.helpers.spec_harness import assert_same_outputs, oracle_for  # noqa: E402

N = 48  # tokens per request: several probe intervals
PARAMS = [
    SamplingParams(top_k=1, num_tokens_to_generate=N, ignore_eos=True, return_log_probs=True),
    SamplingParams(temperature=0.9, top_k=20, seed=5, num_tokens_to_generate=N, ignore_eos=True, return_log_probs=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=6, num_tokens_to_generate=N - 3, ignore_eos=True),
]
OFF = dict(speculative_min_acceptance=0.3, speculative_probe_interval=12)


def _arrivals(seed: int, n: int = 5, stagger: int = 0, vocab: int = 256) -> list[Arrival]:
    return [Arrival(stagger * i, p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(random_prompts(n, 3, 14, vocab, seed))]


def _assert_mostly_plain(st) -> None:
    """Requests start at acceptance 1 and need a few rejected verify rows to switch off; then
    only the step before a probe, the probe and (launch-ahead) the step after it are not plain."""
    assert st.spec_plain_steps > 0.5 * st.decode_steps, st.as_dict()
    assert st.spec_verify_rows > 0 and st.spec_off_rows["acceptance"] > 0, st.as_dict()  # switched off, probing


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain_steps_mtp")
    return add_mtp_heads(make_tiny_checkpoint("LlamaForCausalLM", root / "base", seed=1), root / "mtp", depths=1, seed=3)


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    return make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path_factory.mktemp("plain_steps_hybrid"))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_zero_acceptance_oracle_runs_plain_steps(qwen3_ckpt, hybrid_ckpt, model, async_scheduling, graphs):
    """Hybrid: plain steps advance the Mamba slots in place, as a plain engine's do; the verify
    steps between them keep committing the accepted window state."""
    path = hybrid_ckpt if model == "hybrid" else qwen3_ckpt
    vocab = make_llm(path).model.vocab_size
    arr = _arrivals(41, stagger=2, vocab=vocab)
    cfg = dict(async_scheduling=async_scheduling, max_requests=6, max_tokens=32)
    plain = run_arrivals(make_llm(path, **cfg), arr)
    llm = make_llm(path, oracle_for(plain, arr, 1.0, vocab=vocab), num_speculative_tokens=3, **OFF, **cfg)
    keys = _graphs_logged(llm, mixed=model == "gpt") if graphs else []
    assert_same_outputs(plain, run_arrivals(llm, arr), log_prob_tol=1e-5)
    st = llm.engine.stats
    _assert_mostly_plain(st)
    assert st.spec_accepted_tokens == 0 and llm.context.gpu_view.num_copies == st.steps
    if graphs:  # plain steps replayed a plain engine's decode and mixed graphs (the same keys)
        _assert_plain_keys(llm, keys, mixed=model == "gpt")
        assert any(k is not None and k.spec and k.decode_only for k in keys)  # steps before probes


def _graphs_logged(llm, mixed: bool) -> list:
    """Emulated CUDA graphs, warmed up; returns the list the key of every lookup goes to (None: eager)."""
    runner = llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=mixed, emulate=True)
    llm.engine.warmup()
    keys, lookup = [], runner.lookup

    def logged(*a, **kw):
        step = lookup(*a, **kw)
        keys.append(step.key if step is not None else None)
        return step

    runner.lookup = logged
    return keys


def _assert_plain_keys(llm, keys: list, mixed: bool) -> None:
    """Every plain step replayed a plain engine's graph (the same keys), counted by kind."""
    st = llm.engine.stats
    plain_plan = GraphPlan(replace(llm.config, num_speculative_tokens=0).graph_sizing(), llm.model.vocab_size, mixed=mixed)
    plain_decode = [k for k in keys if k is not None and k.decode_only and not k.spec]
    plain_mixed = [k for k in keys if k is not None and not k.decode_only and not k.spec]
    assert len(plain_decode) == st.spec_plain_steps and set(plain_decode + plain_mixed) <= set(plain_plan.keys())
    assert len(plain_mixed) == (st.spec_plain_mixed_steps if mixed else 0), st.as_dict()
    assert st.graph_captures_after_warmup == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefill_steps_of_a_batch_arriving_at_once_run_plain(qwen3_ckpt, async_scheduling):
    """The benchmark's batch-128 case scaled down, under the adaptive rule: the batch arrives at
    once and is prefilled over several steps, which draft nothing; all but the last (whose
    drafter run gives the first decode step its drafts) run the plain engine's step and replay
    its mixed graphs. Tokens equal the plain engine's."""
    vocab = make_llm(qwen3_ckpt).model.vocab_size
    arr = [Arrival(0, p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(random_prompts(8, 10, 14, vocab, seed=45))]
    cfg = dict(async_scheduling=async_scheduling, max_requests=8, max_tokens=32)
    plain = run_arrivals(make_llm(qwen3_ckpt, **cfg), arr)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arr, 1.0, vocab=vocab), num_speculative_tokens=3,
                   speculative_adaptive=True, **cfg)
    keys = _graphs_logged(llm, mixed=True)
    assert_same_outputs(plain, run_arrivals(llm, arr), log_prob_tol=1e-5)
    st = llm.engine.stats
    mixed = [k for k in keys if k is not None and not k.decode_only and not k.verify_width]
    assert st.spec_plain_mixed_steps >= len(mixed) - 1 >= 3, (keys, st.as_dict())
    assert st.spec_off_rows["prefill"] > 0 and st.spec_off_rows["stale"] == 0, st.as_dict()
    _assert_plain_keys(llm, keys, mixed=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_low_acceptance_drafters_run_plain_steps(qwen3_ckpt, mtp_ckpt, async_scheduling, method):
    """Random prompts: n-gram lookups and random MTP heads rarely land, so requests switch off;
    the drafters follow the plain steps (token history, MTP depth-0 KV) through ``track``."""
    path = mtp_ckpt if method == "mtp" else qwen3_ckpt
    arr = _arrivals(42)
    cfg = dict(async_scheduling=async_scheduling, max_requests=6, max_tokens=32)
    plain = run_arrivals(make_llm(path, **cfg), arr)
    llm = make_llm(path, num_speculative_tokens=3, speculative_method=method, **OFF, **cfg)
    assert_same_outputs(plain, run_arrivals(llm, arr))
    _assert_mostly_plain(llm.engine.stats)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_acceptance_drops_then_recovers(qwen3_ckpt, async_scheduling):
    """The oracle's drafts all wrong for a while (requests switch off, steps go plain), then all
    right: the probes land, drafting resumes with full drafts, outputs stay identical."""
    arr = _arrivals(43, n=4)
    for a in arr:
        a.params = SamplingParams(**{**a.params.__dict__, "num_tokens_to_generate": 80})
    cfg = dict(async_scheduling=async_scheduling, max_requests=6, max_tokens=32)
    plain = run_arrivals(make_llm(qwen3_ckpt, **cfg), arr)
    oracle = oracle_for(plain, arr, 1.0)
    llm = make_llm(qwen3_ckpt, oracle, num_speculative_tokens=3, **OFF, **cfg)
    eng, st = llm.engine, llm.engine.stats
    ids = {eng.add_request(a.prompt, a.params): i for i, a in enumerate(arr)}
    outs = {}
    while st.spec_plain_steps < 12:  # bad drafts: switched off, plain steps between probes
        for o in eng.step().finished:
            outs[ids[o.request_id]] = o
    assert st.spec_accepted_tokens == 0 and st.spec_off_rows["acceptance"] > 0, st.as_dict()
    full_before = st.spec_draft_tokens_per_depth[2] if st.spec_draft_tokens_per_depth else 0
    oracle.configure(oracle.continuations, 0.0)  # drafts right from now on
    while eng.has_unfinished_requests():
        for o in eng.step().finished:
            outs[ids[o.request_id]] = o
    assert_same_outputs(plain, outs)
    assert st.spec_draft_tokens_per_depth[2] > full_before and st.spec_accepted_tokens > 0, st.as_dict()
    assert st.spec_accepted_tokens >= 0.5 * (sum(len(o.generated_tokens) for o in outs.values()) / 4), st.as_dict()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_shrinks_below_the_limit(qwen3_ckpt, async_scheduling):
    """Steps over ``speculative_max_batch_size`` are plain; when finishes bring the batch under
    it, each row first runs one step without drafts ("stale": its drafter did not run), then drafts."""
    arr = [Arrival(0, p, SamplingParams(top_k=1, num_tokens_to_generate=6 + 5 * i, ignore_eos=True))
           for i, p in enumerate(random_prompts(6, 3, 12, 256, seed=44))]
    cfg = dict(async_scheduling=async_scheduling, max_requests=6, max_tokens=32)
    plain = run_arrivals(make_llm(qwen3_ckpt, **cfg), arr)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arr, 0.0), num_speculative_tokens=3,
                   speculative_max_batch_size=3, **cfg)
    assert_same_outputs(plain, run_arrivals(llm, arr))
    st = llm.engine.stats
    assert st.spec_plain_steps > 0 and st.spec_off_rows["batch"] > 0 and st.spec_off_rows["stale"] > 0, st.as_dict()
    assert st.spec_accepted_tokens > 0, st.as_dict()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_prefill_chunks_beside_rows_continuing_a_probe(qwen3_ckpt, hybrid_ckpt, model, async_scheduling):
    """Requests switched off by acceptance probe every 12 steps; long prompts arriving meanwhile
    are prefilled over several steps, one of them right after a probe: rows continuing a launch
    that verified drafts read their input token from the spec state, so that step runs the
    machinery although nothing drafts in it or next; the other prefill steps run plain (hybrid:
    their chunks advance the Mamba slots as a plain engine's do)."""
    path = hybrid_ckpt if model == "hybrid" else qwen3_ckpt
    vocab = make_llm(path).model.vocab_size
    short, long = random_prompts(3, 3, 6, vocab, seed=46), random_prompts(3, 60, 90, vocab, seed=47)
    arr = [Arrival(0, p, PARAMS[i]) for i, p in enumerate(short)]
    arr += [Arrival(9 + 3 * i, p, PARAMS[i]) for i, p in enumerate(long)]
    cfg = dict(async_scheduling=async_scheduling, max_requests=6, max_tokens=32)
    plain = run_arrivals(make_llm(path, **cfg), arr)
    llm = make_llm(path, oracle_for(plain, arr, 1.0, vocab=vocab), num_speculative_tokens=3, **OFF, **cfg)
    sel, beside = llm.runner.spec_steps, []
    speculative = sel.speculative

    def logged(plan):
        spec = speculative(plan)
        beside.append(not plan.is_all_decode and plan.inflight_verified and any(r.prev_row >= 0 for r in plan.rows))
        return spec

    sel.speculative = logged
    assert_same_outputs(plain, run_arrivals(llm, arr))
    st = llm.engine.stats
    assert st.spec_plain_mixed_steps > 0 and st.spec_off_rows["acceptance"] > 0, st.as_dict()
    assert any(beside) == async_scheduling  # (serial steps: the probe landed first)
