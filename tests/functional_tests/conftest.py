import pytest

from megatron_async.testing.hf_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))
