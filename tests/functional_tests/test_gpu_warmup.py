"""CUDA: after the startup warm-up, a run with staggered arrivals and every sampling feature
builds no Triton kernel and captures no graph, in eager and in graph mode; mixed steps replay
graphs, and their tokens equal eager (float32). Skipped without a GPU."""
import random

import pytest

from megatron_async import LLM
from tests.helpers.engine_harness import Arrival, make_llm, run_arrivals, sampling_mix
from tests.helpers.hf_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
N = 12
PARAMS = sampling_mix(N)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3"))


def _arrivals() -> list[Arrival]:
    """Poisson-like: gaps of 0-3 steps, prompts 3-150 tokens (chunked at 64 tokens per step)."""
    rng, step, out = random.Random(5), 0, []
    for i in range(24):
        step += rng.choice((0, 0, 1, 2, 3))
        out.append(Arrival(step, [rng.randrange(256) for _ in range(rng.randint(3, 150))], PARAMS[i % len(PARAMS)]))
    return out


def _run(ckpt, graphs: bool):
    cfg = make_llm(ckpt, cuda_graphs=graphs, attention_backend="triton", max_sequence_length=256).config
    llm = LLM(model=str(ckpt), device="cuda", dtype="float32", inference_config=cfg)  # warms up at build
    st = llm.engine.stats
    assert st.warmup_seconds > 0 and st.warmup_graphs == (len(llm.runner.graphs.plan.keys()) if graphs else 0)
    outs = run_arrivals(llm, _arrivals())
    return {i: o.generated_tokens for i, o in outs.items()}, st


def test_no_builds_or_captures_after_startup_warmup_and_mixed_graphs_equal_eager(ckpt):
    eager, st_e = _run(ckpt, graphs=False)
    assert st_e.triton_builds_after_warmup == 0 and st_e.prefill_steps > 0
    graphs, st_g = _run(ckpt, graphs=True)
    assert st_g.triton_builds_after_warmup == 0 and st_g.graph_captures_after_warmup == 0
    assert st_g.mixed_graph_replays > 0 and st_g.graph_replays == st_g.steps  # every step replayed a graph
    assert graphs == eager


def test_kernels_built_at_once_from_dry_captures_serve_the_same_tokens(tmp_path):
    """Shapes no other test uses (vocabulary 328, hidden 96, 3 query heads): the first engine
    meets unbuilt kernels, finds them by dry captures and builds them on threads (its graphs then
    capture without an eager run first, and serve the same tokens as the eager engine); then neither it
    nor a second engine built one kernel at a time builds anything while serving, and their
    tokens are equal (the dry pass left no buffer unwritten)."""
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "odd", vocab_size=328, hidden_size=96,
                                num_attention_heads=3, num_key_value_heads=1, head_dim=48)
    outs = []
    for threads, graphs in ((4, True), (0, False)):
        cfg = make_llm(path, cuda_graphs=graphs, attention_backend="triton", max_sequence_length=256,
                       startup_build_threads=threads).config
        llm = LLM(model=str(path), device="cuda", dtype="float32", inference_config=cfg)
        phases = llm.startup.phases
        if threads:
            assert phases["kernel builds"].builds > 0
            assert int(phases["kernel builds"].note.split()[0]) > 1  # dry captures go on past the first one
            assert phases["graph captures"].builds == 0  # the dry shapes covered what the graphs launch
            assert "without an eager run first" in phases["graph captures"].note  # built: no run before a capture
        else:
            assert "kernel builds" not in phases
        outs.append(_served_without_builds(llm, 328, 7, 5, 9))
    assert outs[0] == outs[1]


def _served_without_builds(llm, vocab: int, mul: int, base: int, step: int) -> dict:
    """Eight requests at once (prompt i: ``base + step * i`` tokens); asserts the engine built no
    kernel while serving them; closes it and returns the tokens by request."""
    arrivals = [Arrival(0, [(mul * i + j) % vocab for j in range(base + step * i)], PARAMS[i % len(PARAMS)])
                for i in range(8)]
    res = run_arrivals(llm, arrivals)
    assert llm.engine.stats.triton_builds_after_warmup == 0
    llm.close()
    return {i: o.generated_tokens for i, o in res.items()}


