"""Weight updates of an FP8 model: bf16 tensors are requantized into the same storage (equal to a
fresh load, addresses kept, a partial update of one stacked part touches its rows only), FP8
tensors come with their scales, and a weight without its scales (or a scale without its weight)
is refused with nothing changed. The engine then generates with the new weights."""
import pytest
import torch
from safetensors.torch import load_file

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.kernels import fp8_quant as fq
from megatron_async.models import load_checkpoint
from megatron_async.models.fp8_writer import write_fp8_checkpoint
from megatron_async.models.weight_update import WeightUpdateError, update_weights_in_place
from tests.helpers.hf_models import load_hf_reference, make_tiny_checkpoint

SHAPE = dict(hidden_size=192, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_update")
    old = make_tiny_checkpoint("Qwen3ForCausalLM", root / "old", seed=0, **SHAPE)
    new = make_tiny_checkpoint("Qwen3ForCausalLM", root / "new", seed=1, **SHAPE)
    write_fp8_checkpoint(new, root / "new_fp8")
    return old, new, root / "new_fp8"


def _bits(model):
    return {n: (p.view(torch.uint8) if p.dtype == fq.FP8 else p).detach().clone() for n, p in model.named_parameters()}


def _addresses(model):
    return {n: p.data_ptr() for n, p in model.named_parameters()}


@pytest.mark.parametrize("source", ["bf16 tensors", "fp8 checkpoint", "fp8 tensors"])
def test_update_equals_a_fresh_load(ckpts, source):
    old, new, new_fp8 = ckpts
    model, _ = load_checkpoint(old, quantization="fp8")
    addresses, before = _addresses(model), _bits(model)
    if source == "bf16 tensors":
        weights = list(load_hf_reference(new).named_parameters())
    elif source == "fp8 checkpoint":
        weights = new_fp8
    else:
        weights = list(load_file(str(new_fp8 / "model.safetensors")).items())
    update_weights_in_place(model, weights)
    assert _addresses(model) == addresses
    expected = _bits(load_checkpoint(new_fp8)[0])
    for name, bits in _bits(model).items():
        assert torch.equal(bits, expected[name]), name
        assert not torch.equal(bits, before[name]), name


def test_bf16_update_of_one_part_requantizes_its_rows_only(ckpts):
    old, new, _ = ckpts
    model, _ = load_checkpoint(old, quantization="fp8")
    qkv = model.blocks[0].mixer.qkv_proj
    w0, s0 = qkv.weight.view(torch.uint8).clone(), qkv.weight_scale_inv.clone()
    name = "model.layers.0.self_attn.k_proj.weight"
    new_k = dict(load_hf_reference(new).named_parameters())[name]
    update_weights_in_place(model, [(name, new_k)])
    q, s = fq.quantize_weight(new_k)
    assert torch.equal(qkv.weight[128:192].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qkv.weight_scale_inv[128:192], fq.row_scales(s, 64))
    for rows in (slice(0, 128), slice(192, 256)):
        assert torch.equal(qkv.weight[rows].view(torch.uint8), w0[rows]) and torch.equal(qkv.weight_scale_inv[rows], s0[rows])


def test_unpaired_fp8_tensors_are_refused_and_nothing_changes(ckpts):
    old, _, new_fp8 = ckpts
    model, _ = load_checkpoint(old, quantization="fp8")
    before = _bits(model)
    stored = load_file(str(new_fp8 / "model.safetensors"))
    p = "model.layers.0.self_attn.q_proj"
    for bad, what in (([(f"{p}.weight", stored[f"{p}.weight"])], "without"),
                      ([(f"{p}.weight_scale_inv", stored[f"{p}.weight_scale_inv"])], "without its e4m3"),
                      ([("model.norm.weight", stored["model.norm.weight"].to(fq.FP8))], "refused dtypes"),
                      ([(f"{p}.weight", stored[f"{p}.weight"].float()),
                        (f"{p}.weight_scale_inv", stored[f"{p}.weight_scale_inv"])], "without its e4m3")):
        with pytest.raises(WeightUpdateError, match=what):
            update_weights_in_place(model, bad)
    after = _bits(model)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_engine_generates_with_the_updated_fp8_weights(ckpts):
    old, new, new_fp8 = ckpts
    cfg = InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=2, max_tokens=32, max_sequence_length=64)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True)
    prompt = [[3, 14, 15, 92, 65, 35]]
    llm = LLM(str(old), inference_config=cfg, quantization="fp8")
    assert llm.update_weights(list(load_hf_reference(new).named_parameters())) == 1
    out = llm.generate(prompt, sp)[0]
    assert out.weight_versions == [1] * 8
    assert out.generated_tokens == LLM(str(new_fp8), inference_config=cfg).generate(prompt, sp)[0].generated_tokens


def _fp8_model(kind, tp=1, rank=0):
    from megatron_async.models.gpt import build_gpt
    from megatron_async.models.quantization import Fp8Config
    from megatron_async.parallel.state import ParallelState
    from tests.helpers.refit_models import CONFIGS

    cfg = {k: v for k, v in CONFIGS[kind].items() if v is not None}
    return build_gpt(cfg, torch.float32, "cpu", ParallelState(tp_rank=rank, tp_size=tp), Fp8Config())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_pieces_and_megatron_shards_quantize_like_whole_tensors(kind):
    """A trainer's Megatron TP-2 shards (pieces of each HF tensor, staged until a box is whole)
    and the same tensors cut in random pieces give the bits of whole-tensor updates."""
    import random

    from megatron_async.models.slab_loading import Slab, WeightPlan
    from tests.helpers.refit_models import hf_weights, trainer_shards

    hf = hf_weights(kind, seed=3)
    whole = _fp8_model(kind)
    whole.load_hf_weights(hf.items())
    for source in ("megatron", "pieces"):
        model = _fp8_model(kind)
        if source == "megatron":
            update_weights_in_place(model, [item for rank in trainer_shards(kind, hf, tp=2) for item in rank])
        else:
            rng, slabs = random.Random(0), []
            for name, t in hf.items():
                cuts = sorted(rng.sample(range(1, t.shape[0]), min(3, t.shape[0] - 1))) if t.shape[0] > 1 else []
                for lo, hi in zip([0, *cuts], [*cuts, t.shape[0]]):
                    slabs.append(Slab(name, (lo,) + (0,) * (t.dim() - 1), (hi - lo, *t.shape[1:]), tuple(t.shape),
                                      t[lo:hi]))
            rng.shuffle(slabs)
            plan = WeightPlan(model, require_all=True)
            plan.check(slabs)
            plan.verify()
            plan.finish(plan.program(slabs).run((i, s.tensor) for i, s in enumerate(slabs)))
        want = _bits(whole)
        for name, bits in _bits(model).items():
            assert torch.equal(bits, want[name]), (source, name)
