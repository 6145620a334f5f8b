"""Graph padding on the CPU: the graph runner in emulation (no capture; a replay runs the
padded step eagerly) pads decode and mixed steps exactly as a CUDA replay does, so its tokens
and log-probs must equal the unpadded engine's on ragged batches with every sampling feature
(float32, CPU). Also: warm-up leaves the engine's state as it found it, and it covers every
key the run asks for (0 captures after warm-up)."""
import os
import random
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported: the Triton variant interprets
    os.environ["TRITON_INTERPRET"] = "1"

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner  # noqa: E402
from tests.helpers.engine_harness import Arrival, count_replays_by_variant, run_arrivals, sampling_mix  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

CFG = dict(block_size_tokens=4, num_kv_blocks=256, max_requests=6, max_tokens=24, max_sequence_length=96)
N = 8
PARAMS = sampling_mix(N) + [SamplingParams(top_k=1, top_n_logprobs=25, num_tokens_to_generate=N)]  # beyond GRAPH_TOP_N: eager


def _arrivals(seed: int, params: list[SamplingParams] = PARAMS, n: int = 12) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(rng.randrange(0, n), [rng.randrange(1, 1000) for _ in range(rng.randint(3, 40))],
                    params[i % len(params)]) for i in range(n)]


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """2 layers and 2 KV heads (the built-in model: 4 and 4): a quarter of the interpreter's programs."""
    return str(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("graph_padding"), vocab_size=1024))


def _run(arrivals, graphs: bool, async_scheduling: bool, warmup: bool = True, backend: str = "torch",
         model: str | None = None):
    cfg = InferenceConfig(**CFG, async_scheduling=async_scheduling, attention_backend=backend)
    llm = LLM(model, inference_config=cfg)
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, emulate=True)
    if warmup and backend == "triton":  # the interpreter is slow: the graph plan only, no eager pass
        llm.runner.graphs.warmup()
    elif warmup:
        llm.engine.warmup()
    llm.replays = count_replays_by_variant(llm.runner.graphs) if graphs else None
    outs = run_arrivals(llm, arrivals)
    return {i: (o.generated_tokens, o.generated_log_probs, o.generated_top_n_logprobs) for i, o in outs.items()}, llm


@pytest.mark.parametrize("async_scheduling,backend", [(False, "torch"), (True, "torch"), (True, "triton")])
def test_padded_graph_steps_equal_eager_steps(async_scheduling, backend, request):
    """``triton``: the varlen Triton attention (interpreted on CPU) reads the padded rows' spans
    from the snapshot, as a CUDA replay does (the sampler stays torch: the interpreter is slow)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the engine runs on the CPU: needs the Triton interpreter (set before triton was imported; "
                    "on a CUDA box the GPU tests cover the compiled kernels)")
    model = None  # the built-in tiny model
    if backend == "torch":
        arrivals = _arrivals(seed=7)
    else:  # greedy, top-p + log-probs, penalty + top-3; 4 tokens, a smaller model: the interpreter is slow
        arrivals = _arrivals(seed=7, params=[replace(PARAMS[i], num_tokens_to_generate=4) for i in (0, 2, 4)], n=4)
        model = request.getfixturevalue("small_ckpt")
    ref, _ = _run(arrivals, graphs=False, async_scheduling=async_scheduling, warmup=False, backend=backend, model=model)
    got, llm = _run(arrivals, graphs=True, async_scheduling=async_scheduling, backend=backend, model=model)
    assert set(got) == set(ref) == set(range(len(arrivals)))
    for i in ref:
        assert got[i][0] == ref[i][0], i
        if ref[i][1] is not None:
            assert got[i][1] == pytest.approx(ref[i][1], rel=1e-5, abs=1e-5)
        if ref[i][2] is not None:  # a row's top-n: the head of the graph's sorted top-20
            for a, b in zip(got[i][2], ref[i][2]):
                assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    st, runner = llm.engine.stats, llm.runner.graphs
    assert st.mixed_graph_replays > 0 and st.graph_replays > st.mixed_graph_replays  # both kinds ran
    if any(a.params.top_n_logprobs > 20 for a in arrivals):
        assert st.graph_replays < st.steps  # the top-n 25 request's steps ran eager
    assert st.graph_captures_after_warmup == 0 and len(runner.graphs) == len(runner.plan.keys())
    assert {k.variant for k in runner.graphs} == {"greedy", "temperature", "nucleus", "filtered", "full"}
    # each sampling tail replays its size's forward, one per size: not one per variant
    tails = [s for k, s in runner.graphs.items() if not k.logits_only]
    assert tails and all(s.forward is runner.graphs[runner.forward_key(s.key)] for s in tails)
    assert sum(k.logits_only for k in runner.graphs) == len({(k.num_tokens, k.decode_only) for k in runner.graphs})
    assert llm.replays["full"] > 0 and sum(llm.replays.values()) == st.graph_replays, llm.replays  # penalties replayed
    if async_scheduling:
        assert st.overlapped_decode_steps > 0


def test_warmup_leaves_the_engine_state_intact():
    arrivals = _arrivals(seed=11)
    ref, _ = _run(arrivals, graphs=False, async_scheduling=True, warmup=False)
    got, llm = _run(arrivals, graphs=False, async_scheduling=True, warmup=True)
    assert got == ref
    st = llm.engine.stats
    assert st.warmup_seconds > 0 and st.warmup_graphs == 0 and st.graph_replays == 0
    with pytest.raises(RuntimeError, match="idle"):
        llm.engine.add_request([1, 2, 3], PARAMS[0])
        llm.engine.step()  # a launch is in flight now (launch-ahead keeps one)
        llm.engine.step()
        llm.engine.warmup()


def test_lazy_captures_are_counted_without_warmup():
    got, llm = _run(_arrivals(seed=3)[:4], graphs=True, async_scheduling=True, warmup=False)
    st = llm.engine.stats
    assert st.graph_replays > 0 and st.graph_captures_after_warmup == len(llm.runner.graphs.graphs) > 0
