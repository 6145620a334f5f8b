"""Incremental detokenization and stop strings (TextStream), token by token."""
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megatron_async.inference.text_stream import REPLACEMENT_CHAR, TextStream
from megatron_async.models import Tokenizer
from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer(train_tiny_tokenizer(), EOS_TOKEN_ID)


def _stream(tok, prompt, generated, stops=(), include=False, skip=True):
    s = TextStream(tok, prompt, list(stops), skip, include)
    deltas, stopped_at = [], None
    for i, t in enumerate(generated):
        if s.append(t):
            stopped_at = i
            break
        deltas.append(s.take_delta())
    s.finish()
    deltas.append(s.take_delta())
    return s, deltas, stopped_at


def test_multibyte_characters_split_over_tokens(bpe):
    text = "naïve café — 日本語 🙂 done"
    ids = bpe.encode(text)
    assert any(REPLACEMENT_CHAR in bpe.decode([t]) for t in ids), "the case needs a character split over tokens"
    prompt = bpe.encode("Hello world")
    s, deltas, _ = _stream(bpe, prompt, ids)
    assert "".join(deltas) == s.text == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert sum(1 for d in deltas if d) > 5  # it really streamed


def test_incomplete_tail_is_flushed_at_the_end(bpe):
    ids = bpe.encode("日本")
    cut = next(i for i in range(1, len(ids)) if bpe.decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    s, deltas, _ = _stream(bpe, [5], ids[:cut])
    assert "".join(deltas) == s.text == bpe.decode(ids[:cut])


def _wordpiece() -> Tokenizer:
    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", "the", "hello", "##s", "world", "##ly", "big"])}
    tok = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[EOS]"])
    return Tokenizer(tok, 1)


def test_decoder_that_merges_tokens():
    tok = _wordpiece()
    prompt, gen = [2], [3, 4, 5, 6, 7, 1, 3]  # the | hello ##s world ##ly big [EOS] hello
    s, deltas, _ = _stream(tok, prompt, gen)
    full = tok.decode(prompt + gen, skip_special_tokens=True)
    assert "".join(deltas) == s.text == full[len(tok.decode(prompt)):] == " hellos worldly big hello"
    s, deltas, _ = _stream(tok, prompt, gen, skip=False)
    assert "".join(deltas) == s.text == " hellos worldly big [EOS] hello"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(bpe, include):
    text = "The quick brown fox jumps over the lazy dog"
    ids = bpe.encode(text)
    stop = "own fox ju"  # spans several tokens, starts and ends inside tokens
    assert not any(stop in bpe.decode([t]) for t in ids)
    s, deltas, stopped_at = _stream(bpe, [5], ids, stops=["zzz", stop], include=include)
    end = text.index(stop) + (len(stop) if include else 0)
    assert s.text == text[:end] and "".join(deltas) == s.text
    assert bpe.decode(ids[: stopped_at + 1]).find(stop) >= 0 > bpe.decode(ids[:stopped_at]).find(stop)
    assert s.stopped_by == stop


def test_earliest_stop_wins_and_unmatched_stops_hold_nothing_back_at_the_end(bpe):
    text = "Hello world! How are you today?"
    ids = bpe.encode(text)
    s, deltas, _ = _stream(bpe, [5], ids, stops=["are", "world"])
    assert s.text == "Hello " and "".join(deltas) == "Hello "
    s, deltas, stopped = _stream(bpe, [5], ids, stops=["absent stop string"])
    assert stopped is None and "".join(deltas) == s.text == text
