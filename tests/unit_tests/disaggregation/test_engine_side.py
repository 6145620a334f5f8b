"""Both engines' sides of the hand-off in one process, the coordinator played by the test: the
blocks travel over a real gloo pair connection (threads of this process), a decode engine with
no request place defers an import until one ends (never allocating past its pool), a cancelled
import gives its blocks back, and the tokens equal one engine's."""
from __future__ import annotations

from megatron_async import LLM, InferenceConfig
from megatron_async.inference.records import encode_sampling
from tests.helpers.handoff_links import PARAMS, PROMPTS, Link, llm, until


def _decode_until_finished(d, rid, outputs: dict) -> None:
    """Turn the decode link until request ``rid`` ends, its tokens (and any other's) in ``outputs``."""
    def done():
        res = d.turn()
        for out in (res.finished if res else []):
            outputs[d.rid_of.pop(out.request_id)] = out.generated_tokens
        return rid in outputs

    until(done, [])


def test_transfers_over_gloo_with_a_deferred_and_a_cancelled_import():
    want = [o.generated_tokens for o in llm(8).generate(PROMPTS, PARAMS)]
    p, d = Link(llm(), "prefill"), Link(llm(max_requests=1), "decode")
    sampling = encode_sampling(PARAMS)
    for rid, prompt in enumerate(PROMPTS):
        p.handoffs.prefill([rid, rid + 1, prompt, sampling, False, b"", None])
    ready = until(lambda: len(p.channel.sent) == 3 and p.channel.take("kv_ready"), [p])
    assert sorted(m[1] for m in ready) == [0, 1, 2]
    pair = ("kv-test-pair", d.handoffs.kv_address, 1, "gloo")
    outputs = {}
    for rid, blocks, version in ((m[1], m[2], m[3]) for m in ready):
        tokens = want[rid][:1]  # (the first token as the coordinator keeps it from the prefill engine's update)
        d.handoffs.handle("kv_import", [rid, rid + 1, PROMPTS[rid], sampling, False, b"", None, tokens, None, version,
                                        blocks, pair])
    d.handoffs.handle("kv_cancel", [2])  # withdrawn while it waits
    accepted = until(lambda: d.channel.take("kv_accepted"), [d])
    assert [m[1] for m in accepted] == [0] and d.handoffs.deferred_imports >= 1  # one request place
    assert [f[0] for f in d.handoffs.deferred] == [1]
    p.handoffs.handle("kv_send", [0, pair[:2] + (0, "gloo"), accepted[0][2]])
    imported = until(lambda: d.channel.take("kv_imported"), [p, d])
    assert imported == [("kv_imported", 0, -(-len(PROMPTS[0]) // 4))]
    p.handoffs.handle("kv_release", [0])

    def finished():
        res = d.turn()
        for out in (res.finished if res else []):
            outputs[d.rid_of.pop(out.request_id)] = out.generated_tokens
            for m in d.channel.take("kv_accepted") if 1 not in outputs else ():
                p.handoffs.handle("kv_send", [1, pair[:2] + (0, "gloo"), m[2]])
        if any(m[0] == "kv_imported" for m in d.channel.sent):
            p.handoffs.handle("kv_release", [1])
            d.channel.take("kv_imported")
        return len(outputs) == 2

    until(finished, [p])
    assert outputs == {0: want[0], 1: want[1]}
    assert d.engine.stats.prefill_steps == 0 and d.handoffs.kv_received_blocks > 0
    p.handoffs.handle("kv_release", [2])  # (the coordinator frees the withdrawn one's blocks)
    assert not p.handoffs.ready
    until(lambda: p.handoffs.kv_sent_blocks == d.handoffs.kv_received_blocks, [p])  # (its sends' ends, polled)
    moved = p.handoffs.counters()  # (the sends' own time and bytes: the prefill side's)
    assert moved["kv_transfers"] == 2 and moved["kv_transfer_seconds"] > 0
    assert moved["kv_transfer_bytes"] == sum(p.handoffs.layout.nbytes(-(-len(PROMPTS[i]) // 4)) for i in (0, 1))
    for link in (p, d):
        alloc = link.engine.context.allocator
        assert alloc.num_available == alloc.capacity
        link.handoffs.close()


def test_a_send_whose_end_is_seen_after_its_release_still_counts():
    """The coordinator releases the prefill engine's blocks once the decode engine imported them,
    which may come before the prefill engine's loop saw its own send end (the two ends of a
    transfer finish on two threads): the send is counted, and by its bytes, all the same."""
    p, d = Link(llm(), "prefill"), Link(llm(), "decode")
    sampling = encode_sampling(PARAMS)
    p.handoffs.prefill([0, 1, PROMPTS[1], sampling, False, b"", None])
    (_, _, blocks, version), = until(lambda: p.channel.take("kv_ready"), [p])
    pair = ("kv-test-late", d.handoffs.kv_address, 1, "gloo")
    d.handoffs.handle("kv_import", [0, 1, PROMPTS[1], sampling, False, b"", None, [1], None, version, blocks, pair])
    (_, _, hit), = until(lambda: d.channel.take("kv_accepted"), [d])
    p.handoffs.handle("kv_send", [0, pair[:2] + (0, "gloo"), hit])
    assert until(lambda: d.channel.take("kv_imported"), [d]) == [("kv_imported", 0, blocks)]  # (p's loop not polled)
    p.handoffs.handle("kv_release", [0])
    assert not p.handoffs.ready and p.handoffs.in_flight()
    until(lambda: p.handoffs.kv_sent_blocks == blocks, [p], timeout_s=20)
    assert p.handoffs.counters()["kv_transfer_bytes"] == p.handoffs.layout.nbytes(blocks) and not p.handoffs.in_flight()
    for link in (p, d):
        link.handoffs.close()


def test_a_prefix_the_decode_engine_caches_is_not_sent_again():
    head = [(3 * j) % 100 + 1 for j in range(12)]
    prompts = [head + [7, 8, 9], head + [4, 5]]  # blocks of 4: the 3 blocks of ``head`` are shared
    want = [o.generated_tokens for o in llm(8).generate(prompts, PARAMS)]
    p = Link(llm(), "prefill")
    d = Link(LLM(None, "cpu", "float32", InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=4,
                                                         max_tokens=64, enable_prefix_caching=True)), "decode")
    sampling = encode_sampling(PARAMS)
    pair = ("kv-test-prefix", d.handoffs.kv_address, 1, "gloo")
    outputs, cached = {}, []
    for rid, prompt in enumerate(prompts):
        p.handoffs.prefill([rid, rid + 1, prompt, sampling, False, b"", None])
        (_, _, blocks, version), = until(lambda: p.channel.take("kv_ready"), [p])
        d.handoffs.handle("kv_import", [rid, rid + 1, prompt, sampling, False, b"", None, want[rid][:1], None, version,
                                        blocks, pair])
        (_, _, hit), = until(lambda: d.channel.take("kv_accepted"), [d])
        cached.append(hit)
        p.handoffs.handle("kv_send", [rid, pair[:2] + (0, "gloo"), hit])
        (_, _, received), = until(lambda: d.channel.take("kv_imported"), [p, d])
        assert received == blocks - hit
        p.handoffs.handle("kv_release", [rid])
        _decode_until_finished(d, rid, outputs)
    assert cached == [0, 3] and outputs == {0: want[0], 1: want[1]}
    assert d.handoffs.counters()["kv_cached_blocks"] == 3 and d.engine.stats.prefill_steps == 0
    until(lambda: p.handoffs.kv_sent_blocks == d.handoffs.kv_received_blocks, [p])  # (its sends' ends, polled)
    for link in (p, d):
        link.handoffs.close()


def test_ipc_pairs_share_the_blocks_in_memory():
    """"ipc": the prefill engine shares its packed blocks (shared memory on the CPU), the payload
    travels the coordinator's wire, the decode engine maps and copies them."""
    from megatron_async.coordinator import messages

    want = [o.generated_tokens for o in llm(8).generate(PROMPTS[:2], PARAMS)]
    p, d = Link(llm(), "prefill", "ipc"), Link(llm(), "decode", "ipc")
    sampling = encode_sampling(PARAMS)
    pair = ("kv-test-ipc", d.handoffs.kv_address, 1, "ipc")
    outputs = {}
    for rid, prompt in enumerate(PROMPTS[:2]):
        p.handoffs.prefill([rid, rid + 1, prompt, sampling, False, b"", None])
        (_, _, blocks, version), = until(lambda: p.channel.take("kv_ready"), [p])
        d.handoffs.handle("kv_import", [rid, rid + 1, prompt, sampling, False, b"", None, want[rid][:1], None, version,
                                        blocks, pair])
        (_, _, hit), = until(lambda: d.channel.take("kv_accepted"), [d])
        p.handoffs.handle("kv_send", [rid, pair[:2] + (0, "ipc"), hit])
        (shared,) = p.channel.take("kv_shared")
        name, fields = messages.decode(messages.encode(*shared))  # (through the wire's checked reader)
        d.handoffs.handle(name, fields)  # (copied off the compute stream: lands at a poll)
        assert until(lambda: d.channel.take("kv_imported"), [d]) == [("kv_imported", rid, blocks - hit)]
        p.handoffs.handle("kv_release", [rid])
        assert not p.handoffs.shared
        _decode_until_finished(d, rid, outputs)
    assert outputs == {0: want[0], 1: want[1]} and not d.handoffs.channels and not p.handoffs.channels
    moved = d.handoffs.counters()  # (the copies out of the shared blocks: the decode side's)
    assert moved["kv_transfers"] == 2 and moved["kv_transfer_bytes"] == sum(
        d.handoffs.layout.nbytes(-(-len(PROMPTS[i]) // 4)) for i in (0, 1)) and moved["kv_transfer_seconds"] > 0
    d.handoffs.handle("kv_shared", [7, {"storages": [], "tensors": []}])  # (nothing waits for it: ignored)
    for link in (p, d):
        alloc = link.engine.context.allocator
        assert alloc.num_available == alloc.capacity


def test_a_prefill_engine_decodes_itself_when_no_decode_engine_is_left():
    want = [o.generated_tokens for o in llm(8).generate(PROMPTS[:2], PARAMS)]
    p = Link(llm(), "prefill")
    sampling = encode_sampling(PARAMS)
    outputs = {}
    for rid, prompt in enumerate(PROMPTS[:2]):
        p.handoffs.prefill([rid, rid + 1, prompt, sampling, False, b"", None])
        (_, _, blocks, version), = until(lambda: p.channel.take("kv_ready"), [p])
        p.handoffs.handle("kv_import", [rid, rid + 1, prompt, sampling, False, b"", None, want[rid][:1], None, version,
                                        blocks, ("local", "", 1, "local")])
    assert until(lambda: p.channel.take("kv_imported"), [p]) == [("kv_imported", 0, 0), ("kv_imported", 1, 0)]
    prefill_steps = p.engine.stats.prefill_steps
    for rid in (0, 1):
        p.handoffs.handle("kv_release", [rid])  # (the coordinator's answer: nothing left to free)

    def done():
        res = p.turn()
        for out in (res.finished if res else []):
            outputs[p.rid_of.pop(out.request_id)] = out.generated_tokens
        return len(outputs) == 2

    until(done, [])
    assert outputs == {0: want[0], 1: want[1]} and p.engine.stats.prefill_steps == prefill_steps
    alloc = p.engine.context.allocator
    assert alloc.num_available == alloc.capacity and not p.handoffs.hold.kept


def test_kept_blocks_never_starve_the_prompts_a_prefill_engine_computes():
    """A prefill engine whose pool is mostly kept for transfers (its decode side is slow) holds new
    prompts back until a release leaves room for each whole prompt: nothing fails, nothing spins."""
    p = Link(LLM(None, "cpu", "float32", InferenceConfig(block_size_tokens=4, num_kv_blocks=17, max_requests=4,
                                                         max_tokens=64)), "prefill")
    prompts = [[(11 * i + j) % 100 + 1 for j in range(18)] for i in range(5)]  # 5 blocks each, with the next token
    sampling = encode_sampling(PARAMS)
    for rid, prompt in enumerate(prompts):
        p.handoffs.prefill([rid, rid + 1, prompt, sampling, False, b"", None])
    ready = until(lambda: p.channel.take("kv_ready"), [p])
    for _ in range(20):  # (a while longer: no more fit beside the kept blocks)
        p.turn()
        ready += p.channel.take("kv_ready")
    assert len(ready) == 3 and len(p.handoffs.waiting) == 2 and not p.channel.sent
    local = p.handoffs.admit_waiting(3)  # an abort of a waiting prefill: queued uncapped, to end as an abort
    p.engine.abort_request(local)
    aborted = until(lambda: [o for o in (p.turn() or p.engine.step()).finished if o.request_id == local], [])
    assert aborted[0].finish_reason == "abort" and list(p.handoffs.waiting) and p.handoffs.waiting[0][0] == 4
    for _, rid, _, _ in ready:
        p.handoffs.handle("kv_release", [rid])  # (as after the decode engine's import)
    more = until(lambda: p.channel.take("kv_ready"), [p])
    assert [m[1] for m in more] == [4] and not p.handoffs.waiting
    for _, rid, _, _ in more:
        p.handoffs.handle("kv_release", [rid])
    alloc = p.engine.context.allocator
    assert alloc.num_available == alloc.capacity and not p.engine.has_unfinished_requests()
