"""An adapter refit from a trainer process while the engine serves (RL with LoRA): the trainer
broadcasts the adapter's new weights as Megatron-Core TP shards over a gloo transfer group, the
engine takes them between two steps of a running request of that adapter, which goes on with the
new weights (its tokens and log-probs are those of an engine whose adapter ``update_lora`` rewrote
at the same step, and its weight versions change there); then the same through shared-memory IPC
handles, PEFT-named. An adapter that is not loaded is refused."""
from __future__ import annotations

from tests.helpers.lora_refit import NEW, reference, refit_rank
from tests.helpers.multiprocess import free_port, run_ranks


def test_adapter_refit_over_gloo_and_shared_memory_while_serving():
    sent, (joined, before, first, during, second, after, refused) = run_ranks(
        refit_rank, 2, free_port(), free_port(), timeout_s=240)
    assert sent == "sent" and joined == 1
    assert first[0] == 200 and first[1]["weight_version"] == before + 1
    assert second[0] == 200 and second[1]["weight_version"] == before + 2
    want_during, want_after = reference()
    assert during == want_during and after == want_after
    tokens, _, versions = during
    switched = versions.index(before + 1)
    assert 0 < switched < NEW and versions == [before] * switched + [before + 1] * (NEW - switched)
    assert refused[0] == 400 and "no adapter 'zzz' is loaded" in refused[1]["error"]["message"]
