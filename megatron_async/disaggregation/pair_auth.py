"""Who may be the other end of a KV transfer connection: the two engines of a pair prove the pair
key to each other before any block moves, as peers of the coordinator's wire prove its secret
(inference/communication/handshake.py: mutual HMAC challenge-response, fresh nonces both ways).

The pair key comes only over the coordinator's authenticated wire. torch.distributed's store and
groups carry no authentication: anyone who reaches the decode engine's store can read its keys
and take a rank of a group it meets there. So the key itself never goes there: the store sees
``store_prefix(key)`` (a one-way digest: it names the rendezvous, it proves nothing), and the
group's first exchange (``prove``) is over ``mac_key(key)``:

    prefill (rank 0) -> decode (rank 1): N0                                  (32 random bytes)
    decode  -> prefill: N1 | HMAC(K, "decode" | N0 | N1)                     (the store's host proves first)
    prefill -> decode : HMAC(K, "prefill" | N0 | N1)   (zeros when the decode side's MAC was wrong)

Either side that reads a wrong MAC raises ``AuthError``: its connection is refused (every
transfer queued on it fails; the coordinator ends those requests and gives the pair a new key),
the engine serves on. Messages are fixed-size byte tensors: a stranger makes nobody allocate."""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Callable

import torch

from megatron_async.inference.communication.handshake import AuthError

NONCE_BYTES = MAC_BYTES = 32


def store_prefix(key: str) -> str:
    """The pair's rendezvous prefix in the store (what a stranger may read there)."""
    return "kv/" + hashlib.sha256(b"megatron_async/kv-store/v1\0" + key.encode()).hexdigest()[:32] + "/"


def mac_key(key: str) -> bytes:
    """The key of the pair's proofs (never in the store)."""
    return hmac.digest(key.encode(), b"megatron_async/kv-pair/v1\0", "sha256")


def _mac(k: bytes, side: bytes, n0: bytes, n1: bytes) -> bytes:
    return hmac.digest(k, side + b"\0" + n0 + n1, "sha256")


def prove(exchange: Callable[[str, torch.Tensor], None], rank: int, k: bytes, device: torch.device) -> None:
    """The mutual proof over a fresh group; ``exchange(kind, tensor)`` sends ("send") or
    receives into ("recv") a uint8 tensor on ``device``. AuthError: the peer does not hold the key."""
    def put(data: bytes) -> None:
        exchange("send", torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device))

    def get(n: int) -> bytes:
        buf = torch.zeros(n, dtype=torch.uint8, device=device)
        exchange("recv", buf)
        return bytes(buf.cpu().tolist())

    if rank == 0:
        n0 = secrets.token_bytes(NONCE_BYTES)
        put(n0)
        answer = get(NONCE_BYTES + MAC_BYTES)
        n1, theirs = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(theirs, _mac(k, b"decode", n0, n1)):
            put(bytes(MAC_BYTES))  # (the peer's read ends now, refused, instead of at its timeout)
            raise AuthError("the decode side of this KV transfer connection does not hold the pair key")
        put(_mac(k, b"prefill", n0, n1))
        return
    n0 = get(NONCE_BYTES)
    n1 = secrets.token_bytes(NONCE_BYTES)
    put(n1 + _mac(k, b"decode", n0, n1))
    if not hmac.compare_digest(get(MAC_BYTES), _mac(k, b"prefill", n0, n1)):
        raise AuthError("the prefill side of this KV transfer connection does not hold the pair key")