_FAILED_CAPTURE = """
import sys, torch
from megatron_async.inference.text_generation_controllers.kernel_prebuild import end_failed_capture
x, pool, stream = torch.ones(4, device="cuda"), torch.cuda.graph_pool_handle(), torch.cuda.Stream()
try:
    with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool, stream=stream, capture_error_mode="thread_local"):
        (x * 2).sum().item()  # a host read: the capture fails, as a dry step that needs the host does
    sys.exit(3)
except RuntimeError:
    pass
undone = end_failed_capture(pool) if sys.argv[1] == "undo" else None
torch.cuda.empty_cache()
p = torch.cuda.MemPool()
y = torch.empty(1 << 20, device="cuda")
del p, y  # a MemPool's destruction asserts that no capture is underway
torch.cuda.synchronize()
print("undone", undone, flush=True)
"""


@pytest.mark.parametrize("undo", [True, False])
def test_failed_dry_capture_leaves_no_capture_underway(undo):
    """A dry capture that fails (a step that reads the host) must not leave the allocator
    believing a capture is underway: once the next MemPool is destroyed (torch-memory-saver's,
    at exit) the process would abort. Without ``end_failed_capture`` it does abort, which
    shows the case is the one the engine's dry pass meets."""
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", _FAILED_CAPTURE, "undo" if undo else "keep"], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    if undo:
        assert r.returncode == 0 and "undone True" in r.stdout, r.stderr[-2000:]
    else:
        assert r.returncode != 0 and "captures_underway" in r.stderr, (r.returncode, r.stdout, r.stderr[-2000:])


_MEMORY_PROFILE = """
import sys
from megatron_async import LLM
from megatron_async.config import InferenceConfig
from megatron_async.inference.text_generation_controllers import kernel_prebuild
if sys.argv[2] == "cold-cublas":
    kernel_prebuild.warm_libraries = lambda model, stream: None
cfg = InferenceConfig(block_size_tokens=4, max_requests=16, max_tokens=64, max_sequence_length=256,
                      startup_warmup=False, startup_build_threads=4)
llm = LLM(model=sys.argv[1], device="cuda", dtype="float32", inference_config=cfg)
print("memory profile:", llm.memory_plan.probe_build, flush=True)
"""


def test_the_memory_profile_step_is_captured_dry_in_a_fresh_process(ckpt):
    """The memory profile's step (every feature, max_tokens tokens) is the process's first
    matmul: its kernels are built on threads only if its dry capture succeeds, which needs cuBLAS
    set up outside the capture (``warm_libraries``). Without it the capture fails, which shows
    that a fresh process is the case this test meets."""
    import subprocess
    import sys
    from pathlib import Path

    notes = {}
    for case in ("warmed", "cold-cublas"):
        r = subprocess.run([sys.executable, "-c", _MEMORY_PROFILE, str(ckpt), case], capture_output=True, text=True,
                           timeout=300, cwd=Path(__file__).resolve().parents[2])
        assert r.returncode == 0, r.stderr[-3000:]
        notes[case] = r.stdout.split("memory profile:")[-1].strip()
    assert notes["warmed"].startswith("1 step captured dry") and " 0 kernels" not in notes["warmed"], notes
    assert notes["cold-cublas"].startswith("0 steps captured dry"), notes


def test_the_memory_profile_builds_the_warm_up_kernels_and_the_warm_up_checks_them(tmp_path):
    """With the pool sized from measured memory, the probe's dry pass captures the warm-up's eager
    shapes too: one pass of compiles. The warm-up captures two of them again on the real context
    (meeting nothing new), builds nothing, and serving builds nothing either; the tokens equal an
    engine whose pool size was given (warm-up shapes found by its own dry pass)."""
    from megatron_async.config import InferenceConfig

    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "odd", vocab_size=344, hidden_size=96,
                                num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    outs = []
    for planned in (True, False):
        size = dict(gpu_memory_utilization=0.3) if planned else dict(num_kv_blocks=256)
        cfg = InferenceConfig(block_size_tokens=4, max_requests=16, max_tokens=64, max_sequence_length=256,
                              cuda_graphs=True, attention_backend="triton", startup_build_threads=4, **size)
        llm = LLM(model=str(path), device="cuda", dtype="float32", inference_config=cfg)
        assert (llm.memory_plan is not None) == planned
        if planned:
            plan, builds = llm.memory_plan, llm.startup.phases["kernel builds"]
            assert int(plan.probe_build.split()[0]) > 10 and len(plan.prebuilt_shapes) > 10, plan.probe_build
            assert builds.note.startswith("2 steps captured dry (") and " more built before" in builds.note, builds.note
            assert builds.builds == 0 and llm.startup.phases["graph captures"].builds == 0
        outs.append(_served_without_builds(llm, 344, 5, 4, 11))
    assert outs[0] == outs[1]


