"""A LoRA engine's steps where no row has an adapter skip the LoRA ops: eager, they run the base
forward; under (CPU-emulated) CUDA graphs, decode steps replay the LoRA-free twin of their graph
(``GraphKey.no_lora``) and a step with one adapter row replays the LoRA graph. Tokens and log-probs
equal the eager engine's and HF's, serial and launch-ahead; the counters show which steps skipped."""
import pytest
import torch

from megatron_async import InferenceConfig, SamplingParams
from megatron_async.parallel import lora_slots
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from megatron_async.inference.text_generation_controllers.graph_plan import GraphPlan
from megatron_async.inference.text_generation_controllers.warmup import eager_shapes
from megatron_async.step_shape import StepShape
from tests.helpers.engine_harness import count_replays_by_variant, make_llm, random_prompts
from tests.helpers.hf_models import hf_greedy, make_tiny_checkpoint
from tests.helpers.lora_adapters import make_peft_adapter, merged_reference

from tests.helpers.requirements import installed  # noqa: E402

pytestmark = pytest.mark.skipif(not installed("peft"), reason="peft not installed")  # (importing it: ~2 s a worker)

NEW = 6
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_free")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base")
    path = make_peft_adapter(base, root / "x", 8, 16, TARGETS, seed=0)
    prompts = random_prompts(4, 3, 20, 256, seed=3)
    expected = {name: [hf_greedy(merged_reference(base, p), q, NEW) for q in prompts]
                for name, p in ((None, None), ("x", path))}
    assert expected["x"] != expected[None]  # the comparisons below test something
    return base, path, prompts, expected


def _llm(base, path, graphs: bool, **cfg):
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_requests=6, max_tokens=32, **cfg)
    llm.load_lora("x", path)
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, emulate=True,
                                            lora_free=llm.context.lora_skips)
        report = llm.runner.warmup()  # the eager pass (LoRA-free shapes too) and every graph
        assert report.graphs_captured == len(llm.runner.graphs.graphs)
    return llm


def _run(llm, prompts, names):
    params = [SamplingParams(top_k=1, num_tokens_to_generate=NEW, lora=n, return_log_probs=True) for n in names]
    replays = count_replays_by_variant(llm.runner.graphs) if llm.runner.graphs is not None else None
    outs = llm.generate(prompts, params)
    return [o.generated_tokens for o in outs], [o.generated_log_probs for o in outs], replays


@pytest.fixture
def lora_calls(monkeypatch):
    """How many times an adapted linear ran its LoRA op (``lora_add``), by the test's count."""
    calls = [0]
    real = lora_slots.lora_add

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_slots, "lora_add", counting)
    return calls


def _adapted_linears(llm) -> int:
    return len({id(t.slots) for t in llm.model.lora_adapters.targets.values()})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_adapter_steps_skip_lora_and_replay_the_lora_free_graphs(setup, async_scheduling, lora_calls):
    base, path, prompts, expected = setup
    names = [None] * len(prompts)
    eager = _llm(base, path, False, async_scheduling=async_scheduling)
    ref_tokens, ref_lps, _ = _run(eager, prompts, names)
    assert lora_calls[0] == 0 and eager.engine.stats.lora_free_steps == eager.engine.stats.steps > 0
    llm = _llm(base, path, True, async_scheduling=async_scheduling)
    lora_calls[0] = 0
    tokens, lps, replays = _run(llm, prompts, names)
    # only the mixed steps' (LoRA) graphs ran the LoRA ops (an emulated replay runs its forward)
    assert lora_calls[0] == llm.engine.stats.mixed_graph_replays * _adapted_linears(llm) > 0
    assert ref_tokens == tokens == expected[None]
    for a, b in zip(lps, ref_lps):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    st = llm.engine.stats
    # every step skipped LoRA; decode steps replayed LoRA-free graphs, mixed ones their LoRA graph
    assert st.lora_free_steps == st.steps - st.mixed_graph_replays > 0
    assert st.lora_free_graph_replays == st.graph_replays - st.mixed_graph_replays > 0
    assert replays["greedy+log_probs-lora"] == st.lora_free_graph_replays, replays
    assert st.graph_captures_after_warmup == 0
    shapes = [s for s, _ in eager_shapes(llm.runner)]
    assert any(not s.any_lora for s in shapes) and any(s.any_lora for s in shapes)  # both forwards warmed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batches_replay_the_lora_graph_with_each_rows_model(setup, async_scheduling):
    base, path, prompts, expected = setup
    names = [None, "x", None, "x"]
    ref_tokens, ref_lps, _ = _run(_llm(base, path, False, async_scheduling=async_scheduling), prompts, names)
    llm = _llm(base, path, True, async_scheduling=async_scheduling)
    tokens, lps, _ = _run(llm, prompts, names)
    assert tokens == ref_tokens == [expected[n][i] for i, n in enumerate(names)]
    for a, b in zip(lps, ref_lps):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    st = llm.engine.stats
    assert st.graph_replays > 0 and st.lora_free_graph_replays == 0 and st.lora_free_steps == 0


