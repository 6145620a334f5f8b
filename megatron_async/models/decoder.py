"""DecoderModel: every model family as one stack of ``Block``s (``h += mixer(norm(h))``) between
a vocabulary-parallel embedding and LM head. GPT and hybrid models differ only in the list of
blocks they declare (and their Hugging Face names); a new family, or a new mixer kind (MoE: ``LayerKind.MOE``),
needs no new sharding or loading code."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from megatron_async.forward_batch import ForwardBatch
from megatron_async.kernels import mamba_window_ops
from megatron_async.models.base import CausalLM, KVCacheSpec, MambaStateSpec
from megatron_async.models.hybrid_config import MambaConfig
from megatron_async.models.layers.attention_layer import Attention
from megatron_async.models.layers.block import Block, StepInputs
from megatron_async.models.layers.mamba2_mixer import Mamba2Mixer
from megatron_async.models.layers.mamba_step_plan import MambaStepPlan
from megatron_async.models.layers.mlp import build_mlp
from megatron_async.models.layers.moe import MoEMixer
from megatron_async.models.layers.mtp import MTPHeads
from megatron_async.models.megatron_layouts import Dims
from megatron_async.models.layers.norm import NemotronRMSNorm, RMSNorm
from megatron_async.models.layers.rope import RotaryEmbedding
from megatron_async.models.model_config import AttentionConfig, LayerKind, MLPConfig
from megatron_async.models.moe_config import MoEConfig
from megatron_async.models.mtp_weights import MTP_PREFIX, load_main_and_mtp, mtp_hf_prefixes, mtp_layer_blocks
from megatron_async.models.quantization import Fp8Config, QuantScope
from megatron_async.models.weight_loading import HFTarget, hf_targets, load_hf_weights
from megatron_async.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from megatron_async.parallel.fp8_sharding import check_fp8_pairs
from megatron_async.parallel.sharding import full_shape
from megatron_async.parallel.state import ParallelState

log = logging.getLogger("megatron_async")

# Buffers some checkpoints carry that are recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class BlockSpec:
    kind: LayerKind
    hf_norm: str
    """HF module path of the block's norm, e.g. "model.layers.0.input_layernorm"."""
    hf_mixer: str
    """HF module path of its mixer, e.g. "model.layers.0.self_attn"."""


@dataclass(frozen=True)
class DecoderSpec:
    """A model as a stack of blocks, whatever its config format (full sizes; layers shard them)."""

    name: str
    """For error messages (the architecture)."""
    vocab_size: int
    hidden_size: int
    blocks: tuple[BlockSpec, ...]
    attention: AttentionConfig | None
    mamba: MambaConfig | None
    mlp: MLPConfig | None
    norm_eps: float
    nemotron_norm: bool
    """NemotronH's RMSNorm rounding (scale in float32, then cast)."""
    tie_word_embeddings: bool
    residual_in_fp32: bool
    eos_token_id: int | None
    max_position_embeddings: int
    hf_embedding: str
    hf_final_norm: str
    hf_ignored_prefixes: tuple[str, ...] = ()
    """Checkpoint tensors that are not part of the model (e.g. NemotronH "mtp." heads)."""
    moe: MoEConfig | None = None
    """The mixture-of-experts mixer of the MOE blocks (None: the model has none)."""
    mtp_depths: int = 0
    """Multi-token-prediction depths the checkpoint carries (``mtp.*`` tensors, see mtp_weights.py)."""


def _mixer(kind: LayerKind, spec: DecoderSpec, index: int | None, parallel: ParallelState, dtype: torch.dtype,
           device: torch.device | str, quant: QuantScope) -> nn.Module:
    """``index``: the block's number among the blocks of its kind (its cache / state slot, its
    routing-replay layer); None for an MTP head's MoE (it records no routing). ``quant``: the FP8
    config seen from the mixer's HF path."""
    if kind == LayerKind.ATTENTION:
        return Attention(spec.hidden_size, spec.attention, index, parallel, dtype, device, quant)
    if kind == LayerKind.MAMBA:
        return Mamba2Mixer(spec.hidden_size, spec.mamba, index, parallel, dtype, device, quant)
    if kind == LayerKind.MLP:
        return build_mlp(spec.hidden_size, spec.mlp, parallel, dtype, device, quant)
    if kind == LayerKind.MOE:
        return MoEMixer(spec.hidden_size, spec.moe, parallel, dtype, device, moe_layer=index, quant=quant)
    raise ValueError(f"{spec.name}: {kind.name} layers are not supported")


