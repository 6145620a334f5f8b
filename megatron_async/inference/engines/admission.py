"""What admits a request: the checks that decide it can be served (request_validation.py), its
id and seed, and the ``DynamicInferenceRequest`` built from it into the scheduler's queue.

``accept`` runs on the rank that takes ``add_request``; ``admit`` on every rank that serves the
request, at once for an engine alone, at the next per-step exchange where ranks share steps
(rank_roles.py), so every rank builds the same request with the same seed."""
from __future__ import annotations

import numbers

import torch

from megatron_async.config import Scheduling
from megatron_async.inference.engines.request_validation import RequestValidator, ValidRequest
from megatron_async.inference.engines.scheduler import Scheduler
from megatron_async.inference.engines.step_consensus import NewRequest
from megatron_async.inference.request import DynamicInferenceRequest, InvalidRequestError, SamplingParams
from megatron_async.inference.text_stream import TextStream


class Admission:
    def __init__(self, config: Scheduling, validator: RequestValidator, scheduler: Scheduler, tokenizer=None):
        """``validator``: decides what a valid request is; ``scheduler``: queues the admitted
        ones; ``tokenizer``: None, or it streams each request's text (``TextStream``)."""
        self.config = config
        self.validator = validator
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._seeds = torch.Generator().manual_seed(config.seed)
        """Draws the seed of every request that brings none (``InferenceConfig.seed``)."""
        self.next_id = 0
        """The smallest id a new request may take (ids are never reused)."""
        self.arrivals = 0
        """Requests admitted so far: the next one's ``arrival_order``."""
        self._count = None
        """``queue_short``'s last count: (queue, its version, its mark, tokens left under the bound)."""

    def accept(self, prompt_tokens: list[int] | str, sampling_params: SamplingParams | None,
               request_id: int | None, digests: bytes = b"") -> NewRequest:
        """Validate, and give the request its id and seed. InvalidRequestError: refused, and
        nothing changed."""
        valid = self.validator.check(prompt_tokens, SamplingParams() if sampling_params is None else sampling_params)
        rid = self._check_id(request_id)
        self.next_id = rid + 1
        sp = valid.sampling_params
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        return NewRequest(valid, rid, seed, digests=digests)

    def admit(self, new: NewRequest) -> DynamicInferenceRequest:
        """The request ``new`` describes, built and queued in the scheduler."""
        valid, rid = new.valid, new.request_id
        self.next_id = max(self.next_id, rid + 1)
        req = DynamicInferenceRequest(rid, valid.prompt_tokens, valid.sampling_params, new.seed, valid.eos_ids,
                                      valid.stop_sequences, arrival_order=self.arrivals, text=self._text_stream(valid),
                                      banned_ids=valid.banned_ids, banned_sequences=valid.banned_sequences)
        if self.validator.grammars is not None:
            self.validator.grammars.attach(req)
        self.arrivals += 1
        self.scheduler.add(req)
        return req

    def queue_short(self) -> bool:
        """Whether the waiting queue holds less than the next step can admit.

        Validating and adding requests costs the host ~0.2 ms per 1,000 prompt tokens (13.6 ms
        for workload A's 128 prompts), GPU idle if done before the first step. A caller that adds while
        this is true and steps otherwise (``LLM.generate``, the benchmark driver) validates the
        rest while the GPU runs the steps already launched. The next step admits at most
        ``max_requests`` requests and ``max_tokens`` tokens, so a queue holding either (twice the
        tokens, for prefix hits that shorten chunks) loses no admission. A caller asks once an add,
        so the count carries on over the requests appended since the last call while nothing else
        changed the queue (a full sum each time made a burst of n adds O(n^2))."""
        waiting = self.scheduler.waiting
        if len(waiting) >= self.config.max_requests:
            return False
        last = self._count
        if last is not None and last[0] is waiting and last[1] == waiting.version:
            left, new = last[3], waiting.appended_since(last[2])
        else:
            left, new = 2 * self.config.max_tokens, waiting
        mark = waiting.mark
        for r in new:
            if left <= 0:
                break
            left -= r.num_known_tokens - r.num_computed_tokens
        self._count = (waiting, waiting.version, mark, left)
        return left > 0

    def _check_id(self, request_id) -> int:
        if request_id is None:
            return self.next_id
        if isinstance(request_id, bool) or not isinstance(request_id, numbers.Integral) or request_id < 0:
            raise InvalidRequestError(f"request_id must be a non-negative integer or None, got {request_id!r}")
        if request_id < self.next_id:
            raise InvalidRequestError(
                f"request id {request_id} is already in use or was used before (ids are never reused: "
                f"give None or an id >= {self.next_id})")
        return int(request_id)

    def _text_stream(self, valid: ValidRequest) -> TextStream | None:
        if self.tokenizer is None:
            return None
        sp = valid.sampling_params
        return TextStream(self.tokenizer, valid.prompt_tokens, valid.stop_strings, sp.skip_special_tokens,
                          sp.include_stop_str_in_output)