def test_one_adapter_row_uses_the_lora_variant(setup):
    base, path, prompts, expected = setup
    llm = _llm(base, path, True)
    tokens, _, replays = _run(llm, prompts[:1], ["x"])
    assert tokens == [expected["x"][0]]
    st = llm.engine.stats
    assert st.lora_free_graph_replays == 0 and replays["greedy+log_probs"] == st.graph_replays - st.mixed_graph_replays > 0


def test_base_row_alone_equals_beside_adapter_rows_batch_invariant(setup, tmp_path):
    """Batch-invariant bits: a base row's tokens and log-probs are those of its LoRA-free steps
    (alone) and of steps beside adapter rows (the adapters add nothing to it)."""
    base, _, prompts, _ = setup
    narrow = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "narrow", num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    path = make_peft_adapter(narrow, tmp_path / "x", 8, 16, TARGETS, seed=0)
    llm = _llm(narrow, path, False, batch_invariant=True)
    short = [p[:10] for p in prompts[:3]]
    params = [SamplingParams(top_k=1, num_tokens_to_generate=3, lora=n, return_log_probs=True) for n in ("x", None, "x")]
    together = llm.generate(short, params)
    free_before = llm.engine.stats.lora_free_steps
    alone = llm.generate([short[1]], params[1])[0]
    assert llm.engine.stats.lora_free_steps > free_before  # the base row alone ran LoRA-free steps
    assert together[1].generated_tokens == alone.generated_tokens
    assert together[1].generated_log_probs == alone.generated_log_probs  # bit-identical


def _decode_shape(rows: int, any_lora: bool) -> StepShape:
    return StepShape(rows, rows, 1, 8, True, False, False, 0, False, any_lora=any_lora)


def test_plan_lora_free_twins_of_decode_graphs_only():
    sizing = InferenceConfig(max_requests=128, max_tokens=2048, max_sequence_length=4096).graph_sizing()
    plain = GraphPlan(sizing, 151936, mixed=True, logits_only=True)
    free = GraphPlan(sizing, 151936, mixed=True, logits_only=True, lora_free=True)
    before, after = plain.keys(), free.keys()
    decode = [k for k in before if k.decode_only]
    assert len(after) == len(before) + len(decode)  # a twin per decode key, none for mixed keys
    assert {k for k in after if not k.no_lora} == set(before)
    assert all(k.decode_only for k in after if k.no_lora)
    assert free.key(_decode_shape(3, False)).no_lora and not free.key(_decode_shape(3, True)).no_lora
    assert not plain.key(_decode_shape(3, False)).no_lora
    mixed = StepShape(40, 3, 30, 40, False, False, False, 0, False, any_lora=False)
    assert not free.key(mixed).no_lora  # mixed steps replay their LoRA graph
    collective = GraphPlan(sizing, 151936, mixed=True, lora_free=True, collective=True)
    assert not any(k.no_lora for k in collective.keys())
    print(f"graph keys: {len(before)} -> {len(after)} (decode {len(decode)})")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_lora_free_twins_equal_eager_batch_invariant(setup):
    """Real CUDA graphs (bf16, batch-invariant: graph padding changes no bits): base rows alone
    replay the LoRA-free decode graphs, beside adapter rows the LoRA graphs, with the eager
    engine's tokens and log-probs."""
    base, path, prompts, _ = setup
    runs = {}
    for graphs in (False, True):
        llm = make_llm(base, device="cuda", dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8,
                       max_requests=8, max_tokens=64, batch_invariant=True, cuda_graphs=graphs)
        llm.load_lora("x", path)
        runs[graphs] = [_run(llm, prompts, names)[:2] for names in ([None] * 4, [None, "x", None, "x"])], llm.engine.stats
    (eager, _), (replayed, st) = runs[False], runs[True]
    assert replayed == eager
    assert st.lora_free_graph_replays > 0 and st.graph_replays > st.lora_free_graph_replays
    assert st.graph_captures_after_warmup == 0
