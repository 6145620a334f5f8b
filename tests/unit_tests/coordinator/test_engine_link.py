"""Engines behind the coordinator's logic, in one process and without sockets: each engine's
link (dp_engine/link.py) and the coordinator's core exchange their messages through lists,
pumped in turn. Outputs equal one engine's, prefix affinity gives prefix hits, the engines'
eviction reports reach the view, control operations run on every engine, a drained engine
leaves, an engine that dies mid-generation loses no request."""
from __future__ import annotations

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.coordinator.core import CoordinatorCore
from megatron_async.dp_engine.link import EngineLink

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=6)


class Pipe:
    def __init__(self):
        self.inbox, self.sent, self.lost = [], [], False

    def poll(self, timeout_s):
        out, self.inbox = self.inbox, []
        return out

    def send(self, kind, *fields):
        self.sent.append((kind, fields))


class Hub:
    """The core's outbox, and the pump that moves messages between it and the links."""

    def __init__(self, policy="longest_prefix", **kw):
        self.core = CoordinatorCore(self, policy, **kw)
        self.pipes, self.links, self.slots, self.client = {}, {}, {}, []
        self.core.client_joined("c")

    def add_engine(self, llm, name):
        pipe = Pipe()
        link = EngineLink(llm.engine, pipe, llm.config.max_requests, name, llm.update_weights)
        slot = self.core.engine_registered(name, link.info())
        self.pipes[name], self.links[name], self.slots[name] = pipe, link, slot
        return slot

    def to_engine(self, slot, kind, *fields):
        self.pipes[slot.peer].inbox.append((kind, fields))

    def to_client(self, client, kind, *fields):
        self.client.append((kind, *fields))

    def pump(self, turns=1, skip=()):
        ended = {}
        for _ in range(turns):
            for name, link in list(self.links.items()):
                if name in skip:
                    continue
                why = link.turn(wait=False)
                sent, self.pipes[name].sent = self.pipes[name].sent, []
                for kind, fields in sent:
                    self.core.engine_message(self.slots[name], kind, fields)
                if why is not None:
                    ended[name] = why
                    del self.links[name]
        return ended

    def run(self, max_turns=400, skip=()):
        for _ in range(max_turns):
            self.pump(skip=skip)
            if not len(self.core.requests) and not self.core.controls:
                return
        raise AssertionError("requests did not end")

    def finished(self):
        return {o.request_id: o for kind, *f in self.client if kind == "finished" for o in f[0]}


def tiny(**cfg):
    base = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=8, max_tokens=64, max_sequence_length=128,
                enable_prefix_caching=True)
    base.update(cfg)
    return LLM(None, "cpu", "float32", InferenceConfig(**base), default_model="tiny")


@pytest.fixture(scope="module")
def llms():
    return [tiny() for _ in range(2)]


def prompts(n, shared=12, seed=0):
    import random

    rng = random.Random(seed)
    heads = [[rng.randrange(1, 1000) for _ in range(shared)] for _ in range(2)]
    return [heads[i % 2] + [rng.randrange(1, 1000) for _ in range(5)] for i in range(n)]


def test_outputs_equal_one_engines_and_prefixes_stay_together(llms):
    ps = prompts(8)
    ps = ps[:2] + sorted(ps[2:], key=lambda p: p[:12] != ps[0][:12])  # later turns: three of head 0, then head 1
    reference = [o.generated_tokens for o in tiny().generate(ps, GREEDY)]
    hub = Hub()
    for i, llm in enumerate(llms):
        hub.add_engine(llm, f"e{i}")
    before = [llm.engine.stats.prefix_hit_tokens for llm in llms]
    for i, p in enumerate(ps[:2]):
        hub.core.submit("c", i, p, [GREEDY], stream=False)
    hub.run()
    for i, p in enumerate(ps[2:], 2):  # later turns: their heads are cached where they went first
        hub.core.submit("c", i, p, [GREEDY], stream=i % 3 == 0)
    hub.run()
    outs = hub.finished()
    assert [outs[i].generated_tokens for i in range(8)] == reference
    assert all(slot.pending == 0 for slot in hub.slots.values())
    hits = [llm.engine.stats.prefix_hit_tokens - b for llm, b in zip(llms, before)]
    assert sum(hits) == 6 * 12 and min(hits) > 0  # each head cached on its own engine, every later request hit it
    assert any(kind == "stream" for kind, *_ in hub.client)


