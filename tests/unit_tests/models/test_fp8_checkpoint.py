"""FP8 weights at load: a checkpoint in the published block-scaled layout (``weight`` e4m3 +
``weight_scale_inv``, an ignored module kept in bf16) loads as it is, equal bit for bit to the
same bf16 checkpoint quantized at load (``quantization="fp8"``); transformers reads the layout back;
TP shards of weights and scales are slices of the full ones (exact, except within one e4m3
rounding where a shard's K range starts inside a block), quantized at load or not; configs and
pairs that cannot be served are refused with the reason."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_async.kernels import fp8_quant as fq
from megatron_async.models.checkpoint import load_checkpoint
from megatron_async.models.fp8_writer import write_fp8_checkpoint
from megatron_async.models.quantization import Fp8Config, Fp8ConfigError
from megatron_async.parallel.state import ParallelState
from tests.helpers.hf_models import make_tiny_checkpoint

IGNORED = ("model.layers.1.mlp.down_proj",)
# q / k / v 128 / 64 / 64 rows (v starts inside a block), gate / up 320 (up too), hidden 192 (K ragged)
SMALL = dict(hidden_size=192, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
# TP 2: q / k / v 128 / 64 / 64 per rank, gate / up 192 per rank (rank 1 starts inside a block), down K 192
TP = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_ckpt")
    out = {}
    for name, cfg in (("small", SMALL), ("tp", TP)):
        src = make_tiny_checkpoint("Qwen3ForCausalLM", root / f"{name}_bf16", seed=0, tie_word_embeddings=False,
                                   **cfg)
        write_fp8_checkpoint(src, root / f"{name}_fp8", IGNORED if name == "small" else ())
        out[name] = (src, root / f"{name}_fp8")
    return out


def dequantized(lin) -> torch.Tensor:
    return fq.dequantize_weight(lin.weight, lin.weight_scale_inv, lin.scale_block_n)


def test_published_checkpoint_loads_as_it_is_and_equals_quantize_at_load(ckpts):
    src, dst = ckpts["small"]
    stored = load_file(str(dst / "model.safetensors"))
    fp8, hf_config = load_checkpoint(dst)
    assert Fp8Config.from_hf(hf_config).prequantized
    at_load, _ = load_checkpoint(src, quantization="fp8")
    other = dict(at_load.named_parameters())
    for name, a in fp8.named_parameters():
        b = other[name]
        if name == "blocks.3.mixer.down_proj.weight":  # the ignored module: bf16 in the checkpoint only
            continue
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == fq.FP8 else a,
                                                  b.view(torch.uint8) if b.dtype == fq.FP8 else b), name
    attn, mlp1 = fp8.blocks[0].mixer, fp8.blocks[3].mixer
    assert attn.qkv_proj.scale_block_n == 1 and attn.o_proj.scale_block_n == 128
    p = "model.layers.0.self_attn"
    q = stored[f"{p}.q_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight[:128].view(torch.uint8), q.view(torch.uint8))
    v_grid = stored[f"{p}.v_proj.weight_scale_inv"]
    assert torch.equal(attn.qkv_proj.weight_scale_inv[192:], fq.row_scales(v_grid, 64))
    full = torch.cat([fq.dequantize_weight(stored[f"{p}.{n}_proj.weight"], stored[f"{p}.{n}_proj.weight_scale_inv"])
                      for n in "qkv"])
    assert torch.equal(dequantized(attn.qkv_proj), full)
    assert mlp1.down_proj.weight.dtype == torch.float32 and mlp1.down_proj.weight_scale_inv is None  # ignored
    assert mlp1.gate_up_proj.weight.dtype == fq.FP8


def test_fp8_layers_are_close_to_the_float_layers(ckpts):
    src, dst = ckpts["small"]
    ref, fp8 = load_checkpoint(src)[0], load_checkpoint(dst)[0]
    g = torch.Generator().manual_seed(0)
    pairs = [(ref.blocks[1].mixer, fp8.blocks[1].mixer, torch.randn(5, 192, generator=g)),  # gate_up + down
             (ref.blocks[0].mixer.o_proj, fp8.blocks[0].mixer.o_proj, torch.randn(5, 128, generator=g))]
    for a, b, x in pairs:
        want, got = a(x), b(x)
        rel = (got - want).norm() / want.norm()
        assert 1e-4 < rel < 0.08, rel  # FP8 moves the outputs, a little


def test_published_layout_reads_back_in_transformers(ckpts):
    """(On the 128-multiple shapes: transformers refuses others, which this engine loads.)"""
    transformers = pytest.importorskip("transformers")
    _, dst = ckpts["tp"]
    stored = load_file(str(dst / "model.safetensors"))
    assert stored["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)
    assert "lm_head.weight_scale_inv" not in stored and "model.layers.0.mlp.gate.weight" not in stored
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    try:
        back = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    except (ImportError, ValueError, RuntimeError) as e:  # transformers' FP8 path needs more on some setups
        pytest.skip(f"transformers cannot read FP8 here: {e}")
    theirs = dict(back.named_parameters())
    name = "model.layers.0.mlp.gate_proj.weight"
    if theirs[name].dtype == fq.FP8:
        pytest.skip("transformers kept the weights in FP8 (no dequantization on this setup)")
    ours = fq.dequantize_weight(stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"])
    assert torch.equal(theirs[name], ours)


@pytest.mark.parametrize("r", [0, 1])
def test_tp_shards_of_weights_and_scales(ckpts, r):
    src, dst = ckpts["tp"]
    full, _ = load_checkpoint(dst)
    shard, _ = load_checkpoint(dst, parallel=ParallelState(tp_rank=r, tp_size=2))
    at_load, _ = load_checkpoint(src, parallel=ParallelState(tp_rank=r, tp_size=2), quantization="fp8")
    attn, fa = shard.blocks[0].mixer, full.blocks[0].mixer
    rows = [slice(r * 128, r * 128 + 128), slice(256 + r * 64, 320 + r * 64), slice(384 + r * 64, 448 + r * 64)]
    assert torch.equal(dequantized(attn.qkv_proj), torch.cat([dequantized(fa.qkv_proj)[s] for s in rows]))
    assert attn.qkv_proj.scale_block_n == 1  # k, v of 64 rows
    assert torch.equal(dequantized(attn.o_proj), dequantized(fa.o_proj)[:, r * 128:(r + 1) * 128])
    mlp, fm = shard.blocks[1].mixer, full.blocks[1].mixer
    gate_up = torch.cat([dequantized(fm.gate_up_proj)[i * 384 + r * 192:i * 384 + (r + 1) * 192] for i in (0, 1)])
    assert torch.equal(dequantized(mlp.gate_up_proj), gate_up)  # rows start inside a block: one scale per row
    want = dequantized(fm.down_proj)[:, r * 192:(r + 1) * 192]
    got = dequantized(mlp.down_proj)
    if r == 0:
        assert torch.equal(got, want)  # K starts on a block: exact
    else:  # K starts inside a block: requantized on this rank's grid, within one e4m3 rounding
        assert not torch.equal(got, want) and bool(((got - want).abs() <= want.abs() * 2.0 ** -3 + 1e-6).all())
    # quantized at load on the full tensors' row blocks: the same bits as the FP8 checkpoint's shards,
    # also where a shard's rows start inside a block (rank 1's gate / up, k / v of 64 rows)
    for a, b in ((at_load.blocks[0].mixer.qkv_proj, attn.qkv_proj), (at_load.blocks[0].mixer.o_proj, attn.o_proj),
                 (at_load.blocks[1].mixer.gate_up_proj, mlp.gate_up_proj)):
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.weight_scale_inv, b.weight_scale_inv)


def test_unservable_configs_are_refused():
    with pytest.raises(Fp8ConfigError, match="quant_method"):
        Fp8Config.from_hf({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(Fp8ConfigError, match="per-tensor"):
        Fp8Config.from_hf({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(Fp8ConfigError, match="quantization must be"):
        Fp8Config.resolve("int4", None)
    cfg = Fp8Config.from_hf({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                     "ignored_layers": ["model.layers.0.self_attn.k_proj"]}})
    assert cfg.quantizes("model.layers.0.mlp.experts.3.down_proj") and not cfg.quantizes("model.layers.0.mlp.gate")
    assert not cfg.quantizes("lm_head") and not cfg.quantizes("model.layers.0.mixer.conv1d")
    with pytest.raises(Fp8ConfigError, match="stacked"):
        cfg.fused([f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])


def test_missing_or_unpaired_scales_are_refused(ckpts, tmp_path):
    _, dst = ckpts["small"]
    stored = load_file(str(dst / "model.safetensors"))
    del stored["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(stored, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((dst / "config.json").read_text())
    with pytest.raises(ValueError, match="k_proj.weight is e4m3 but comes without"):
        load_checkpoint(bad)
