"""engine.suspend / resume on CPU (the emulated backend frees the tensors' storages): running
requests continue token-identically (async and serial, greedy and seeded, GPT and hybrid), the
RL order resume weights -> update_weights -> resume kv_cache gives the same tokens as an update
without suspending, prefix-cache entries are never hit after the KV cache was released, and every
wrong order is refused with nothing lost."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.engines.suspend import SuspendError
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.unit_tests.inference.engine_driver import drive

# max_requests 2 keeps the third prompt waiting at first; max_tokens 8 chunks the 14-token prompt.
CFG = dict(block_size_tokens=4, num_kv_blocks=40, max_requests=2, max_tokens=8, max_sequence_length=64)
PROMPTS = [list(range(40, 54)), [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
BOTH = ("weights", "kv_cache")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_suspend")
    return {"gpt": make_tiny_checkpoint("Qwen3ForCausalLM", root / "gpt", seed=0),
            "gpt_new": make_tiny_checkpoint("Qwen3ForCausalLM", root / "gpt_new", seed=1),
            "hybrid": make_tiny_hybrid_checkpoint("NemotronHForCausalLM", root / "hybrid", seed=0)}


def _params(sampled: bool):
    if sampled:
        return [SamplingParams(temperature=0.8, top_k=20, seed=i, num_tokens_to_generate=10, ignore_eos=True)
                for i in range(3)]
    return [SamplingParams(top_k=1, num_tokens_to_generate=10, ignore_eos=True) for _ in range(3)]


def _engine(path, async_scheduling=True, **cfg):
    llm = LLM(str(path), inference_config=InferenceConfig(**{**CFG, **cfg}, async_scheduling=async_scheduling,
                                                          enable_suspend=True))
    return llm, llm.engine


def _tokens(outs):
    return [outs[rid].generated_tokens for rid in sorted(outs)]


def _run_to(eng, params, steps):
    for p, sp in zip(PROMPTS, params):
        eng.add_request(p, sp)
    outs = {}
    for _ in range(steps):
        outs.update((o.request_id, o) for o in eng.step().finished)
    eng.pause_generation("keep")
    outs.update((o.request_id, o) for o in eng.step().finished)  # the in-flight launch lands
    return outs


def _released(eng) -> bool:
    storages = [p.untyped_storage() for p in eng.runner.model.parameters()] + [t.untyped_storage() for t in eng.context.kv_caches]
    return all(s.nbytes() == 0 for s in storages)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_running_requests_continue_token_identically(checkpoints, model, async_scheduling, sampled):
    params = _params(sampled)
    _, eng = _engine(checkpoints[model], async_scheduling)
    for p, sp in zip(PROMPTS, params):
        eng.add_request(p, sp)
    reference, _ = drive(eng)
    pause_at = 5 if sampled else 2  # mid-prefill of the chunked prompt / decoding, the third one waiting
    _, eng = _engine(checkpoints[model], async_scheduling)
    outs = _run_to(eng, params, pause_at)
    running = [r for r in eng.context.active.values() if r.block_ids]
    assert running, "requests must hold KV at suspend"
    if model == "hybrid":
        assert all(r.state_slot >= 0 for r in running)
    eng.suspend(BOTH)
    assert _released(eng) and eng.memory.suspended == set(BOTH)
    assert eng.step().step_id == -1  # paused and suspended: no device work
    eng.resume(("weights",))
    eng.resume(("kv_cache",))
    eng.resume_generation()
    rest, _ = drive(eng)
    outs.update(rest)
    assert _tokens(outs) == _tokens(reference), f"suspended at step {pause_at}"


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_dropped_weights_refilled_by_update_weights(checkpoints, async_scheduling):
    """resume weights -> update_weights (new weights) -> resume kv_cache == the same update without suspending."""
    params = _params(False)
    ref_llm, ref = _engine(checkpoints["gpt"], async_scheduling)
    ref_outs = _run_to(ref, params, 3)
    ref_llm.update_weights(checkpoints["gpt_new"])
    ref.resume_generation()
    ref_outs.update(drive(ref)[0])

    llm, eng = _engine(checkpoints["gpt"], async_scheduling)
    outs = _run_to(eng, params, 3)
    eng.suspend(BOTH, keep_weights_on_host=False)
    with pytest.raises(SuspendError, match="weights are suspended"):
        llm.update_weights(checkpoints["gpt_new"])
    with pytest.raises(SuspendError, match="before"):
        eng.resume(("kv_cache",))
    with pytest.raises(SuspendError, match="dropped"):
        eng.resume(BOTH)
    eng.resume(("weights",))
    assert all(not p.any() for p in eng.runner.model.parameters())  # dropped: nothing kept
    with pytest.raises(SuspendError, match="dropped"):
        eng.resume(("kv_cache",))
    assert llm.update_weights(checkpoints["gpt_new"]) == 1
    with pytest.raises(SuspendError, match="suspended"):
        eng.resume_generation()
    eng.resume(("kv_cache",))
    eng.resume_generation()
    outs.update(drive(eng)[0])
    assert _tokens(outs) == _tokens(ref_outs)
    assert any(1 in o.weight_versions and 0 in o.weight_versions for o in outs.values())  # spans the update


def test_wrong_orders_are_refused_and_nothing_is_lost(checkpoints, tmp_path):
    params = _params(True)
    _, eng = _engine(checkpoints["gpt"])
    for p, sp in zip(PROMPTS, params):
        eng.add_request(p, sp)
    reference, _ = drive(eng)

    _, eng = _engine(checkpoints["gpt"])
    for p, sp in zip(PROMPTS, params):
        eng.add_request(p, sp)
    outs = {}
    for _ in range(3):
        outs.update((o.request_id, o) for o in eng.step().finished)
    with pytest.raises(SuspendError, match="while generating"):
        eng.suspend(BOTH)
    eng.pause_generation("keep")
    assert eng._pending is not None
    with pytest.raises(SuspendError, match="in flight"):
        eng.suspend(BOTH)
    outs.update((o.request_id, o) for o in eng.step().finished)
    with pytest.raises(ValueError, match="unknown suspend tags"):
        eng.suspend(("kv",))
    with pytest.raises(SuspendError, match="not suspended"):
        eng.resume(("weights",))
    eng.suspend(("kv_cache",))
    with pytest.raises(SuspendError, match="already suspended"):
        eng.suspend(BOTH)
    eng.suspend(("weights",))
    with pytest.raises(SuspendError, match="before"):
        eng.resume(("kv_cache",))
    with pytest.raises(SuspendError, match="suspended"):
        eng.resume_generation()
    with pytest.raises(SuspendError, match="suspended"):
        eng.pause_generation("wait")  # would run the requests
    assert eng.step().step_id == -1
    eng.resume(BOTH)
    eng.resume_generation()
    outs.update(drive(eng)[0])
    assert _tokens(outs) == _tokens(reference)


def test_prefix_cache_is_not_hit_after_the_kv_cache_was_released(checkpoints):
    _, eng = _engine(checkpoints["gpt"], enable_prefix_caching=True)
    prompt, sp = list(range(20, 37)), SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True)
    eng.add_request(prompt, sp)
    first = drive(eng)[0]
    eng.add_request(prompt, sp)
    drive(eng)
    hits = eng.stats.prefix_hit_tokens
    assert hits > 0  # the cache works before suspending
    eng.pause_generation("keep")
    eng.suspend(("kv_cache",))
    eng.resume(("kv_cache",))
    eng.resume_generation()
    eng.add_request(prompt, sp)
    again = drive(eng)[0]
    assert eng.stats.prefix_hit_tokens == hits  # zeroed blocks are never hit
    assert _tokens(again) == _tokens(first)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_an_idle_engine_suspends_without_a_pause(checkpoints, async_scheduling):
    """Idle (every request reported finished, nothing in flight): suspend needs no pause, the
    memory is released, and after resume the next requests are those of an engine never
    suspended. A request still queued or running refuses it; with one added while suspended,
    step() says to resume first and the request runs afterwards."""
    params = _params(True)
    llm, eng = _engine(checkpoints["gpt"], async_scheduling)
    reference = [o.generated_tokens for o in _engine(checkpoints["gpt"], async_scheduling)[0].generate(PROMPTS, params)]
    first = [o.generated_tokens for o in llm.generate(PROMPTS, params)]
    eng.suspend(BOTH)
    assert _released(eng) and not eng.is_paused
    eng.resume(BOTH)
    assert first == reference and [o.generated_tokens for o in llm.generate(PROMPTS, params)] == reference
    eng.add_request(PROMPTS[0], params[0])  # queued, not admitted: not idle
    with pytest.raises(SuspendError, match="while generating"):
        eng.suspend(BOTH)
    out = drive(eng)[0]
    eng.suspend(("kv_cache",))
    rid = eng.add_request(PROMPTS[0], params[0])
    with pytest.raises(SuspendError, match="resume them first"):
        eng.step()
    eng.resume(("kv_cache",))
    assert drive(eng)[0][rid].generated_tokens == reference[0] == next(iter(out.values())).generated_tokens


def test_suspend_needs_the_config_flag(checkpoints):
    llm = LLM(str(checkpoints["gpt"]), inference_config=InferenceConfig(**CFG))
    llm.engine.pause_generation("keep")
    with pytest.raises(SuspendError, match="enable_suspend"):
        llm.engine.suspend()
