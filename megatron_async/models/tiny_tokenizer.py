"""A small byte-level BPE tokenizer trained in-process (no downloads): the built-in tiny default
model's vocabulary, and the tokenizer of the tests' tiny checkpoints."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 0  # the first special token gets id 0

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
A paged cache stores keys and values in fixed blocks so that requests can grow without copying.
Inference engines batch many requests together and decode one token for each of them per step.
The scheduler admits new prompts when memory allows, and pauses others when blocks run out.
Once upon a time there was a small model that wanted to predict the next word of every story.
Rivers flow to the sea, mountains rise toward the sky, and forests cover the valleys between them.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2048 appear in many technical texts.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
She asked him what time the train would leave, and he said it would leave at half past seven.
Graphics processors run thousands of threads at once, but they still wait when the host is slow.
Hello world! How are you today? I am fine, thank you. What would you like to talk about?
The library opened early on Saturday, and students gathered around long wooden tables to study chemistry.
Bakers knead dough before dawn; the bread rises slowly, then browns in ovens heated by burning oak.
Our committee reviewed seventeen proposals, approved twelve, rejected three, and postponed two for further analysis.
Astronomers measured distant galaxies whose light travelled billions of years before reaching telescopes.
Please remember: umbrellas, passports, chargers, tickets, sandwiches, and the yellow notebook with addresses.
Quantum physics describes particles, waves, probabilities, entanglement, and measurements that collapse states.
Farmers harvested pumpkins, carrots, potatoes, onions, beans, apples, pears, grapes, and golden wheat fields.
JSON objects map keys to values: {"name": "alpha", "size": 3, "tags": ["x", "y"], "valid": true}.
Musicians tuned violins, cellos, trumpets, clarinets, drums, and pianos before the evening symphony began.
import torch
x = torch.zeros(4, 8, dtype=torch.float32)
if x.sum() == 0:
    raise ValueError("empty tensor")
Volcanoes erupt molten rock; glaciers carve fjords; hurricanes gather strength above warm tropical oceans.
Doctors recommend sleeping eight hours, drinking water, exercising regularly, and eating fresh vegetables.
The architecture document explains modules, interfaces, responsibilities, dependencies, and verification steps.
Children built sandcastles, chased seagulls, collected shells, and laughed whenever waves splashed their feet.
Merchants traded silk, spices, porcelain, copper, salt, and jewelry along ancient caravan routes through deserts.
Engineers profile kernels, reduce synchronization, overlap transfers, and measure throughput against latency budgets.
Attention lets every token look at the tokens before it and weigh them by their relevance.
The weather was cold in winter, mild in spring, hot in summer, and windy in the autumn months.
"""


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    # Repeating lines with small variations gives the trainer enough pair statistics.
    lines = _CORPUS.splitlines()
    corpus = [f"{line} {lines[(i * 7 + 3) % len(lines)]}" for i, line in enumerate(lines * 8)]
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def train_tiny_tokenizer(vocab_size: int = 1024) -> tokenizers.Tokenizer:
    """A byte-level BPE with at most ``vocab_size`` entries; EOS_TOKEN has id EOS_TOKEN_ID.
    Trained once per vocab size per process (well under a second)."""
    return tokenizers.Tokenizer.from_str(_trained_json(vocab_size))


def save_tiny_tokenizer(path: str | Path, vocab_size: int = 1024) -> Path:
    """Write tokenizer.json and tokenizer_config.json (naming the EOS token) into ``path``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    train_tiny_tokenizer(vocab_size).save(str(root / "tokenizer.json"))
    with open(root / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": EOS_TOKEN, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    return root
