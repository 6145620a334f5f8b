"""Hybrid models (NemotronH, Bamba, Mamba2) against transformers on tiny random checkpoints:
packed ragged prefill, chunked prefill mixed with decode rows, greedy decoding, weight loading."""
import pytest
import torch
from safetensors.torch import load_file

from megatron_async.forward_batch import MambaMetadata
from megatron_async.models.checkpoint import load_checkpoint, read_hf_config
from megatron_async.models.hybrid import build_hybrid
from tests.helpers.engine_harness import forbid_host_traffic
from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import hf_greedy, hf_logits, load_hf_reference
from tests.helpers.simple_session import SimpleSession

VOCAB = 128  # the tiny checkpoints' vocabulary


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def pair(request, tmp_path_factory):
    """(checkpoint path, HF reference model, our model) for one architecture."""
    path = make_tiny_hybrid_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, load_hf_reference(path), load_checkpoint(path)[0]


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _poisoned_session(model) -> SimpleSession:
    """A session whose state slots hold garbage, as reused slots do: rows without an initial
    state must not read it."""
    session = SimpleSession(model)
    for pool in session.conv_states + session.ssm_states:
        pool.normal_(generator=torch.Generator().manual_seed(99))
    return session


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < rel, f"max error {err:.2e} relative to the largest logit"


def test_packed_ragged_prefill_matches_hf(pair):
    _, hf, ours = pair
    prompts = [_tokens(i, n) for i, n in enumerate((9, 1, 13, 6))]  # 13 > 3 chunks of 4
    logits = _poisoned_session(ours).step(list(enumerate(prompts)))
    _assert_close(logits, torch.cat([hf_logits(hf, p) for p in prompts]))


def test_dt_limit_clamps_like_hf_prefill(tmp_path):
    """An upper time_step_limit inside the tiny models' step sizes (0.05-0.3) bites. Only
    prefill is compared: transformers' torch decode step ignores time_step_limit."""
    path = make_tiny_hybrid_checkpoint("Mamba2ForCausalLM", tmp_path, time_step_limit=(0.0, 0.1))
    ours, hf = load_checkpoint(path)[0], load_hf_reference(path)
    prompts = [_tokens(60, 10), _tokens(61, 3)]
    _assert_close(SimpleSession(ours).step(list(enumerate(prompts))), torch.cat([hf_logits(hf, p) for p in prompts]))


def test_chunked_prefill_mixed_with_decode_matches_hf(pair):
    """Every token's logits, fed over five steps mixing prefill chunks and decode rows, equal
    the HF full-sequence forward of each sequence."""
    _, hf, ours = pair
    seqs = {0: _tokens(10, 16), 1: _tokens(11, 10), 2: _tokens(12, 4), 3: _tokens(13, 2)}
    schedule = [
        [(0, seqs[0][0:5]), (1, seqs[1][0:6])],
        # one-token prefill row (no initial state) among a chunk continuation and a decode row
        [(1, seqs[1][6:7]), (0, seqs[0][5:9]), (2, seqs[2][0:1])],
        [(2, seqs[2][1:2]), (0, seqs[0][9:14]), (1, seqs[1][7:8])],
        # decode-only step in which a new one-token prompt starts from zeros
        [(0, seqs[0][14:15]), (1, seqs[1][8:9]), (2, seqs[2][2:3]), (3, seqs[3][0:1])],
        [(3, seqs[3][1:2]), (1, seqs[1][9:10]), (2, seqs[2][3:4]), (0, seqs[0][15:16])],
    ]
    session = _poisoned_session(ours)
    got: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    for rows in schedule:
        logits = session.step(rows)
        start = 0
        for seq, toks in rows:
            got[seq].append(logits[start : start + len(toks)])
            start += len(toks)
    for seq, toks in seqs.items():
        _assert_close(torch.cat(got[seq]), hf_logits(hf, toks))


