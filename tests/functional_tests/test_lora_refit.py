"""An adapter refit from a trainer process while the engine serves (RL with LoRA): the trainer
broadcasts the adapter's new weights as Megatron-Core TP shards over a gloo transfer group, the
engine takes them between two steps of a running request of that adapter, which goes on with the
new weights (its tokens and log-probs are those of an engine whose adapter ``update_lora`` rewrote
at the same step, and its weight versions change there); then the same through shared-memory IPC
handles, PEFT-named. An adapter that is not loaded is refused. On a GPU (``gpu``): CUDA IPC handles
and an engine with CUDA graphs, whose captured graphs read the rewritten slots."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.lora_refit import NEW, reference, refit_rank
from tests.helpers.multiprocess import free_port, run_ranks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_adapter_refit_over_gloo_and_shared_memory_while_serving(device):
    sent, (joined, before, first, during, second, after, refused) = run_ranks(
        refit_rank, 2, free_port(), free_port(), device, timeout_s=240)
    assert sent == "sent" and joined == 1
    assert first[0] == 200 and first[1]["weight_version"] == before + 1
    assert second[0] == 200 and second[1]["weight_version"] == before + 2
    want_during, want_after = reference(device)
    for (tokens, log_probs, versions), (want_tokens, want_log_probs, want_versions) in zip(
            [during, *after], [want_during, *want_after]):
        assert tokens == want_tokens and versions == want_versions
        if device == "cpu":
            assert log_probs == want_log_probs
        else:  # (the same kernels and batch; a tolerance for the GPU's reduction order)
            assert torch.allclose(torch.tensor(log_probs), torch.tensor(want_log_probs), atol=1e-4)
    tokens, _, versions = during
    switched = versions.index(before + 1)
    assert 0 < switched < NEW and versions == [before] * switched + [before + 1] * (NEW - switched)
    assert refused[0] == 400 and "no adapter 'zzz' is loaded" in refused[1]["error"]["message"]
