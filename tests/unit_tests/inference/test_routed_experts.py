"""Routing replay's host side alone: which step tokens a launch copies (packed rows and the
uniform verify layout), where each row's routing lands (prefill chunks, decode rows at the
position their request reached, verify rows keeping accepted tokens only, finished requests
dropped, recomputed positions overwritten) and which tokens an output covers."""
import numpy as np
import torch

from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.step_plan import RowPlan
from megatron_async.inference.request import DynamicInferenceRequest, SamplingParams, Status
from megatron_async.inference.routed_experts import RoutingRecorder, land_routing, routed_experts_of
from megatron_async.step_shape import StepShape

ASK = SamplingParams(return_routed_experts=True)
L, K = 2, 3


def _req(prompt_len: int, generated: int = 0, params: SamplingParams = ASK) -> DynamicInferenceRequest:
    req = DynamicInferenceRequest(0, list(range(prompt_len)), params, seed=0)
    req.generated_tokens = list(range(100, 100 + generated))
    req.status, req.max_generated_tokens = Status.ACTIVE, 8
    return req


def _ids(token: int) -> list[list[int]]:
    """The routing the test writes for step token ``token``."""
    return [[token, layer, 7] for layer in range(L)]


def _recorder(tokens: int) -> RoutingRecorder:
    rec = RoutingRecorder(L, K, tokens, DeviceFacade("cpu"))
    for t in range(tokens):
        rec.buffer[t] = torch.tensor(_ids(t))
    return rec


def _shape(rows: list[RowPlan], width: int = 0) -> StepShape:
    T = len(rows) * width if width else sum(r.num_tokens for r in rows)
    return StepShape(T, len(rows), 1, 1, False, False, False, 0, False, verify_width=width)


def test_copy_spans_the_asking_rows_only():
    plain = _req(4, params=SamplingParams())
    a, b = _req(6), _req(9)
    rows = [RowPlan(plain, 0, 4, True), RowPlan(a, 0, 3, False), RowPlan(plain, 0, 2, True), RowPlan(b, 5, 4, True)]
    routing = _recorder(16).copy_to_host(rows, _shape(rows))
    assert routing.first_token == 4 and routing.row_tokens == [0, 4, 7, 9]
    assert routing.host.tolist() == [_ids(t) for t in range(4, 13)]  # row 1 to row 3, the plain row between
    verify = [RowPlan(plain, 5, 2, True, num_drafts=1), RowPlan(b, 9, 3, True, num_drafts=2)]
    routing = _recorder(16).copy_to_host(verify, _shape(verify, width=4))  # rows laid out 4 tokens apart
    assert routing.first_token == 4 and routing.row_tokens == [0, 4] and len(routing.host) == 3


def _landed(rows: list[RowPlan], accepted=None) -> None:
    land_routing(rows, _recorder(16).copy_to_host(rows, _shape(rows)), accepted, Status.FINISHED)


def test_rows_land_at_their_positions():
    req = _req(5)
    _landed([RowPlan(req, 0, 3, False)])  # a first chunk
    _landed([RowPlan(req, 3, 2, True)])  # the last chunk samples
    assert req.routed_experts[:5].tolist() == [_ids(0), _ids(1), _ids(2), _ids(0), _ids(1)]
    req.generated_tokens = [100]
    _landed([RowPlan(req, 99, 1, True)])  # a decode row's input is the request's last token: position 5
    assert req.routed_experts[5].tolist() == _ids(0)
    _landed([RowPlan(req, 0, 2, False)])  # recomputed after an eviction: overwritten in place
    assert req.routed_experts[:2].tolist() == [_ids(0), _ids(1)] and req.routed_experts[2].tolist() == _ids(2)


def test_verify_rows_keep_accepted_tokens_and_finished_requests_drop():
    req, done, plain = _req(3, generated=1), _req(3, generated=1), _req(3, generated=1, params=SamplingParams())
    done.status = Status.FINISHED
    rows = [RowPlan(done, 3, 3, True, num_drafts=2), RowPlan(plain, 3, 1, True), RowPlan(req, 3, 3, True, num_drafts=2)]
    _landed(rows, accepted=[2, 0, 1])
    assert req.routed_experts.tolist()[:6] == [[[-1] * K] * L] * 3 + [_ids(4), _ids(5), [[-1] * K] * L]  # input + 1 draft
    assert done.routed_experts is None and plain.routed_experts is None


def test_outputs_cover_the_prompt_and_every_generated_token_but_the_last():
    req = _req(3, generated=2)
    req.routed_experts = np.array([_ids(t) for t in range(6)], dtype=np.int16)  # a launch-ahead row past the end too
    assert routed_experts_of(req).tolist() == [_ids(t) for t in range(4)]
    req.generated_tokens = []
    assert routed_experts_of(req).tolist() == [_ids(t) for t in range(3)]  # scoring only: the whole prompt
    assert routed_experts_of(_req(3, params=SamplingParams())) is None
    assert routed_experts_of(_req(3)) is None  # nothing ran



def test_the_asking_check_reads_the_active_requests_only_when_they_change():
    rec, plain, asking = _recorder(4), _req(3, params=SamplingParams()), _req(3)
    rows = [RowPlan(plain, 0, 3, True)]
    assert not rec.asked(rows, {0: plain}, 1)
    assert not rec.asked(rows + [RowPlan(asking, 0, 3, True)], {0: plain}, 1)  # same version: not re-read
    assert rec.asked(rows + [RowPlan(asking, 0, 3, True)], {0: plain, 1: asking}, 2)
    assert not rec.asked(rows, {0: plain, 1: asking}, 2)  # an asking request without a row here