def test_greedy_decode_matches_hf_generate(pair):
    _, hf, ours = pair
    prompts = [_tokens(20 + i, n) for i, n in enumerate((5, 1, 11))]
    num_new = 8
    session = _poisoned_session(ours)
    logits = session.step(list(enumerate(prompts)))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    out = [[t] for t in logits[ends].argmax(-1).tolist()]
    for _ in range(num_new - 1):
        logits = session.step([(i, [o[-1]]) for i, o in enumerate(out)])
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    for prompt, tokens in zip(prompts, out):
        assert tokens == hf_greedy(hf, prompt, num_new)


def test_forward_reads_nothing_back(pair, monkeypatch):
    """Neither decode-only nor mixed steps read a tensor on the host or build one from host
    data inside forward: every table comes with the batch (the engine's step snapshot)."""
    _, _, ours = pair
    session = SimpleSession(ours)
    session.step([(0, _tokens(30, 6)), (1, _tokens(31, 3))])
    forbid_host_traffic(ours, monkeypatch)
    session.step([(0, [1]), (1, [2]), (2, [3])])  # row 2: a new one-token prompt
    session.step([(0, [4, 5]), (1, [6])])  # mixed: a two-token chunk beside a decode token
    session.step([(0, [4, 5]), (1, [6]), (3, [7, 8, 9])])  # and a fresh prompt


@pytest.mark.gpu
def test_decode_only_step_does_not_sync_on_cuda(pair):
    path, hf, _ = pair
    model = load_checkpoint(path, device="cuda")[0]
    session = SimpleSession(model)
    prompts = [_tokens(40, 7), _tokens(41, 2)]
    session.step(list(enumerate(prompts)))
    forward = model.forward

    def guarded(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model.forward = guarded
    logits = session.step([(0, [1]), (1, [2])])
    _assert_close(logits.cpu(), torch.stack([hf_logits(hf, p + [t])[-1] for p, t in zip(prompts, (1, 2))]))
    session.step([(0, [3, 4]), (1, [5])])  # mixed steps plan their Mamba rows from the snapshot: no sync either

    def reads_back(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = forward(*args, **kwargs)
            torch.ones(1, device="cuda").item()
            return out
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model.forward = reads_back
    with pytest.raises(RuntimeError, match="synchroniz"):  # the detector works: a host read raises
        session.step([(0, [6]), (1, [7])])


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_load_errors_name_the_tensor(tmp_path):
    path = make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path)
    cfg = read_hf_config(path)
    weights = _weights(path)

    def load(w):
        build_hybrid(cfg, torch.float32, "cpu").load_hf_weights(w.items())

    missing = dict(weights)
    del missing["backbone.layers.0.mixer.dt_bias"]
    with pytest.raises(ValueError, match=r"missing tensors: backbone\.layers\.0\.mixer\.dt_bias"):
        load(missing)
    with pytest.raises(ValueError, match=r"unexpected tensors: backbone\.layers\.9\.norm\.weight"):
        load({**weights, "backbone.layers.9.norm.weight": torch.ones(32)})
    bad_shape = {**weights, "backbone.layers.0.mixer.conv1d.weight": torch.ones(80, 4)}
    with pytest.raises(ValueError, match=r"conv1d\.weight.*shape \(80, 4\).*\(80, 1, 4\)"):
        load(bad_shape)
    # The prefix transformers loads NemotronH with ("model.") and ignored MTP heads are accepted.
    renamed = {k.replace("backbone.", "model.", 1): v for k, v in weights.items()}
    load({**renamed, "mtp.layers.0.norm.weight": torch.ones(32)})


def test_tied_mamba2_with_legacy_embedding_name(tmp_path):
    path = make_tiny_hybrid_checkpoint("Mamba2ForCausalLM", tmp_path, tie_word_embeddings=True)
    weights = _weights(path)
    assert "lm_head.weight" not in weights
    weights["backbone.embedding.weight"] = weights.pop("backbone.embeddings.weight")  # mamba_ssm's name
    ours = build_hybrid(read_hf_config(path), torch.float32, "cpu")
    ours.load_hf_weights(weights.items())
    prompt = _tokens(50, 7)
    _assert_close(SimpleSession(ours).step([(0, prompt)]), hf_logits(load_hf_reference(path), prompt))
