"""The server under tensor parallelism (torchrun, 2 CPU ranks, gloo + ZMQ): rank 0 serves HTTP,
rank 1 follows its steps; greedy streams equal the single-process engine, a disconnect aborts
on both ranks, and a SIGTERM stops every rank."""
import shutil
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.functional_tests.server_client import concurrent_greedy_streams  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
FLAGS = ["--num-kv-blocks", "96", "--block-size", "16", "--max-requests", "8", "--max-sequence-length", "192",
         "--device", "cpu", "--tensor-parallel-size", "2"]
PROMPTS = ["Hello world! How are you", "The quick brown fox", "Rivers flow to the sea", "Numbers like 0, 1, 2"]


def test_tp2_server_streams_equal_single_process_and_abort(tmp_path):
    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "tp-model", with_tokenizer=True, vocab_size=512)
    llm = LLM(str(ckpt), inference_config=InferenceConfig(num_kv_blocks=96, block_size_tokens=16, max_requests=8,
                                                          max_sequence_length=192))
    want = [o.generated_tokens for o in llm.generate(PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=10,
                                                                             ignore_eos=True))]
    launcher = ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    with ServerProcess(["--model", str(ckpt), *FLAGS], launcher=launcher) as srv:
        assert concurrent_greedy_streams(srv.url, "tp-model", PROMPTS, 10) == want
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tp-model", prompt="Once upon a time", max_tokens=150, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            body = urllib.request.urlopen(f"{srv.url}/metrics", timeout=10).read().decode()
            if 'finished_reason="abort"' in body and 'num_requests_running{model_name="tp-model"} 0.0' in body:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"abort not seen:\n{body}")
        again = client.completions.create(model="tp-model", prompt=PROMPTS[0], max_tokens=10, temperature=0.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        assert again.choices[0].model_extra["token_ids"] == want[0]  # both ranks still agree after the abort
        proc = srv.proc
    assert proc.wait(30) is not None
