"""CPU KV pools come from zero pages (nothing written until a block is), except a suspendable
pool, whose storage the emulated suspend backend resizes in place."""
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.contexts import lazy_zeros

CPU = torch.device("cpu")


def test_zero_pages_are_a_writable_pool_of_zeros():
    pool = lazy_zeros.zeros((2, 5, 4, 2, 8), torch.bfloat16, CPU, suspendable=False)
    assert pool.shape == (2, 5, 4, 2, 8) and pool.dtype == torch.bfloat16 and not pool.any()
    pool[1, 3] = 2.5
    assert pool.sum().item() == 2.5 * 4 * 2 * 8
    assert lazy_zeros.zeros((0, 3), torch.float32, CPU, False).shape == (0, 3)


def test_a_suspendable_pool_can_be_resized_in_place():
    pool = lazy_zeros.zeros((2, 3), torch.float32, CPU, suspendable=True)
    pool.untyped_storage().resize_(0)  # (what EmulatedBackend.release does)
    pool.untyped_storage().resize_(24)


def test_the_default_cpu_pool_serves_the_same_tokens_as_a_small_one():
    """The default CPU pool (~1 GB of zero pages) is read only where blocks were written: greedy
    tokens equal those of an engine whose small pool torch zeroed."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True)
    big = LLM(inference_config=InferenceConfig(max_requests=4))
    small = LLM(inference_config=InferenceConfig(max_requests=4, num_kv_blocks=32, enable_suspend=True))
    try:
        assert big.context.kv_caches[0].numel() > 1000 * small.context.kv_caches[0].numel() / 32
        outs = [[o.generated_tokens for o in llm.generate(prompts, greedy)] for llm in (big, small)]
        assert outs[0] == outs[1]
    finally:
        big.close()
        small.close()