class DecoderModel(CausalLM):
    def __init__(self, spec: DecoderSpec, parallel: ParallelState, dtype: torch.dtype, device: torch.device | str,
                 quant: Fp8Config | None = None):
        """``quant``: FP8 weights for the linears it names (None: every weight in ``dtype``)."""
        super().__init__()
        self.spec, self.parallel, self.dtype, self.quant = spec, parallel, dtype, quant
        self.vocab_size = spec.vocab_size
        self.eos_token_id = spec.eos_token_id
        self.max_position_embeddings = spec.max_position_embeddings
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, parallel, dtype, device)
        norm_cls = NemotronRMSNorm if spec.nemotron_norm else RMSNorm
        counts = {kind: 0 for kind in LayerKind}
        blocks = []
        for b in spec.blocks:
            mixer = _mixer(b.kind, spec, counts[b.kind], parallel, dtype, device, QuantScope(quant, b.hf_mixer))
            blocks.append(Block(norm_cls(spec.hidden_size, spec.norm_eps, dtype, device), mixer))
            counts[b.kind] += 1
        self.blocks = nn.ModuleList(blocks)
        self.dry_blocks: list[int] | None = None
        """Set only inside a dry capture (kernel_prebuild.py): the blocks it runs (dry_blocks.py)."""
        self.num_blocks_of = counts
        self.final_norm = norm_cls(spec.hidden_size, spec.norm_eps, dtype, device)
        tied = self.embed_tokens if spec.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype, device, tied=tied)
        self.mtp = self._build_mtp(norm_cls, counts[LayerKind.ATTENTION], parallel, dtype, device)
        self.mtp_enabled = False
        """The MTP heads run (set by ``enable_mtp``): their KV layers are part of ``kv_cache_spec``."""
        att = spec.attention
        self.rope = None
        if att is not None and att.rotary_dim > 0:
            self.rope = RotaryEmbedding(att.rotary_dim, spec.max_position_embeddings, att.rope_theta,
                                        att.rope_scaling, dtype, device)

    def _mtp_mlp_kind(self) -> LayerKind:
        return LayerKind.MOE if self.spec.moe is not None else LayerKind.MLP

    def _build_mtp(self, norm_cls, num_attention: int, parallel: ParallelState, dtype: torch.dtype,
                   device: torch.device | str) -> MTPHeads | None:
        """Depth d's attention uses KV layer ``num_attention + d``, after the main model's."""
        spec = self.spec
        if spec.mtp_depths == 0:
            return None
        if spec.attention is None or (spec.mlp is None and spec.moe is None):
            raise ValueError(f"{spec.name}: MTP heads need the model's attention and MLP configs")
        layers = []
        for d in range(spec.mtp_depths):
            kinds = [(kind, mixer) for kind, _, mixer in mtp_layer_blocks(d, self._mtp_mlp_kind())]
            layers.append([Block(norm_cls(spec.hidden_size, spec.norm_eps, dtype, device),
                                 _mixer(kind, spec, num_attention + d if kind == LayerKind.ATTENTION else None,
                                        parallel, dtype, device, QuantScope(self.quant, mixer)))
                           for kind, mixer in kinds])
        return MTPHeads(spec.hidden_size, lambda: norm_cls(spec.hidden_size, spec.norm_eps, dtype, device),
                        layers, parallel, dtype, device)

    @property
    def num_mtp_depths(self) -> int:
        return 0 if self.mtp is None else self.mtp.num_depths

    def enable_mtp(self) -> None:
        """Give the MTP heads their KV layers (call before the KV pool is sized from ``kv_cache_spec``)."""
        if self.mtp is None:
            raise ValueError(f"{self.spec.name}: the checkpoint has no MTP heads (mtp.* tensors and "
                             "num_nextn_predict_layers / mtp_num_hidden_layers in config.json)")
        self.mtp_enabled = True

    def mtp_forward(self, depth: int, next_ids: torch.Tensor, hidden: torch.Tensor,
                    batch: ForwardBatch) -> torch.Tensor:
        """One MTP depth over the tokens of ``batch`` (its positions and KV slots): ``hidden``
        [T, H] the previous hidden states at those positions, ``next_ids`` [T] the tokens that
        follow them. Returns the depth's normed output [T, H] (``compute_logits`` gives the
        drafts' logits). Writes depth ``depth``'s KV at the batch's slots."""
        T = next_ids.shape[0]
        rope = None
        if self.rope is not None:
            self.rope.reserve(batch.attn.max_kv_len)
            rope = self.rope(batch.attn.positions[:T])
        step = StepInputs(batch, rope, None, batch.ep_num_tokens, self.kernels)
        return self.mtp(depth, self.embed_tokens(next_ids), hidden, step)

    def routed_experts_shape(self) -> tuple[int, int] | None:
        num_moe = self.num_blocks_of[LayerKind.MOE]
        return (num_moe, self.spec.moe.top_k) if num_moe else None

    def _mixers(self, kind: type[nn.Module]) -> list[nn.Module]:
        return [b.mixer for b in self.blocks if isinstance(b.mixer, kind)]

    def reserve_positions(self, num_positions: int) -> None:
        """Pre-size the rope table (e.g. to max_sequence_length before CUDA-graph capture)."""
        if self.rope is not None:
            self.rope.reserve(num_positions)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = input_ids.shape[0]
        rope = None
        if self.rope is not None:
            self.rope.reserve(batch.attn.max_kv_len)  # a host int: growing the table never syncs
            rope = self.rope(batch.attn.positions[:T])
        kernels = self.kernels
        plan = MambaStepPlan.build(batch.mamba, kernels.triton_mamba) if self.num_blocks_of[LayerKind.MAMBA] else None
        step = StepInputs(batch, rope, plan, batch.ep_num_tokens, kernels, batch.routed_experts)
        x, residual = self.embed_tokens(input_ids), None
        if self.spec.residual_in_fp32:
            x = x.float()
        blocks = self.blocks if self.dry_blocks is None else [self.blocks[i] for i in self.dry_blocks]
        for block in blocks:
            x, residual = block(x, residual, step)
        inv = batch.batch_invariant
        if residual is None:
            return self.final_norm(self.final_norm.in_dtype(x), inv, kernels.fused)
        return self.final_norm.add_and_norm(x, residual, inv, kernels.fused)[0]

    def commit_speculative(self, out) -> None:
        """Mamba layers: each verify row's slot takes the state after its accepted drafts from
        the window scratch its Mamba window left (rows without drafts advanced in place and are
        left alone, except in a step where every row is a window: a uniform verify step, where
        rows without drafts commit the state after their one real token). Device only; a no-op
        without Mamba windows."""
        b = out.batch
        if b.mamba is None or not b.conv_window_states:
            return
        mamba_window_ops.commit_window_states(
            b.conv_states + b.ssm_states, b.conv_window_states + b.ssm_window_states,
            b.mamba.state_slots[: out.num_rows], out.accepted,
            rows=None if b.mamba.window_tokens else out.num_drafts > 0, triton=self.kernels.triton_mamba,
        )

    @property
    def supports_batch_invariant(self) -> bool:
        """Attention and MLP blocks honour ``ForwardBatch.batch_invariant``; Mamba2 mixers do
        not (their chunked scan depends on where prefill chunks are cut), nor do MoE mixers (the
        router and the grouped expert GEMMs have no batch-invariant kernels yet)."""
        return self.num_blocks_of[LayerKind.MAMBA] == 0 and self.num_blocks_of[LayerKind.MOE] == 0

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False, float32: bool = True) -> torch.Tensor:
        return self.lm_head(hidden, batch_invariant, float32)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self._mixers(Attention)
        if not attn:  # pure Mamba2: no KV cache; head dims only keep size arithmetic well-defined
            return KVCacheSpec(0, 1, self.spec.mamba.head_dim)
        mtp_layers = self.num_mtp_depths if self.mtp_enabled else 0
        return KVCacheSpec(len(attn) + mtp_layers, attn[0].num_kv_heads, attn[0].head_dim)  # this rank's KV heads

    def mamba_state_spec(self) -> MambaStateSpec | None:
        mamba = self._mixers(Mamba2Mixer)
        if not mamba:
            return None
        conv_shape, ssm_shape = mamba[0].state_shapes()  # this rank's heads and channels
        return MambaStateSpec(len(mamba), conv_shape, ssm_shape)

    # ------------------------------------------------------------------ checkpoints
    def hf_prefixes(self) -> dict[str, str]:
        """Our module paths -> the HF module paths they stand for."""
        names = {"embed_tokens": self.spec.hf_embedding, "final_norm": self.spec.hf_final_norm, "lm_head": "lm_head"}
        for i, b in enumerate(self.spec.blocks):
            names[f"blocks.{i}.norm"] = b.hf_norm
            names[f"blocks.{i}.mixer"] = b.hf_mixer
        return names | mtp_hf_prefixes(self.num_mtp_depths, self._mtp_mlp_kind())

    def hf_targets(self) -> dict[str, HFTarget]:
        """Every HF tensor name this model needs -> (parameter, shard_id)."""
        return hf_targets(self, self.hf_prefixes())

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full (unsharded) shape of every HF tensor this model needs, in a fixed order."""
        return {name: full_shape(param, shard_id) for name, (param, shard_id) in self.hf_targets().items()}

    def megatron_dims(self) -> Dims:
        """The full sizes Megatron-Core's fused layouts of this model need (``megatron_layouts``)."""
        spec, att, mamba, moe = self.spec, self.spec.attention, self.spec.mamba, self.spec.moe
        return Dims(vocab=spec.vocab_size, hidden=spec.hidden_size,
                    heads=att.num_heads if att else 0, groups=att.num_kv_heads if att else 0,
                    head_dim=att.head_dim if att else 0, ffn=spec.mlp.intermediate_size if spec.mlp else 0,
                    moe_ffn=moe.intermediate_size if moe else 0, experts=moe.num_experts if moe else 0,
                    shared_ffn=moe.shared_expert_intermediate_size if moe else 0,
                    mamba_inner=mamba.intermediate_size if mamba else 0,
                    mamba_bc=mamba.n_groups * mamba.d_state if mamba else 0, mamba_heads=mamba.num_heads if mamba else 0)

    def canonical_name(self, name: str) -> str:
        """Map an accepted alternative spelling onto the name transformers saves."""
        return name

    def optional_hf_name(self, name: str) -> bool:
        """Tensors a load does not require: FP8 block scales (a float weight is quantized at load)."""
        return name.endswith(".weight_scale_inv")

    def check_weight_names(self, dtypes: dict) -> None:
        """Before a load or update copies anything: FP8 weights and their scales come in pairs."""
        check_fp8_pairs(self.hf_targets, dtypes)

    def skips_hf_name(self, name: str) -> bool:
        """Whether a checkpoint tensor of this name is not needed (loading and updates ignore it)."""
        # some tied checkpoints also store the (identical) head: skip it; mtp.* heads that the
        # config does not declare are ignored, as transformers ignores them
        return (name.endswith(_IGNORED_SUFFIXES) or name.startswith(self.spec.hf_ignored_prefixes)
                or (self.mtp is None and name.startswith(MTP_PREFIX))
                or (self.lm_head.is_tied and name == "lm_head.weight"))

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.mtp is None:
            load_hf_weights(self.hf_targets(), weights, self.skips_hf_name, self.canonical_name, self.spec.name, self)
        elif not load_main_and_mtp(self.hf_targets(), weights, self.skips_hf_name, self.canonical_name, self.spec.name,
                                   self):
            log.warning("%s: config.json declares %d MTP depths but the checkpoint has no mtp.* tensors: "
                        "loaded without MTP heads", self.spec.name, self.mtp.num_depths)
            self.mtp = None
