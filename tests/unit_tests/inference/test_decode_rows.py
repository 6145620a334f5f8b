"""The decode-only fast path (contexts/decode_rows.py) writes the same host bytes and the same
StepShape as initialize_attention_state's general path, and neither changes a request (the
request book commits the step after it is assembled).

Every step of real engine runs (staggered ragged prompts, greedy and sampled rows, penalties,
min_tokens, log-probs, a small KV pool that pauses and evicts, prefix caching, serial and
launch-ahead so inputs come from the host and from the in-flight ``prev_row``, GPT and hybrid
models with Mamba state slots) is assembled twice from the same state, in one of two orders
(picked at random per step):
- general path first, then the dispatcher, each into a buffer pre-filled with the same junk
  byte, so a field one side forgets to write shows up as a difference too;
- the dispatcher first, into the buffer as earlier steps left it (the fast path keeps the
  columns that only depend on which requests sit in which rows), then the general path over
  it: every byte the general path writes must already be there."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses  # noqa: E402
import random  # noqa: E402
from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.inference.contexts.step_errors import RequestStepError  # noqa: E402
from tests.helpers.engine_harness import Arrival, run_arrivals, sampling_mix  # noqa: E402

JUNK = 0xA5


def _state(req):
    return (req.num_computed_tokens, req.num_inflight, req.inflight_row, req.num_inflight_drafts)


def compare_both_paths(ctx, seen: Counter, seed: int = 0) -> None:
    """Replace ``ctx.initialize_attention_state``: both paths from the same state, compared
    whenever the dispatcher took the fast path."""
    dispatch, general, rows = ctx.initialize_attention_state, ctx._assemble_general, ctx._decode_rows
    assemble = rows.assemble
    fast_used = []
    rng = random.Random(seed)

    def spy(*args):
        shape = assemble(*args)
        fast_used.append(shape is not None)
        return shape

    rows.assemble = spy

    def run(fn, plan, verify_width, before, ring, junk: bool):
        """``fn`` from the state before the step; returns (shape, bytes, request state)."""
        assert [_state(r.request) for r in plan.rows] == before  # assembly changes no request
        ctx._ring = ring
        buf = ctx._host_buffers[ring ^ 1]
        if junk:
            buf.fill_(JUNK)
        shape = fn(plan, verify_width)
        assert ctx._ring == ring ^ 1
        return shape, buf.clone(), [_state(r.request) for r in plan.rows]

    def both(plan, verify_width=0):
        ring = ctx._ring
        nxt = ring ^ 1
        undo = [_state(r.request) for r in plan.rows]  # what every assembly must leave as it was
        general_first = rng.random() < 0.5
        fast_used.clear()
        if general_first:
            try:
                ref = run(general, plan, verify_width, undo, ring, junk=True)
            except RequestStepError:
                return dispatch(plan, verify_width)  # it raises the same (nothing was changed)
            got = run(dispatch, plan, verify_width, undo, ring, junk=True)
        else:
            prior = rows._constant.get(nxt)
            got = run(dispatch, plan, verify_width, undo, ring, junk=False)
            after = rows._constant.get(nxt)
            if not fast_used[0]:
                seen["general"] += 1
                return got[0]
            ref = run(general, plan, verify_width, undo, ring, junk=False)
            rows._constant[nxt] = after  # asserted below: the bytes are the fast path's, its record holds
            seen["kept_constant"] += prior is not None and after is prior
        if not fast_used[-1]:
            seen["general"] += 1
            return got[0]
        assert torch.equal(got[1], ref[1]), _first_difference(ctx, got[1], ref[1])
        assert got[0] == ref[0]
        assert got[2] == ref[2] == undo
        seen["fast"] += 1
        for row in plan.rows:
            sp = row.request.sampling_params
            seen["prev_row"] += row.prev_row >= 0
            seen["host_input"] += row.prev_row < 0
            seen["sampled"] += not sp.is_greedy
            seen["greedy"] += sp.is_greedy
            seen["penalties"] += row.request.sampling_slot >= 0
            seen["log_probs"] += sp.return_log_probs
            seen["state_slots"] += row.request.state_slot >= 0
            seen["spec_inflight"] += ctx.spec is not None and plan.inflight_verified and row.prev_row >= 0
        seen["ragged"] += len({len(r.request.block_ids) for r in plan.rows}) > 1
        seen["columns"] += plan.plain_decode  # the scheduler's columns, not the rows, were read
        return got[0]

    ctx.initialize_attention_state = both


def _first_difference(ctx, got: torch.Tensor, ref: torch.Tensor) -> str:
    got_views, ref_views = ctx.layout.views(got), ctx.layout.views(ref)
    bad = [name for name in got_views if not torch.equal(got_views[name], ref_views[name])]
    return f"fields differ: {bad}"


def _arrivals(seed: int, n: int, vocab: int) -> list[Arrival]:
    rng = random.Random(seed)
    kinds = sampling_mix(0)
    shared = [rng.randrange(1, vocab) for _ in range(9)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 23))]
        params = dataclasses.replace(kinds[rng.randrange(len(kinds))], num_tokens_to_generate=rng.randint(4, 14),
                                     ignore_eos=rng.random() < 0.3)
        out.append(Arrival(rng.randrange(0, 2 * n), shared + prompt if i % 4 == 0 else prompt, params))
    return out


def _run(model, arrivals, async_scheduling: bool, num_kv_blocks: int, seen: Counter, drafter=None, **cfg):
    config = InferenceConfig(block_size_tokens=4, num_kv_blocks=num_kv_blocks, max_requests=8, max_tokens=40,
                             max_sequence_length=64, enable_prefix_caching=True, async_scheduling=async_scheduling,
                             **cfg)
    llm = LLM(model, inference_config=config, drafter=drafter)
    compare_both_paths(llm.context, seen)
    _count_blocks_given_back(llm.context, seen)
    outs = run_arrivals(llm, arrivals)
    return {i: o.generated_tokens for i, o in outs.items()}, llm.engine.stats


def _count_blocks_given_back(ctx, seen: Counter) -> None:
    """Speculative decoding: rejected drafts that give back blocks (the per-request rows must follow)."""
    trim = ctx.trim_blocks

    def counted(req):
        before = len(req.block_ids)
        trim(req)
        seen["blocks_given_back"] += len(req.block_ids) < before

    ctx.trim_blocks = counted


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_fast_path_equals_general_path_gpt(seed, async_scheduling):
    seen = Counter()
    arrivals = _arrivals(seed, 24, 1000)
    outs, stats = _run(None, arrivals, async_scheduling, num_kv_blocks=24, seen=seen)
    assert len(outs) == len(arrivals)
    assert seen["fast"] >= 10, seen
    for what in ("sampled", "greedy", "penalties", "log_probs", "ragged", "host_input", "kept_constant", "columns"):
        assert seen[what] > 0, (what, seen)
    if async_scheduling:
        assert seen["prev_row"] > 0 and stats.overlapped_decode_steps > 0, seen
    assert stats.paused + stats.evicted > 0, "the pool was meant to run short"


@pytest.mark.parametrize("policy", ["forced", "switch-off"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_fast_path_equals_general_path_speculative(async_scheduling, policy):
    """A speculative engine's decode steps without drafts (plain steps, drafter steps, rows
    continuing a launch that verified drafts) take the fast path too, spec columns included;
    rejected drafts give blocks back between them. The oracle's drafts are right about half
    the time, so verify rows, corrections and (switch-off policy) plain steps all happen."""
    from megatron_async.inference.speculative.oracle import OracleDrafter

    seen = Counter()
    arrivals = _arrivals(5, 20, 1000)
    plain, _ = _run(None, arrivals, async_scheduling, num_kv_blocks=40, seen=Counter())
    cont = {tuple(a.prompt): plain[i] for i, a in enumerate(arrivals)}
    knobs = dict(speculative_min_acceptance=0.0) if policy == "forced" else dict(
        speculative_min_acceptance=0.6, speculative_probe_interval=3)
    outs, stats = _run(None, arrivals, async_scheduling, num_kv_blocks=40, seen=seen,
                       drafter=OracleDrafter(cont, 0.45, 1000, 64), num_speculative_tokens=3, **knobs)
    assert outs == plain
    assert seen["fast"] >= 3 and seen["general"] > 0, seen
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens and seen["blocks_given_back"] > 0, seen
    assert stats.fast_decode_snapshots >= seen["fast"] and stats.fast_landings > 0, stats.as_dict()
    if async_scheduling:  # rows continuing a launch in flight: one that verified drafts, and a plain one
        assert seen["spec_inflight"] > 0 and seen["prev_row"] > seen["spec_inflight"], seen
    if policy == "switch-off":
        assert stats.spec_plain_steps > 0, stats.as_dict()


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint

    return make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path_factory.mktemp("nemotron"))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_fast_path_equals_general_path_hybrid(hybrid_ckpt, async_scheduling):
    seen = Counter()
    arrivals = _arrivals(2, 16, 120)
    outs, _ = _run(str(hybrid_ckpt), arrivals, async_scheduling, num_kv_blocks=40, seen=seen,
                   prefix_caching_mamba_gb=1e-3)
    assert len(outs) == len(arrivals)
    assert seen["fast"] >= 10 and seen["state_slots"] > 0 and seen["kept_constant"] > 0 and seen["columns"] > 0, seen


def test_fast_path_equals_general_path_hybrid_speculative(hybrid_ckpt):
    """A hybrid speculative engine's steps without drafts: Mamba columns and spec columns together."""
    from megatron_async.inference.speculative.oracle import OracleDrafter

    arrivals = _arrivals(4, 12, 120)
    plain, _ = _run(str(hybrid_ckpt), arrivals, True, num_kv_blocks=60, seen=Counter())
    seen = Counter()
    cont = {tuple(a.prompt): plain[i] for i, a in enumerate(arrivals)}
    outs, stats = _run(str(hybrid_ckpt), arrivals, True, num_kv_blocks=60, seen=seen,
                       drafter=OracleDrafter(cont, 0.45, 120, 64), num_speculative_tokens=2,
                       speculative_min_acceptance=0.6, speculative_probe_interval=3)
    assert outs == plain
    assert seen["fast"] >= 3 and seen["state_slots"] > 0 and seen["spec_inflight"] > 0, seen
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats.as_dict()


