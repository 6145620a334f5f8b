"""Plain values (None, bool, int, float, str, bytes, lists, str-keyed maps) gathered from every
rank of a process group, through msgpack and two tensor all-gathers. ``torch.distributed``'s
``all_gather_object`` would unpickle what each peer sends (its bytes cross the network when the
ranks span hosts); msgpack builds plain values only (no object construction, no import)."""
from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist


def all_gather_plain(value: Any, group, device: torch.device) -> list[Any]:
    """``value`` of every rank of ``group``, in rank order (tuples come back as lists).
    Collective: every rank of ``group`` calls it; ``device``: where the group's backend takes
    tensors (the rank's GPU under NCCL, the CPU under gloo)."""
    data = torch.frombuffer(bytearray(msgpack.packb(value)), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [msgpack.unpackb(g[:n].cpu().numpy().tobytes()) for g, n in zip(gathered, lengths)]
