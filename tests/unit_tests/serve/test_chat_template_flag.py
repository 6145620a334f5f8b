"""``--chat-template FILE``: the file replaces the checkpoint's own template for
/v1/chat/completions and /tokenize (the checkpoint's special tokens still fill it in), a template
that renders tools lets a request name one, and a path that cannot be read or a template that does
not parse stops the server at start-up with the reason."""
import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from megatron_async import LLM  # noqa: E402
from megatron_async.cli.flags import inference_config_from_args  # noqa: E402
from megatron_async.serve.__main__ import build_parser, build_state, main  # noqa: E402
from megatron_async.serve.app import create_app  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.asgi_call import post  # noqa: E402

OWN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
CUSTOM = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>{% endif %}"
          "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
          "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
MESSAGES = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("template") / "qwen3", seed=0,
                                with_tokenizer=True)
    save_chat_template(root, OWN)
    return root


def test_a_chat_template_file_replaces_the_checkpoint_s(ckpt, tmp_path):
    template = tmp_path / "custom.jinja"
    template.write_text(CUSTOM)
    args = build_parser().parse_args(["--model", str(ckpt), "--max-sequence-length", "128", "--num-kv-blocks", "64",
                                      "--max-requests", "4", "--chat-template", str(template)])
    llm = LLM(str(ckpt), inference_config=inference_config_from_args(args))
    state = build_state(llm, args)
    app = create_app(state)
    state.engine_loop.start()
    try:
        eos = llm.tokenizer.decode([llm.tokenizer.eos_token_ids[0]])
        want = llm.tokenizer.encode(f"[USER] hello{eos}[ASSISTANT]", add_special_tokens=False)
        status, body = asyncio.run(post(app, "/tokenize", {"messages": MESSAGES}))
        assert status == 200 and body["tokens"] == want  # the file's template, the checkpoint's eos_token
        status, body = asyncio.run(post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                                      "return_token_ids": True}))
        assert status == 200 and body["prompt_token_ids"] == want
        assert state.chat_template.renders_tools  # the checkpoint's own template renders none
        status, body = asyncio.run(post(app, "/tokenize", {"messages": MESSAGES, "tools": [TOOL]}))
        assert status == 200 and llm.tokenizer.decode(body["tokens"]).startswith("<tools>get_time;</tools>")
    finally:
        state.engine_loop.stop()
        llm.close()


@pytest.mark.parametrize("source, why", [(None, "No such file"), ("{% for m in messages %}", "does not parse")])
def test_a_bad_chat_template_is_a_startup_error(ckpt, tmp_path, capsys, source, why):
    path = tmp_path / "template.jinja"
    if source is not None:
        path.write_text(source)
    assert main(["--model", str(ckpt), "--port", "0", "--chat-template", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat-template") and str(path) in err and why in err
