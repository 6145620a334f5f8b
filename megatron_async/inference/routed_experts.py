"""Routing replay: the top-k experts each token of a request was routed to
(``SamplingParams.return_routed_experts`` -> ``RequestOutput.routed_experts[token][moe_layer]``).

Device side (``RoutingRecorder``, held by the model runner): every MoE layer of the model writes
its tokens' global expert ids (routing happens before any expert-parallel exchange) into one
static int16 buffer [max_tokens, num_moe_layers, top_k] (ids below 32768) at a fixed address, so a CUDA graph
writes it too. Graphs always record (the softmax router's kernel stores the ids in the same
program, no extra launch); eager steps record only when a row asked. A step with rows that
asked copies the tokens from the first to the last of those rows to pinned host memory, on the
stream after the forward and before the samples' event: the host reads them with the samples.

Host side (``land_routing``, called by the request book for every landed launch): each asking
row's tokens land at their positions in its request's ``routed_experts``; a verify row keeps
its input token and its accepted drafts only, at the position the request reached (a
launch-ahead row's planned start assumes the drafts in flight were all accepted). A position
computed again (after an eviction) is overwritten. Requests that ask skip prefix-cache hits: a
cached prompt part is not run.

Output (``routed_experts_of``): an int16 numpy array [tokens, num_moe_layers, top_k] (as vLLM
returns it: a nested Python list costs ~0.1 ms per token of a 48-layer top-8 model), one entry
per token the model ran for the request: every prompt token and every generated token except
the last, which is returned but never fed back (len(prompt) + len(generated) - 1 entries;
len(prompt) when nothing was generated). A request that ended early (abort) returns the
entries of the tokens that ran, -1 for those that did not; None when none ran."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_async.step_shape import StepShape

RING = 3
"""Host buffers in rotation: a launch in flight, the one being landed, the next one."""


@dataclass
class StepRouting:
    """A launch's routing on the host (valid once its samples' event completed)."""

    host: torch.Tensor
    """[tokens, num_moe_layers, top_k] int16: step tokens ``first_token`` onwards."""
    first_token: int
    row_tokens: list[int]
    """Each row's first token in the step."""


def asks(request) -> bool:
    return request.sampling_params.return_routed_experts


class RoutingRecorder:
    """The static device buffer MoE layers record into, and its copies to the host."""

    def __init__(self, num_moe_layers: int, top_k: int, max_tokens: int, device):
        """``device``: the engine's ``DeviceFacade``; ``max_tokens``: the most tokens a step
        runs, graph padding included."""
        self.device = device
        self.buffer = torch.zeros((max_tokens, num_moe_layers, top_k), dtype=torch.int16, device=device.device)
        self._host: list[torch.Tensor] = []  # allocated by the first step that asks
        self._next = 0
        self._active_version, self._any_active = -1, False

    @classmethod
    def for_model(cls, model, max_tokens: int, device) -> RoutingRecorder | None:
        """None for a model without MoE layers."""
        shape = model.routed_experts_shape()
        return None if shape is None else cls(*shape, max_tokens, device)

    def asked(self, rows, active: dict, active_version: int) -> bool:
        """Some row asks. ``active``: the context's active requests (every row's among them) and
        their version: re-read only when it changes, so steps of requests that never ask cost one
        comparison, not a pass over the rows."""
        if active_version != self._active_version:
            self._active_version, self._any_active = active_version, any(map(asks, active.values()))
        return self._any_active and any(asks(r.request) for r in rows)

    def copy_to_host(self, rows, shape: StepShape) -> StepRouting:
        """Enqueue the D2H copy of the asking rows' span of tokens (call after the forward,
        before the samples' event is recorded)."""
        width = shape.verify_width
        starts, t = [], 0
        for r, row in enumerate(rows):
            starts.append(r * width if width else t)
            t += row.num_tokens
        asking = [r for r, row in enumerate(rows) if asks(row.request)]
        lo, hi = starts[asking[0]], starts[asking[-1]] + rows[asking[-1]].num_tokens
        if not self._host:
            pin = self.device.is_cuda
            self._host = [torch.empty(self.buffer.shape, dtype=torch.int16, pin_memory=pin) for _ in range(RING)]
        self._next = (self._next + 1) % RING
        host = self._host[self._next][:hi - lo]
        host.copy_(self.buffer[lo:hi], non_blocking=True)
        return StepRouting(host, lo, starts)


def land_routing(rows, routing: StepRouting, accepted: list[int] | None, finished) -> None:
    """Store each asking row's routing at its positions (rows of requests already ``finished``
    status are dropped; a verify row keeps its input token and ``accepted[i]`` drafts): one
    memcpy per row into the request's array, never a Python list per token."""
    host = routing.host.numpy()
    for i, row in enumerate(rows):
        req = row.request
        if not asks(req) or req.status == finished:
            continue
        n = 1 + accepted[i] if row.num_drafts else row.num_tokens
        first = routing.row_tokens[i] - routing.first_token
        # a decode row's input is the request's last token so far: its planned start assumed
        # every draft of a verify row in flight was accepted
        pos = len(req.prompt_tokens) + len(req.generated_tokens) - 1 if row.is_decode else row.start
        store = req.routed_experts
        if store is None or len(store) < pos + n:  # sized once for the whole request, as a rule
            size = max(pos + n, len(req.prompt_tokens) + req.max_generated_tokens)
            grown = np.full((size,) + host.shape[1:], -1, dtype=np.int16)  # -1: not run (yet)
            if store is not None:
                grown[:len(store)] = store
            req.routed_experts = store = grown
        store[pos:pos + n] = host[first:first + n]


def routed_experts_of(req) -> np.ndarray | None:
    """``RequestOutput.routed_experts``: int16 [tokens, num_moe_layers, top_k] (see the module
    docstring for which tokens); None unless the request asked and some token ran."""
    if not asks(req) or req.routed_experts is None:
        return None
    ran = len(req.prompt_tokens) + max(len(req.generated_tokens) - 1, 0)
    return req.routed_experts[:ran]
