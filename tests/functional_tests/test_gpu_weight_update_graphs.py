"""CUDA: captured graphs replay weights updated in place. After LLM.update_weights the engine's
greedy tokens (decode graphs, launch-ahead) equal a fresh engine loaded from the new weights,
graphs kept replaying and none was captured after the warm-up; a paused update gives partial
rollouts with the old version before it and the new after. Skipped without a GPU."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.hf_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
CFG = dict(block_size_tokens=16, num_kv_blocks=64, max_requests=8, max_tokens=64, max_sequence_length=128,
           cuda_graphs=True)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True)


def _llm(path) -> LLM:
    return LLM(str(path), device="cuda", inference_config=InferenceConfig(**CFG))


def test_graphs_replay_updated_weights(tmp_path):
    old = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "old", seed=0)
    new = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "new", seed=1)
    expected = [o.generated_tokens for o in _llm(new).generate(PROMPTS, GREEDY)]
    llm = _llm(old)
    st = llm.engine.stats
    before = [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)]
    replays = st.graph_replays
    assert replays > 0 and before != expected, st.as_dict()
    assert llm.update_weights(str(new)) == 1
    after = llm.generate(PROMPTS, GREEDY)
    assert [o.generated_tokens for o in after] == expected
    assert all(o.weight_versions == [1] * 24 for o in after)
    assert st.graph_replays > replays and st.graph_captures_after_warmup == 0, st.as_dict()

    llm.update_weights(str(old), version=5)  # partial rollouts across a paused update
    eng = llm.engine
    rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    outs = {}
    for _ in range(6):
        outs.update((o.request_id, o) for o in eng.step().finished)
    eng.pause_generation("keep")
    eng.step()
    done = {rid: len(eng._requests[rid].generated_tokens) for rid in rids}
    llm.update_weights(str(new), version=6)
    eng.resume_generation()
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step().finished)
    for i, rid in enumerate(rids):
        n = done[rid]
        assert 0 < n < 24 and outs[rid].weight_versions == [5] * n + [6] * (24 - n)
        assert outs[rid].generated_tokens[:n] == before[i][:n]
    assert st.graph_captures_after_warmup == 0, st.as_dict()
