"""An adapter staged for its slots: the expensive half of a load, off the engine's step.

``stage`` (any thread) lays a checked adapter out exactly as the slots of every linear it touches
hold it, cast to the model dtype, in one buffer (pinned host memory on a CUDA engine, so its copies
to the device do not block; the device itself when the adapter's tensors already are there, as a
refit's are), and checks the values once over that buffer. The buffer is always as large as the
image of every adapted linear, whatever the adapter touches, and an engine pins one such buffer
when it is built (``reserve_pinned``): the host allocator's cache then serves each stage with a
block of that size, and pinning (``cudaHostAlloc``, which holds a driver-wide lock that the step
loop's launches queue behind) happens only when several staged adapters are held at once.
``slot_writes.SlotWriter.install`` copies it into a slot between two steps."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_async.models.lora.peft_format import AdapterConfig, AdapterWeights, LoRAError
from megatron_async.models.lora.slot_writes import unique_slots

SCALE_ALIGN = 4
"""Bytes the scales' float32 part starts on within the buffer."""


@dataclass
class StagedAdapter:
    """``LoRAAdapters.prepare``'s result: what ``load`` / ``update`` install into a slot."""

    config: AdapterConfig
    targets: dict
    """The ``LoRAAdapters.targets`` it was laid out for (another engine's cannot install it)."""
    keys: list[int]
    """``id`` of each linear's slots it touches, in image order."""
    flat: torch.Tensor
    """Every touched linear's a and b image, back to back (model dtype)."""
    scales: torch.Tensor
    """Every touched linear's scale image, back to back (float32)."""
    src_ab: list[torch.Tensor] = field(default_factory=list)
    """Views of ``flat``: each touched linear's a then b, shaped like its ``slot_views``."""
    src_scale: list[torch.Tensor] = field(default_factory=list)
    """Views of ``scales``: each touched linear's scale."""

    @property
    def key_set(self) -> frozenset[int]:
        return frozenset(self.keys)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size() + self.scales.numel() * 4


def image_bytes(targets: dict) -> int:
    """Bytes of a buffer that holds the image of every adapted linear (``stage``'s allocation)."""
    ab = sc = 0
    for slots in unique_slots(targets).values():
        a, b, scale = slots.slot_views(0)
        ab += (a.numel() + b.numel()) * a.element_size()
        sc += scale.numel() * 4
    return -(-ab // SCALE_ALIGN) * SCALE_ALIGN + sc


def reserve_pinned(targets: dict) -> None:
    """Pin one staging buffer now and give it to the host allocator's cache (a CUDA engine's build)."""
    first = next(iter(unique_slots(targets).values()))
    if first.a.device.type == "cuda":
        torch.empty(image_bytes(targets), dtype=torch.uint8, pin_memory=True)  # freed at once, into the cache


@torch.no_grad()
def stage(targets: dict, weights: AdapterWeights, lap=lambda name: None) -> StagedAdapter:
    """``weights`` (checked against ``targets``' shapes) laid out as their slots hold them;
    ``lap(name)`` ends a timed phase ("alloc", "layout", "finite")."""
    touched = {}
    for module in weights.modules:
        slots = targets[module].slots
        touched.setdefault(id(slots), slots)
    first = next(iter(touched.values()))
    dtype, device = first.a.dtype, first.a.device
    on_device = device.type != "cpu" and any(a.device == device for a, _ in weights.modules.values())
    where = {"device": device} if on_device else {"pin_memory": device.type == "cuda"}
    views = [s.slot_views(0) for s in touched.values()]
    n_ab, n_sc = sum(a.numel() + b.numel() for a, b, _ in views), sum(sc.numel() for _, _, sc in views)
    buffer = torch.empty(image_bytes(targets), dtype=torch.uint8, **where)
    at_scales = -(-n_ab * first.a.element_size() // SCALE_ALIGN) * SCALE_ALIGN
    flat = buffer[:n_ab * first.a.element_size()].view(dtype)
    scales = buffer[at_scales:at_scales + 4 * n_sc].view(torch.float32)
    flat.zero_()
    scales.zero_()
    lap("alloc")
    images, src_ab, src_scale, at, at_scale = {}, [], [], 0, 0
    for (key, slots), (a, b, sc) in zip(touched.items(), views):
        a_img = flat[at:at + a.numel()].view(a.shape)
        b_img = flat[at + a.numel():at + a.numel() + b.numel()].view(b.shape)
        sc_img = scales[at_scale:at_scale + sc.numel()].view(sc.shape)
        at, at_scale = at + a.numel() + b.numel(), at_scale + sc.numel()
        images[key] = (a_img, b_img, sc_img)
        src_ab += (a_img, b_img)
        src_scale.append(sc_img)
    scaling = weights.config.scaling
    for module, (a, b) in weights.modules.items():
        target = targets[module]
        target.slots.write_image(images[id(target.slots)], target.part, a, b, scaling)
    lap("layout")
    _check_finite(flat, weights, dtype)
    lap("finite")
    return StagedAdapter(weights.config, targets, list(touched), flat, scales, src_ab, src_scale)


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
