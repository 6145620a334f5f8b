"""The two ends of a request on its engines: the prefill engine computes the prompt and samples
the first token only, keeping the blocks past the request's end (``PrefillHold``); the decode
engine admits it directly in decoding with blocks it allocated and filled (``admit_decoding``),
so it never computes a prompt and its next token is sampled at the same (seed, position) as on
an engine that did both: the same tokens.

Requests whose sampling needs what the hand-off does not carry (prompt log-probs, top-n
log-probs, routed experts, a grammar) or that want one token are served by the prefill engine
to their end (``hands_off``)."""
from __future__ import annotations

import torch

from megatron_async.disaggregation.kv_layout import KVLayout
from megatron_async.inference.contexts.kv_block_allocator import chain_keys, known_digests
from megatron_async.inference.request import DynamicInferenceRequest, SamplingParams


def hands_off(req: DynamicInferenceRequest) -> bool:
    """Whether ``req`` (just queued on a prefill engine) goes to a decode engine after its first token."""
    sp: SamplingParams = req.sampling_params
    return (req.max_generated_tokens > 1 and not sp.return_prompt_log_probs and sp.top_n_logprobs == 0
            and not sp.return_routed_experts and req.grammar is None)


class PrefillHold:
    """A prefill engine's requests that hand off: each is capped at its first token, and when its
    blocks and slots go back (``RequestBook.on_release``) its blocks are kept, with a copy of its
    Mamba state, until ``release``."""

    def __init__(self, engine, layout: KVLayout | None = None):
        self.engine = engine
        self.layout = layout or KVLayout(engine.context)
        self.capped: dict[int, int] = {}  # engine id -> its real length limit
        self.computing: dict[int, DynamicInferenceRequest] = {}  # capped, its blocks not yet kept
        self.kept: dict[int, tuple[list[int], list | None]] = {}  # engine id -> (blocks, Mamba state)
        self.written: dict[int, torch.cuda.Event] = {}
        """CUDA: engine id -> an event of the compute stream after the launches that wrote its kept
        blocks and copied its state (recorded at its release: before the next step is scheduled, so a
        send waits for that step only, not for the steps launched since)."""
        engine.book.on_release = self._on_release

    def submit(self, add) -> int | None:
        """``add()`` queues a request on the engine (its id, or None: refused); it is capped at
        its first token when it hands off."""
        mark = self.engine.scheduler.waiting.mark
        local = add()
        if local is not None:
            req = queued(self.engine, mark, local)
            if hands_off(req):
                self.capped[local] = req.max_generated_tokens
                self.computing[local] = req
                req.max_generated_tokens = 1
        return local

    def fits(self, prompt) -> bool:
        """Whether a prompt's blocks fit beside the kept ones and those the prompts being computed
        still need (always when there are neither: the engine's own admission decides)."""
        if not self.kept and not self.computing:
            return True
        ctx = self.engine.context
        owed = sum(max(0, ctx.blocks_for(len(r.prompt_tokens) + 1) - len(r.block_ids)) for r in self.computing.values())
        return ctx.allocator.num_available - owed >= ctx.blocks_for(len(prompt) + 1)

    def _on_release(self, req: DynamicInferenceRequest) -> None:
        local = req.request_id
        self.computing.pop(local, None)
        if local in self.capped and local not in self.kept:
            self.kept[local] = (req.block_ids, self.layout.take_state(req.state_slot))
            req.block_ids = []
            if self.layout.device.type == "cuda":
                self.written[local] = torch.cuda.Event()
                self.written[local].record(torch.cuda.current_stream(self.layout.device))

    def handed(self, local: int, reason: str, num_generated: int) -> bool:
        """The request ended with ``reason``: True when it stopped at the cap (its blocks wait
        for the decode engine), False when it truly ended (its blocks are freed now)."""
        limit = self.capped.pop(local, None)
        if limit is not None and reason == "length" and num_generated == 1 and local in self.kept:
            return True
        self.release(local)
        return False

    def pack(self, local: int, cached: int = 0):
        """The request's blocks after the first ``cached`` (the decode engine holds those) and its state."""
        blocks, state = self.kept[local]
        return self.layout.pack(blocks[cached:], state)

    def take(self, local: int) -> tuple[list[int], list | None]:
        """What ``local`` kept (its blocks and state), now the caller's."""
        self.capped.pop(local, None)
        self.written.pop(local, None)
        return self.kept.pop(local)

    def num_blocks(self, local: int) -> int:
        return len(self.kept[local][0])

    def release(self, local: int) -> int:
        """Free what ``local`` kept; the number of blocks."""
        self.capped.pop(local, None)
        self.written.pop(local, None)
        kept = self.kept.pop(local, None)
        if kept is None:
            return 0
        self.engine.context.allocator.release(kept[0])
        return len(kept[0])


