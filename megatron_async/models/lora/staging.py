"""An adapter staged for its slots, and its install between two steps.

``stage`` (the expensive part, off the engine's step: any thread) lays a checked adapter out
exactly as the slots of every linear it touches hold it, cast to the model dtype, in one flat
buffer (pinned host memory on a CUDA engine, so its copy to the device does not block; the
device itself when the adapter's tensors already are there, as a refit's are), and checks the
values once over that buffer. ``install`` (between two steps) then copies that buffer to the
device in one stream-ordered copy and scatters it into the slots with a few multi-tensor copies,
and zeroes the slots of the linears the adapter leaves alone: no host read of a device value,
so it never waits for the step in flight. The copies are stream-ordered after that step, which
never reads a free slot."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.models.lora.peft_format import AdapterConfig, AdapterWeights, LoRAError


@dataclass
class StagedAdapter:
    """``LoRAAdapters.prepare``'s result: what ``load`` / ``update`` install into a slot."""

    config: AdapterConfig
    targets: dict
    """The ``LoRAAdapters.targets`` it was laid out for (another engine's cannot install it)."""
    images: list[tuple[object, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
    """(slots, (a, b, scale) image shaped like ``slots.slot_views``) of each linear it touches."""
    flat: torch.Tensor
    """Every image's a and b, back to back (model dtype)."""
    scales: torch.Tensor
    """Every image's scale, back to back (float32)."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size() + self.scales.numel() * 4


def _unique_slots(targets: dict) -> dict[int, object]:
    return {id(t.slots): t.slots for t in targets.values()}


@torch.no_grad()
def stage(targets: dict, weights: AdapterWeights) -> StagedAdapter:
    """``weights`` (checked against ``targets``' shapes) laid out as their slots hold them."""
    touched = {}
    for module in weights.modules:
        slots = targets[module].slots
        touched.setdefault(id(slots), slots)
    first = next(iter(touched.values()))
    dtype, device = first.a.dtype, first.a.device
    on_device = device.type != "cpu" and any(a.device == device for a, _ in weights.modules.values())
    where = {"device": device} if on_device else {"pin_memory": device.type == "cuda"}
    views = [s.slot_views(0) for s in touched.values()]
    flat = torch.zeros(sum(a.numel() + b.numel() for a, b, _ in views), dtype=dtype, **where)
    scales = torch.zeros(sum(sc.numel() for _, _, sc in views), dtype=torch.float32, **where)
    images, at, at_scale = {}, 0, 0
    for (key, slots), (a, b, sc) in zip(touched.items(), views):
        a_img = flat[at:at + a.numel()].view(a.shape)
        b_img = flat[at + a.numel():at + a.numel() + b.numel()].view(b.shape)
        sc_img = scales[at_scale:at_scale + sc.numel()].view(sc.shape)
        at, at_scale = at + a.numel() + b.numel(), at_scale + sc.numel()
        images[key] = (slots, (a_img, b_img, sc_img))
    scaling = weights.config.scaling
    for module, (a, b) in weights.modules.items():
        target = targets[module]
        target.slots.write_image(images[id(target.slots)][1], target.part, a, b, scaling)
    _check_finite(flat, weights, dtype)
    return StagedAdapter(weights.config, targets, list(images.values()), flat, scales)


def _check_finite(flat: torch.Tensor, weights: AdapterWeights, dtype: torch.dtype) -> None:
    """One pass over the staged values (NaN propagates through min / max); the module is looked
    for only when there is one to name."""
    if flat.numel() and all(map(torch.isfinite, torch.aminmax(flat))):
        return
    for module, (a, b) in weights.modules.items():
        if not (torch.isfinite(a.to(dtype)).all() and torch.isfinite(b.to(dtype)).all()):
            raise LoRAError(f"{module}: the adapter's tensors hold NaN or infinite values (in the model's {dtype})")
    if flat.numel():
        raise LoRAError("the adapter's tensors hold NaN or infinite values")


@torch.no_grad()
def install(staged: StagedAdapter, slot: int, targets: dict) -> None:
    """Copy ``staged`` into slot ``slot`` of every linear of ``targets`` (zeros where it has nothing)."""
    touched = {id(s) for s, _ in staged.images}
    first = next(iter(_unique_slots(targets).values()))
    device = first.a.device
    flat = staged.flat.to(device, non_blocking=True)  # pinned: a stream-ordered copy, the host goes on
    scales = staged.scales.to(device, non_blocking=True)
    dst, src, dst_scale, src_scale = [], [], [], []
    at, at_scale = 0, 0
    for slots, (a_img, b_img, sc_img) in staged.images:
        a, b, sc = slots.slot_views(slot)
        dst += [a, b]
        src += [flat[at:at + a.numel()].view(a.shape), flat[at + a.numel():at + a.numel() + b.numel()].view(b.shape)]
        dst_scale.append(sc)
        src_scale.append(scales[at_scale:at_scale + sc.numel()].view(sc.shape))
        at, at_scale = at + a.numel() + b.numel(), at_scale + sc.numel()
    if dst:
        torch._foreach_copy_(dst, src)
        torch._foreach_copy_(dst_scale, src_scale)
    clear_slots([s for k, s in _unique_slots(targets).items() if k not in touched], slot)


@torch.no_grad()
def clear_slots(all_slots: list, slot: int) -> None:
    """Zero slot ``slot`` of every linear in ``all_slots`` with one multi-tensor op per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for slots in all_slots:
        for t in slots.slot_views(slot):
            by_dtype.setdefault(t.dtype, []).append(t)
    for tensors in by_dtype.values():
        torch._foreach_zero_(tensors)
