"""A tiny Llama checkpoint whose greedy answers are scripted, for end-to-end tests of what the
server makes of a model's text (tool calls, reasoning sections).

Each script is a trigger text and the pieces of its answer. The tokenizer is the tests' tiny BPE
plus one added token per trigger and per piece; the model is a bigram table over those tokens:
its layers add nothing to the residual stream (zero output projections), a trigger's or piece's
embedding is a one-hot direction, and the LM head maps that direction to the next piece (the
last one to EOS). So a prompt whose last token is a trigger is answered with its pieces, token by
token, whatever came before; the pieces may split tags anywhere."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from tokenizers import AddedToken

from megatron_async.models.tiny_tokenizer import EOS_TOKEN, EOS_TOKEN_ID, train_tiny_tokenizer
from tests.helpers.hf_models import make_tiny_checkpoint

BASE_VOCAB = 512
HIDDEN = 128  # one direction per trigger and piece
NEXT_LOGIT = 50.0


def make_scripted_checkpoint(path: str | Path, scripts: dict[str, list[str]], chat_template: str) -> Path:
    """``scripts``: trigger -> answer pieces; every trigger and piece must be distinct text."""
    texts = [t for trigger, pieces in scripts.items() for t in (trigger, *pieces)]
    if len(set(texts)) != len(texts) or len(texts) > HIDDEN:
        raise ValueError("triggers and pieces must be distinct, at most HIDDEN of them")
    tok = train_tiny_tokenizer(BASE_VOCAB)
    tok.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in texts])
    ids = {t: tok.token_to_id(t) for t in texts}

    root = make_tiny_checkpoint("LlamaForCausalLM", path, vocab_size=tok.get_vocab_size(), hidden_size=HIDDEN,
                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    (root / "chat_template.jinja").write_text(chat_template)

    weights = load_file(root / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    weights["model.norm.weight"].fill_(1.0)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    head[:, : len(texts)] = 0.0
    dim = 0
    for trigger, pieces in scripts.items():
        chain = [ids[t] for t in (trigger, *pieces)] + [EOS_TOKEN_ID]
        for src, nxt in zip(chain, chain[1:]):
            embed[src] = 0.0
            embed[src, dim] = 1.0
            head[nxt, dim] = NEXT_LOGIT
            dim += 1
    save_file(weights, root / "model.safetensors", metadata={"format": "pt"})
    return root