def room_for(engine, num_blocks: int, arriving: int = 0) -> bool:
    """Whether the decode engine can admit a request of ``num_blocks`` blocks now (a request
    place beside ``arriving`` ones whose blocks are taken, its blocks and one more for its next token)."""
    ctx = engine.context
    return len(ctx.active) + arriving < ctx.max_requests and ctx.allocator.num_available > num_blocks


def prefix_keys(engine, prompt, digests: bytes, num_blocks: int) -> list:
    """The block keys of ``prompt``'s leading complete blocks (of its ``num_blocks``) that this
    engine's prefix cache could hold (the last block is always sent: never an empty transfer);
    computed once per import (hashing a long prompt costs the loop a millisecond or more)."""
    ctx = engine.context
    alloc, bs = ctx.allocator, ctx.block_size
    if not alloc.publishes or isinstance(prompt, str):
        return []
    full = min(num_blocks - 1, len(prompt) // bs)
    known = known_digests(digests, prompt, bs, alloc.hash_key) if digests else None
    return chain_keys(None, prompt[:full * bs], bs, alloc.hash_key, None if known is None else (alloc.hash_key, known))


def cached_prefix(engine, keys: list) -> list[int]:
    """The leading blocks of ``keys`` (``prefix_keys``) that this engine's prefix cache holds now
    (their KV is not sent again); not yet taken (``allocate`` takes them)."""
    alloc = engine.context.allocator
    found = []
    for key in keys:
        block = alloc.lookup(key)
        if block is None:
            break
        found.append(block)
    return found


def allocate(engine, num_blocks: int, cached: list[int] = ()) -> list[int]:
    """``cached`` (taken: a reference each) then fresh blocks, ``num_blocks`` in all."""
    alloc = engine.context.allocator
    for block in cached:
        alloc.acquire_cached(block)
    return list(cached) + [alloc.allocate() for _ in range(num_blocks - len(cached))]


def queued(engine, mark: int, local: int) -> DynamicInferenceRequest:
    """The request ``local`` that ``engine.add_request`` queued after the waiting queue's ``mark``."""
    return next(r for r in engine.scheduler.waiting.appended_since(mark) if r.request_id == local)


def admit_decoding(engine, prompt, params: SamplingParams, digests: bytes, tokens: list[int],
                   log_probs: list[float] | None, version: int, block_ids: list[int], fill=None) -> int:
    """Admit the request on the decode engine, decoding: ``block_ids`` (allocated here) hold its
    prompt's KV, or ``fill(state_slot)`` writes what they do not hold yet (its Mamba state, or
    blocks copied now) once the request has its slot; ``tokens`` were generated by the prefill
    engine (and streamed by it). Returns its engine id. InvalidRequestError: refused (the
    caller frees the blocks)."""
    mark = engine.scheduler.waiting.mark
    local = engine.add_request(prompt, params, prompt_digests=digests)  # checked, numbered, seeded, queued
    req = queued(engine, mark, local)
    engine.scheduler.remove_waiting(req)  # admitted here instead, decoding
    req.generated_tokens.extend(tokens)
    if log_probs is not None and req.sampling_params.return_log_probs:
        req.generated_log_probs.extend(log_probs)
    req.num_streamed_tokens = len(tokens)
    req.weight_version_runs.append((0, version))
    engine.book.activate(req, block_ids)
    if fill is not None:
        fill(req.state_slot)
    return local
