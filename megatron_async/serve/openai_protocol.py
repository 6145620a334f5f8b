"""OpenAI request bodies (completions and chat) as strict pydantic models, and their mapping to
``SamplingParams``. Wrong types, unknown fields and unsupported options are ``BadRequest`` (HTTP
400 with the reason), never a silent coercion: ``"0.5"`` is not a temperature and ``true`` is not
a token count."""
from __future__ import annotations

import json
import reprlib
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from megatron_async.inference.request import SamplingParams
from megatron_async.inference.structured.spec import StructuredOutputs
from megatron_async.serve.structured_body import StructuredFields

TokenIds = list[int]


class BadRequest(ValueError):
    """A request the server answers with HTTP ``status`` (400 here, other 4xx in the subclasses)
    and OpenAI's error object; ``param`` names the offending field."""

    status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFound(BadRequest):
    status = 404


class PayloadTooLarge(BadRequest):
    status = 413


class UnsupportedMediaType(BadRequest):
    status = 415


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 2, 80, 80, 80
    return r


_brief = _short_repr().repr
"""A short repr of any decoded JSON value (deeply nested or huge ones included) for messages."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    """A last chunk (no choices) with the whole request's usage."""
    continuous_usage_stats: bool = False
    """With ``include_usage``: every chunk also carries its choice's usage so far (vLLM's field)."""


class _SamplingFields(_Strict, StructuredFields):
    """Fields shared by both endpoints: OpenAI's, then the extra ones vLLM also accepts (and those
    that constrain the answer: structured_body.py)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)  # at most the engine's max_requests (checked by the app)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # accepted and ignored, as OpenAI does without stored completions
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)  # vLLM's: lower is admitted first
    # extras (vLLM names)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(cls, options, info):
        if options is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed with stream: true")
        if options is not None and options.continuous_usage_stats and not options.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage")
        return options


class CompletionRequest(_SamplingFields):
    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt only (serve/echo.py)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's extra
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema."""
    strict: bool | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Strict):
    name: str
    arguments: str
    """The arguments as a JSON string."""


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction

    def as_template_call(self) -> dict[str, Any]:
        """As transformers' templates take it: arguments that are a JSON object become a dict
        (templates write ``arguments | tojson``); anything else stays the string it was."""
        try:
            args = json.loads(self.function.arguments)
        except (ValueError, RecursionError):
            args = None
        arguments = args if isinstance(args, dict) else self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant messages: the calls it made (their results follow as "tool" messages)."""
    tool_call_id: str | None = None
    """Tool messages: the call this is the result of."""

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool messages, and only they, need a tool_call_id")
        return self

    def as_template_message(self) -> dict[str, Any]:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        msg = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.as_template_call() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(default_factory=list)
    """At least one, unless ``prompt_token_ids`` is the prompt."""
    prompt_token_ids: TokenIds | None = Field(default=None, min_length=1)
    """The prompt as token ids, the chat template not rendered (a multi-turn rollout sends its
    earlier turns as the ids they were, never re-tokenized); instead of ``messages``."""
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    """False: at most one tool call is returned (the first the model makes); nothing constrains the
    model itself."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _a_prompt(self):
        if not self.messages and self.prompt_token_ids is None:
            raise ValueError("messages: at least one (or prompt_token_ids)")
        return self


_TEMPLATE_RESERVED = ("messages", "self")
"""Names ChatTemplate.render takes itself; ``add_generation_prompt`` may be overridden (vLLM's rule)."""


def chat_template_kwargs(req: ChatCompletionRequest) -> tuple[bool, dict[str, Any]]:
    """(add_generation_prompt, the other template variables) of a chat request: its
    ``chat_template_kwargs`` override the request's own ``add_generation_prompt``."""
    extra = dict(req.chat_template_kwargs or {})
    add_generation_prompt = extra.pop("add_generation_prompt", req.add_generation_prompt)
    if not isinstance(add_generation_prompt, bool):
        raise BadRequest("chat_template_kwargs.add_generation_prompt must be a boolean",
                         "chat_template_kwargs.add_generation_prompt")
    for name in _TEMPLATE_RESERVED:
        if name in extra:
            raise BadRequest(f"chat_template_kwargs may not set {name!r}", f"chat_template_kwargs.{name}")
    return add_generation_prompt, extra


def _is_union_branch(part: Any) -> bool:
    """pydantic names the union member it tried in an error's location ('str', 'list[int]', ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part or "-" in part)


def parse_body(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_branch(p))
        raise BadRequest(f"{loc or 'body'}: {err['msg']} (got {_brief(err.get('input'))})", loc or None) from None


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None,
                    structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
    """The engine's SamplingParams for one choice. ``logprobs``: None = none, k >= 0 = the sampled
    token's log-prob plus the top k; ``structured_outputs``: the request's constraint
    (structured_fields.spec_of)."""
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


def completion_prompts(req: CompletionRequest) -> list[str | TokenIds]:
    """The request's prompts: one text, one token-id list, or a batch of either."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise BadRequest("prompt must not be empty", "prompt")
    if isinstance(p[0], int):
        return [p]
    return list(p)


def check_completion_options(req: CompletionRequest) -> None:
    if req.suffix:
        raise BadRequest("suffix is not supported", "suffix")
