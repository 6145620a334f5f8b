"""A Qwen3-sized byte-level BPE tokenizer built in-process (the real one cannot be fetched on the
GPU machine): 151,643 entries, the Qwen special tokens after them (151,643 ``<|endoftext|>``,
151,644 ``<|im_start|>``, 151,645 ``<|im_end|>``, then fillers to 151,669), for grammar masks at
the real vocabulary's size with the built-in Qwen3-shaped models (151,936 rows).

Its tokens are what a trained BPE mostly holds: the 256 bytes, then prefixes of synthetic words
(syllables, with and without a leading space, capitalized or not), digit runs and the JSON
punctuation runs of real vocabularies (``": "``, ``", "``, ``{"`` ...), each made by one merge of a
token and a byte, so the merge list is a valid BPE of the vocabulary. Deterministic (seeded)."""
from __future__ import annotations

import functools
import json
import random

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

ENTRIES, SPECIAL_END = 151_643, 151_669
EOS_ID = 151_645  # <|im_end|>, the built-in Qwen3 configs' eos_token_id
_PUNCT = ['":', '",', '{"', '"}', '": "', '", "', '},', '}}', '],', '["', '"]', ': ', ', ', '{\n', '\n}', '  ', '    ',
          '":"', '","', '":[', '":{', 'true', 'false', 'null', '\n', '\n\n', '.\n', '. ', '?', '!']


def _bytes() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _words(rng: random.Random):
    cons, vows = "bcdfghjklmnprstvwyz", "aeiou"
    syllables = [c + v for c in cons for v in vows] + [v + c for v in vows for c in cons] + list(vows)
    space = "Ġ"  # the byte-level alphabet's space
    while True:
        r = rng.random()
        if r < 0.06:
            yield "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
        elif r < 0.08:
            yield rng.choice(_PUNCT).replace(" ", space).replace("\n", "Ċ")
        else:
            w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.15:
                w = w.capitalize()
            yield (space + w) if rng.random() < 0.6 else w


@functools.lru_cache(maxsize=2)
def synthetic_bpe_json(entries: int = ENTRIES, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = {b: i for i, b in enumerate(_bytes())}
    merges = []
    for word in _words(rng):
        cur = word[0]
        for ch in word[1:]:
            nxt = cur + ch
            if nxt not in vocab:
                if len(vocab) >= entries:
                    break
                vocab[nxt] = len(vocab)
                merges.append([cur, ch])
            cur = nxt
        if len(vocab) >= entries:
            break
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(entries + 3, SPECIAL_END)]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    assert tok.token_to_id("<|im_end|>") == EOS_ID, tok.token_to_id("<|im_end|>")
    return tok.to_str()


def synthetic_bpe(entries: int = ENTRIES, seed: int = 0) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(synthetic_bpe_json(entries, seed))


if __name__ == "__main__":
    t = synthetic_bpe()
    s = '{"id": 42, "status": "open", "tags": ["a", "b"], "owner": {"name": "bob", "admin": true}}'
    print(t.get_vocab_size(), len(t.encode(s).ids), json.dumps(t.decode(t.encode(s).ids) == s))