def test_an_engine_reads_the_digests_it_is_routed_with(monkeypatch):
    """The prompt is hashed where it arrives (the client, or the coordinator for it): the engine's
    admission checks the first digest against its own key and hashes nothing else."""
    from megatron_async.inference.contexts import kv_block_allocator as kv

    count, digest = [0], kv._digest
    monkeypatch.setattr(kv, "_digest", lambda m: (count.__setitem__(0, count[0] + 1), digest(m))[1])
    prompt = prompts(1)[0] + list(range(100, 140))  # 57 tokens: 14 blocks of 4 a hit may skip
    alone = tiny()
    count[0] = 0
    want = alone.generate([prompt], GREEDY)[0].generated_tokens
    hashed_alone = count[0]
    hub = Hub()
    hub.add_engine(tiny(), "e0")
    hub.core.submit("c", 0, prompt, [GREEDY], stream=False)  # hashed here, as a client would have
    count[0] = 0
    hub.run()
    assert hub.finished()[0].generated_tokens == want
    assert hashed_alone >= 14 and count[0] <= 2, (hashed_alone, count[0])


def test_eviction_reports_reach_the_view():
    hub = Hub()
    slot = hub.add_engine(tiny(num_kv_blocks=12, max_requests=2), "small")
    ps = prompts(6, shared=4, seed=3)
    for i, p in enumerate(ps):
        hub.core.submit("c", i, p + [7] * 12, [GREEDY], stream=False)
        hub.run()
    assert hub.core.counts["evicted_keys"] > 0
    assert hub.core.view.num_keys(slot.index) <= 11


def test_control_operations_run_on_every_engine(llms):
    hub = Hub()
    for i, llm in enumerate(llms):
        hub.add_engine(llm, f"e{i}")
    hub.core.control("c", 1, "pause_generation", {"mode": "keep"})
    hub.core.control("c", 2, "set_generation_epoch", {"epoch": 7})
    hub.core.submit("c", 10, prompts(1)[0], [GREEDY], stream=False)
    hub.pump(5)
    assert not hub.finished()  # paused: nothing runs
    hub.core.control("c", 3, "resume_generation", {})
    hub.run()
    done = [f for kind, *f in hub.client if kind == "control_done"]
    assert [(op, status) for op, status, _ in done] == [(1, 200), (2, 200), (3, 200)]
    assert hub.finished()[10].weight_versions == [7] * 6
    hub.core.control("c", 4, "set_generation_epoch", {"epoch": -1})
    hub.pump(2)
    assert [f for kind, *f in hub.client if kind == "control_done"][-1][1] == 400


def test_a_drained_engine_finishes_its_requests_then_leaves(llms):
    hub = Hub(policy="load_balanced")
    for i, llm in enumerate(llms):
        hub.add_engine(llm, f"e{i}")
    for i, p in enumerate(prompts(4, seed=5)):
        hub.core.submit("c", i, p, [GREEDY], stream=False)
    hub.core.drain("c", 9, 0)
    hub.core.submit("c", 4, prompts(1, seed=6)[0], [GREEDY], stream=False)
    ended = {}
    for _ in range(200):
        ended.update(hub.pump())
        if len(hub.finished()) == 5 and ended:
            break
    assert ended == {"e0": "left"} and len(hub.finished()) == 5
    assert hub.core.requests.get(4) is None and hub.slots["e0"].index not in hub.core.engines.slots
    assert ("control_done", 9, 200, {"index": 0, "left": True, "died": False}) in hub.client


