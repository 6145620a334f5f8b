"""The transfer group's waits run off the engine's step loop, bounded: a set-up nobody joins (a
loopback port nobody serves) and an update whose senders never begin (a trainer that joined the
group and sends nothing) each fail after their timeout with an error naming the address, the port
and the timeout, while the engine keeps stepping; a second operation meanwhile is refused naming
the one in progress; nothing of a failed group is kept, and a new set-up works."""
import threading

import pytest

from megatron_async.weight_transfer import TransferFailed, build_manifest, init_transfer_group
from megatron_async.weight_transfer.group import free_port
from tests.helpers.refit_engine import GREEDY, PROMPTS, engine, trainer_items


def _step_until_done(llm, pending) -> int:
    """Step the engine (a request always running) until ``pending``'s wait ends; the steps that
    produced tokens meanwhile."""
    eng, steps = llm.engine, 0
    while not pending.done():
        if not eng.has_unfinished_requests():
            eng.add_request(PROMPTS[0], GREEDY)
        res = eng.step()
        steps += bool(res.updates)
    return steps


def test_a_set_up_nobody_joins_fails_after_its_timeout_while_the_engine_steps():
    llm = engine()
    weights, port = llm.engine.weights, free_port()
    where = f"127.0.0.1:{port}"
    pending = weights.start_init("127.0.0.1", port, 1, 2, timeout_s=1.0)
    with pytest.raises(TransferFailed, match=f"a transfer group set-up to {where} is in progress"):
        weights.start_init("127.0.0.1", port, 1, 2, timeout_s=1.0)
    with pytest.raises(TransferFailed, match=f"a transfer group set-up to {where} is in progress"):
        llm.engine.update_weights_from_distributed("{}")
    with pytest.raises(TransferFailed, match="in progress"):
        llm.engine.destroy_weight_transfer()
    assert _step_until_done(llm, pending) > 0
    with pytest.raises(TransferFailed, match=rf"at {where} was not set up .*timeout 1 s"):
        pending.finish()
    assert weights.group is None and weights.pending is None
    with pytest.raises(TransferFailed, match=rf"at {where} was not set up .*timeout 1 s"):  # the blocking call too
        llm.engine.init_weight_transfer("127.0.0.1", port, 1, 2, timeout_s=1.0)
    assert weights.group is None and weights.pending is None


def test_the_default_timeout_is_the_config_field_and_bad_timeouts_are_refused():
    llm = engine()
    assert llm.engine.weights.timeout_s == llm.config.weight_transfer_timeout_s == 30.0
    for bad in (0, -1.0, float("inf"), True, "5"):
        with pytest.raises(ValueError, match="timeout_s"):
            llm.engine.init_weight_transfer("127.0.0.1", 29500, 1, 2, timeout_s=bad)


def test_an_update_whose_senders_never_begin_fails_after_the_groups_timeout_while_the_engine_steps():
    llm = engine()
    m = llm.model
    manifest = build_manifest(trainer_items(m.hf_shapes(), 3, 2, m.megatron_dims(), m.spec.name), 64 << 10)
    port = free_port()
    where = f"127.0.0.1:{port}"
    trainer, joined = [], threading.Event()

    def trainer_joins_and_sends_nothing():
        trainer.append(init_transfer_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60))
        joined.set()

    thread = threading.Thread(target=trainer_joins_and_sends_nothing)
    thread.start()
    try:
        assert llm.engine.init_weight_transfer("127.0.0.1", port, 1, 2, timeout_s=1.5) == 1
        assert joined.wait(60)
        weights = llm.engine.weights
        version = llm.engine.weight_version
        pending = weights.start_distributed(manifest.to_json())
        with pytest.raises(TransferFailed, match=f"a weight update from the transfer group at {where} is in progress"):
            weights.start_distributed(manifest.to_json())
        assert _step_until_done(llm, pending) > 0
        with pytest.raises(TransferFailed, match=rf"at {where} within its timeout of 1.5 s .*group is closed"):
            pending.finish()
        assert weights.group is None and weights.pending is None and llm.engine.weight_version == version
        assert not llm.engine.memory.weights_missing  # nothing was copied: the weights are whole
        assert llm.generate(PROMPTS, GREEDY)[0].generated_tokens
    finally:
        thread.join(60)
        for group in trainer:
            group.close()
