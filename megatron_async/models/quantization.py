"""Which linears are FP8: a checkpoint's ``quantization_config`` (published FP8 block-scaled
checkpoints, loaded as they are) or ``quantization="fp8"`` on a bf16 / fp32 checkpoint (quantized at
load), and the writer of the published layout.

The published layout (Qwen3-*-FP8, DeepSeek-V3): each quantized linear ``<module>`` stores
  <module>.weight            float8_e4m3fn [N, K]
  <module>.weight_scale_inv  float32 [ceil(N / 128), ceil(K / 128)]   (W ~= weight * scale, per block)
and everything else (embeddings, norms, the LM head, MoE routers, modules the config lists as not
converted) as in a bf16 checkpoint; config.json has
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
(``ignored_layers`` is another spelling of the last; ``fp8_writer.write_fp8_checkpoint`` writes
it). Activations are quantized per token in 1 x 128 groups at run time (kernels/fp8_quant.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass

QUANTIZABLE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj|out_proj)$"
                         r"|\.experts\.\d+\.(w1|w2|w3)$")
"""HF linears that may be FP8: attention, MLP and MoE expert projections (Mixtral's w1 / w2 / w3), Mamba in / out
projections. Never embeddings, norms, the LM head, MoE routers (``mlp.gate``), Mamba's conv1d /
A / D / dt, MTP heads' input projection (``fc``)."""

QUANTIZATIONS = ("fp8",)
"""``LLM(quantization=...)`` values (None: the checkpoint's own)."""


class Fp8ConfigError(ValueError):
    """A quantization setting this engine cannot serve (the message says why)."""


@dataclass(frozen=True)
class Fp8Config:
    """FP8 W8A8 with 128 x 128 weight blocks for one model."""

    ignored: tuple[str, ...] = ()
    """HF module paths (or trailing / leading parts of them) that stay in the checkpoint's precision."""
    prequantized: bool = False
    """The checkpoint stores e4m3 weights with ``weight_scale_inv`` (else they are quantized at load)."""

    @classmethod
    def from_hf(cls, hf_config: dict) -> Fp8Config | None:
        """The checkpoint's ``quantization_config`` (None: it has none)."""
        qc = hf_config.get("quantization_config")
        if qc is None:
            return None
        if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise Fp8ConfigError(f"quantization_config.quant_method {method!r} is not supported "
                                 "(only 'fp8' with weight_block_size [128, 128])")
        block = tuple(qc.get("weight_block_size") or ())
        if block != (128, 128):
            raise Fp8ConfigError(f"FP8 checkpoints need weight_block_size [128, 128], got {list(block) or None} "
                                 "(per-tensor FP8 checkpoints are not supported)")
        if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
            raise Fp8ConfigError(f"FP8 checkpoints need fmt e4m3 and dynamic activations, got {qc}")
        ignored = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
        return cls(ignored=tuple(ignored), prequantized=True)

    @classmethod
    def resolve(cls, quantization: str | None, hf_config: dict | None) -> Fp8Config | None:
        """``quantization`` ("fp8" or None) for a checkpoint with ``hf_config`` (None: built-in
        model): the checkpoint's own FP8 config wins ("fp8" on it changes nothing)."""
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise Fp8ConfigError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
        own = cls.from_hf(hf_config or {})
        if own is not None:
            return own
        return cls() if quantization == "fp8" else None

    def quantizes(self, hf_module: str) -> bool:
        """Whether the linear at ``hf_module`` (e.g. "model.layers.3.self_attn.q_proj") is FP8."""
        if QUANTIZABLE.search(hf_module) is None:
            return False
        return not any(hf_module == e or hf_module.endswith("." + e) or hf_module.startswith(e + ".")
                       for e in self.ignored)

    def fused(self, hf_modules: list[str]) -> bool:
        """One answer for HF modules stacked into one parameter (q / k / v, gate / up)."""
        answers = {m: self.quantizes(m) for m in hf_modules}
        if len(set(answers.values())) > 1:
            raise Fp8ConfigError(f"modules stacked into one parameter must all be FP8 or all not: {answers}")
        return next(iter(answers.values()))


@dataclass(frozen=True)
class QuantScope:
    """The FP8 config seen from one mixer (its HF module path): what its layers ask when built."""

    config: Fp8Config | None = None
    prefix: str = ""

    def fp8(self, *modules: str) -> bool:
        """Whether the linear stacking the HF ``modules`` (relative to the mixer) is FP8."""
        if self.config is None:
            return False
        return self.config.fused([f"{self.prefix}.{m}" if self.prefix else m for m in modules])

    def child(self, name: str) -> QuantScope:
        return QuantScope(self.config, f"{self.prefix}.{name}" if self.prefix else name)


NO_QUANT = QuantScope()
