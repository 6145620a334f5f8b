"""CudaGraphRunner's decisions for data-parallel engines (no GPU: graphs stand in as keys):
decode plans that fit a jointly captured graph replay it at the largest sampling variant any
rank needs; a step whose largest launch (any rank's) holds more tokens than a decode batch
replays the mixed graph of that count on every rank (FULL sampling), decode and idle ranks
included; and a collective runner never captures alone: a missing graph is a clear error, not
a capture (or a hang)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_async import InferenceConfig, SamplingParams
from megatron_async.inference.step_plan import RowPlan, StepPlan
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner, decode_key
from megatron_async.inference.text_generation_controllers.graph_plan import GraphKey, SamplingVariant
from megatron_async.step_shape import StepShape


def runner(collective: bool) -> CudaGraphRunner:
    ctl = SimpleNamespace(model=SimpleNamespace(vocab_size=64),
                          context=SimpleNamespace(device=SimpleNamespace(suspend_backend=None)))
    r = CudaGraphRunner(ctl, InferenceConfig(max_requests=8).graph_sizing(), mixed=True, collective=collective)
    if collective:
        # mixed graphs above the largest decode batch (FULL only), then decode graphs of every
        # variant, each kind's sampling tails before their forwards (the logits-only graphs)
        counts, greedy = r.plan.token_counts, SamplingVariant.GREEDY
        assert counts[0] == 16 and counts[-1] == InferenceConfig().max_tokens
        assert r.split_sampling
        assert r.plan.keys() == ([GraphKey(t, 9, False, SamplingVariant.FULL) for t in reversed(counts)]
                                 + [GraphKey(t, 9, False, greedy, logits_only=True) for t in reversed(counts)]
                                 + [decode_key(b, v) for b in (8, 4, 2, 1) for v in SamplingVariant]
                                 + [GraphKey(b, b, True, greedy, logits_only=True) for b in (8, 4, 2, 1)])
    r.graphs = {k: SimpleNamespace(num_rows=k.num_rows, key=k) for k in r.plan.keys()}  # what warmup captures
    return r


def decode_plan(*params: SamplingParams) -> StepPlan:
    return StepPlan([RowPlan(SimpleNamespace(sampling_params=sp), start=5, num_tokens=1, samples=True)
                     for sp in params])


GREEDY = SamplingParams(top_k=1)


V = list(SamplingVariant)


S = SamplingVariant


@pytest.mark.parametrize("other,variant", [
    (GREEDY, S.GREEDY), (SamplingParams(temperature=0.0, top_p=0.5), S.GREEDY), (SamplingParams(temperature=0.8), S.TEMPERATURE),
    (SamplingParams(temperature=0.8, top_p=0.9), S.NUCLEUS), (SamplingParams(temperature=0.8, min_p=0.1), S.NUCLEUS),
    (SamplingParams(temperature=0.8, top_k=40), S.FILTERED), (SamplingParams(temperature=0.8, top_k=40, top_p=0.9), S.FILTERED),
    (SamplingParams(top_k=1, return_log_probs=True), S.FULL), (SamplingParams(top_k=1, top_n_logprobs=2), S.FULL),
    (SamplingParams(top_k=1, repetition_penalty=1.2), S.FULL), (SamplingParams(top_k=1, min_tokens=3), S.FULL),
    (SamplingParams(top_k=1, top_n_logprobs=21), None),  # beyond GRAPH_TOP_N: eager
])
def test_a_decode_plan_replays_its_covering_variant(other, variant):
    want = None if variant is None else V.index(variant)
    assert runner(True).replay_variant(decode_plan(GREEDY, other)) == want


def prefill_plan(tokens: int, params: SamplingParams = GREEDY) -> StepPlan:
    prompt = list(range(tokens))
    return StepPlan([RowPlan(SimpleNamespace(sampling_params=params, prompt_tokens=prompt), start=0, num_tokens=tokens,
                             samples=True),
                     RowPlan(SimpleNamespace(sampling_params=GREEDY, prompt_tokens=[1] * 7), start=7, num_tokens=1,
                             samples=True)])


def test_a_prefill_plan_above_a_decode_batch_replays_the_full_mixed_graph():
    r = runner(True)
    assert r.replay_variant(prefill_plan(11)) == V.index(S.FULL)  # 12 tokens > 8 rows: the 16-token graph
    largest = InferenceConfig().max_tokens
    assert r.replay_variant(prefill_plan(largest - 1)) == V.index(S.FULL)
    assert r.replay_variant(prefill_plan(largest)) is None  # one token above the largest mixed graph
    assert r.replay_variant(prefill_plan(11, SamplingParams(top_k=1, top_n_logprobs=21))) is None
    assert r.replay_variant(prefill_plan(11, SamplingParams(top_k=1, return_prompt_log_probs=True))) is None  # scoring
    del r.graphs[GraphKey(16, 9, False, S.FULL)]
    assert r.replay_variant(prefill_plan(11)) is None  # not captured on every rank


def test_every_rank_replays_the_mixed_graph_of_the_agreed_count():
    """A prefill rank, a decode rank and an idle rank of one step above a decode batch: one graph."""
    r = runner(True)
    mixed = StepShape(300, 3, 290, 400, False, False, False, 0, False)
    want = GraphKey(320, 9, False, S.FULL)
    assert r.lookup(mixed, min_rows=300).key == want
    assert r.lookup(shape(2), min_rows=300, min_variant=V.index(S.FULL)).key == want
    assert r.lookup(shape(2, sampling=True), min_rows=300, min_variant=V.index(S.FULL)).key == want
    assert r.padding_key(300, V.index(S.FULL)) == want
    # up to a decode batch the agreed count keeps decode graphs, and a prefill chunk that small runs eager
    assert r.lookup(shape(2), min_rows=8).key == decode_key(8)
    assert r.plan.key(StepShape(6, 2, 5, 9, False, False, False, 0, False), min_rows=6) is None
    assert r.plan.key(mixed, min_rows=9000) is None  # above the largest mixed graph: eager


def test_a_single_engine_plan_keeps_every_mixed_variant():
    r = runner(False)
    assert not r.plan.collective and r.plan.token_counts[0] == 16 and r.plan.collective_mixed_key(300) is None
    assert GraphKey(16, 9, False, S.GREEDY) in r.plan.keys()


def test_prefill_too_large_and_uncaptured_plans_run_eager():
    r = runner(True)
    prefill = StepPlan([RowPlan(SimpleNamespace(sampling_params=GREEDY), start=0, num_tokens=4, samples=True)])
    assert r.replay_variant(prefill) is None  # no more tokens than a decode batch: eager
    assert r.replay_variant(decode_plan(*[GREEDY] * 9)) is None  # beyond the largest size (8)
    del r.graphs[decode_key(4)]
    assert r.replay_variant(decode_plan(GREEDY, GREEDY, GREEDY)) is None  # pads to 4: not captured on every rank


def test_ranks_replay_the_agreed_variant():
    """A greedy step on a rank whose peers sample replays their (larger) variant, at their size."""
    r = runner(True)
    assert r.lookup(shape(2), min_rows=3, min_variant=V.index(S.FILTERED)).key == decode_key(4, SamplingVariant.FILTERED)
    assert r.lookup(shape(2), min_variant=V.index(S.NUCLEUS)).key == decode_key(2, SamplingVariant.NUCLEUS)
    assert r.lookup(shape(2, sampling=True), min_variant=0).key == decode_key(2, SamplingVariant.TEMPERATURE)
    replayed = []
    r.graphs[decode_key(4, SamplingVariant.FULL)].replay = lambda: replayed.append("full 4")
    key = r.padding_key(3, V.index(S.FULL))
    r.replay_padding(key)
    assert key == decode_key(4, SamplingVariant.FULL) and replayed == ["full 4"] and r.num_padding_replays == 1


def shape(rows: int, sampling: bool = False) -> StepShape:
    return StepShape(rows, rows, 1, 9, True, sampling, False, 0, False)


def test_lookup_pads_to_the_agreed_rows():
    r = runner(True)
    assert r.lookup(shape(1), min_rows=3).num_rows == 4
    assert r.lookup(shape(3), min_rows=0).num_rows == 4
    assert r.lookup(shape(5), min_rows=8).num_rows == 8


def test_a_collective_runner_never_captures_alone():
    r = runner(True)
    r._capture = lambda key: pytest.fail(f"captured {key} on one rank")
    del r.graphs[decode_key(2, SamplingVariant.TEMPERATURE)]
    with pytest.raises(RuntimeError, match="agreed to replay CUDA graphs.*no graph that every rank captured"):
        r.lookup(shape(2, sampling=True))
    with pytest.raises(RuntimeError, match="agreed to replay"):
        r.lookup(StepShape(6, 2, 5, 9, False, False, False, 0, False))  # a prefill step under an agreed replay
    with pytest.raises(RuntimeError, match="no greedy CUDA graph for a dummy step of 9000 tokens"):
        r.padding_key(9000)
    with pytest.raises(RuntimeError, match="no temperature CUDA graph for a dummy step of 2 tokens"):
        r.padding_key(2, 1)


def test_a_single_engine_runner_captures_lazily():
    r = runner(False)
    r._capture = lambda key: SimpleNamespace(num_rows=key.num_rows, key=key)
    assert r.lookup(shape(2, sampling=True)).key == GraphKey(2, 2, True, SamplingVariant.TEMPERATURE)
    prefill = StepShape(6, 2, 5, 9, False, False, False, 0, False)
    assert r.lookup(prefill).key == GraphKey(16, 9, False, SamplingVariant.GREEDY)  # a mixed graph
    r.plan.token_counts = []
    assert r.lookup(prefill) is None  # no mixed graphs: eager


def test_log_prob_decode_steps_replay_their_variants_twin():
    """A decode step asking for log-probs (and top-n up to GRAPH_TOP_N) replays the log-prob twin
    of its own sampling variant, not FULL; penalties, mixed and data-parallel steps replay FULL."""
    r = runner(False)
    r._capture = lambda key: SimpleNamespace(num_rows=key.num_rows, key=key)
    greedy_lp = StepShape(3, 3, 1, 9, True, False, False, 0, True)
    top5 = StepShape(3, 3, 1, 9, True, True, False, 5, False)
    top_p_top20 = StepShape(3, 3, 1, 9, True, True, True, 20, True, filters=(False, True, False))
    top_k_top20 = StepShape(3, 3, 1, 9, True, True, True, 20, True, filters=(True, False, False))
    assert r.lookup(greedy_lp).key == GraphKey(4, 4, True, SamplingVariant.GREEDY, log_probs=True)
    assert r.lookup(top5).key == GraphKey(4, 4, True, SamplingVariant.TEMPERATURE, log_probs=True)
    assert r.lookup(top_p_top20).key == GraphKey(4, 4, True, SamplingVariant.NUCLEUS, log_probs=True)
    assert r.lookup(top_k_top20).key == GraphKey(4, 4, True, SamplingVariant.FILTERED, log_probs=True)
    assert r.lookup(top5).key.label == "temperature+log_probs"
    penalties_lp = StepShape(3, 3, 1, 9, True, False, False, 0, True, any_penalties=True)
    assert r.lookup(penalties_lp).key == GraphKey(4, 4, True, SamplingVariant.FULL)
    prefill_lp = StepShape(6, 2, 5, 9, False, False, False, 0, True)
    assert r.lookup(prefill_lp).key == GraphKey(16, 9, False, SamplingVariant.FULL)
    dp = runner(True)  # the ranks agree on one chain index: log-probs replay FULL, no twins captured
    assert not any(k.log_probs for k in dp.plan.keys())
    assert dp.lookup(greedy_lp).key == decode_key(4, SamplingVariant.FULL)


def verify_plan(*drafts: int, prefill: bool = False) -> StepPlan:
    rows = [RowPlan(SimpleNamespace(sampling_params=GREEDY, prompt_tokens=[1]), start=5, num_tokens=1 + k,
                    samples=True, num_drafts=k) for k in drafts]
    if prefill:
        rows.append(RowPlan(SimpleNamespace(sampling_params=GREEDY, prompt_tokens=[1] * 9), 0, 4, samples=False))
    return StepPlan(rows)


def verify_shape(rows: int, width: int, uniform: bool = True, sampling: bool = False) -> StepShape:
    return StepShape(rows * width, rows, width, 9, False, sampling, False, 0, False, num_samples=rows * width,
                     verify_width=width if uniform else 0)


def test_verify_keys_pad_rows_to_a_decode_size_at_the_narrowest_width():
    """K = 3, widths 2 and 4 (the default): verify graphs at the decode sizes whose tokens fit
    max_tokens (24: width 4 sizes 1, 2, 4; width 2 also 8); a step replays the narrowest width
    holding its most drafted row; a step laid out compactly (rows next to a prefill chunk), of
    another width or beyond the largest size runs eager; without speculation no verify key."""
    cfg = InferenceConfig(max_requests=8, max_tokens=24, num_speculative_tokens=3)
    r = CudaGraphRunner(SimpleNamespace(model=SimpleNamespace(vocab_size=64)), cfg.graph_sizing(), mixed=True)
    r._capture = lambda key: SimpleNamespace(num_rows=key.num_rows, key=key)
    assert r.plan.verify_sizes == {2: [1, 2, 4, 8], 4: [1, 2, 4]}
    verify_keys = [k for k in r.plan.keys() if k.verify_width]
    assert verify_keys == [GraphKey(w * b, b, False, v, w, True) for w, sizes in ((4, (4, 2, 1)), (2, (8, 4, 2, 1)))
                           for b in sizes for v in SamplingVariant if v != S.NUCLEUS]  # NUCLEUS: decode graphs only
    assert r.lookup(verify_shape(3, 4, sampling=True)).key == GraphKey(16, 4, False, SamplingVariant.TEMPERATURE, 4, True)
    assert r.lookup(verify_shape(1, 4)).key == GraphKey(4, 1, False, SamplingVariant.GREEDY, 4, True)
    assert r.lookup(verify_shape(5, 2)).key == GraphKey(16, 8, False, SamplingVariant.GREEDY, 2, True)
    assert r.lookup(verify_shape(5, 4)) is None  # beyond the largest size of width 4
    assert r.lookup(verify_shape(2, 3, uniform=False)) is None  # compact layout: eager
    assert r.lookup(verify_shape(2, 3)) is None  # not a captured width
    assert r.num_verify_replays == 3 and r.num_mixed_replays == 0
    # the width the runner lays a plan out at (0: compact, eager or a plain decode graph)
    assert r.plan.verify_width(verify_plan(3, 1, 0)) == 4
    assert r.plan.verify_width(verify_plan(2, 1, 0)) == 4  # no width 3: the next one up
    assert r.plan.verify_width(verify_plan(1, 0, 1)) == 2  # probes only: the narrow graphs
    assert r.plan.verify_width(verify_plan(*[1] * 5)) == 2 and r.plan.verify_width(verify_plan(*[3] * 5)) == 0
    assert r.plan.verify_width(verify_plan(0, 0)) == 0  # no drafts: a plain decode graph
    assert r.plan.verify_width(verify_plan(3, 1, prefill=True)) == 0
    every = CudaGraphRunner(r.model_runner, replace(cfg, cuda_graph_verify_widths=(2, 3)).graph_sizing(), mixed=True)
    assert list(every.plan.verify_sizes) == [2, 3, 4] and every.plan.verify_width(verify_plan(2, 1)) == 3
    off = CudaGraphRunner(r.model_runner, InferenceConfig(max_requests=8, max_tokens=24).graph_sizing(), mixed=True)
    assert off.plan.verify_sizes == {} and not any(k.verify_width for k in off.plan.keys())
    assert off.plan.verify_width(verify_plan(3)) == 0
    no_verify = CudaGraphRunner(r.model_runner, cfg.graph_sizing(), mixed=True, verify=False)
    assert no_verify.plan.verify_width(verify_plan(3)) == 0 and no_verify.lookup(verify_shape(1, 4)) is None
    with pytest.raises(ValueError, match="cuda_graph_verify_widths must lie in 2 .. num_speculative_tokens"):
        InferenceConfig(num_speculative_tokens=3, cuda_graph_verify_widths=(5,)).validate()


def test_llm_close_destroys_graphs_before_the_process_group():
    """ncclCommDestroy waits for every graph that captured NCCL ops: close() must drop them first
    (the multi-GPU EP + graphs runs hung in close otherwise)."""
    from megatron_async import LLM

    llm = LLM(None, inference_config=InferenceConfig(max_requests=4, num_kv_blocks=16, max_sequence_length=64))
    order = []
    r = runner(True)
    r.release = lambda: (order.append("graphs released"), CudaGraphRunner.release(r))
    llm.runner.graphs = r
    left = lambda: order.append(f"process group destroyed, graphs left: {len(r.graphs)}")  # noqa: E731
    llm.parallel = SimpleNamespace(destroy=left)
    llm.close()
    assert order == ["graphs released", "process group destroyed, graphs left: 0"]
    assert llm.runner.graphs is None


def test_a_built_warmup_captures_every_graph_but_the_first_without_an_eager_run():
    """After a whole dry pass (``built``) the warm-up's graphs capture without running their
    step first; the first still runs (it creates the graphs' pool); lazy captures always run."""
    r = runner(False)
    r.graphs, runs = {}, []

    def capture(key, eager_run=True):
        runs.append(eager_run)
        r._pool = "pool"
        return SimpleNamespace(num_rows=key.num_rows, key=key)

    r._capture = capture
    assert r.warmup(built=True) == len(r.plan.keys()) > 2
    assert runs == [True] + [False] * (len(runs) - 1)
    r2 = runner(False)
    r2.graphs, r2._capture, runs[:] = {}, capture, []
    r2.warmup()
    assert all(runs)  # without a dry pass: every graph after an eager run
    r3 = runner(False)
    r3.graphs, r3._capture, runs[:] = {}, capture, []
    r3.model_runner.context.device.suspend_backend = object()
    r3.warmup(built=True)
    assert runs and all(runs)  # a suspendable pool: every graph after an eager run


def test_captures_keep_the_allocator_caches_until_the_warmup_ends(monkeypatch):
    import torch

    from megatron_async.inference.text_generation_controllers.kernel_prebuild import caches_kept

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("device"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append("host"), raising=False)  # CUDA builds
    original = torch.cuda.empty_cache, torch._C._host_emptyCache
    with caches_kept():
        torch.cuda.empty_cache()  # what torch.cuda.graph's __enter__ calls before each capture
        torch._C._host_emptyCache()
        assert emptied == []
    assert (torch.cuda.empty_cache, torch._C._host_emptyCache) == original
    torch.cuda.empty_cache()
    assert emptied == ["device"]


def test_the_startup_profile_says_how_many_graphs_captured_without_an_eager_run():
    from megatron_async.inference.startup_profile import StartupProfile
    from megatron_async.inference.text_generation_controllers.warmup import WarmupReport

    profile = StartupProfile()
    profile.add_warmup(WarmupReport(1.0, 0, 5, 0, 0, capture_seconds=0.5, captures_without_eager_run=4))
    assert profile.phases["graph captures"].note == "5 graphs, 4 without an eager run first"
    profile.add_warmup(WarmupReport(1.0, 0, 5, 0, 0, capture_seconds=0.5))
    assert profile.phases["graph captures"].note == "5 graphs"
    profile.add_warmup(WarmupReport(1.0, 0, 5, 0, 0, capture_seconds=0.5, captures_without_eager_run=3,
                                    capture_retries=1))
    assert profile.phases["graph captures"].note == "5 graphs, 3 without an eager run first, 1 captured again after one"


def test_a_startup_phase_names_its_timed_parts():
    from megatron_async.inference.startup_profile import StartupProfile

    profile = StartupProfile()
    with profile.phase("communicators"):
        with profile.part("first collective"):
            pass
        with profile.part("TP all-reduce"):
            pass
    note = profile.phases["communicators"].note
    assert note.startswith("first collective 0.") and ", TP all-reduce 0." in note and note.endswith(" s")
    with profile.phase("load"):  # a phase without parts: no note, and the last phase's parts are not carried over
        pass
    assert profile.phases["load"].note == ""
