"""A checkpoint's chat template (``chat_template.jinja`` or ``tokenizer_config.json``'s
``chat_template``), rendered with jinja2 the way Hugging Face does: a sandboxed environment
with ``trim_blocks`` / ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``
and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), plus ``raise_exception``,
``strftime_now`` and a ``tojson`` filter that keeps non-ASCII text."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from datetime import datetime
from pathlib import Path
from typing import Any

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The template is missing, cannot be parsed, or rejected the messages (its own raise_exception)."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older tokenizer_config files store AddedToken dicts
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str):
    raise ChatTemplateError(message)


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]

    def __post_init__(self):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not parse: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` (each a dict with ``role`` and ``content``)."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the template shows the model the ``tools`` it is given: a conversation rendered
        with a probe tool differs from the same one without it (a template that never reads
        ``tools``, or fails with them, does not)."""
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        tool = {"type": "function", "function": {"name": "probe_function", "description": "a probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            return self.render(messages, True, tools=[tool]) != self.render(messages, True)
        except ChatTemplateError:
            return False


def load_chat_template(path: str | Path | None, template_file: str | Path | None = None) -> ChatTemplate | None:
    """The checkpoint dir's chat template, or None when it has none. ``template_file``: a Jinja
    file that replaces the checkpoint's template (its special tokens still come from ``path``);
    OSError when it cannot be read, ChatTemplateError when it does not parse."""
    tok_cfg_path = Path(path) / "tokenizer_config.json" if path is not None else None
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path is not None and tok_cfg_path.is_file() else {}
    if template_file is not None:
        source = Path(template_file).read_text()
    else:
        source = _checkpoint_source(Path(path), tok_cfg) if path is not None else None
    if source is None:
        return None
    specials = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(tok_cfg.get(k))) is not None}
    return ChatTemplate(source, specials)


def _checkpoint_source(root: Path, tok_cfg: dict) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    if isinstance(tok_cfg.get("chat_template"), str):
        return tok_cfg["chat_template"]
    if isinstance(tok_cfg.get("chat_template"), list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in tok_cfg["chat_template"] if isinstance(t, dict)}
        return named.get("default")
    return None