def test_an_engine_that_dies_loses_no_request(llms):
    hub = Hub(policy="load_balanced")
    for i, llm in enumerate(llms):
        hub.add_engine(llm, f"e{i}")
    params = SamplingParams(top_k=1, num_tokens_to_generate=12)
    for i, p in enumerate(prompts(6, seed=8)):
        hub.core.submit("c", i, p, [params], stream=False)
    hub.pump(3)  # e0 has produced tokens for some of its requests
    dead = hub.slots["e0"]
    started = {r.client_rid for r in hub.core.requests.on_engine(dead) if r.tokens}
    assert started
    hub.core.engine_lost(dead)
    hub.links.pop("e0")
    hub.run()
    outs = hub.finished()
    assert sorted(outs) == list(range(6))
    assert {i for i, o in outs.items() if o.finish_reason == "error"} == started
    assert all(len(outs[i].generated_tokens) == 12 for i in outs if i not in started)
    assert all(0 < len(outs[i].generated_tokens) < 12 and "died" in outs[i].error for i in started)
    assert hub.core.counts["rerouted"] == 3 - len(started)
    for rid in list(llms[0].engine._requests):
        llms[0].engine.abort_request(rid)
    llms[0].engine.run_until_done()


def test_hybrid_engines_route_on_the_same_keys(tmp_path):
    """Mamba states are cached at block boundaries: affinity on the same keys gives a hybrid
    engine its hits, with one engine's tokens."""
    from tests.helpers.engine_harness import make_llm
    from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint

    path = make_tiny_hybrid_checkpoint(HYBRID_ARCHS[0], tmp_path / "hybrid")

    def hybrid():
        return make_llm(path, enable_prefix_caching=True, prefix_caching_mamba_gb=1e-3, max_requests=4)

    first = [[t % 127 + 1 for t in p] for p in prompts(2, seed=9)]  # (its vocabulary: 128)
    ps = first + [first[i // 2] + [5 + i, 6, 7, 8, 9, 10] for i in range(4)]  # later turns extend the first ones
    one = hybrid()
    reference = [o.generated_tokens for o in one.generate(ps[:2], GREEDY) + one.generate(ps[2:], GREEDY)]
    hub = Hub()
    engines = [hybrid() for _ in range(2)]
    for i, llm in enumerate(engines):
        hub.add_engine(llm, f"h{i}")
    for i, p in enumerate(ps[:2]):
        hub.core.submit("c", i, p, [GREEDY], stream=False)
    hub.run()
    for i, p in enumerate(ps[2:], 2):
        hub.core.submit("c", i, p, [GREEDY], stream=False)
    hub.run()
    outs = hub.finished()
    assert [outs[i].generated_tokens for i in range(6)] == reference
    stats = [llm.engine.stats for llm in engines]
    assert all(st.prefix_hit_tokens > 0 and st.mamba_states_restored > 0 for st in stats), [
        (s.prefix_hit_tokens, s.mamba_states_stored, s.mamba_states_restored) for s in stats]
    assert sum(st.prefix_hit_tokens for st in stats) == one.engine.stats.prefix_hit_tokens == 4 * 16


def test_a_route_with_bad_sampling_parameters_is_refused_alone():
    """A route's sampling map is read field by field by the engine's admission (not walked by the
    wire's reader as well): bad values end that request with "rejected", the others are served."""
    from benchmarks.null_engine import NullEngine
    from megatron_async.coordinator import messages

    pipe = Pipe()
    link = EngineLink(NullEngine(), pipe, 8)
    maps = [{"top_k": "5"}, {"nonsense": 1}, {"stop_words": [[1, "x"]]}, {"logit_bias": [b"\0" * 8, b""]},
            {"top_k": 2, "seed": 3}]
    for rid, sampling in enumerate(maps):
        frame = messages.encode("route", rid, rid + 1, [1, 2, 3], sampling, False, b"")
        pipe.inbox.append(messages.decode(frame))  # as the engine's channel reads it
    link.turn(wait=False)
    (kind, fields), = pipe.sent
    kind, fields = messages.decode(messages.encode(kind, *fields))  # as the coordinator reads it
    assert kind == "outputs"
    rejected, finished = dict(fields[3]), [o.request_id for o in fields[2]]
    assert sorted(rejected) == [0, 1, 2, 3] and all(m.startswith("bad sampling parameters") for m in rejected.values())
    assert finished == [4]
