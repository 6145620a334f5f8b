"""Chat templates from a checkpoint dir, rendered as transformers does."""
import json

import pytest

from megatron_async.models.chat_template import ChatTemplateError, load_chat_template

MSGS = [{"role": "user", "content": "Hi é"}]


def test_tokenizer_config_template_with_special_tokens(tmp_path):
    tpl = "{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content | tojson }}{% endfor %}" \
          "{% if add_generation_prompt %}[gen]{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tpl, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    t = load_chat_template(tmp_path)
    assert t.render(MSGS) == '<s>user="Hi é"[gen]'
    assert t.render(MSGS, add_generation_prompt=False) == '<s>user="Hi é"'


def test_jinja_file_wins_and_trims_blocks(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}")
    assert load_chat_template(tmp_path).render(MSGS) == "  Hi é\n"


def test_named_templates_and_missing(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path).render(MSGS) == "D"


def test_template_errors_are_chat_template_errors(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="must be system"):
        load_chat_template(tmp_path).render(MSGS)
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")  # sandboxed
    with pytest.raises(ChatTemplateError):
        load_chat_template(tmp_path).render(MSGS)
