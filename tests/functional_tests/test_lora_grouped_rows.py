"""An engine whose LoRA ops read the step's rows grouped by adapter (``lora_grouped_rows``, the
default) gives the bits of one whose ops take tiles of any rows, in batch-invariant mode (both
on the decode tiles): interpreted on the CPU, and on a GPU under real CUDA graphs in bf16. The
count of grouped calls shows the grouped op ran."""
import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.parallel import lora_slots
from tests.helpers.engine_harness import make_llm, random_prompts
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.lora_adapters import make_peft_adapter

from tests.helpers.requirements import installed  # noqa: E402

pytestmark = pytest.mark.skipif(not installed("peft"), reason="peft not installed")  # (importing it: ~2 s a worker)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ["x", None, "y", "x", "y"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_grouped")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base", num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1)
    adapters = {n: make_peft_adapter(base, root / n, 8, 16, TARGETS, seed=i) for i, n in enumerate(("x", "y"))}
    return base, adapters, random_prompts(len(NAMES), 3, 12, 256, seed=4)


@pytest.fixture
def grouped_calls(monkeypatch):
    calls = [0]
    real = lora_slots.lora_add

    def counting(*args, **kwargs):
        calls[0] += (args[9] if len(args) > 9 else kwargs.get("groups")) is not None
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_slots, "lora_add", counting)
    return calls


def _generate(base, adapters, prompts, grouped: bool, **cfg):
    llm = make_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8, max_requests=6, max_tokens=32,
                   batch_invariant=True, lora_grouped_rows=grouped, **cfg)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=3, lora=n, return_log_probs=True) for n in NAMES]
    outs = llm.generate(prompts, params)
    return [(o.generated_tokens, o.generated_log_probs) for o in outs], llm.engine.stats


def test_grouped_rows_equal_ungrouped_batch_invariant(setup, grouped_calls):
    base, adapters, prompts = setup
    plain, _ = _generate(base, adapters, prompts, False)
    assert grouped_calls[0] == 0
    grouped, stats = _generate(base, adapters, prompts, True)
    assert grouped_calls[0] > 0 and stats.steps > 0  # the grouped op ran
    assert grouped == plain  # tokens and log-probs, bit for bit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_grouped_rows_equal_ungrouped(setup, grouped_calls):
    base, adapters, prompts = setup
    runs = {g: _generate(base, adapters, prompts, g, device="cuda", dtype="bfloat16", cuda_graphs=True)
            for g in (False, True)}
    assert grouped_calls[0] > 0
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].graph_replays > 0 and runs[True][1].graph_captures_after_warmup == 0
