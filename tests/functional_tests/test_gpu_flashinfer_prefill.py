"""FlashInfer's FA3 kernel for a long-tile step's long rows in the engine (``InferenceConfig.
flashinfer_prefill``), on an H100 / H200 with ``flashinfer`` importable: the engine loads the
kernel, steps with 2,048+-token prompt chunks take the long tiles, and launch-ahead equals the
serial engine token for token with CUDA graphs (the FA3 lists built inside the step's graph), with
bf16 and FP8 weights; the switch off keeps every row on Triton."""
import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.kernels import flashinfer_prefill
from tests.helpers.engine_harness import random_prompts
from tests.helpers.hf_models import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or flashinfer_prefill.unusable(torch.device("cuda"), torch.bfloat16, 128) is not None,
                       reason="FlashInfer's FA3 kernel: an H100 / H200 with flashinfer importable"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("fa3") / "m", head_dim=128,
                                max_position_embeddings=8192)


def _llm(path, on: bool, async_scheduling: bool, quantization: str | None = None):
    from megatron_async import LLM, InferenceConfig

    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=2048, max_requests=4, max_tokens=4096,
                          max_sequence_length=4200, async_scheduling=async_scheduling, flashinfer_prefill=on)
    return LLM(model=str(path), device="cuda", dtype="bfloat16", inference_config=cfg, quantization=quantization)


@pytest.mark.parametrize("quantization", [None, "fp8"])  # fp8: o_proj quantizes the FA3 step's output itself
def test_long_rows_on_fa3_async_equals_serial(ckpt, quantization):
    # two 2-4k prompts fill a 4,096-token step each; the later ones join beside decode rows
    prompts = random_prompts(5, 2100, 4000, 256, seed=3)
    params = SamplingParams(top_k=1, num_tokens_to_generate=6)
    tokens = {}
    for async_scheduling in (False, True):
        llm = _llm(ckpt, True, async_scheduling, quantization)
        assert llm.model.kernels.flashinfer_prefill
        tokens[async_scheduling] = [o.generated_tokens for o in llm.generate(prompts, params)]
        st = llm.engine.stats
        assert st.long_tile_steps > 0 and st.long_tile_graph_replays > 0
    assert tokens[False] == tokens[True]
    off = _llm(ckpt, False, True)
    assert not off.model.kernels.flashinfer_prefill
    assert all(len(t) == 6 for t in tokens[True])
