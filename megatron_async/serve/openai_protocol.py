"""OpenAI request bodies (completions and chat, with the fields that constrain an answer) as strict
pydantic models, and the ``BadRequest`` family every refusal raises (an HTTP 4xx with OpenAI's
error object). Wrong types, unknown fields and unsupported options are refused with the reason
(request_input.parse_body), never a silent coercion: ``"0.5"`` is not a temperature and ``true``
is not a token count."""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` body: exactly one of the kinds; ``disable_any_whitespace``
    True (the default here) writes JSON compactly, False allows any JSON whitespace."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    backend: str | None = None


class StructuredFields(_Strict):
    """The fields that constrain an answer, in both endpoints' bodies (mixed into
    ``_SamplingFields``; sampling_fields.py turns them into one ``StructuredOutputs``)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    """A last chunk (no choices) with the whole request's usage."""
    continuous_usage_stats: bool = False
    """With ``include_usage``: every chunk also carries its choice's usage so far (vLLM's field)."""


class _SamplingFields(StructuredFields):
    """Fields shared by both endpoints: OpenAI's, then the extra ones vLLM also accepts (and those
    that constrain the answer: ``StructuredFields``)."""

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
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt only (completion_routes.py)
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
