"""A validated body's fields as what each of its choices samples with: ``SamplingParams``, and the
one ``StructuredOutputs`` that constrains its answer, from OpenAI's ``response_format``
(``json_object``, ``json_schema``: enforced whether ``strict`` or not, as vLLM does), vLLM's
``structured_outputs`` and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, or in chat ``tool_choice`` "required" or a named function (a grammar of the
model's tool-call format over the tools' parameter schemas). At most one source per request: two
are a 400 naming both. Sub-fields not supported are refused by name (the models forbid extra
fields)."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor

from megatron_async.inference.request import SamplingParams
from megatron_async.inference.structured.spec import GrammarError, SpecError, StructuredOutputs
from megatron_async.serve.openai_protocol import BadRequest, NamedToolChoice, StructuredFields, _SamplingFields

_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_WHITESPACE = (r"[\n\t ]*", r"[ \t\n]*", r"[\t\n ]*", r"[ \n\t]*", r"\s*")
"""``guided_whitespace_pattern`` values that mean JSON's own whitespace (served as "flexible")."""
BACKENDS = ("auto", "xgrammar", "guidance")


def _make(param: str, **kinds) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kinds)
    except SpecError as e:
        raise BadRequest(str(e), param) from None


def _sources(req: StructuredFields) -> dict[str, StructuredOutputs]:
    out = {}
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out["response_format"] = _make("response_format", json_object=True)
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise BadRequest("response_format json_schema needs json_schema.schema", "response_format.json_schema")
        out["response_format"] = _make("response_format.json_schema", json=rf.json_schema.schema_)
    so = req.structured_outputs
    if so is not None:
        _check_backend(so.backend, "structured_outputs.backend")
        ws = "compact" if so.disable_any_whitespace else "flexible"
        kinds = {"json": so.json_, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
                 "grammar": so.grammar}
        out["structured_outputs"] = _make("structured_outputs", whitespace=ws, **{k: v for k, v in kinds.items()
                                                                                  if v is not None})
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}
    for kind, value in guided.items():
        if value is not None:
            out[f"guided_{kind}"] = _make(f"guided_{kind}", whitespace=_whitespace(req), **{kind: value})
    return out


def _whitespace(req: StructuredFields) -> str:
    pattern = req.guided_whitespace_pattern
    if pattern is None:
        return "compact"
    if pattern in _JSON_WHITESPACE:
        return "flexible"
    raise BadRequest("guided_whitespace_pattern: only JSON's whitespace ([\\n\\t ]*) is supported",
                     "guided_whitespace_pattern")


def _check_backend(name: str | None, param: str) -> None:
    if name is not None and name not in BACKENDS:
        raise BadRequest(f"{param}: the engine's grammar backend is chosen at startup ({', '.join(BACKENDS)}); "
                         f"got {name!r}", param)


def spec_of(req: StructuredFields, tools: StructuredOutputs | None = None) -> tuple[StructuredOutputs | None, str]:
    """The one constraint of a request (``tools``: the constraint of its ``tool_choice``) and the
    field it came from."""
    _check_backend(req.guided_decoding_backend, "guided_decoding_backend")
    if req.guided_whitespace_pattern is not None and not any(
            getattr(req, f) is not None for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")):
        raise BadRequest("guided_whitespace_pattern needs guided_json", "guided_whitespace_pattern")
    found = _sources(req)
    if tools is not None:
        found["tool_choice"] = tools
    if len(found) > 1:
        a, b = list(found)[:2]
        raise BadRequest(f"{a} and {b} both constrain the answer; give one", b)
    return next(iter(found.values()), None), next(iter(found), "")


def tool_choice_spec(tools: list, tool_choice, parallel_tool_calls: bool | None, parser: str | None
                     ) -> StructuredOutputs | None:
    """The grammar of a forced tool call: ``tool_choice`` "required" (one call or more of any
    tool; one when ``parallel_tool_calls`` is false) or a named function (one call of it), in the
    hermes format the tool-call parser reads back: ``<tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call>`` with the arguments held to the function's ``parameters`` schema."""
    named = isinstance(tool_choice, NamedToolChoice)
    if tool_choice != "required" and not named:
        return None
    if parser is None:
        raise BadRequest('tool_choice "required" or a named function needs a tool-call parser (--tool-call-parser '
                         "hermes)", "tool_choice")
    chosen = [t for t in tools if not named or t.function.name == tool_choice.function.name]
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                "arguments": t.function.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _COMPACT}
    call = f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
    many = not named and parallel_tool_calls is not False
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return _make("tool_choice", grammar=f"{start}\ncall: {call}")

async def constraint(req: StructuredFields, grammars, pool: Executor, tools: StructuredOutputs | None = None
                     ) -> StructuredOutputs | None:
    """The request's one constraint (``tools``: its tool choice's, ``tool_choice_spec``), compiled
    on ``pool`` where the engine's ``grammars`` are at hand, so a bad schema, regex or grammar is a
    400 with the library's message before anything is queued and the engine thread finds it
    compiled. (Elsewhere the engine refuses it when it is added.)"""
    spec, field = spec_of(req, tools)
    if spec is not None and grammars is not None:
        try:
            await asyncio.get_running_loop().run_in_executor(pool, grammars.validate, spec)
        except GrammarError as e:
            raise BadRequest(str(e), field) from None
    return spec


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None,
                    structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
    """The engine's SamplingParams for one choice. ``logprobs``: None = none, k >= 0 = the sampled
    token's log-prob plus the top k; ``structured_outputs``: the request's constraint
    (``constraint``)."""
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise BadRequest("logit_bias keys must be token ids", "logit_bias") from None
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0  # -1 / 0: off (vLLM uses -1)
    top_p = req.top_p if req.top_p is not None and req.top_p < 1.0 else 0.0  # 1.0 = off = our 0
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop is not None and any(not s for s in stop):
        raise BadRequest("stop strings must not be empty", "stop")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=top_k, top_p=top_p, num_tokens_to_generate=max_tokens, ignore_eos=req.ignore_eos, seed=req.seed,
        return_log_probs=logprobs is not None, top_n_logprobs=logprobs or 0, stop_words=stop or None,
        min_tokens=req.min_tokens, min_p=req.min_p, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=structured_outputs, logit_bias=logit_bias, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, priority=req.priority,
    )


def choice_params(req: _SamplingFields, max_tokens: int, logprobs: int | None, i: int,
                  structured_outputs: StructuredOutputs | None = None, prompt_top_n: int | None = None,
                  lora: str | None = None) -> SamplingParams:
    """The sampling parameters of choice ``i`` of request body ``req`` (``structured_outputs``: its
    constraint, ``constraint``; ``prompt_top_n``: score the prompt too, with this many top entries
    at least; ``lora``: the LoRA adapter its ``model`` names, request_input.lora_of)."""
    sp = sampling_params(req, max_tokens, logprobs, structured_outputs)
    sp.lora = lora
    if sp.seed is not None and i:  # n samples of one seeded request must differ
        sp.seed = (sp.seed + i) % 2**63
    if prompt_top_n is not None:
        sp.return_prompt_log_probs = True
        sp.top_n_logprobs = max(sp.top_n_logprobs, prompt_top_n)
    return sp
