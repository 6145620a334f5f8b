"""What a request's computed prompt is, as bytes: its KV blocks of every attention layer, then
(hybrid models) its Mamba conv and SSM state of every Mamba layer, packed into one flat uint8
tensor in that order. Both engines run one model setup (the coordinator checks the block size;
the same model gives the same shapes), so the receiver knows the layout from the block count.

    layout = KVLayout(context)
    state = layout.take_state(req.state_slot)        # prefill side, before the slot is freed
    buf = layout.pack(block_ids, state)              # prefill side, to send
    layout.unpack(buf, new_block_ids, req.state_slot)  # decode side, into its own pool"""
from __future__ import annotations

import torch


class KVLayout:
    def __init__(self, context):
        self.kv = context.kv_caches  # each [2, num_blocks, block_size, heads, head_dim]
        mamba = context.mamba
        self.states = [] if mamba is None else list(mamba.conv_states) + list(mamba.ssm_states)  # each [slots + 1, ...]
        self.device = self.kv[0].device if self.kv else (self.states[0].device if self.states else torch.device("cpu"))

    def block_bytes(self) -> int:
        """Bytes of one block over every layer."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.kv)

    def nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes() + sum(t[0].numel() * t.element_size() for t in self.states)

    def take_state(self, slot: int) -> list[torch.Tensor] | None:
        """A copy of a request's Mamba states (stream-ordered after the launches that wrote them),
        before its slot goes back; None without Mamba layers."""
        if not self.states or slot < 0:
            return None
        return [t[slot].clone() for t in self.states]

    def pack(self, block_ids: list[int], state: list[torch.Tensor] | None) -> torch.Tensor:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        parts = [t.index_select(1, idx) for t in self.kv] + list(state or ())
        if not parts:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])

    def empty(self, num_blocks: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The receive buffer of ``num_blocks`` blocks (and a state)."""
        return torch.empty(self.nbytes(num_blocks), dtype=torch.uint8, device=device or self.device)

    def put_state(self, state: list[torch.Tensor] | None, slot: int) -> None:
        """``take_state``'s copy into state slot ``slot``."""
        for t, s in zip(self.states, state or ()):
            t[slot].copy_(s)

    def unpack(self, buf: torch.Tensor, block_ids: list[int], slot: int) -> None:
        """Copy ``buf`` (``pack``'s bytes) into ``block_ids`` of this pool and state slot ``slot``."""
        if buf.numel() != self.nbytes(len(block_ids)):
            raise ValueError(f"a transfer of {buf.numel()} bytes for {len(block_ids)} blocks "
                             f"({self.nbytes(len(block_ids))} expected): another model setup?")
        buf = buf.to(self.device)
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        offset = 0
        for t in self.kv:
            shape = (t.shape[0], len(block_ids), *t.shape[2:])
            n = t[:, 0].numel() * len(block_ids) * t.element_size()
            t.index_copy_(1, idx, buf[offset:offset + n].view(t.dtype).view(shape))
            offset += n
        for t in self.states:
            n = t[0].numel() * t.element_size()
            t[slot].copy_(buf[offset:offset + n].view(t.dtype).view(t.shape[1:]))
            offset += n
