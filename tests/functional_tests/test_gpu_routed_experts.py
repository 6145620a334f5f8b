"""CUDA, routing replay with CUDA graphs (float32 MoE checkpoints: Qwen3-MoE and Mixtral through the
fused softmax router kernel, NemotronH through the torch grouped router): the experts each token
was routed to equal HF's routers' picks, serial, async and with graphs replaying decode steps;
steady launch-ahead decode of asking requests makes no host sync. Skipped without a GPU."""
import pytest

from megatron_async import SamplingParams
from tests.functional_tests.test_gpu_engine import cuda_llm
from tests.functional_tests.test_routed_experts_engine import as_sets, covered, hf_routing
from tests.helpers.engine_harness import decode_steps_without_host_sync, random_prompts
from tests.helpers.hf_models import load_hf_reference

pytestmark = pytest.mark.gpu
NEW = 10
ASK = SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True, return_routed_experts=True)



def test_routing_on_cuda_equals_hf_serial_async_and_graphs(hf_moe_ckpt):
    ref = load_hf_reference(hf_moe_ckpt)
    prompts = random_prompts(8, 2, 30, ref.config.vocab_size, seed=1)
    params = [ASK if i % 3 else SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True)
              for i in range(len(prompts))]
    for async_scheduling, graphs in ((False, False), (True, False), (True, True)):
        llm = cuda_llm(hf_moe_ckpt, max_tokens=16, num_kv_blocks=40, attention_backend="triton",
                       async_scheduling=async_scheduling, cuda_graphs=graphs)
        outs = llm.generate(prompts, params)
        if graphs:
            assert llm.runner.graphs.num_replays > 0
        for p, o in zip(params, outs):
            if not p.return_routed_experts:
                assert o.routed_experts is None
                continue
            assert len(o.routed_experts) == len(o.prompt_tokens) + NEW - 1
            assert as_sets(o.routed_experts) == hf_routing(ref, covered(o)), (async_scheduling, graphs)


def test_steady_async_decode_asking_for_routing_makes_no_host_sync(hf_moe_ckpt):
    llm = cuda_llm(hf_moe_ckpt, attention_backend="triton", max_requests=16, cuda_graphs=True)
    eng = llm.engine
    for p in random_prompts(8, 5, 20, 128, seed=4):
        eng.add_request(p, SamplingParams(temperature=1.0, top_k=20, seed=1, num_tokens_to_generate=40,
                                          return_routed_experts=True))
    decoded = decode_steps_without_host_sync(eng, 20)
    assert decoded == 20 and eng.stats.overlap_ratio > 0.9 and llm.runner.graphs.num_replays > 0
