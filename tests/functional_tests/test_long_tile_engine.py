"""Long prefill tiles in the engine (``InferenceConfig.long_prefill_tiles``), Triton attention on CPU
(interpreter), a threshold lowered to tiny prompts: the host sets ``StepShape.long_tiles`` exactly on
the steps whose longest row reaches it, eager steps run the long-row launch, under (CPU-emulated) CUDA
graphs such steps replay the long-tile twin of their mixed graph; tokens and log-probs equal the
switch-off engine's, serial and launch-ahead; the counters show which steps took it."""
import pytest

from megatron_async import SamplingParams
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from megatron_async.kernels import triton_invariant_attention, triton_prefill_attention
from megatron_async.kernels.triton_prefill_common import HOPPER_LONG, LONG_TILE_MIN_QUERY
from tests.helpers.engine_harness import count_replays_by_variant, make_llm, random_prompts
from tests.helpers.hf_models import make_tiny_checkpoint

pytest.importorskip("triton")

MIN_QUERY = 20
"""The threshold the test lowers the engine's to (its prompts are 7-30 tokens, steps up to 48)."""
NEW = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("long_tiles") / "m")


def _llm(path, on: bool, graphs: bool, async_scheduling: bool):
    llm = make_llm(path, attention_backend="triton", max_requests=4, max_tokens=48, async_scheduling=async_scheduling,
                   long_prefill_tiles=on)
    assert llm.context.long_tile_min_query == (LONG_TILE_MIN_QUERY if on else 0)
    if on:
        llm.context.long_tile_min_query = MIN_QUERY
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, emulate=True,
                                            long_tile_min=llm.context.long_tile_min_query)
    return llm


def _run(llm, prompts):
    """(tokens, log-probs, each assembled step's (decode-only, longest query, long_tiles), replays by label)."""
    shapes, ctx = [], llm.context
    assemble = ctx.initialize_attention_state

    def recording(*args, **kwargs):
        shape = assemble(*args, **kwargs)
        shapes.append((shape.is_decode_only, shape.max_query_len, shape.long_tiles))
        return shape

    ctx.initialize_attention_state = recording
    replays = count_replays_by_variant(llm.runner.graphs) if llm.runner.graphs is not None else None
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW, return_log_probs=True))
    return [o.generated_tokens for o in outs], [o.generated_log_probs for o in outs], shapes, replays


@pytest.fixture
def launches(monkeypatch):
    """The launch of every prefill attention call (after the step's choice)."""
    seen = []
    real = triton_prefill_attention.fitted_launch
    monkeypatch.setattr(triton_prefill_attention, "fitted_launch",
                        lambda launch, *a: seen.append(launch) or real(launch, *a))
    return seen


@pytest.mark.parametrize("graphs", [False, True])
def test_long_rows_take_the_long_launch_and_tokens_do_not_change(ckpt, graphs, launches):
    # with 4 rows at most, the later prompts join decode rows: short mixed steps beside long ones
    prompts = [p[:n] for p, n in zip(random_prompts(6, 40, 40, 256, seed=5), (30, 8, 25, 12, 10, 7))]
    ref_tokens, ref_lps, _, _ = _run(_llm(ckpt, False, False, False), prompts)
    assert HOPPER_LONG not in launches
    results = {}
    for async_scheduling in (False, True):
        llm = _llm(ckpt, True, graphs, async_scheduling)
        launches.clear()
        tokens, lps, shapes, replays = _run(llm, prompts)
        results[async_scheduling] = tokens, lps
        assert tokens == ref_tokens
        for a, b in zip(lps, ref_lps):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-4)
        # the host's choice: exactly the non-decode steps whose longest row reaches the threshold
        assert all(long == (not decode and q >= MIN_QUERY) for decode, q, long in shapes), shapes
        chosen = sum(long for _, _, long in shapes)
        assert 0 < chosen < len(shapes)
        st = llm.engine.stats
        assert st.long_tile_steps == chosen
        layers = llm.model.kv_cache_spec().num_layers
        assert launches.count(HOPPER_LONG) > 0 and len(set(launches)) == 2  # short mixed steps: the default
        if graphs:  # every mixed step fits a graph: the long ones replayed the twins
            assert st.long_tile_graph_replays == chosen == sum(n for k, n in replays.items() if k.endswith("+long"))
            assert st.mixed_graph_replays > chosen
        else:
            assert st.long_tile_graph_replays == 0
            assert launches.count(HOPPER_LONG) == chosen * layers
    assert results[False] == results[True]  # launch-ahead == serial


def test_batch_invariant_long_tile_steps_keep_every_bit(ckpt, monkeypatch):
    """Batch-invariant mode takes the long-tile steps too: its kernel runs the rows that fill a
    larger tile in such tiles, a launch apart from the others, and tokens and log-probs equal the
    switch-off engine's bit for bit (a tile's size changes which program computes a query, never
    its bits). Launch-ahead against serial: the batch-invariant engine tests."""
    # two rows at most: the third prompt's chunk runs beside a decode row (two launches, both busy)
    prompts = [p[:n] for p, n in zip(random_prompts(3, 40, 40, 256, seed=5), (30, 8, 25))]
    split = []
    real = triton_invariant_attention.launches
    monkeypatch.setattr(triton_invariant_attention, "launches", lambda *a: split.append(len(out := real(*a)) > 1) or out)
    cfg = dict(attention_backend="triton", max_requests=2, max_tokens=48, batch_invariant=True)
    ref_tokens, ref_lps, _, _ = _run(make_llm(ckpt, long_prefill_tiles=False, **cfg), prompts)
    assert not any(split)
    llm = make_llm(ckpt, long_prefill_tiles=True, **cfg)
    assert llm.context.long_tile_min_query == LONG_TILE_MIN_QUERY
    llm.context.long_tile_min_query = MIN_QUERY
    split.clear()
    tokens, lps, shapes, _ = _run(llm, prompts)
    assert (tokens, lps) == (ref_tokens, ref_lps)
    chosen = sum(long for _, _, long in shapes)
    assert 0 < chosen == llm.engine.stats.long_tile_steps < len(shapes)
    assert sum(split) == chosen * llm.model.kv_cache_spec().num_layers  # two launches in each layer of those


def test_torch_attention_has_no_long_tiles(ckpt):
    """The torch reference has no tiles: no long steps."""
    llm = make_llm(ckpt, attention_backend="torch", long_prefill_tiles=True)
    assert llm.context.long_tile_min_query == 0
    llm.generate([list(range(3, 40))], SamplingParams(top_k=1, num_tokens_to_generate=2))
    assert llm.engine.stats.long_tile_steps == 0
