"""A KV transfer connection admits only the other engine of its pair (pair_auth.py): the proof
over queues between two threads (the key, a wrong key on either side), then a stranger at a
decode engine's rendezvous store, one that read the pair's store prefix there and joins its
group as the prefill side without the key: refused before any block moves, the decode engine
gives the import's blocks back, says kv_failed, and serves the next transfer (a new pair key)
with the tokens one engine gives."""
from __future__ import annotations

import os
import queue
import socket
import threading

import torch

from megatron_async.disaggregation.engine_side import _tag
from megatron_async.disaggregation.pair_auth import mac_key, prove, store_prefix
from megatron_async.disaggregation.transfer import PairChannel
from megatron_async.inference.communication.handshake import AuthError
from megatron_async.inference.records import encode_sampling
from tests.helpers.handoff_links import PARAMS, PROMPTS, Link, llm, until


def run_pair(key0: str, key1: str) -> list:
    """Both sides of ``prove`` on two threads, their bytes through queues: each side's outcome."""
    wires = [queue.Queue(), queue.Queue()]  # wires[r]: what rank r receives
    outcomes = [None, None]

    def side(rank: int, key: str) -> None:
        def exchange(kind, tensor):
            if kind == "send":
                wires[1 - rank].put(tensor.clone())
            else:
                tensor.copy_(wires[rank].get(timeout=10))
        try:
            prove(exchange, rank, mac_key(key), torch.device("cpu"))
            outcomes[rank] = "ok"
        except AuthError as e:
            outcomes[rank] = e

    threads = [threading.Thread(target=side, args=(r, k)) for r, k in enumerate((key0, key1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return outcomes


def test_the_proof_admits_the_key_and_refuses_a_guess_on_either_side():
    assert run_pair("kv-1-2-abc", "kv-1-2-abc") == ["ok", "ok"]
    prefill, decode = run_pair("a guess", "kv-1-2-abc")  # a stranger as the prefill side
    assert isinstance(prefill, AuthError) and isinstance(decode, AuthError)  # (told at once, not at a timeout)
    prefill, decode = run_pair("kv-1-2-abc", "a guess")  # a stranger as the store's host
    assert isinstance(prefill, AuthError) and "decode side" in str(prefill) and isinstance(decode, AuthError)
    assert "abc" not in store_prefix("kv-1-2-abc") and store_prefix("kv-1-2-abc") != store_prefix("kv-1-2-abd")


def test_a_stranger_at_the_pair_store_is_refused_and_the_engines_serve_on():
    want = [o.generated_tokens for o in llm(8).generate(PROMPTS[:2], PARAMS)]
    p, d = Link(llm(), "prefill"), Link(llm(), "decode")
    sampling = encode_sampling(PARAMS)
    host, port = d.handoffs.kv_address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:  # (bytes that are no store request: ignored)
        raw.sendall(os.urandom(512))

    def prefilled(rid: int) -> tuple[int, int]:
        p.handoffs.prefill([rid, rid + 1, PROMPTS[rid], sampling, False, b"", None])
        (_, _, blocks, version), = until(lambda: p.channel.take("kv_ready"), [p])
        return blocks, version

    blocks, version = prefilled(0)
    pair = ("kv-test-stranger", d.handoffs.kv_address, 1, "gloo")
    d.handoffs.handle("kv_import", [0, 1, PROMPTS[0], sampling, False, b"", None, want[0][:1], None, version, blocks,
                                    pair])
    until(lambda: d.channel.take("kv_accepted"), [d])
    stranger = PairChannel(pair[0], pair[1], 0, "gloo", torch.device("cpu"))  # the store prefix, not the key
    stranger._mac_key = mac_key("a guess")
    stranger.send(_tag(0), torch.zeros(d.handoffs.layout.nbytes(blocks), dtype=torch.uint8))  # forged blocks
    (failed,) = until(lambda: d.channel.take("kv_failed"), [d])
    assert failed[1] == 0 and "AuthError" in failed[2] and "pair key" in failed[2]
    (_, _, error, _), = until(lambda: stranger.take_done(), [])
    assert "AuthError" in error
    stranger.close()
    assert not d.handoffs.receiving and not d.handoffs.channels and not d.engine.has_unfinished_requests()
    alloc = d.engine.context.allocator
    assert alloc.num_available == alloc.capacity and d.handoffs.kv_received_blocks == 0
    p.handoffs.handle("kv_release", [0])  # (the coordinator ends rid 0 with "error" and frees the prefill side)

    blocks, version = prefilled(1)  # the pair's next transfer, on the new key the coordinator gives it
    pair = ("kv-test-stranger-2", d.handoffs.kv_address, 1, "gloo")
    d.handoffs.handle("kv_import", [1, 2, PROMPTS[1], sampling, False, b"", None, want[1][:1], None, version, blocks,
                                    pair])
    (_, _, hit), = until(lambda: d.channel.take("kv_accepted"), [d])
    p.handoffs.handle("kv_send", [1, pair[:2] + (0, "gloo"), hit])
    assert until(lambda: d.channel.take("kv_imported"), [p, d]) == [("kv_imported", 1, blocks)]
    p.handoffs.handle("kv_release", [1])
    outputs = {}

    def done():
        res = d.turn()
        for out in (res.finished if res else []):
            outputs[d.rid_of.pop(out.request_id)] = out.generated_tokens
        return 1 in outputs

    until(done, [p])
    assert outputs == {1: want[1]} and not d.channel.take("kv_failed")
    for link in (p, d):
        alloc = link.engine.context.allocator
        assert alloc.num_available == alloc.capacity
        link.handoffs.close()
