"""A step replays the smallest captured sampling variant that covers it (graph_plan.py); every
larger variant that covers it must draw the same tokens, or a step's tokens would depend on
which graphs were captured. For greedy, temperature, top-p and top-k steps, with and without
log-probs: ``SampleLauncher.sample_with_log_probs`` with the step's own flags and with each
covering variant's flags (log-prob twins included) returns the tokens of the plain draw. Torch
backend on the CPU; the Triton sampler at Qwen3's vocabulary and 128 rows on CUDA. Times:
``python -m benchmarks kernel-times graph-variants``."""
import pytest
import torch

from tests.helpers.sampling_variant_cases import STEPS, VARIANTS, covers, exact_shape, launcher, step_rows, variant_shape


def _covering_variants_draw_the_same_tokens(backend: str, rows: int, vocab: int, device: str) -> None:
    sampler = launcher(backend, rows, vocab, device)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (0.3 * torch.randn(rows, vocab, generator=gen, device=device)).to(torch.bfloat16)
    if not sampler.reads_model_dtype:
        logits = logits.float()  # the step's float32 copy for the torch sampler
    for case, (t, k, p, exact) in STEPS.items():
        g = step_rows(rows, t, k, p, device)
        base = sampler(logits, g, rows, exact[0], exact[1], False)
        got = sampler.sample_with_log_probs(logits, g, rows, exact_shape(exact), False)[0]
        assert torch.equal(got, base), (case, "exact flags")
        for variant, log_probs in VARIANTS:
            if covers(variant, log_probs, vocab, exact):
                got = sampler.sample_with_log_probs(logits, g, rows, variant_shape(variant, log_probs, vocab), False)[0]
                assert torch.equal(got, base), (case, variant.value, log_probs)


def test_covering_variants_draw_the_same_tokens():
    _covering_variants_draw_the_same_tokens("torch", 6, 97, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_covering_variants_draw_the_same_tokens_on_gpu():
    _covering_variants_draw_the_same_tokens("triton", 128, 151_936, "cuda")
