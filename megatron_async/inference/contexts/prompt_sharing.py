"""Requests with the same prompt prefill it once.

The n samples of one prompt (``n`` in the server, a GRPO group) arrive together. Admitted
together, each would prefill the whole prompt. Instead the first one admitted becomes the
prompt's owner; a waiting request whose shareable prefix (the complete blocks a prefix hit may
skip: ``PrefixBlocks.match``) the owner is still computing waits at admission
until the owner's step that completes them is launched, then takes them as a prefix hit and
prefills only its last partial block (the tokens after the last complete block) itself.

A prompt is identified by the digest of its last shareable block (``prefix_digests``: it chains
every block before it, and names the model and the weights version), so two prompts share an
owner exactly when they would share all those blocks. Whether a request waits depends only on
the scheduler's state when it plans a step, which is the same in serial and launch-ahead modes
(blocks are published when their step is launched), so both build the same schedules."""
from __future__ import annotations

from megatron_async.inference.contexts.kv_block_allocator import KVBlockAllocator, adopted_digest, prefix_digests
from megatron_async.inference.request import DynamicInferenceRequest


class PromptSharing:
    def __init__(self, allocator: KVBlockAllocator, block_size: int, enabled: bool):
        """``enabled``: the allocator publishes blocks and a hit can be taken (a hybrid model needs
        its cached Mamba states, i.e. prefix caching with a state pool)."""
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self._owners: dict[bytes, tuple[DynamicInferenceRequest, int]] = {}
        """Digest of a prompt's last shareable block -> (the request computing it, blocks to share)."""
        self.waits_started = 0
        """Requests that waited at admission for an identical prompt's prefill."""
        self.shared_tokens = 0
        """Prompt tokens those requests took from their owner instead of prefilling them."""

    def shareable_blocks(self, req: DynamicInferenceRequest) -> int:
        """Complete prompt blocks a fresh request may take from another (never its last token)."""
        if req.generated_tokens:  # a recompute after eviction: never waits, never owns
            return 0
        return min(len(req.prompt_tokens) - 1, req.max_prefix_hit) // self.block_size

    def _key(self, req: DynamicInferenceRequest) -> bytes | None:
        n = self.shareable_blocks(req)
        if n <= 0:
            return None
        cached = req.share_key
        hash_key = self.allocator.hash_key
        if cached is None or cached[0] is not hash_key:
            digest = adopted_digest(req.prompt_digests, hash_key, n - 1)  # hashed where it arrived (routing)
            if digest is None:  # hashed once: the prefix match and the published blocks read them
                digests = prefix_digests(req.prompt_tokens, self.block_size, hash_key, n)
                req.prompt_digests, digest = (hash_key, digests), digests[-1]
            cached = req.share_key = (hash_key, digest)
        return cached[1]

    def waits(self, req: DynamicInferenceRequest) -> bool:
        """``req`` (waiting) should not be admitted yet: another request is computing the blocks
        it would share."""
        if not self.enabled:
            return False
        key = self._key(req)
        entry = self._owners.get(key) if key is not None else None
        if entry is None:
            return False
        owner, blocks = entry
        if owner.num_hashed_blocks >= blocks:  # published: the hit is there to take
            del self._owners[key]
            return False
        if not req.waited_for_prompt:
            req.waited_for_prompt = True
            self.waits_started += 1
        return True

    def admitted(self, req: DynamicInferenceRequest, hit_tokens: int) -> None:
        """``req`` took its slots with ``hit_tokens`` prefix tokens: it owns its prompt when it
        will compute blocks others could share."""
        if not self.enabled:
            return
        if req.waited_for_prompt:
            self.shared_tokens += hit_tokens
            req.waited_for_prompt = False
        blocks = self.shareable_blocks(req)
        if hit_tokens < blocks * self.block_size:
            key = self._key(req)
            if key not in self._owners:
                self._owners[key] = (req, blocks)

    def released(self, req: DynamicInferenceRequest) -> None:
        """``req`` gave its blocks back (finished or evicted): it owns nothing any more."""
        if req.share_key is not None:
            entry = self._owners.get(req.share_key[1])
            if entry is not None and entry[0] is req:
                del self._owners[req.share_key[1]]
