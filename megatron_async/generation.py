"""``LLM.generate``'s way through the engine: prompts normalized to a list (one string or one
list of token ids is one prompt), each added with its sampling params (a prompt the engine
refuses becomes an error output and the others run), run to completion, and the outputs in
prompt order. Under tensor / expert parallelism every rank runs it (SPMD) and only rank 0's
prompts are used."""
from __future__ import annotations

import numbers
from collections.abc import Callable

from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_async.inference.engines.step_records import OUTPUTS_CODEC, SLOTS_CODEC
from megatron_async.inference.request import InvalidRequestError, RequestOutput, SamplingParams
from megatron_async.parallel.state import ParallelState


def run_prompts(engine: DynamicInferenceEngine, communicator, parallel: ParallelState, prompts,
                sampling_params: SamplingParams | list[SamplingParams] | None) -> list[RequestOutput]:
    """See ``LLM.generate``. ``communicator``: the ranks' (None: one rank)."""
    prompts = _as_prompt_list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    sampling_params = list(sampling_params)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
    slots: list[RequestOutput | int | None] = [None] * len(prompts)
    pending = iter(enumerate(zip(prompts, sampling_params)))

    def add(limit: Callable[[], bool]) -> tuple[list[int], bool]:
        """Add prompts while ``limit()`` holds; -> (new ids, whether prompts remain)."""
        ids = []
        while limit():
            nxt = next(pending, None)
            if nxt is None:
                return ids, False
            i, (prompt, sp) = nxt
            try:
                slots[i] = engine.add_request(prompt, sp)
                ids.append(slots[i])
            except InvalidRequestError as e:
                slots[i] = RequestOutput(-1, _token_ids_or_empty(prompt), [], None, "error", error=str(e))
        return ids, True

    if communicator is None:
        # one rank: later prompts are validated and added while the GPU runs the first steps
        ids, more = add(engine.admission_queue_short)
        done = engine.run_requests(ids, (lambda: add(engine.admission_queue_short)) if more else None)
        return [s if isinstance(s, RequestOutput) else done[s] for s in slots]
    # Under TP / EP every rank calls generate (SPMD) but only rank 0's prompts are used: the
    # others receive its requests at the per-step exchange, and its slots here.
    if parallel.is_leader:
        add(lambda: True)
    slots = communicator.broadcast_object(slots if parallel.is_leader else [], SLOTS_CODEC)
    done = engine.run_requests([s for s in slots if not isinstance(s, RequestOutput)])
    if parallel.dp_size > 1:  # only rank 0 gathered every rank's outputs
        done = communicator.broadcast_object(done if parallel.is_leader else {}, OUTPUTS_CODEC)
    return [s if isinstance(s, RequestOutput) else done[s] for s in slots]


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)


def _as_prompt_list(prompts) -> list:
    """One string or one non-empty list of token ids is a single prompt."""
    if isinstance(prompts, str) or (_is_token_ids(prompts) and len(prompts) > 0):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(
            f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
    return list(prompts)


def _token_ids_or_empty(prompt) -> list[int]:
    return [int(t) for t in prompt] if _is_token_ids(prompt) else []
