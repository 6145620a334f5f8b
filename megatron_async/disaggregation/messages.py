"""The hand-off's messages on the coordinator's wire (control plane values 68-79): their fields,
checked readers and writers. ``coordinator/messages.py`` registers them with the others
(``SPECS``); nothing here imports torch.

A pair spec names the transfer connection of one (prefill, decode) pair: [pair key (the store
prefix, random per pair: only the coordinator and the two engines know it), store address
"host:port" (the decode engine's), this engine's rank in the pair (0 prefill, 1 decode), backend].

- coordinator -> prefill engine: prefill [the fields of ``route``]: compute the prompt and the
  first token, keep the blocks; kv_send [rid, pair spec, cached]: the decode engine is ready, send
  the blocks after the first ``cached``;
  kv_release [rid]: the decode engine holds them (or is gone): free them.
- prefill engine -> coordinator: kv_ready [rid, blocks, weight version]: the first token was
  sampled (it rode the step's outputs) and the blocks wait.
- coordinator -> decode engine: kv_import [rid, submission number, prompt, sampling map, stream,
  digests, direct reply | nil, generated tokens ints, log-probs floats | nil, weight version,
  blocks, pair spec]; kv_cancel [rid]: drop a pending import.
- decode engine -> coordinator: kv_accepted [rid, cached: the leading blocks its own prefix cache
  holds, not sent] (blocks allocated, the receive posted);
  kv_imported [rid, blocks received] (admitted, decoding); kv_failed [rid, message] (either side: the
  transfer broke).
- "ipc" pairs, prefill engine -> coordinator -> decode engine: kv_shared [rid, payload map]: the
  packed blocks in memory the decode engine maps (weight_transfer/ipc.py's payload of one tensor:
  CUDA IPC, or shared memory on the CPU), instead of a send on a pair connection."""
from __future__ import annotations

from megatron_async.inference.communication import wire_fields as f

BACKENDS = ("gloo", "nccl", "ipc", "local")
"""How a pair's blocks move; "local": no decode engine is left, the prefill engine decodes the
request itself with the blocks it kept."""
MAX_KEY_LEN = 128
MAX_PAYLOAD_DEPTH = 6
"""Nesting of an ipc transfer's payload (weight_transfer/ipc.py's: storages and tensors)."""


def _pair(v) -> tuple[str, str, int, str]:
    key, address, rank, backend = f.arity(v, 4, "pair")
    backend = f.str_(backend, "backend", 8)
    if backend not in BACKENDS:
        raise f.bad("backend")
    return f.str_(key, "pair key", MAX_KEY_LEN), f.str_(address, "store address", 256), f.int_(rank, "rank", 0, 1), backend


def _pair_out(pair) -> list:
    return list(pair)


def _rid(v) -> int:
    return f.int_(v, "id")


def _read_import(v: list) -> list:
    rid, seq, prompt, sampling, stream, digests, reply, tokens, lps, version, blocks, pair = v
    if reply is not None:
        endpoint, client_rid = f.arity(reply, 2, "reply")
        reply = (f.str_(endpoint, "endpoint", 256), _rid(client_rid))
    if type(digests) is not bytes:
        raise f.bad("digests")
    return [_rid(rid), _rid(seq), prompt if type(prompt) is str else f.ints(prompt, "prompt"),
            f.dict_(sampling, "sampling_params"), f.bool_(stream, "stream"), digests, reply,
            f.ints(tokens, "tokens"), None if lps is None else f.floats(lps, "log_probs"), f.int_(version, "version"),
            f.int_(blocks, "blocks", 0), _pair(pair)]


def _write_import(rid, seq, prompt, sampling, stream, digests, reply, tokens, lps, version, blocks, pair) -> list:
    prompt = prompt if type(prompt) in (str, bytes) else f.pack_ints(prompt)
    return [rid, seq, prompt, sampling, stream, digests, None if reply is None else list(reply), f.pack_ints(tokens),
            None if lps is None else f.pack_floats(lps), version, blocks, _pair_out(pair)]


SPECS = (  # (name, value, arity, reader, writer); "prefill" reuses route's reader and writer (None here)
    ("prefill", 68, 7, None, None),
    ("kv_ready", 69, 3, lambda v: [_rid(v[0]), f.int_(v[1], "blocks", 0), f.int_(v[2], "version")], None),
    ("kv_import", 70, 12, _read_import, _write_import),
    ("kv_accepted", 71, 2, lambda v: [_rid(v[0]), f.int_(v[1], "cached", 0)], None),
    ("kv_send", 72, 3, lambda v: [_rid(v[0]), _pair(v[1]), f.int_(v[2], "cached", 0)],
     lambda rid, pair, cached: [rid, _pair_out(pair), cached]),
    ("kv_imported", 73, 2, lambda v: [_rid(v[0]), f.int_(v[1], "blocks", 0)], None),
    ("kv_release", 74, 1, lambda v: [_rid(v[0])], None),
    ("kv_cancel", 75, 1, lambda v: [_rid(v[0])], None),
    ("kv_failed", 76, 2, lambda v: [_rid(v[0]), f.str_(v[1], "message")], None),
    ("kv_shared", 77, 2, lambda v: [_rid(v[0]), f.plain(f.dict_(v[1], "shared"), "shared", MAX_PAYLOAD_DEPTH)], None),
)
ENGINE_SENDS = frozenset({"kv_ready", "kv_accepted", "kv_imported", "kv_failed", "kv_shared"})
COORDINATOR_SENDS = frozenset({"prefill", "kv_import", "kv_send", "kv_release", "kv_cancel", "kv_shared"})
