"""LLM.update_weights through the engine: outputs equal a fresh load of the new weights, every
token records the weight version that produced it (launch-ahead and partial rollouts included),
and prefix-cache entries computed with old weights are never hit again."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.models.weight_update import WeightUpdateError
from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import load_hf_reference, make_tiny_checkpoint
from tests.unit_tests.inference.engine_driver import drive

CFG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=16, max_sequence_length=64)
PROMPTS = [list(range(3, 17)), [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_weight_update")
    return (make_tiny_checkpoint("Qwen3ForCausalLM", root / "old", seed=0),
            make_tiny_checkpoint("Qwen3ForCausalLM", root / "new", seed=1))


def _llm(path, async_scheduling=True, **cfg) -> LLM:
    return LLM(str(path), inference_config=InferenceConfig(**{**CFG, **cfg}, async_scheduling=async_scheduling))


def _tokens(outs):
    return [o.generated_tokens for o in outs]


@pytest.fixture(scope="module")
def references(checkpoints):
    return [_tokens(_llm(path).generate(PROMPTS, GREEDY)) for path in checkpoints]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("source", ["directory", "named_parameters"])
def test_outputs_after_update_equal_a_fresh_load(checkpoints, references, async_scheduling, source):
    old, new = checkpoints
    llm = _llm(old, async_scheduling)
    before = llm.generate(PROMPTS, GREEDY)
    assert _tokens(before) == references[0] and all(o.weight_versions == [0] * 8 for o in before)
    weights = new if source == "directory" else list(load_hf_reference(new).named_parameters())
    assert llm.update_weights(weights) == 1
    after = llm.generate(PROMPTS, GREEDY)
    assert _tokens(after) == references[1] != references[0]
    assert all(o.weight_versions == [1] * 8 for o in after)
    assert llm.update_weights(old, version=7) == 7  # back to the old weights, a version of the caller's
    again = llm.generate(PROMPTS, GREEDY)
    assert _tokens(again) == references[0] and all(o.weight_versions == [7] * 8 for o in again)


def test_refused_update_keeps_the_version(checkpoints):
    old, new = checkpoints
    llm = _llm(old)
    for bad in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="version"):
            llm.update_weights(new, version=bad)
    with pytest.raises(WeightUpdateError):
        llm.update_weights([("no.such.weight", load_hf_reference(new).lm_head.weight)])
    assert llm.engine.weight_version == 0
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _tokens(_llm(old).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("recompute_kv", [True, False], ids=["recompute", "keep_kv"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_tokens_carry_the_version_of_their_launch(checkpoints, references, async_scheduling, recompute_kv):
    """An update between steps: a launch already enqueued ran on the old weights, and its tokens
    say so. With ``recompute_kv=False`` nothing lands the launch in flight before the version
    changes: its token lands after the update and must still say 0 (stamped at launch, not at
    landing): [0, 0, 0, 0, 1, ...] in async mode, not [0, 0, 0, 1, ...]."""
    old, new = checkpoints
    llm = _llm(old, async_scheduling)
    eng = llm.engine
    rid = eng.add_request(PROMPTS[0], GREEDY)
    while len(eng._requests[rid].generated_tokens) < 3:
        eng.step()
    req = eng._requests[rid]
    in_flight = req.num_inflight  # launch-ahead: one more token already launched on the old weights
    assert in_flight == async_scheduling
    landed = len(req.generated_tokens)
    old_tokens = landed + in_flight
    llm.update_weights(new, recompute_kv=recompute_kv)
    if not recompute_kv:  # the launch is still in flight after the update: it lands with the next step
        assert eng._pending is not None if async_scheduling else eng._pending is None
        assert len(req.generated_tokens) == landed
    out = drive(eng)[0][rid]
    assert out.weight_versions == [0] * old_tokens + [1] * (8 - old_tokens)
    assert out.generated_tokens[:old_tokens] == references[0][0][:old_tokens]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_partial_rollouts_across_a_paused_update(checkpoints, references, async_scheduling):
    old, new = checkpoints
    llm = _llm(old, async_scheduling)
    eng = llm.engine
    rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    outs = {}
    for _ in range(4):
        outs.update((o.request_id, o) for o in eng.step().finished)
    eng.pause_generation("keep")
    eng.step()  # the in-flight launch lands
    assert eng._pending is None and eng.step().step_id == -1
    done = {rid: len(eng._requests[rid].generated_tokens) for rid in rids}
    assert any(0 < n < 8 for n in done.values())  # some requests span the update
    assert llm.update_weights(new) == 1
    eng.resume_generation()
    outs.update(drive(eng)[0])
    for i, rid in enumerate(rids):
        n = done[rid]
        assert outs[rid].weight_versions == [0] * n + [1] * (8 - n)
        assert outs[rid].generated_tokens[:n] == references[0][i][:n]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_prefix_cache_is_not_hit_across_an_update(checkpoints, references, async_scheduling):
    old, new = checkpoints
    llm = _llm(old, async_scheduling, enable_prefix_caching=True)
    stats = llm.engine.stats
    prompt = PROMPTS[0]  # 14 tokens: 3 full blocks of 4 can be hit
    cached = 3 * CFG["block_size_tokens"]

    def hits() -> int:
        before = stats.prefix_hit_tokens
        out = llm.generate([prompt], GREEDY)[0]
        return stats.prefix_hit_tokens - before, out

    assert hits()[0] == 0
    assert hits()[0] == cached
    llm.update_weights(new)
    hit, out = hits()
    assert hit == 0 and out.generated_tokens == references[1][0]  # recomputed with the new weights
    hit, out = hits()
    assert hit == cached and out.generated_tokens == references[1][0]


def test_requests_keeping_old_kv_stop_publishing_blocks(checkpoints):
    old, new = checkpoints
    llm = _llm(old, enable_prefix_caching=True)
    eng, allocator = llm.engine, llm.engine.context.allocator
    rid = eng.add_request(PROMPTS[0], SamplingParams(top_k=1, num_tokens_to_generate=20, ignore_eos=True))
    while len(eng._requests[rid].generated_tokens) < 2:
        eng.step()
    published = len(allocator._block_of)
    assert published >= 3
    llm.update_weights(new, recompute_kv=False)  # it keeps its old-weight KV
    out = drive(eng)[0][rid]
    assert len(out.generated_tokens) == 20  # it completed several more blocks, all holding old-weight KV
    assert len(allocator._block_of) == published
    fresh = eng.add_request(PROMPTS[0] + out.generated_tokens, GREEDY)  # after the update: publishes again
    drive(eng)
    assert len(allocator._block_of) > published and fresh >= 0


def test_hybrid_prefix_states_are_not_restored_across_an_update(tmp_path):
    old = make_tiny_hybrid_checkpoint(HYBRID_ARCHS[0], tmp_path / "old", seed=0)
    new = make_tiny_hybrid_checkpoint(HYBRID_ARCHS[0], tmp_path / "new", seed=1)
    llm = _llm(old, enable_prefix_caching=True, prefix_caching_mamba_gb=0.01)
    stats, prompt = llm.engine.stats, PROMPTS[0]

    def restores() -> tuple[int, list[int]]:
        before = stats.mamba_states_restored
        out = llm.generate([prompt], GREEDY)[0]
        return stats.mamba_states_restored - before, out.generated_tokens

    assert restores()[0] == 0 and restores()[0] == 1
    llm.update_weights(new)
    expected = _tokens(_llm(new).generate([prompt], GREEDY))[0]
    assert restores() == (0, expected)  # recomputed with the new weights
    assert restores() == (1, expected)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_requests_recompute_their_kv_with_the_new_weights(checkpoints, async_scheduling):
    """The default: tokens after an update are those of the new weights over the whole sequence so
    far (the KV is recomputed), as a fresh engine on the new checkpoint continues it; keeping the
    old KV gives other tokens."""
    old, new = checkpoints
    outs = {}
    for recompute in (True, False):
        llm = _llm(old, async_scheduling)
        eng = llm.engine
        rid = eng.add_request(PROMPTS[0], GREEDY)
        while len(eng._requests[rid].generated_tokens) < 3:
            eng.step()
        llm.update_weights(new, recompute_kv=recompute)
        assert eng.stats.recomputed_after_update == recompute
        outs[recompute] = drive(eng)[0][rid]
    out = outs[True]
    n = out.weight_versions.count(0)
    assert 3 <= n < 8
    fresh = _llm(new).generate([PROMPTS[0] + out.generated_tokens[:n]],
                               SamplingParams(top_k=1, num_tokens_to_generate=8 - n, ignore_eos=True))[0]
    assert out.generated_tokens[n:] == fresh.generated_tokens
    assert outs[False].generated_tokens[n:] != fresh.generated_tokens
