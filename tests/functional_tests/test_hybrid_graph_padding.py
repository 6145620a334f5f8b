"""Mixed-step CUDA graphs of hybrid (Mamba) models on the CPU: the graph runner in emulation (a
replay runs the padded step eagerly, reading only the padded snapshot, as a CUDA replay does)
on a tiny NemotronH / Bamba checkpoint, with ragged staggered arrivals, chunked prefill, Mamba
prefix caching and KV-pool pressure (pauses). Tokens and log-probs equal the unpadded engine
(float32, serial and launch-ahead), mixed graphs really replayed, prefix hits and pauses really
happened (padding writes only the padding Mamba slot: test_mamba_varlen.py checks it per op). Also: exactly one H2D copy per step for a
hybrid model (mixed and decode steps)."""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported: the Triton variant interprets
    os.environ["TRITON_INTERPRET"] = "1"

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner  # noqa: E402
from tests.helpers.engine_harness import Arrival, forbid_host_traffic, run_arrivals, sampling_mix  # noqa: E402
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint  # noqa: E402

CFG = dict(block_size_tokens=4, max_requests=6, max_tokens=24, max_sequence_length=96, enable_prefix_caching=True,
           prefix_caching_mamba_gb=1e-3)


@pytest.fixture(scope="module", params=["NemotronHForCausalLM", "BambaForCausalLM"])
def ckpt(request, tmp_path_factory):
    return make_tiny_hybrid_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


TWO_LAYERS = {"NemotronHForCausalLM": dict(hybrid_override_pattern="M*"),
              "BambaForCausalLM": dict(num_hidden_layers=2, attn_layer_indices=[1])}
"""One Mamba layer, then one attention layer (the tiny models: 2 or 3 Mamba layers, whose interpreted
scans are most of the Triton test's time; each runs the same kernels)."""


@pytest.fixture(scope="module", params=list(TWO_LAYERS))
def two_layer_ckpt(request, tmp_path_factory):
    return make_tiny_hybrid_checkpoint(request.param, tmp_path_factory.mktemp(f"{request.param}-2"),
                                       **TWO_LAYERS[request.param])


def _arrivals(seed: int, n: int, new: int, kinds: tuple[int, ...] = tuple(range(6))) -> list[Arrival]:
    """Staggered ragged prompts; every third shares a 12-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 128) for _ in range(12)]
    params = sampling_mix(new)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 128) for _ in range(rng.randint(2, 30))]
        out.append(Arrival(rng.randrange(0, n), shared + prompt[:6] if i % 3 == 0 else prompt,
                           params[kinds[i % len(kinds)]]))
    return out


def _run(path, arrivals, graphs: bool, async_scheduling: bool, backend: str = "torch", num_kv_blocks: int = 18):
    cfg = InferenceConfig(**CFG, num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling,
                          attention_backend=backend, mamba_backend=backend)
    llm = LLM(str(path), inference_config=cfg)
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, emulate=True)
        llm.runner.graphs.warmup()  # the plan only: the eager compile pass has nothing to build on CPU
    outs = run_arrivals(llm, arrivals)
    return {i: (o.generated_tokens, o.generated_log_probs, o.generated_top_n_logprobs) for i, o in outs.items()}, llm


def _assert_same(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for i in ref:
        assert got[i][0] == ref[i][0], i
        if ref[i][1] is not None:
            assert got[i][1] == pytest.approx(ref[i][1], rel=1e-5, abs=1e-5)
        if ref[i][2] is not None:
            for a, b in zip(got[i][2], ref[i][2]):
                assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hybrid_padded_graph_steps_equal_eager_steps(ckpt, async_scheduling):
    arrivals = _arrivals(seed=5, n=12, new=6)
    ref, ref_llm = _run(ckpt, arrivals, graphs=False, async_scheduling=async_scheduling)
    got, llm = _run(ckpt, arrivals, graphs=True, async_scheduling=async_scheduling)
    _assert_same(got, ref)
    st, runner = llm.engine.stats, llm.runner.graphs
    assert st.mixed_graph_replays > 0 and st.graph_replays > st.mixed_graph_replays, st.as_dict()
    assert st.graph_captures_after_warmup == 0
    assert st.prefix_hit_tokens > 0 and st.mamba_states_restored > 0, st.as_dict()
    assert st.paused > 0 and st.prefill_steps > 2, st.as_dict()
    assert any(not k.decode_only for k in runner.graphs)
    if async_scheduling:
        assert st.overlapped_decode_steps > 0


def test_hybrid_padded_graph_steps_triton_kernels(two_layer_ckpt):
    """The packed Triton conv / scan and varlen attention (interpreted): same tokens with and
    without graph padding, launch-ahead; small (two layers, four requests): the interpreter is slow."""
    ckpt = two_layer_ckpt
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the engine runs on the CPU: needs the Triton interpreter (set before triton was imported; "
                    "on a CUDA box the GPU tests cover the compiled kernels)")
    arrivals = _arrivals(seed=9, n=4, new=3, kinds=(0, 2, 4))
    ref, _ = _run(ckpt, arrivals, graphs=False, async_scheduling=True, backend="triton", num_kv_blocks=64)
    got, llm = _run(ckpt, arrivals, graphs=True, async_scheduling=True, backend="triton", num_kv_blocks=64)
    _assert_same(got, ref)
    st = llm.engine.stats
    assert st.mixed_graph_replays > 0 and st.graph_captures_after_warmup == 0, st.as_dict()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hybrid_one_copy_per_step(ckpt, async_scheduling, monkeypatch):
    """Every step's device tables come in the one snapshot copy: no tensor is built from host data
    and nothing is read back inside the forward (mixed and decode steps), and the view is copied
    exactly once per step."""
    llm = LLM(str(ckpt), inference_config=InferenceConfig(**CFG, num_kv_blocks=40, async_scheduling=async_scheduling))
    forwards = []
    forbid_host_traffic(llm.model, monkeypatch, on_forward=lambda ids, batch: forwards.append(batch.attn.is_decode_only))
    outs = run_arrivals(llm, _arrivals(seed=2, n=6, new=5, kinds=(0,)))
    assert len(outs) == 6
    st = llm.engine.stats
    assert True in forwards and False in forwards  # decode-only and mixed steps both ran
    assert llm.context.gpu_view.num_copies == st.steps == len(forwards)


def test_every_graph_mode_equals_eager_on_cpu(tmp_path):
    """The GPU test's modes (test_gpu_hybrid_graphs.py) on the CPU with emulated graphs: six short
    staggered requests of the tiny model, tokens equal eager serial's in every mode, mixed graphs
    replayed, nothing built after the warm-up."""
    from tests.helpers import hybrid_graph_runs as runs

    path = runs.checkpoint("tiny", tmp_path / "nh")
    work = runs.arrivals(6, runs.vocab_size("tiny"), new=3)
    done = {mode: runs.run_mode(path, work, *flags, device="cpu") for mode, flags in runs.MODES.items()}
    assert not [f for mode, run in done.items() for f in runs.failures(mode, run, done[runs.REFERENCE])]
