"""GPT models loaded by megatron_async vs Hugging Face transformers on the same tiny random checkpoints:
teacher-forced logits of a ragged packed batch, and chunked prefill + greedy decode tokens."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async.models import load_checkpoint  # noqa: E402
from tests.helpers.hf_models import hf_greedy, hf_logits, load_hf_reference, make_tiny_checkpoint  # noqa: E402
from tests.helpers.simple_session import SimpleSession  # noqa: E402

torch.set_num_threads(1)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "llama-bias": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "llama-tied-llama3": ("LlamaForCausalLM", dict(tie_word_embeddings=True, rope_scaling=LLAMA3)),
    "qwen2": ("Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    "qwen2-tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen3-bias": ("Qwen3ForCausalLM", dict(attention_bias=True)),
    "qwen3-tied-yarn": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, max_position_embeddings=64,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
}
ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": LLAMA3,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8},
}
PROMPTS = [[5, 17, 3, 99, 42, 8, 250, 1, 64], [7], [200, 11, 11, 11, 37], list(range(30, 70, 3))]


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.cpu() - ref).abs().max() / ref.abs().max())


def check_teacher_forced(path, prompts, device="cpu", tol=1e-4):
    """Every prompt packed into ONE step; logits of every token vs HF full-sequence forward."""
    ref = load_hf_reference(path)
    model, _ = load_checkpoint(path, device, torch.float32)
    session = SimpleSession(model, max_seqs=len(prompts), max_len=max(map(len, prompts)) + 4)
    logits = session.step(list(enumerate(prompts)))
    offset = 0
    for prompt in prompts:
        ours = logits[offset:offset + len(prompt)]
        offset += len(prompt)
        assert _rel_err(ours, hf_logits(ref, prompt)) < tol


def greedy_chunked(model, prompts, chunk_sizes, start_steps, num_tokens, max_len):
    """Prefill each prompt in chunks of chunk_sizes[i] starting at step start_steps[i], packed with
    other rows' prefill chunks and decode tokens; then decode greedily. Row order alternates."""
    session = SimpleSession(model, max_seqs=len(prompts), max_len=max_len, block_size=4)
    fed = [0] * len(prompts)
    generated: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(g) < num_tokens for g in generated):
        rows = []
        for i, prompt in enumerate(prompts):
            if step < start_steps[i] or len(generated[i]) == num_tokens:
                continue
            if fed[i] < len(prompt):
                toks = prompt[fed[i]:fed[i] + chunk_sizes[i]]
                fed[i] += len(toks)
            else:
                toks = [generated[i][-1]]
            rows.append((i, toks))
        if step % 2:
            rows.reverse()
        logits = session.step(rows)
        ends = torch.tensor([len(t) for _, t in rows]).cumsum(0) - 1
        picks = logits[ends].argmax(-1).tolist()
        for (i, _), tok in zip(rows, picks):
            if fed[i] == len(prompts[i]):  # prompt complete: this row produced a token
                generated[i].append(tok)
        step += 1
    return generated


def check_greedy(path, prompts, num_tokens, device="cpu", chunk_sizes=None, start_steps=None):
    ref = load_hf_reference(path)
    model, _ = load_checkpoint(path, device, torch.float32)
    chunk_sizes = chunk_sizes or [3, 1, 2, 5][: len(prompts)]
    start_steps = start_steps or [0, 1, 2, 3][: len(prompts)]
    ours = greedy_chunked(model, prompts, chunk_sizes, start_steps, num_tokens,
                          max_len=max(map(len, prompts)) + num_tokens + 4)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(ref, prompt, num_tokens)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=list(CASES))
def case_ckpt(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    return make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param), **overrides)


def test_teacher_forced_logits_one_packed_step(case_ckpt):
    check_teacher_forced(case_ckpt, PROMPTS, "cpu")


def test_chunked_prefill_and_greedy_decode(case_ckpt):
    check_greedy(case_ckpt, PROMPTS, num_tokens=12, device="cpu")


@pytest.mark.parametrize("rope", list(ROPE_CASES))
def test_rope_scaling_long_positions(rope, tmp_path):
    """Positions well past original / max positions, where the scaling types differ most."""
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path, max_position_embeddings=32,
                                rope_scaling=ROPE_CASES[rope], num_hidden_layers=1)
    if rope == "dynamic":
        # HF rescales with the longest sequence of each forward call, so only
        # token-by-token decoding past max_position_embeddings is comparable.
        check_teacher_forced(path, [list(range(3, 35)), [9, 8, 7]], "cpu")
        check_greedy(path, [list(range(20, 40)), [4, 5, 6]], num_tokens=40, device="cpu",
                     chunk_sizes=[20, 3], start_steps=[0, 0])
    else:
        check_teacher_forced(path, [list(range(3, 100)), [9, 8, 7]], "cpu")
        check_greedy(path, [list(range(50, 70)), [4, 5, 6]], num_tokens=30, device="cpu")


@pytest.mark.gpu
@needs_cuda
def test_cuda_parity(case_ckpt):
    check_teacher_forced(case_ckpt, PROMPTS, "cuda")
    check_greedy(case_ckpt, PROMPTS, num_tokens=12, device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_cuda_forward_never_syncs(tmp_path):
    """The forward must not wait for the device (no .item() / .cpu() / data-dependent shapes)."""
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                max_position_embeddings=8)
    model, _ = load_checkpoint(path, "cuda", torch.float32)
    model.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode("error"))
    model.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("default"))
    try:
        greedy_chunked(model, PROMPTS, [3, 1, 2, 5], [0, 1, 2, 3], num_tokens=4, max_len=40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
