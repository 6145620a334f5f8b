"""The server under tensor parallelism (torchrun, 2 CPU ranks, gloo + ZMQ): rank 0 serves HTTP,
rank 1 follows its steps; greedy streams equal the single-process engine, a disconnect aborts
on both ranks, a short request beside a body of 8 prompts holds the same requests on both ranks
(tokens unchanged), and a SIGTERM stops every rank."""
import shutil
import threading
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
         "--device", "cpu", "--tensor-parallel-size", "2", "--launch-ahead"]
PROMPTS = ["Hello world! How are you", "The quick brown fox", "Rivers flow to the sea", "Numbers like 0, 1, 2"]


def test_tp2_server_streams_equal_single_process_and_abort(tmp_path):
    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "tp-model", with_tokenizer=True, vocab_size=512)
    llm = LLM(str(ckpt), inference_config=InferenceConfig(num_kv_blocks=96, block_size_tokens=16, max_requests=8,
                                                          max_sequence_length=192))
    want = [o.generated_tokens for o in llm.generate(PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=10,
                                                                             ignore_eos=True))]
    long = [o.generated_tokens for o in llm.generate(PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=40,
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
        assert shared_bodies(client, srv.url, want, long) == ["held"]  # both ranks held the same requests
        proc = srv.proc
    assert proc.wait(30) is not None


def shared_bodies(client, url: str, want: list[list[int]], long: list[list[int]]) -> list[str]:
    """A body of 8 prompts (the engine's 8 places: 7 for one body) and, once it runs, a short
    request: the body's places above its share are held on both ranks. ["held"] when every
    token equals the single process's and the engine held requests."""
    done: dict = {}
    big = threading.Thread(target=lambda: done.setdefault("big", client.completions.create(
        model="tp-model", prompt=PROMPTS * 2, max_tokens=40, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True})))
    big.start()
    deadline = time.monotonic() + 30
    while 'num_requests_running{model_name="tp-model"} 7.0' not in urllib.request.urlopen(
            f"{url}/metrics", timeout=10).read().decode() and time.monotonic() < deadline:
        time.sleep(0.05)
    short = client.completions.create(model="tp-model", prompt=PROMPTS[1], max_tokens=10, temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    big.join(60)
    got = [c.model_extra["token_ids"] for c in sorted(done["big"].choices, key=lambda c: c.index)]
    assert short.choices[0].model_extra["token_ids"] == want[1] and got == long * 2
    body = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    held = next(float(line.split()[-1]) for line in body.splitlines() if line.startswith("megatron_async_engine_held_steps"))
    return ["held"] if held > 0 else [f"no step held a request: {held}"]
