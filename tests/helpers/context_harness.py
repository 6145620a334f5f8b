"""A DynamicInferenceContext on the CPU driven by hand the way the engine drives it: requests
activated and reserved, steps assembled and committed, samples landed (tests of the context's
transitions and of the step tables it writes)."""
import torch

from megatron_async import InferenceConfig, SamplingParams
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.engines.request_book import RequestBook
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.step_plan import RowPlan, StepPlan

BS = 4
"""KV block size of the contexts below (tokens)."""


def make_ctx(model, num_kv_blocks=9, prefix_caching=True, max_requests=4, max_tokens=32,
             share=True) -> DynamicInferenceContext:
    cfg = InferenceConfig(block_size_tokens=BS, num_kv_blocks=num_kv_blocks, max_requests=max_requests,
                          max_tokens=max_tokens, max_sequence_length=32, enable_prefix_caching=prefix_caching,
                          share_prompt_prefill=share)
    return DynamicInferenceContext(cfg.cache_sizing(), model, DeviceFacade("cpu"), torch.float32)


def make_req(rid, prompt, **sp) -> DynamicInferenceRequest:
    return DynamicInferenceRequest(rid, list(prompt), SamplingParams(**sp), seed=100 + rid,
                                   arrival_order=rid)


def assemble_and_commit(ctx, plan: StepPlan) -> None:
    """What a launch does on the host: the context assembles, the request book commits."""
    before = [(r.request.num_computed_tokens, r.request.num_inflight) for r in plan.rows]
    ctx.initialize_attention_state(plan)
    assert [(r.request.num_computed_tokens, r.request.num_inflight) for r in plan.rows] == before  # assembly only writes
    RequestBook(ctx).commit(plan)


def run_prefill(ctx, req, n=None) -> None:
    """Reserve, assemble and commit one prefill chunk of ``n`` tokens (default: the rest)."""
    n = req.num_known_tokens - req.num_computed_tokens if n is None else n
    assert ctx.reserve(req, n)
    samples = req.num_computed_tokens + n == req.num_known_tokens
    assemble_and_commit(ctx, StepPlan([RowPlan(req, req.num_computed_tokens, n, samples)]))


def land(req, token) -> None:
    """What bookkeeping does with a kept sample."""
    req.num_inflight -= 1
    if req.num_inflight == 0:
        req.inflight_row = -1
    req.generated_tokens.append(token)


def host(ctx) -> dict:
    return ctx._host_views[ctx._ring]
