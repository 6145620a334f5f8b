"""CUDA, MoE checkpoints (Qwen3-MoE, Mixtral, NemotronH with MoE layers) through the engine with
the fused Triton experts: greedy tokens equal HF (float32) serial, async and with CUDA graphs,
and steady launch-ahead decode makes no host sync. Skipped without a GPU."""
import pytest

from megatron_async import SamplingParams
from tests.functional_tests.test_gpu_engine import cuda_llm
from tests.helpers.engine_harness import decode_steps_without_host_sync, random_prompts
from tests.helpers.hf_models import hf_greedy, load_hf_reference

pytestmark = pytest.mark.gpu
NEW = 12
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True)



def test_moe_cuda_matches_hf_serial_async_and_graphs(hf_moe_ckpt):
    ref = load_hf_reference(hf_moe_ckpt)
    prompts = random_prompts(8, 2, 30, ref.config.vocab_size, seed=1)
    expected = [hf_greedy(ref, p, NEW) for p in prompts]
    for async_scheduling, graphs in ((False, False), (True, False), (True, True)):
        llm = cuda_llm(hf_moe_ckpt, max_tokens=16, num_kv_blocks=40, attention_backend="triton",
                       async_scheduling=async_scheduling, cuda_graphs=graphs)
        outs = llm.generate(prompts, GREEDY)
        assert [o.generated_tokens for o in outs] == expected, (async_scheduling, graphs)
        if graphs:
            assert llm.runner.graphs.num_replays > 0


def test_moe_steady_async_decode_makes_no_host_sync(hf_moe_ckpt):
    llm = cuda_llm(hf_moe_ckpt, attention_backend="triton", max_requests=16, cuda_graphs=False)
    eng = llm.engine
    for p in random_prompts(8, 5, 20, 128, seed=4):
        eng.add_request(p, SamplingParams(temperature=1.0, top_k=20, seed=1, num_tokens_to_generate=40))
    decoded = decode_steps_without_host_sync(eng, 20)
    assert decoded == 20 and eng.stats.overlap_ratio > 0.9
