"""How the host waits for a launch's samples (``ModelRunner.host_wait``): by default it blocks
(sleeps) only on launches made ahead, where another launch is queued behind the one waited for,
and spins on the rest; "spin" / "block" force one way. The events' flag is what decides."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams


def _launch_flags(llm, monkeypatch) -> list[tuple[bool, bool]]:
    """(overlapped, blocking event) per launch of one generate call."""
    runner, seen, launches = llm.runner, [], []
    original_launch, original_event = runner.launch, runner.device.event

    def launch(step, step_id, overlapped, timed):
        launches.append(overlapped)
        return original_launch(step, step_id, overlapped, timed)

    def event(blocking=False):
        seen.append(blocking)
        return original_event(blocking)

    monkeypatch.setattr(runner, "launch", launch)
    monkeypatch.setattr(runner.device, "event", event)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True))
    assert len(seen) == len(launches)
    return list(zip(launches, seen))


@pytest.mark.parametrize("mode", [None, "spin", "block"])
def test_blocking_events_on_launches_made_ahead_only_by_default(mode, monkeypatch):
    llm = LLM(inference_config=InferenceConfig(max_requests=4, num_kv_blocks=32))  # not the 1 GB CPU default
    llm.runner.host_wait = mode
    flags = _launch_flags(llm, monkeypatch)
    assert any(o for o, _ in flags) and any(not o for o, _ in flags)  # launch-ahead happened, and first launches
    for overlapped, blocking in flags:
        assert blocking == {None: overlapped, "spin": False, "block": True}[mode]


def test_serial_engines_spin():
    llm = LLM(inference_config=InferenceConfig(max_requests=4, async_scheduling=False, num_kv_blocks=32))
    seen = []
    original = llm.runner.device.event
    llm.runner.device.event = lambda blocking=False: seen.append(blocking) or original(blocking)
    llm.generate([[1, 2, 3]], SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True))
    assert seen and not any(seen)
