"""The detokenizer's native path (tokenizers' DecodeStream) gives the Python path's text, delta for
delta, and hands over to it where the stream cannot go on."""
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models

from megatron_async.inference.text_stream import REPLACEMENT_CHAR, IncrementalDetokenizer
from megatron_async.models import Tokenizer
from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer


class PythonOnly:
    """The same tokenizer without its ``backend_tokenizer``: the detokenizer's Python path."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer(train_tiny_tokenizer(), EOS_TOKEN_ID)


def _run(tok, prompt, chunks, skip):
    d = IncrementalDetokenizer(tok, prompt, skip)
    native_at_start = d._stream is not None
    deltas = [d.extend(list(c)) for c in chunks] + [d.flush()]
    return deltas, native_at_start, d._stream is not None


def _chunked(ids, sizes):
    out, i = [], 0
    for n in sizes:
        if i >= len(ids):
            break
        out.append(ids[i : i + n])
        i += n
    return out + ([ids[i:]] if i < len(ids) else [])


TEXTS = ["naïve café — 日本語 🙂 done", "Hello world! How are you today?", "÷ wörld 🙂🙂 ok  spaced",
         "The quick brown fox jumps over the lazy dog"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt_text=st.sampled_from(TEXTS), text=st.sampled_from(TEXTS), cut=st.integers(0, 40),
       sizes=st.lists(st.integers(1, 4), max_size=40), skip=st.booleans(), special=st.lists(st.integers(0, 60), max_size=3))
def test_native_path_gives_the_python_paths_deltas_on_text(bpe, prompt_text, text, cut, sizes, skip, special):
    prompt = bpe.encode(prompt_text)
    ids = bpe.encode(text)[cut:]
    for at in special:  # EOS / special tokens between the generated characters: skipped or kept text
        at = min(at, len(ids))
        if REPLACEMENT_CHAR not in bpe.decode(ids[:at]):  # not inside a character (that one stays broken)
            ids.insert(at, EOS_TOKEN_ID)
    chunks = _chunked(ids, sizes)
    native, started, _ = _run(bpe, prompt, chunks, skip)
    python, _, _ = _run(PythonOnly(bpe), prompt, chunks, skip)
    assert started, "a prompt of complete text starts on the native path"
    assert native == python
    if cut == 0:  # whole characters: a character split over tokens is held back, never half-emitted
        assert not any(REPLACEMENT_CHAR in d for d in native)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_native_path_gives_the_python_paths_deltas_on_random_ids(bpe, data, skip):
    ids = st.integers(0, bpe.vocab_size - 1)
    prompt = data.draw(st.lists(ids, max_size=8))
    gen = data.draw(st.lists(ids, min_size=1, max_size=40))
    chunks = _chunked(gen, data.draw(st.lists(st.integers(1, 3), max_size=40)))
    native, _, _ = _run(bpe, prompt, chunks, skip)
    assert native == _run(PythonOnly(bpe), prompt, chunks, skip)[0]


def test_prompt_ending_inside_a_character_takes_the_python_path(bpe):
    ids = bpe.encode("日本語")
    cut = next(i for i in range(1, len(ids)) if bpe.decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    native, started, _ = _run(bpe, ids[:cut], [[t] for t in ids[cut:]], True)
    assert not started
    assert native == _run(PythonOnly(bpe), ids[:cut], [[t] for t in ids[cut:]], True)[0]


def test_a_decoder_that_rewrites_earlier_text_hands_over_to_the_python_path():
    # Fuse + Replace rewrites "a b" into "ZZZZ": the stream's earlier text is no longer a prefix
    inner = tokenizers.Tokenizer(models.WordLevel({"a": 0, " b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    inner.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("a b", "ZZZZ")])
    tok = Tokenizer(inner, None)
    chunks = [[2], [0], [1], [2], [0, 2]]
    native, started, still_native = _run(tok, [2], chunks, False)
    assert started and not still_native, "the stream ran, then raised and handed over"
    python = _run(PythonOnly(tok), [2], chunks, False)[0]
    assert native == python and "".join(native) == "caZZZcac"  # (emitted text is never taken back)
