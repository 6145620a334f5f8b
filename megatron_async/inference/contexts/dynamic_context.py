"""DynamicInferenceContext: the CPU-owned truth of every active request and of the step.

Request state lives in ``DynamicInferenceRequest`` objects, the step's per-token and
per-row tables in one host byte buffer (a ring of two, so launch-ahead can fill step
N+1's while step N's copy may still be pending); the device sees them only through
``ContextGPUView``, refreshed by one copy per step. The snapshot's tables are declared in
step_snapshot.py; which cached blocks a request's prefix matches and which of its blocks are
published is prefix_blocks.py's."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_async.config import CacheSizing
from megatron_async.forward_batch import AttentionMetadata, ForwardBatch, MambaMetadata
from megatron_async.inference.contexts import lazy_zeros
from megatron_async.inference.contexts.bookkeeping_layout import BookkeepingLayout
from megatron_async.inference.contexts.decode_rows import DecodeRows
from megatron_async.inference.contexts.general_rows import assemble_rows
from megatron_async.inference.contexts.gpu_view import ContextGPUView
from megatron_async.inference.contexts.graph_padding import PaddingSlots, fill_padding, fill_verify_padding
from megatron_async.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron_async.inference.contexts.lora_rows import bind_adapter, skips_free_steps
from megatron_async.inference.contexts.mamba_states import MambaStateManager, window_rows
from megatron_async.inference.contexts.prefix_blocks import PrefixBlocks
from megatron_async.inference.contexts.prompt_sharing import PromptSharing
from megatron_async.inference.contexts.sampling_state import SamplingStateSlots
from megatron_async.inference.contexts.spec_state import SpecState
from megatron_async.inference.contexts.step_snapshot import bookkeeping_fields
from megatron_async.inference.contexts.step_errors import RequestStepError
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.request import DynamicInferenceRequest, Status
from megatron_async.kernels import lora_ops
from megatron_async.kernels.kv_cache_fp8 import pool_dtype
from megatron_async.kernels.lora_groups import GROUPED_MIN_ROWS, group_lora_rows
from megatron_async.step_shape import StepShape

if TYPE_CHECKING:  # type-only: engines and models import contexts, not the reverse
    from megatron_async.inference.step_plan import StepPlan
    from megatron_async.models.base import CausalLM


class DynamicInferenceContext:
    def __init__(self, config: CacheSizing, model: CausalLM, device: DeviceFacade, dtype: torch.dtype,
                 batch_invariant: bool = False, long_tile_min_query: int = 0):
        """``batch_invariant``: every forward batch asks for batch-invariant kernels.
        ``long_tile_min_query``: a step whose longest row has this many query tokens runs the prefill
        attention's long-row launch (``StepShape.long_tiles``); 0: never."""
        self.batch_invariant = batch_invariant
        self.long_tile_min_query = long_tile_min_query
        self.long_tile_steps = 0
        """Assembled steps that chose the long-row prefill launch."""
        # the sizes the tables hold (read by the book, the runner and warm-up)
        self.max_requests = config.max_requests
        self.max_tokens = config.max_tokens
        self.max_sequence_length = config.max_sequence_length
        self.num_speculative_tokens = config.num_speculative_tokens
        self.device = device
        self.block_size = config.block_size_tokens
        self.max_blocks_per_request = -(-config.max_sequence_length // self.block_size)
        spec = model.kv_cache_spec()
        kv_dtype = pool_dtype(config.kv_cache_dtype, dtype)
        elt = torch.empty((), dtype=kv_dtype).element_size()
        bytes_per_block = 2 * self.block_size * spec.num_kv_heads * spec.head_dim * elt * spec.num_layers
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif bytes_per_block == 0:  # no attention layers: blocks are bookkeeping only (prefix hashes)
            num_blocks = config.max_requests * self.max_blocks_per_request + 1
        else:
            num_blocks = max(2, int(config.kv_budget_gb * 1e9 // bytes_per_block) + 1)
        with device.memory_region("kv_cache"):  # engine.suspend frees it
            shape = (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            suspendable = device.suspend_backend is not None
            self.kv_caches = [lazy_zeros.zeros(shape, kv_dtype, device.device, suspendable)
                              for _ in range(spec.num_layers)]
        # One model per engine; the key keeps identities apart should pools ever be shared.
        self._model_key = type(model).__name__.encode()
        self.lora = model.lora_adapters
        self.lora_skips = skips_free_steps(self.lora)
        """A step whose shape has no adapter row (``StepShape.any_lora``) runs without the LoRA ops."""
        with device.memory_region("kv_cache"):  # live states, prefix-state pool, window scratch
            self.mamba = MambaStateManager.create(model, config, device, dtype)
        share = config.share_prompt_prefill and (self.mamba is None or self.mamba.prefix_cache is not None)
        self.allocator = KVBlockAllocator(num_blocks, config.enable_prefix_caching, self._model_key, share_live=share)
        self.sharing = PromptSharing(self.allocator, self.block_size, share)
        self.prefix = PrefixBlocks(self.allocator, self.block_size, self.mamba, self.lora)
        self.weights_epoch = 0
        """Weight updates so far: part of every block identity (``weights_changed``)."""
        if self.mamba is not None:
            self.allocator.on_reclaim = lambda block, block_hash: self.mamba.on_kv_block_reclaimed(block_hash)
        self.sampling_state = SamplingStateSlots(config.max_requests, model.vocab_size, device)
        K = config.num_speculative_tokens
        self.spec = SpecState(config.max_requests, K, device) if K > 0 else None

        # One row more than max_requests: a mixed-step CUDA graph pads with at least one spare
        # row, which holds the padding tokens (see pad_for_graph). Graph steps sample one
        # position per row (steps with drafts run eager), so the spare row needs a sample too.
        self.max_rows = config.max_requests + 1
        self.max_samples = max(config.max_samples, self.max_rows)
        self.layout = BookkeepingLayout(bookkeeping_fields(
            config.max_tokens, self.max_rows, self.max_blocks_per_request, self.max_samples, K > 0, self.mamba is not None,
            self.lora is not None))
        self._host_buffers = [device.host_empty(self.layout.nbytes) for _ in range(2)]
        # numpy views of the host buffers: list -> buffer assignment is much cheaper than torch.tensor()
        self._host_views = [{k: t.numpy() for k, t in self.layout.views(b).items()} for b in self._host_buffers]
        self._ring = 0
        self.gpu_view = ContextGPUView(self.layout, device.device)
        # decode-only snapshots (speculative engines: steps without drafts) from per-request rows
        self._decode_rows = DecodeRows(
            config.max_requests, self.block_size, self.sampling_state.padding_slot, self._host_views[0])

        self.active: dict[int, DynamicInferenceRequest] = {}  # ACTIVE and PAUSED, by request id
        self.active_version = 0  # bumped whenever ``active`` gains or loses a request

    # ------------------------------------------------------------------ capacity
    @property
    def num_kv_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, total_tokens: int) -> bool:
        return self.blocks_for(total_tokens) <= self.allocator.capacity

    # ------------------------------------------------------------------ resources (the book changes the status)
    def admit(self, req: DynamicInferenceRequest, transferred: list[int] | None = None) -> int:
        """Give a waiting request its slots and the matching cached prefix blocks, or ``transferred``:
        blocks of this pool that hold its prompt's KV from another engine (disaggregation/). Returns
        the prefix tokens those blocks hold (their prefill is skipped; the book counts them computed)."""
        assert req.status == Status.WAITING and not req.block_ids and req.num_inflight == 0
        req.weights_epoch = self.weights_epoch
        if self.lora is not None:
            bind_adapter(req, self.lora)
        self.active[req.request_id] = req
        self.active_version += 1
        if self.mamba is not None:
            self.mamba.assign_slot(req)
        self.sampling_state.assign(req)
        if self.spec is not None:
            self.spec.assign(req)
        if transferred is not None:
            req.block_ids = list(transferred)
        hit = self.prefix.match(req) if transferred is None else len(req.prompt_tokens)
        self._decode_rows.assign(req)
        self.sharing.admitted(req, hit)
        return hit

    def adopt_prompt_digests(self, req: DynamicInferenceRequest, packed: bytes) -> None:
        """``packed``: ``req``'s prompt block digests as the rank that took it computed them (to
        route it; empty: none): read instead of hashing those blocks again (``PrefixBlocks``)."""
        self.prefix.adopt_digests(req, packed)

    def reserve(self, req: DynamicInferenceRequest, num_tokens: int) -> bool:
        """Own blocks for positions [num_computed, num_computed + num_tokens); all or nothing."""
        need = self.blocks_for(req.num_computed_tokens + num_tokens) - len(req.block_ids)
        if need > self.allocator.num_available:
            return False
        for _ in range(need):
            req.block_ids.append(self.allocator.allocate())
        if need > 0:
            self._decode_rows.sync_blocks(req)
        return True

    def reservable_tokens(self, req: DynamicInferenceRequest) -> int:
        """Most new tokens the request could reserve blocks for right now."""
        slack = len(req.block_ids) * self.block_size - req.num_computed_tokens
        return slack + self.allocator.num_available * self.block_size

    def release(self, req: DynamicInferenceRequest) -> None:
        """Free a request's blocks (complete hashed ones stay cached) and slots, and drop it
        from ``active``: it finished, or was evicted (it recomputes later). Its status is the
        book's to change."""
        self.allocator.release(req.block_ids)
        req.block_ids = []
        self.sharing.released(req)
        self._decode_rows.free(req)
        if self.mamba is not None:
            self.mamba.free_slot(req)
        self.sampling_state.free(req)
        if self.spec is not None:
            self.spec.free(req)
        self.active.pop(req.request_id, None)
        self.active_version += 1

    def trim_blocks(self, req: DynamicInferenceRequest) -> None:
        """Give back the blocks beyond ``req.num_computed_tokens`` (the book took back drafts a
        verify row rejected: only they needed them). Positions beyond the computed count hold
        stale KV that later steps overwrite; a launch in flight had the same correction applied
        on the device (verify.py), so its writes stay in range."""
        keep = self.blocks_for(req.num_computed_tokens)
        if len(req.block_ids) > keep:
            self.allocator.release(req.block_ids[keep:])
            del req.block_ids[keep:]
            self._decode_rows.sync_blocks(req)  # its row must not keep the given-back blocks

    def weights_changed(self) -> None:
        """The model's weights were updated: KV and Mamba states cached before are never hit
        again (every block identity is rooted in a key naming the weights), and requests
        admitted before stop publishing blocks (theirs hold old-weight KV)."""
        self.weights_epoch += 1
        self.allocator.hash_key = self._model_key + b"\0weights:%d" % self.weights_epoch

    def register_complete_blocks(self, req: DynamicInferenceRequest) -> None:
        """Publish blocks whose tokens are all known and whose KV is enqueued (``PrefixBlocks.publish``)."""
        self.prefix.publish(req, self.weights_epoch)

    # ------------------------------------------------------------------ step assembly
    def initialize_attention_state(self, plan: StepPlan, verify_width: int = 0) -> StepShape:
        """Fill the next host buffer of the ring with the step's tables (no request changes:
        ``RequestBook.commit`` advances the rows once the step is assembled). Raises
        RequestStepError, nothing committed, when one request's values break it.

        ``verify_width`` (speculative decoding, a step of decode rows only; the layout verify
        CUDA graphs replay): every row is laid out as ``verify_width`` tokens and as many
        samples, its last token and drafts first, then padding tokens (input 0, the row's last
        position, K/V to the dummy block, ``spec_src`` -2) whose samples nobody reads. Causal
        attention keeps the real tokens blind to them, and a Mamba window leaves their states
        in scratch positions past any accepted count, so the real samples are those of the
        compact layout; only the row's sizes are uniform."""
        if not verify_width:
            nxt = self._ring ^ 1
            shape = self._decode_rows.assemble(plan, self._host_views[nxt], nxt, self.mamba is not None)
            if shape is not None:
                self._ring ^= 1
                return shape
        return self._assemble_general(plan, verify_width)

    @property
    def fast_decode_snapshots(self) -> int:
        """Steps assembled by the decode-only fast path (``DecodeRows``)."""
        return self._decode_rows.assembled

    def _assemble_general(self, plan: StepPlan, verify_width: int) -> StepShape:
        """Any step (prefill chunks, verify rows, mixed): the tables row by row."""
        self._ring ^= 1
        self._decode_rows.invalidate(self._ring)
        try:
            shape = assemble_rows(plan, self._host_views[self._ring], self.block_size, verify_width,
                                  self.spec.padding_slot if self.spec is not None else None,
                                  self.sampling_state.padding_slot, self.mamba is not None)
        except RequestStepError:
            self._ring ^= 1  # the buffer was not used: keep the ring's order
            raise
        if self.long_tile_min_query and not shape.is_decode_only and shape.max_query_len >= self.long_tile_min_query:
            shape.long_tiles = True
            self.long_tile_steps += 1
        return shape

    def pad_for_graph(self, num_tokens: int, num_rows: int, padded_tokens: int, padded_rows: int,
                      verify_width: int = 0) -> None:
        """Make rows [num_rows, padded_rows) and tokens [num_tokens, padded_tokens) of the current
        host buffer harmless padding for a padded CUDA-graph replay (graph_padding.py).
        ``verify_width``: a uniform verify step, whose padding rows hold that many tokens and
        samples each (``padded_tokens`` is then ``padded_rows * verify_width``)."""
        v = self._host_views[self._ring]
        if verify_width:
            assert padded_tokens == padded_rows * verify_width and num_tokens == num_rows * verify_width
            fill_verify_padding(v, self._padding_slots, num_rows, padded_rows, verify_width)
        elif padded_rows > num_rows or padded_tokens > num_tokens:
            assert padded_rows > num_rows, "padding tokens need a padding row"
            fill_padding(v, self._padding_slots, num_rows, padded_rows, num_tokens, padded_tokens)

    def padding_snapshot(self, num_rows: int, num_tokens: int | None = None, verify_width: int = 0) -> torch.Tensor:
        """A whole host snapshot of padding only (what graph capture and warm-up run on):
        ``num_rows`` rows, one token each unless ``num_tokens`` (> rows: the last row holds the
        rest), or ``verify_width`` tokens and samples each (a uniform verify step)."""
        buf = torch.zeros(self.layout.nbytes, dtype=torch.uint8)
        views = {k: t.numpy() for k, t in self.layout.views(buf).items()}
        if verify_width:
            fill_verify_padding(views, self._padding_slots, 0, num_rows, verify_width)
        else:
            fill_padding(views, self._padding_slots, 0, num_rows, 0, num_rows if num_tokens is None else num_tokens)
        return buf

    @property
    def _padding_slots(self) -> PaddingSlots:
        return PaddingSlots(self.block_size, self.mamba.padding_slot if self.mamba is not None else 0,
                            self.sampling_state.padding_slot, self.spec.padding_slot if self.spec is not None else None)

    def transfer_bookkeeping_to_gpu(self) -> None:
        """The step's one H2D copy of the whole snapshot."""
        self.gpu_view.copy_from(self._host_buffers[self._ring])

    def forward_batch(self, shape: StepShape) -> ForwardBatch:
        g, T, R = self.gpu_view, shape.num_tokens, shape.num_rows
        attn = AttentionMetadata(
            num_tokens=T, num_rows=R, max_query_len=shape.max_query_len, max_kv_len=shape.max_kv_len,
            is_decode_only=shape.is_decode_only, positions=g.positions[:T], slot_mapping=g.slot_mapping[:T],
            token_to_row=g.token_to_row[:T], cu_query_lens=g.cu_query_lens[: R + 1], kv_lens=g.kv_lens[:R],
            block_table=g.block_table[:R], block_size=self.block_size, row_order=g.attention_row_order[:R],
            long_tiles=shape.long_tiles,
        )
        batch = ForwardBatch(attn=attn, kv_caches=self.kv_caches, batch_invariant=self.batch_invariant)
        if self.lora is not None and (shape.any_lora or not self.lora_skips):
            batch.lora_slots = g.lora_slot[:T]
            if (self.lora.grouped_rows and (T >= GROUPED_MIN_ROWS or self.batch_invariant)
                    and lora_ops.runs_triton(batch.lora_slots, self.batch_invariant)):
                batch.lora_groups = group_lora_rows(batch.lora_slots, self.lora.max_loras, self.batch_invariant)
        if self.mamba is not None:
            batch.mamba = MambaMetadata(
                state_slots=g.state_slots[:R], has_initial_state=g.has_initial_state[:R],
                cu_query_lens=attn.cu_query_lens, num_rows=R, is_decode_only=shape.is_decode_only,
                max_query_len=shape.max_query_len, token_to_row=attn.token_to_row, row_order=g.mamba_row_order[:R],
                num_scan_rows=shape.num_multi_rows if shape.num_multi_rows >= 0 else R,
            )
            if shape.verify_width:  # uniform verify step: every row (padding too) is one window
                W = shape.verify_width
                batch.mamba.window_tokens, batch.mamba.num_window_rows, batch.mamba.max_window_len = W, R, W
            elif shape.num_drafts is not None:  # verify rows run as Mamba windows
                flags, batch.mamba.window_tokens = window_rows(shape.num_drafts, T)
                if flags is not None:
                    batch.mamba.num_window_rows = sum(flags)
                    batch.mamba.max_window_len = max(shape.num_drafts) + 1
            batch.conv_states, batch.ssm_states = self.mamba.conv_states, self.mamba.ssm_states
            batch.conv_window_states, batch.ssm_window_states = self.mamba.conv_window_states, self.mamba.ssm_window_states
        return batch
