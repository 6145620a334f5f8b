"""The LoRA adapters a model holds: which slot each name occupies, and the one checked path
that writes, rewrites and clears slots.

``LoRAAdapters.attach`` gives the attention and MLP linears of the model's blocks their slots
(``ParallelLinear.add_lora_slots``) once, at build, and maps every Hugging Face module path those
linears stand for (``model.layers.0.self_attn.q_proj`` -> the fused qkv linear, part "q") through
the model's own checkpoint targets (``hf_targets``). Loading checks the whole adapter against that
map (every module known, every shape the base model's, every rank within ``max_lora_rank``, every
value finite) and stages it (staging.py) before it copies anything into a slot; a failed load
changes nothing. ``prepare`` (read, check, stage) touches no mutable state, so it may run off the
engine's step; only the install into the slots (slot_writes.py: copies, never a wait for the device)
runs between two steps, and an unload only marks its slot free. MoE layers adapt their routed experts per expert
(``model.layers.0.mlp.experts.5.gate_proj``; ``parallel/expert_lora_slots.py``, not TP-split or FP8
experts) and their shared expert; Mamba mixers are not adapted.
Adapters come in PEFT's format (peft_format.py) or Megatron-Core's naming (megatron_format.py,
through the model's Megatron-Core name table)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from megatron_async.config import LoRASizing
from megatron_async.models.layers.attention_layer import Attention
from megatron_async.models.layers.mlp import ReluSquaredMLP, SwiGLUMLP
from megatron_async.models.layers.moe import MoEMixer
from megatron_async.models.lora.megatron_format import megatron_config, megatron_source, read_megatron_adapter
from megatron_async.models.lora.peft_format import AdapterConfig, AdapterWeights, LoRAError, read_adapter
from megatron_async.models.lora.phase_times import PhaseClock
from megatron_async.models.lora.slot_writes import SlotWriter
from megatron_async.models.lora.staging import StagedAdapter, reserve_pinned, stage
from megatron_async.models.megatron_layouts import NameMap
from megatron_async.models.slab_loading import WeightUpdateError
from megatron_async.parallel.expert_lora_slots import ExpertLoRASlots
from megatron_async.parallel.lora_slots import LoRASlots

ADAPTED = {Attention: ("qkv_proj", "o_proj"), SwiGLUMLP: ("gate_up_proj", "down_proj"),
           ReluSquaredMLP: ("up_proj", "down_proj")}
"""The linears of each mixer type that get adapter slots."""


@dataclass(frozen=True)
class Target:
    slots: LoRASlots | ExpertLoRASlots
    part: int | tuple[int, int]
    """The part index, or for an expert linear (global expert, part index)."""


@dataclass
class Loaded:
    slot: int
    config: AdapterConfig
    generation: int
    """Which load or update wrote its weights (part of its prefix-cache key)."""


class LoRAAdapters:
    def __init__(self, targets: dict[str, Target], sizing: LoRASizing):
        self.targets, self.max_loras, self.max_rank = targets, sizing.max_loras, sizing.max_lora_rank
        self.grouped_rows = sizing.lora_grouped_rows
        self.loaded: dict[str, Loaded] = {}
        self.megatron = None
        """(``NameMap``, ``Dims``) of the model: adapters in Megatron-Core's naming (None: it has no table)."""
        self._free = list(range(sizing.max_loras - 1, -1, -1))
        self._generation = 0
        self.writer = SlotWriter(targets, sizing.max_loras)
        self.last_lora_ms: dict[str, dict[str, float]] = {}
        """Host ms by phase of the last ``prepare`` ("read", "check", "alloc", "layout", "finite"),
        install ("checks", "order", "copy", "zero", "commit") and unload ("users", "free")."""

    @classmethod
    def attach(cls, model: nn.Module, sizing: LoRASizing) -> LoRAAdapters:
        """Give ``model``'s attention, MLP and MoE expert linears their slots; sets ``model.lora_adapters``."""
        linears = {}
        for linear in _adapted_linears(model, sizing):
            if linear.weight_scale_inv is not None:
                raise LoRAError("LoRA adapters are not supported on FP8 linears")
            if linear.lora is None:
                linear.add_lora_slots(sizing.max_loras, sizing.max_lora_rank)
            linears[id(linear.weight)] = linear
        targets = {}
        for hf_name, (param, shard_id) in model.hf_targets().items():
            linear = linears.get(id(param))
            if linear is not None and hf_name.endswith(".weight"):
                targets[hf_name[: -len(".weight")]] = Target(linear.lora, linear.lora.part_of(shard_id))
        adapters = model.lora_adapters = cls(targets, sizing)
        reserve_pinned(targets)
        try:
            adapters.megatron = (NameMap.for_arch(model.spec.name), model.megatron_dims())
        except (AttributeError, WeightUpdateError):  # no Megatron-Core name table: PEFT's format only
            pass
        return adapters

    # ------------------------------------------------------------------ names and slots
    def slot_of(self, name: str | None) -> int:
        """The slot of adapter ``name`` (-1 for None: the base model); KeyError if not loaded."""
        return -1 if name is None else self.loaded[name].slot

    def key_of(self, name: str | None) -> bytes:
        """What separates this adapter's prefix-cache entries (b"" for the base model): its name and
        the load / update that wrote its weights."""
        return b"" if name is None else b"\0lora:%s:%d" % (name.encode(), self.loaded[name].generation)

    # ------------------------------------------------------------------ the checked path
    def prepare(self, source, config: AdapterConfig | None = None) -> StagedAdapter:
        """Read, check and stage an adapter for any slot (staging.py). Reads only what ``attach``
        fixed (targets, rank limit, name table), never the loaded table: safe on another thread
        while the engine steps. ``config``: a mapping's scale (``update`` keeps the adapter's)."""
        if isinstance(source, StagedAdapter):
            if source.targets is not self.targets:
                raise LoRAError("this adapter was prepared for another engine's model")
            return source
        clock = PhaseClock()
        weights = self._read(source, config)
        clock.lap("read")
        self._checked(weights)
        clock.lap("check")
        staged = stage(self.targets, weights, clock.lap)
        self.last_lora_ms["prepare"] = clock.ms
        return staged

    def check_load(self, name: str) -> None:
        """Why adapter ``name`` cannot be loaded now (LoRAError), before anything is read."""
        if not isinstance(name, str) or not name:
            raise LoRAError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self.loaded:
            raise LoRAError(f"adapter {name!r} is already loaded (update_lora rewrites it, unload_lora frees it)")
        if not self._free:
            raise LoRAError(f"all {self.max_loras} adapter slots are in use (InferenceConfig.max_loras): unload one")

    def load(self, name: str, source) -> int:
        """Read, check and copy a new adapter into a free slot (``source``: also a ``prepare``d
        adapter, then only its install runs here); returns the slot."""
        self.check_load(name)
        staged = self.prepare(source)
        clock = PhaseClock()
        self.check_load(name)  # (a prepare on another thread may have raced a load of that name)
        slot = self._free.pop()
        clock.lap("checks")
        self.writer.install(staged, slot, False, clock.lap)
        self._generation += 1
        self.loaded[name] = Loaded(slot, staged.config, self._generation)
        clock.lap("commit")
        self.last_lora_ms["install"] = clock.ms
        return slot

    def update(self, name: str, source) -> int:
        """Rewrite loaded adapter ``name`` in place (same slot, read and checked like ``load``;
        a mapping of tensors keeps the adapter's config); returns the slot."""
        if name not in self.loaded:
            raise LoRAError(f"no adapter {name!r} is loaded (loaded: {sorted(self.loaded)})")
        entry = self.loaded[name]
        staged = self.prepare(source, entry.config)
        clock = PhaseClock()
        self.writer.install(staged, entry.slot, True, clock.lap)
        self._generation += 1
        entry.config, entry.generation = staged.config, self._generation
        clock.lap("commit")
        self.last_lora_ms["install"] = clock.ms
        return entry.slot

    def unload(self, name: str, clock: PhaseClock | None = None) -> int:
        """Free adapter ``name``'s slot (the caller makes sure no request uses it): bookkeeping
        only, its weights stay until the next load overwrites them. ``clock``: the caller's phases."""
        clock = clock or PhaseClock()
        if name not in self.loaded:
            raise LoRAError(f"no adapter {name!r} is loaded (loaded: {sorted(self.loaded)})")
        slot = self.loaded.pop(name).slot
        self.writer.free(slot)
        self._free.append(slot)
        clock.lap("free")
        self.last_lora_ms["unload"] = clock.ms
        return slot

    def _read(self, source, config: AdapterConfig | None = None) -> AdapterWeights:
        """PEFT's format, or Megatron-Core's naming (``megatron_format.megatron_source``'s forms)."""
        found = megatron_source(source)
        if found is None:
            return read_adapter(source, config)
        if self.megatron is None:
            raise LoRAError("this model has no Megatron-Core name table: give the adapter in PEFT's format")
        return read_megatron_adapter(found[1], *self.megatron, self._full_shapes, megatron_config(found[0]) or config)

    def _full_shapes(self, module: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        target = self.targets.get(module)
        if target is None:
            raise LoRAError(f"the adapter targets {module!r}, which this model does not adapt")
        return target.slots.full_shapes(target.part, rank)

    def _checked(self, weights: AdapterWeights) -> AdapterWeights:
        if weights.config.rank > self.max_rank:
            raise LoRAError(f"adapter rank {weights.config.rank} is over InferenceConfig.max_lora_rank={self.max_rank}")
        for module, (a, b) in weights.modules.items():
            target = self.targets.get(module)
            if target is None:
                raise LoRAError(f"the adapter targets {module!r}, which this model does not have or does not adapt "
                                "(attention, MLP and, with InferenceConfig.lora_experts, MoE expert projections "
                                "only, not tensor-parallel or FP8 experts; an adapter of another base model?)")
            want_a, want_b = target.slots.full_shapes(target.part, a.shape[0])
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise LoRAError(f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, the base model needs "
                                f"{want_a} / {want_b} (an adapter of another base model?)")
        return weights


def _adapted_linears(model: nn.Module, sizing: LoRASizing) -> list:
    """The linears that take slots: ``ADAPTED``'s of each block's mixer; a MoE layer's routed
    experts (with ``lora_experts``: given their slots here, where they can take them) and its shared
    expert's."""
    linears = []
    for block in model.blocks:
        mixer = block.mixer
        if isinstance(mixer, MoEMixer):
            if sizing.lora_experts and mixer.experts.add_lora_slots(sizing.max_loras, sizing.max_lora_rank):
                linears += [mixer.experts.input_proj, mixer.experts.down_proj]
            mixer = mixer.shared_experts
        linears += [getattr(mixer, name) for name in ADAPTED.get(type(mixer), ())]
    return linears
