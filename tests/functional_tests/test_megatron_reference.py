"""Megatron-Core itself as the reference (CPU, gloo; skipped without megatron-core): the same
weights in a Megatron-Core GPTModel's forward and in the engine after ``update_weights`` from the
model's ``named_parameters()`` give the same log-probs (fp32, 1e-5): dense (untied, tied), MoE
(local experts, and the Transformer-Engine / grouped-expert names), Megatron TP 2 (two processes,
their shards reassembled by the engine) and expert parallelism 2. In a world of one, a fresh engine
loaded from the equivalent HF checkpoint gives the same log-probs and the same greedy tokens as the
updated one. The comparison (``tests/helpers/mcore_reference.py``) is the GPU tests' too
(``test_megatron_reference_gpu.py``), whose flows (``tests/helpers/mcore_gpu.py``: trainer and
engine in one process; the trainer in another, shared-memory IPC) also run here in bf16."""
import pytest
import torch

from megatron_async import LLM, InferenceConfig
from tests.helpers.requirements import installed

pytestmark = pytest.mark.skipif(not installed("megatron.core", "einops"), reason="megatron-core not installed")

from tests.helpers.mcore_cpu import TinyShape, mcore_rank, mcore_rank_jobs, write_engine_checkpoint  # noqa: E402
from tests.helpers.mcore_gpu import colocated_rank, ipc_refit  # noqa: E402
from tests.helpers.mcore_reference import BF16_TOL, PROMPT, against_fresh, log_probs_of, refit, te_names  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402

TOL = 1e-5
KV_BLOCKS = 64
"""The engines' pool (one short prompt each): the CPU default is 1 GB, zeroed at every build."""
ONE_RANK = [TinyShape(), TinyShape(tied=True), TinyShape(num_experts=4)]


@pytest.fixture(scope="module")
def one_rank_jobs():
    """Every 1-rank case's Megatron-Core items, logits and HF tensors from one process (importing
    Megatron-Core takes seconds), by shape; the TE-names case renames the MoE model's items."""
    (jobs,) = run_ranks(mcore_rank, 1, ONE_RANK, 1, 1, PROMPT, timeout_s=240)
    return dict(zip(ONE_RANK, jobs))


TWO_RANKS = [([TinyShape()], 2, 1), ([TinyShape(num_experts=4)], 1, 2)]


@pytest.fixture(scope="module")
def two_rank_jobs():
    """The TP 2 and EP 2 cases' per-rank results, by (tp, ep), from one 2-rank world (Megatron-Core's
    parallel state rebuilt between them): one start and import per rank instead of two."""
    ranks = run_ranks(mcore_rank_jobs, 2, TWO_RANKS, PROMPT, timeout_s=240)
    return {(tp, ep): [jobs[i][0] for jobs in ranks] for i, (_, tp, ep) in enumerate(TWO_RANKS)}


@pytest.mark.parametrize("shape,tp,ep,te", [
    (TinyShape(), 1, 1, False), (TinyShape(tied=True), 1, 1, False), (TinyShape(num_experts=4), 1, 1, False),
    (TinyShape(num_experts=4), 1, 1, True), (TinyShape(), 2, 1, False), (TinyShape(num_experts=4), 1, 2, False),
], ids=["dense", "tied", "moe", "moe-te-names", "tp2", "moe-ep2"])
def test_engine_after_update_equals_megatron_core(request, tmp_path, shape, tp, ep, te):
    if tp * ep == 1:
        ranks = [request.getfixturevalue("one_rank_jobs")[shape]]
    else:
        ranks = request.getfixturevalue("two_rank_jobs")[tp, ep]
    items = [(n, torch.from_numpy(a), shard) for rank_items, _, _ in ranks
             for n, a, shard in (te_names(rank_items) if te else rank_items)]
    logits, hf = torch.from_numpy(ranks[0][1]), ranks[0][2]
    assert logits.shape == (len(PROMPT), shape.vocab_size)
    want = log_probs_of(logits)
    llm = LLM(str(write_engine_checkpoint(shape, tmp_path / "engine")), dtype="float32",
              inference_config=InferenceConfig(num_kv_blocks=KV_BLOCKS))
    check = refit(llm, lambda: llm.update_weights(items), want)
    if hf is not None:
        fresh = LLM(str(write_engine_checkpoint(shape, tmp_path / "hf", tensors=hf)), dtype="float32",
                    inference_config=InferenceConfig(num_kv_blocks=KV_BLOCKS))
        against_fresh(check, llm, fresh, want)
    print(check.row(request.node.callspec.id))
    check.assert_within(TOL)


@pytest.mark.parametrize("flow", ["colocated-moe-bf16", "ipc-moe-te-names-bf16"])
def test_gpu_flows_in_bf16_on_cpu(request, tmp_path, flow):
    shape = TinyShape(num_experts=4)
    if flow == "colocated-moe-bf16":
        check = run_ranks(colocated_rank, 1, shape, "bfloat16", False, tmp_path, "cpu", timeout_s=240)[0]
    else:
        check = ipc_refit(shape, True, tmp_path, device="cpu")
    print(check.row(request.node.callspec.id))
    check.assert_within(BF16_TOL)
