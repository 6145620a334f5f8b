"""A small chat template for tiny test checkpoints (their tokenizer has an EOS token, no BOS)."""
from __future__ import annotations

from pathlib import Path

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token if loop.first and bos_token is defined else '' }}"
    "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_chat_template(path: str | Path, template: str = TINY_CHAT_TEMPLATE) -> Path:
    """Give a checkpoint dir a chat template (``chat_template.jinja``, as transformers 5 writes it)."""
    out = Path(path) / "chat_template.jinja"
    out.write_text(template)
    return out
