"""Refit admin operations under tensor parallelism (one torchrun server, 2 CPU ranks): rank 0 serves HTTP and
tells rank 1 to run each weight operation too, so after /update_weights_from_ipc (a trainer's
Megatron-Core shards in shared memory), /update_weights (a checkpoint directory) and
/update_weights_from_distributed (a trainer's gloo broadcast) both ranks hold the new weights:
greedy streams equal a single-process engine updated in-process. A transfer group set-up that
nobody joins waits off both ranks' step loops: the server keeps generating, then answers 409."""
import json
import shutil
import threading
import urllib.request

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.serve.process import ServerProcess  # noqa: E402
from megatron_async.weight_transfer import build_manifest, free_port, init_transfer_group, ipc, send  # noqa: E402
from tests.functional_tests.test_server_refit_waits import TIMEOUT_S, _Call, _serves_while  # noqa: E402
from tests.functional_tests.server_client import concurrent_greedy_streams  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.refit_engine import new_hf, trainer_items  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
FLAGS = ["--num-kv-blocks", "96", "--block-size", "16", "--max-requests", "8", "--max-sequence-length", "192",
         "--device", "cpu", "--tensor-parallel-size", "2", "--enable-admin-endpoints"]
PROMPTS = ["Hello world! How are you", "The quick brown fox"]
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=10, ignore_eos=True)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_weight_operations_reach_every_tp_rank_and_a_pending_set_up_leaves_them_stepping(tmp_path):
    """One TP=2 server takes each weight operation in turn; each is checked against an in-process
    engine holding what that operation sent (the trainer's items are every weight, so the last
    broadcast's result does not depend on what the server held before it)."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    old = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "tp-model", with_tokenizer=True, vocab_size=512)
    new = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "new", seed=1, with_tokenizer=True, vocab_size=512)
    cfg = InferenceConfig(num_kv_blocks=96, block_size_tokens=16, max_requests=8, max_sequence_length=192)
    llm = LLM(str(old), inference_config=cfg)
    m = llm.model
    items = trainer_items(m.hf_shapes(), 7, 2, m.megatron_dims(), m.spec.name)
    for _, t, _ in items:
        t.share_memory_()
    manifest = build_manifest(items, 64 << 10, version=5)
    llm.update_weights(new_hf(llm, 7))
    want_items = [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)]
    want_ckpt = [o.generated_tokens for o in LLM(str(new), inference_config=cfg).generate(PROMPTS, GREEDY)]
    assert want_items != want_ckpt  # the broadcast below moves the server off the checkpoint's weights
    launcher = ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    with ServerProcess(["--model", str(old), *FLAGS], launcher=launcher) as srv:
        assert _post(f"{srv.url}/update_weights_from_ipc", {"handles": ipc.share(items)})["weight_version"] == 1
        assert concurrent_greedy_streams(srv.url, "tp-model", PROMPTS, 10) == want_items
        assert _post(f"{srv.url}/update_weights", {"path": str(new)})["weight_version"] == 2
        assert concurrent_greedy_streams(srv.url, "tp-model", PROMPTS, 10) == want_ckpt

        port = free_port()
        where = f"127.0.0.1:{port}"
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3, "timeout_s": TIMEOUT_S}
        call = _Call(srv.url + "/init_weight_transfer", init)
        _serves_while(srv, call, "/update_weights_from_distributed", {"manifest": {}},
                      f"a transfer group set-up to {where}")
        assert call.answered.wait(120)
        status, reply = call.outcome
        assert status == 409 and f"at {where} was not set up" in reply["error"]["message"], reply

        sent = []
        trainer = threading.Thread(target=lambda: sent.append(send(init_transfer_group("127.0.0.1", port, 0, 3, "gloo",
                                                                                       timeout_s=60), manifest, items)))
        trainer.start()
        try:
            assert _post(f"{srv.url}/init_weight_transfer", init)["weight_version"] == 2
            body = _post(f"{srv.url}/update_weights_from_distributed", {"manifest": manifest.to_json()})
            assert body["weight_version"] == 5, body
        finally:
            trainer.join(120)
        assert len(sent) == 1
        assert concurrent_greedy_streams(srv.url, "tp-model", PROMPTS, 10) == want_items
