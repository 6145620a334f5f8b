"""Prefix blocks of the paged KV cache: which cached blocks an admitted request's leading tokens
match (their prefill is skipped; a hybrid model only as deep as a cached Mamba state exists),
each block's identity (a hash chained under the cache's key, or the digest a router computed for
it), and publishing a request's complete blocks once their KV is enqueued. A request served by a
LoRA adapter chains its blocks under the cache's key joined with the adapter's
(contexts/lora_rows.py) and publishes none once the adapter's weights changed. The allocator
holds the blocks and their table; the context owns this room and asks it at admission and
bookkeeping."""
from __future__ import annotations

from megatron_async.inference.contexts.kv_block_allocator import (
    BlockKey, KVBlockAllocator, adopted_digest, chain_hash, chain_keys, known_digests,
)
from megatron_async.inference.contexts.lora_rows import adapter_current, request_hash_key
from megatron_async.inference.contexts.mamba_states import MambaStateManager
from megatron_async.inference.request import DynamicInferenceRequest


class PrefixBlocks:
    def __init__(self, allocator: KVBlockAllocator, block_size: int, mamba: MambaStateManager | None, lora=None):
        """``lora``: the model's ``models.lora.LoRAAdapters`` (None: it serves none)."""
        self.allocator, self.block_size, self.mamba, self.lora = allocator, block_size, mamba, lora

    def match(self, req: DynamicInferenceRequest) -> int:
        """Acquire the cached blocks that match ``req``'s leading known tokens (at admission); the
        prefix tokens they hold."""
        req.num_hashed_blocks, req.last_block_hash = 0, None
        if not self.allocator.publishes:
            return 0
        bs = self.block_size
        # Leave at least one known token to compute: its logits give the next token.
        limit = min(req.num_known_tokens - 1, req.max_prefix_hit) // bs
        hashes, blocks, parent = [], [], None
        for i in range(limit):
            h = self._block_hash(req, i, parent)
            block = self.allocator.lookup(h)
            if block is None:
                break
            hashes.append(h)
            blocks.append(block)
            parent = h
        kv_depth = depth = len(blocks)
        if not self.allocator.enable_prefix_caching and depth < limit:
            return 0  # without prefix caching only a whole prompt's blocks are shared (prompt_sharing.py)
        if self.mamba is not None:  # a hybrid skips only as deep as a cached state exists
            depth = self.mamba.matched_depth(hashes)
        for block in blocks[:depth]:
            self.allocator.acquire_cached(block)
            req.block_ids.append(block)
        if depth:
            req.num_hashed_blocks, req.last_block_hash = depth, hashes[depth - 1]
            if self.mamba is not None:
                self.mamba.restore_prefix_state(req, hashes[depth - 1])
        if self.mamba is not None:
            req.mamba_store_points = self.mamba.store_points(req, kv_depth, depth * bs)
        return depth * bs

    def adopt_digests(self, req: DynamicInferenceRequest, packed: bytes) -> None:
        """``packed``: ``req``'s prompt block digests as the rank that took it computed them (to
        route it; empty: none): read instead of hashing those blocks again, while they are this
        cache's key's."""
        if not packed:
            return
        key = self.allocator.hash_key
        digests = known_digests(packed, req.prompt_tokens, self.block_size, key)
        if digests is not None:
            req.prompt_digests = (key, digests)

    def _block_hash(self, req: DynamicInferenceRequest, i: int, parent: BlockKey | None) -> BlockKey:
        bs = self.block_size
        key = request_hash_key(self.allocator.hash_key, req)
        digest = adopted_digest(req.prompt_digests, key, i)
        return chain_hash(parent, req.tokens_between(i * bs, (i + 1) * bs), key, digest)

    def publish(self, req: DynamicInferenceRequest, weights_epoch: int) -> None:
        """Publish blocks whose tokens are all known and whose KV is enqueued (computed with
        the current weights, ``weights_epoch``, and the current adapter weights, from the request's
        admission on)."""
        if not self.allocator.publishes or req.weights_epoch != weights_epoch or not adapter_current(req, self.lora):
            return
        bs = self.block_size
        known = req.num_known_tokens if self.allocator.enable_prefix_caching else len(req.prompt_tokens)
        full, first = min(req.num_computed_tokens, known) // bs, req.num_hashed_blocks
        if full <= first:
            return
        keys = chain_keys(req.last_block_hash, req.tokens_between(first * bs, full * bs), bs,
                          request_hash_key(self.allocator.hash_key, req), req.prompt_digests, first)
        self.allocator.register_run(req.block_ids[first:full], keys)
        if self.mamba is not None:
            for i, h in enumerate(keys, first):
                self.mamba.on_block_registered(req, i, h)
        req.num_hashed_blocks, req.last_block_hash = full, keys[-1]
