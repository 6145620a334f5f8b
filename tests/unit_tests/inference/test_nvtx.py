"""Every engine stage is wrapped in an NVTX range when the flag is on, and ranges nest."""
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference import nvtx

STAGES = {
    "schedule", "initialize_attention_state", "transfer_bookkeeping_to_gpu", "forward_pass", "sampling",
    "transfer_samples_to_cpu", "active_request_mask", "update_requests", "launch_ahead", "reconcile",
}


def test_stages_are_nvtx_ranges(monkeypatch):
    pushed, depth = [], [0]

    def push(name):
        pushed.append(name)
        depth[0] += 1

    def pop():
        depth[0] -= 1
        assert depth[0] >= 0

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", pop)
    llm = LLM(inference_config=InferenceConfig(max_requests=4, max_tokens=64, num_kv_blocks=64))
    monkeypatch.setattr(nvtx, "_enabled", True)  # CPU: the flag alone would keep them off
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(top_k=1, num_tokens_to_generate=6))
    assert STAGES <= set(pushed), STAGES - set(pushed)
    assert depth[0] == 0


def test_ranges_off_by_default():
    nvtx.set_enabled(False)
    assert nvtx.nvtx_range("schedule") is nvtx.nvtx_range("forward_pass")  # the shared no-op
