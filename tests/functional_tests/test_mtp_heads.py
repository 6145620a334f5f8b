"""MTP heads: checkpoint names and config, ``scripts/add_mtp_heads.py``, and teacher-forced MTP
logits of the paged implementation (ragged packed steps, chunked prefill) against the dense
reference (testing/mtp_reference.py: HF main model + plain-torch MTP layer)."""
import json
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from megatron_async.models import load_checkpoint  # noqa: E402
from megatron_async.models.mtp_weights import mtp_depths  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.mtp_heads import add_mtp_heads  # noqa: E402
from tests.helpers.mtp_reference import MTPReference  # noqa: E402
from tests.helpers.simple_session import SimpleSession  # noqa: E402

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("base"), seed=3)


def _perturb_mtp_norms(path):
    """Unit norm weights would hide a swapped or mis-mapped norm: rewrite them ~1 + 0.1 N(0, 1)."""
    from safetensors.torch import save_file

    file = path / "model-mtp.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    gen = torch.Generator().manual_seed(7)
    for n, t in tensors.items():
        if "norm" in n:
            tensors[n] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(file))


@pytest.fixture(scope="module")
def mtp_ckpt(base_ckpt, tmp_path_factory):
    out = add_mtp_heads(base_ckpt, tmp_path_factory.mktemp("mtp") / "ckpt", depths=2, seed=5)
    _perturb_mtp_norms(out)
    return out


def test_config_keys():
    assert mtp_depths({}) == 0
    assert mtp_depths({"num_nextn_predict_layers": 2}) == 2
    assert mtp_depths({"mtp_num_hidden_layers": 1}) == 1
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        mtp_depths({"num_nextn_predict_layers": -1})


def test_script_adds_named_heads(base_ckpt, tmp_path):
    out = tmp_path / "with_mtp"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts/add_mtp_heads.py"), str(base_ckpt), str(out),
                    "--depths", "1", "--seed", "2"], check=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with safe_open(str(out / "model-mtp.safetensors"), "pt") as f:
        names = set(f.keys())
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight",
                 "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.q_proj.weight",
                 "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.post_attention_layernorm.weight",
                 "mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        assert name in names
    model, _ = load_checkpoint(out)
    assert model.num_mtp_depths == 1
    base, _ = load_checkpoint(base_ckpt)
    assert base.num_mtp_depths == 0
    with pytest.raises(ValueError, match="no MTP heads"):
        base.enable_mtp()


def test_missing_mtp_tensor_is_named(mtp_ckpt, tmp_path):
    from safetensors.torch import save_file

    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(mtp_ckpt, bad)
    with safe_open(str(bad / "model-mtp.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != "mtp.layers.1.mlp.up_proj.weight"}
    save_file(tensors, str(bad / "model-mtp.safetensors"))
    with pytest.raises(ValueError, match="mtp.layers.1.mlp.up_proj.weight"):
        load_checkpoint(bad)


def test_heads_without_tensors_or_config(mtp_ckpt, base_ckpt, tmp_path, caplog):
    """A config that declares heads its weights lack loads the main model (with a warning); heads
    that the config does not declare are ignored (as transformers ignores them)."""
    import shutil

    no_tensors = tmp_path / "no_tensors"
    shutil.copytree(base_ckpt, no_tensors)
    cfg = json.loads((no_tensors / "config.json").read_text())
    (no_tensors / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    model, _ = load_checkpoint(no_tensors)
    assert model.num_mtp_depths == 0 and "no mtp.* tensors" in caplog.text
    no_config = tmp_path / "no_config"
    shutil.copytree(mtp_ckpt, no_config)
    cfg = json.loads((no_config / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (no_config / "config.json").write_text(json.dumps(cfg))
    model, _ = load_checkpoint(no_config)
    assert model.num_mtp_depths == 0
    base, _ = load_checkpoint(base_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))


def test_kv_pool_grows_only_when_enabled(mtp_ckpt):
    model, _ = load_checkpoint(mtp_ckpt)
    main_layers = model.kv_cache_spec().num_layers
    model.enable_mtp()
    assert model.kv_cache_spec().num_layers == main_layers + 2


@pytest.mark.parametrize("depth", [0, 1])
def test_teacher_forced_mtp_logits_match_dense_reference(mtp_ckpt, depth):
    """Three sequences prefilled in ragged chunks, packed with each other, then decoded a few
    tokens (teacher forced); every position's MTP logits (the next token known: at a chunk's
    end, the first token of the next chunk) against the dense reference."""
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (23, 9, 30)]
    chunk = [5, 4, 7]
    prompt_len = [17, 9, 21]  # then one token per step (decode), teacher forced from the sequence
    model, _ = load_checkpoint(mtp_ckpt)
    model.enable_mtp()
    session = SimpleSession(model, max_seqs=3, max_len=40, block_size=4)
    fed = [0, 0, 0]
    got: list[dict[int, torch.Tensor]] = [{}, {}, {}]
    step = 0
    while any(f < len(s) - 1 for f, s in zip(fed, seqs)):
        rows = []
        for i, s in enumerate(seqs):
            if fed[i] >= len(s) - 1 or step < i:  # staggered starts; the last token has no next
                continue
            n = chunk[i] if fed[i] < prompt_len[i] else 1
            rows.append((i, fed[i], s[fed[i]:min(fed[i] + n, len(s) - 1)]))
        if step % 2:
            rows.reverse()
        hidden, batch = session.forward([(i, toks) for i, _, toks in rows])
        next_ids = torch.tensor([seqs[i][start + 1 + j] for i, start, toks in rows for j in range(len(toks))])
        out = model.mtp_forward(depth, next_ids, hidden, batch)
        logits = model.compute_logits(out)
        t = 0
        for i, start, toks in rows:
            for j in range(len(toks)):
                got[i][start + j] = logits[t]
                t += 1
            fed[i] += len(toks)
        step += 1
    ref = MTPReference(mtp_ckpt)
    for i, s in enumerate(seqs):
        expect = ref.teacher_forced(s, depth)
        ours = torch.stack([got[i][p] for p in range(len(s) - 1)])
        err = float((ours - expect).abs().max() / expect.abs().max())
        assert err < 1e-5, (i, err)
        assert ours.shape[0] == len(s) - 1