def test_outputs_equal_with_and_without_the_fast_path():
    """Same tokens whether decode steps take the fast path or the general path."""
    arrivals = _arrivals(3, 20, 1000)
    seen = Counter()
    fast, _ = _run(None, arrivals, True, num_kv_blocks=30, seen=seen)
    config = InferenceConfig(block_size_tokens=4, num_kv_blocks=30, max_requests=8, max_tokens=40,
                             max_sequence_length=64, enable_prefix_caching=True)
    llm = LLM(None, inference_config=config)
    llm.context._decode_rows.assemble = lambda *a: None  # every step through the general path
    general = {i: o.generated_tokens for i, o in run_arrivals(llm, arrivals).items()}
    assert fast == general and seen["fast"] > 0


def test_request_without_a_row_takes_the_general_path():
    """A request whose values the per-request arrays cannot hold gets no row; its steps go
    through the general path, which fails that request alone (engine keeps serving)."""
    llm = LLM(None, inference_config=InferenceConfig(max_requests=4, max_tokens=64, num_kv_blocks=64))
    eng = llm.engine
    good = eng.add_request([5, 6, 7], SamplingParams(top_k=1, num_tokens_to_generate=5))
    bad = eng.add_request([8, 9], SamplingParams(top_k=1, num_tokens_to_generate=5))
    eng._requests[bad].seed = 2**64  # slipped past validation before admission
    outs = {o.request_id: o for o in eng.run_until_done()}
    assert outs[bad].finish_reason == "error" and "OverflowError" in outs[bad].error
    assert outs[good].finish_reason == "length" and len(outs[good].generated_tokens) == 5
    assert sorted(eng.context._decode_rows._free) == list(range(4))  # every row given back


def test_a_snapshot_field_the_decode_path_does_not_write_is_refused():
    """The decode path declares the fields it writes; a layout with one more field (which the
    general path would write) fails at construction instead of leaving that field stale."""
    import numpy as np

    from megatron_async.inference.contexts.decode_rows import DecodeRows
    from megatron_async.inference.contexts.step_snapshot import bookkeeping_fields

    for spec, mamba in ((False, False), (True, True)):
        views = {f.name: np.zeros(f.shape, dtype=np.dtype(str(f.dtype).replace("torch.", "")))
                 for f in bookkeeping_fields(16, 5, 4, 8, speculative=spec, mamba=mamba)}
        DecodeRows(4, 4, 0, views)  # every field declared
        with pytest.raises(ValueError, match=r"does not write the snapshot fields \['new_field'\]"):
            DecodeRows(4, 4, 0, {**views, "new_field": np.zeros(5, dtype=np.int64)})

