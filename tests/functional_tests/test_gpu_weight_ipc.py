"""CUDA IPC refit on one GPU (tests/helpers/refit_ipc_gpu.py): a trainer process shares its
Megatron-Core-named weights (one flat bf16 buffer, or a storage per tensor) with the engine on the
same GPU; repeated
updates hit the cached copy plan, a change the trainer makes in place arrives, tensors the trainer
moves to new memory arrive (no old mapping is read), a payload from before ``release_after`` is
refused as stale, a storage per tensor is mapped once per allocator segment, and the engine then generates the tokens of the same weights given in-process;
an update of the 0.6B shape takes at most 20 ms once its plan is cached, whichever way it is
shared and launched; by the later updates the default copy kernel is the table (compiled on a thread
while the engine started)."""
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", ["flat", "separate"])
def test_ipc_refit_from_another_process_on_the_same_gpu(layout):
    from tests.helpers.refit_ipc_gpu import run

    rep = run("qwen3-0.6b", updates=4, layout=layout)
    assert rep.change_arrived and rep.tokens_equal, rep
    assert rep.moved_arrived and rep.moved_tokens_equal and rep.stale_refused, rep
    assert rep.plan_hits >= 3, rep
    assert rep.mapped == rep.entries and (layout == "flat" or rep.entries < rep.tensors), rep  # a map per segment
    assert rep.kernels["hot"] == "table" and rep.kernels["foreach"] == "foreach", rep  # compiled off start-up by now
    for times in (rep.hot_ms, rep.fresh_ms, rep.foreach_ms):
        assert sorted(times)[len(times) // 2] <= 20.0, rep
