"""LoRA under tensor parallelism on CPU (gloo + ZMQ): 2 spawned ranks serving a batch that mixes
two adapters and the base model give exactly the single-process tokens (column-parallel B sharded
on its output rows, row-parallel A on its input columns, partial products summed with the layer's)."""
from __future__ import annotations

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.lora_adapters import make_peft_adapter
from tests.helpers.multiprocess import run_ranks

from tests.helpers.requirements import installed  # noqa: E402

pytestmark = pytest.mark.skipif(not installed("peft"), reason="peft not installed")  # (importing it: ~2 s a worker)

CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=128,
              enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68]]
NAMES = ["x", None, "y", "x"]


def _run(llm: LLM, adapters: dict[str, str]) -> list[list[int]]:
    for name, path in adapters.items():
        llm.load_lora(name, path)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True, lora=n) for n in NAMES]
    return [o.generated_tokens for o in llm.generate(PROMPTS, params)]


def _tp_worker(rank: int, world: int, ckpt: str, adapters: dict[str, str]) -> list[list[int]]:
    llm = LLM(ckpt, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=world)
    try:
        return _run(llm, adapters)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM"])
def test_tp2_with_adapters_equals_one_process(arch, tmp_path):
    ckpt = make_tiny_checkpoint(arch, tmp_path / "base")
    adapters = {"x": str(make_peft_adapter(ckpt, tmp_path / "x", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"], seed=1)),
                "y": str(make_peft_adapter(ckpt, tmp_path / "y", 4, 4, ["v_proj", "down_proj"], seed=2))}
    expected = _run(LLM(str(ckpt), inference_config=InferenceConfig(**CONFIG)), adapters)
    for rank, got in enumerate(run_ranks(_tp_worker, 2, str(ckpt), adapters, timeout_s=180)):
        assert got == expected, f"rank {rank}"
