import pytest
import torch

from megatron_async.models import DEFAULT_CONFIGS, build_default_model
from megatron_async.models.gpt import build_gpt
from megatron_async.models.tiny_tokenizer import train_tiny_tokenizer
from tests.helpers.simple_session import SimpleSession


def test_tiny_is_seeded_and_runs():
    a, b, c = (build_default_model("tiny", seed=s) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    logits = SimpleSession(a, max_seqs=2, max_len=32).step([(0, [1, 2, 3]), (1, [4])])
    assert logits.shape == (4, DEFAULT_CONFIGS["tiny"]["vocab_size"]) and logits.dtype == torch.float32
    assert a.eos_token_id == 0 and a.vocab_size >= train_tiny_tokenizer().get_vocab_size()


def test_dtype_override():
    assert next(build_default_model("tiny", dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_qwen3_06b_shape():
    model = build_gpt(DEFAULT_CONFIGS["qwen3-0.6b"], torch.bfloat16, "meta")  # no memory, no init
    assert 595e6 < sum(p.numel() for p in model.parameters()) < 597e6
    spec = model.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (28, 8, 128)
    assert model.lm_head.is_tied


_META_BUILD = """
import json, sys
import torch
from megatron_async.inference.memory_profiling import builtin_weight_bytes
from megatron_async.models.layers.rope import RotaryEmbedding
n = builtin_weight_bytes("qwen3-0.6b", torch.bfloat16)
dynamo = "torch._dynamo" in sys.modules
meta, cpu = (RotaryEmbedding(128, 300, 1e6, None, torch.bfloat16, d).table for d in ("meta", "cpu"))
print(json.dumps({"bytes": n, "dynamo": dynamo, "tables": [list(meta.shape), list(cpu.shape)], "meta": meta.is_meta}))
"""


def test_a_meta_build_counts_the_weights_without_importing_dynamo():
    """CUDA start-up counts the built-in model's bytes from a build on the meta device before
    loading it; meta arithmetic (the rotary table) would import torch._dynamo, ~1 s. In a
    fresh process: the suite may have imported it already."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _META_BUILD], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert 2 * 595e6 < out["bytes"] < 2 * 597e6 + 2**26  # bf16 weights + rotary table
    assert out["dynamo"] is False
    assert out["tables"][0] == out["tables"][1] == [300, 128] and out["meta"]


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown default model"):
        build_default_model("huge")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qwen3_06b_builds_fast_on_cuda():
    import time

    torch.zeros(1, device="cuda")  # CUDA context start-up is not the model's cost
    start = time.perf_counter()
    model = build_default_model("qwen3-0.6b", "cuda", seed=3)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"building took {elapsed:.1f}s"
    assert next(model.parameters()).dtype == torch.bfloat16
    logits = SimpleSession(model, max_seqs=2, max_len=64, block_size=16).step([(0, list(range(40))), (1, [7])])
    assert logits.shape == (41, 151936) and torch.isfinite(logits).all()


def test_tiny_moe_expert_shards_are_slices_of_the_ep1_model():
    from megatron_async.parallel.state import ParallelState

    full = build_default_model("tiny-moe", seed=2)
    assert sum(type(b.mixer).__name__ == "MoEMixer" for b in full.blocks) == 3
    for rank in range(2):
        part = build_default_model("tiny-moe", seed=2, parallel=ParallelState(ep_rank=rank, ep_size=2))
        for name, p in part.state_dict().items():
            ref = full.state_dict()[name]
            if ".experts." in name:
                ref = ref[4 * rank:4 * (rank + 1)]
            assert torch.equal(p, ref), name
    logits = SimpleSession(full, max_seqs=2, max_len=32).step([(0, [1, 2, 3]), (1, [4])])
    assert logits.shape == (4, 1024) and torch.isfinite(logits).all()


def test_qwen3_30b_a3b_shape():
    model = build_gpt(DEFAULT_CONFIGS["qwen3-30b-a3b"], torch.bfloat16, "meta")
    assert 30.4e9 < sum(p.numel() for p in model.parameters()) < 30.6e9
    assert sum(type(b.mixer).__name__ == "MoEMixer" for b in model.blocks) == 48