def test_a_check_that_meets_a_new_kernel_captures_every_shape(tmp_path, monkeypatch):
    """``built_before`` naming every eager shape: when the two checked shapes meet nothing the
    process had not met, the others are assumed built; when the check meets a specialization
    (planted: the build hook's record grows during it), every shape is captured dry."""
    from megatron_async.inference import triton_builds
    from megatron_async.inference.text_generation_controllers.kernel_prebuild import prebuild, shape_key
    from megatron_async.inference.text_generation_controllers.warmup import eager_shapes

    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "odd2", vocab_size=352)
    llm = make_llm(path, device="cuda", cuda_graphs=False, attention_backend="triton", startup_warmup=False,
                   startup_build_threads=4)
    shapes = eager_shapes(llm.runner)
    named = frozenset(shape_key(s) for s in shapes)
    prebuild(llm.runner, shapes, 4)  # every kernel of these shapes built
    trusted = prebuild(llm.runner, shapes, 4, built_before=named)
    assert trusted.shapes == 2 and trusted.assumed == len(shapes) - 2 and trusted.kernels == 0
    assert len(trusted.covered) == len(shapes) and not trusted.left
    real_seen, calls = triton_builds.seen, []

    def growing():  # one more specialization met after the pass's first look
        calls.append(1)
        return real_seen() + [object()] * (len(calls) > 1)

    monkeypatch.setattr(triton_builds, "seen", growing)
    checked = prebuild(llm.runner, shapes, 4, built_before=named)
    assert checked.assumed == 0 and checked.shapes == len(shapes) and not checked.left
    llm.close()


@pytest.mark.parametrize("plant", [False, True])
def test_dry_captures_run_a_prefix_of_the_blocks_or_every_block_when_it_misses_kernels(tmp_path, monkeypatch,
                                                                                      caplog, plant):
    """The dry pass captures with the shortest prefix of blocks that stands for the model (4 of
    its 8 attention / MLP blocks) after checking it against every block on the largest decode and
    mixed shape. Planted: the build hook's record grows during the capture of every block (a
    kernel the prefix did not meet): the pass drops the prefix and runs every block. Either way
    the engine builds nothing while serving."""
    import logging

    from megatron_async.inference import triton_builds
    from megatron_async.inference.text_generation_controllers import kernel_prebuild

    real, real_seen, ran, extra = kernel_prebuild._dry_capture, triton_builds.seen, [], []

    def spy(*args):
        blocks = args[6] if len(args) > 6 else None  # (runner, shape, stream, pool, kept, graphs, blocks)
        ran.append(blocks)
        if plant and blocks is None and not extra:
            extra.append(object())
        return real(*args)

    monkeypatch.setattr(kernel_prebuild, "_dry_capture", spy)
    monkeypatch.setattr(triton_builds, "seen", lambda: real_seen() + extra)
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "odd3", vocab_size=360, hidden_size=80,
                                num_attention_heads=5, num_key_value_heads=1, head_dim=16, num_hidden_layers=4)
    cfg = make_llm(path, cuda_graphs=False, attention_backend="triton", max_sequence_length=256,
                   startup_build_threads=4).config
    with caplog.at_level(logging.INFO, logger="megatron_async"):
        llm = LLM(model=str(path), device="cuda", dtype="float32", inference_config=cfg)
    assert ("do not stand for the others" in caplog.text) == plant, caplog.text[-2000:]
    prefix = [0, 1, 2, 3]
    assert ran[:2] == [prefix, prefix] and ran[2:4] == [None, None]  # the check: prefix, then every block
    later = {tuple(b) if b else None for b in ran[4:]}
    assert later == ({None} if plant else {tuple(prefix)}), ran
    assert len(_served_without_builds(llm, 360, 7, 5, 9)) == 8
