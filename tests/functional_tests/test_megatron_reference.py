"""Megatron-Core itself as the reference (CPU, gloo; skipped without megatron-core): the same
weights in a Megatron-Core GPTModel's forward and in the engine after ``update_weights`` from the
model's ``named_parameters()`` give the same log-probs (fp32, 1e-5): dense (untied, tied), MoE
(local experts, and the Transformer-Engine / grouped-expert names), Megatron TP 2 (two processes,
their shards reassembled by the engine) and expert parallelism 2."""
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("einops")

from megatron_async import LLM, SamplingParams  # noqa: E402
from tests.helpers.mcore_cpu import TinyShape, mcore_rank, write_engine_checkpoint  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402

PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33]
TOL = 1e-5


def _prompt_log_probs(llm) -> list[float]:
    out = llm.generate([PROMPT], SamplingParams(num_tokens_to_generate=0, return_prompt_log_probs=True))[0]
    return out.prompt_log_probs


@pytest.mark.parametrize("shape,tp,ep,te", [
    (TinyShape(), 1, 1, False), (TinyShape(tied=True), 1, 1, False), (TinyShape(num_experts=4), 1, 1, False),
    (TinyShape(num_experts=4), 1, 1, True), (TinyShape(), 2, 1, False), (TinyShape(num_experts=4), 1, 2, False),
], ids=["dense", "tied", "moe", "moe-te-names", "tp2", "moe-ep2"])
def test_engine_after_update_equals_megatron_core(tmp_path, shape, tp, ep, te):
    ranks = run_ranks(mcore_rank, tp * ep, shape, tp, ep, te, PROMPT, timeout_s=240)
    items = [(n, torch.from_numpy(a), shard) for rank_items, _ in ranks for n, a, shard in rank_items]
    logits = torch.from_numpy(ranks[0][1])
    assert logits.shape == (len(PROMPT), shape.vocab_size)
    want = torch.log_softmax(logits, -1)
    want = [want[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    llm = LLM(str(write_engine_checkpoint(shape, tmp_path / "engine")), dtype="float32")
    before = _prompt_log_probs(llm)
    assert max(abs(a - b) for a, b in zip(before, want)) > 1e-2  # unrelated weights before the update
    assert llm.update_weights(items) == 1  # Megatron-Core names detected
    got = _prompt_log_probs(llm)
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL
