"""Prompt chunks on cuDNN's attention in the engine (``InferenceConfig.cudnn_prefill_attention``), Triton
attention on CPU (interpreter, torch's math backend standing in for cuDNN), the threshold lowered to
tiny prompts: the host gives cuDNN exactly the rows without a cached prefix that reach it, such steps
run eager under (CPU-emulated) CUDA graphs while the others replay theirs, tokens equal the switch-off
engine's (log-probs to rounding), serial and launch-ahead alike; the counter shows the steps."""
import pytest

from megatron_async import SamplingParams
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from megatron_async.kernels import cudnn_prefill
from tests.helpers.engine_harness import make_llm, random_prompts
from tests.helpers.hf_models import make_tiny_checkpoint

pytest.importorskip("triton")

MIN_QUERY = 20
"""The threshold the test lowers the engine's to (its prompts are 7-30 tokens, steps up to 48)."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("cudnn_prefill") / "m")


def _llm(path, on: bool, graphs: bool, async_scheduling: bool):
    llm = make_llm(path, attention_backend="triton", max_requests=4, max_tokens=48, async_scheduling=async_scheduling,
                   cudnn_prefill_attention=on)
    assert llm.context.fresh_min_query == 0  # a float32 model on a CPU: cuDNN cannot take it
    if on:
        llm.context.fresh_min_query = MIN_QUERY
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, emulate=True)
    return llm


def _run(llm, prompts, monkeypatch):
    """(tokens, log-probs, each assembled step's (fresh rows, rows, kv lens by row), cuDNN calls,
    per graph lookup (fresh rows, whether a graph served it))."""
    shapes, ctx, calls, lookups = [], llm.context, [], []
    assemble = ctx.initialize_attention_state

    def recording(*args, **kwargs):
        shape = assemble(*args, **kwargs)
        v, r = ctx._host_views[ctx._ring], shape.num_rows
        shapes.append((shape.fresh_rows, v["cu_query_lens"][: r + 1].tolist(), v["kv_lens"][:r].tolist()))
        return shape

    real = cudnn_prefill.attend_fresh_rows
    monkeypatch.setattr(ctx, "initialize_attention_state", recording)
    monkeypatch.setattr(cudnn_prefill, "attend_fresh_rows", lambda *a: calls.append(a[2].fresh_rows) or real(*a))
    if llm.runner.graphs is not None:
        lookup = llm.runner.graphs.lookup
        monkeypatch.setattr(llm.runner.graphs, "lookup",
                            lambda shape, *a, **k: lookups.append((shape.fresh_rows, lookup(shape, *a, **k)))
                            or lookups[-1][1])
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=4, return_log_probs=True))
    return [o.generated_tokens for o in outs], [o.generated_log_probs for o in outs], shapes, calls, lookups


@pytest.mark.parametrize("graphs", [False, True])
def test_fresh_chunks_run_on_cudnn_and_tokens_do_not_change(ckpt, graphs, monkeypatch):
    # with 4 rows at most, the later prompts join decode rows; 48-token steps chunk the longer prompts
    prompts = [p[:n] for p, n in zip(random_prompts(6, 40, 40, 256, seed=5), (30, 8, 25, 12, 40, 22))]
    ref_tokens, ref_lps, *_ = _run(_llm(ckpt, False, False, False), prompts, monkeypatch)
    results = {}
    for async_scheduling in (False, True):
        llm = _llm(ckpt, True, graphs, async_scheduling)
        tokens, lps, shapes, calls, lookups = _run(llm, prompts, monkeypatch)
        results[async_scheduling] = tokens, lps
        assert tokens == ref_tokens
        for a, b in zip(lps, ref_lps):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-4)
        # the host's rule: rows with no cached prefix (kv == query tokens) of MIN_QUERY+ tokens
        for fresh, cu, kv in shapes:
            want = tuple((cu[r], cu[r + 1] - cu[r]) for r in range(len(kv))
                         if cu[r + 1] - cu[r] == kv[r] >= MIN_QUERY)
            assert fresh == want, (fresh, cu, kv)
        chosen = [fresh for fresh, _, _ in shapes if fresh]
        assert 0 < len(chosen) < len(shapes)
        assert any(kv[r] > cu[r + 1] - cu[r] > 1 for _, cu, kv in shapes for r in range(len(kv)))  # a later chunk
        st = llm.engine.stats
        assert st.cudnn_prefill_steps == len(chosen)
        assert calls == [f for f in chosen for _ in range(llm.model.kv_cache_spec().num_layers)]
        if graphs:  # those steps eager, the other mixed steps replayed
            assert any(fresh for fresh, _ in lookups) and st.mixed_graph_replays > 0
            assert all(step is None for fresh, step in lookups if fresh)
    assert results[False] == results[True]  # launch-ahead == serial
