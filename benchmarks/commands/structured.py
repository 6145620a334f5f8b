"""Structured outputs' cost: workload A (128 requests, prompts 100-1,024 tokens) on the
Qwen3-0.6B-shaped model with CUDA graphs and launch-ahead, with every request (and with 10 % of
them) constrained to a JSON schema, each against the same requests unconstrained with the same
output lengths (a constrained request ends where its JSON does; its plain twin generates as many
tokens with EOS ignored), greedy and sampled, on one engine in one process, cells interleaved.
Every constrained output must parse and validate against the schema (the run fails otherwise).
Prints one markdown table last: output tok/s of each pair and their ratio, mean decode step,
host time filling grammar masks per constrained step (on the grammar worker thread, beside the
next launch's scheduling) and how long the engine thread waited for it, and the share of decode
steps launched ahead.

The model has random weights and no tokenizer: the grammars run on a Qwen3-sized synthetic
byte-level BPE (benchmarks/synthetic_vocab.py, 151,669 entries). The schema has an integer range,
enums, an array with min / max items, a nested object with a pattern, and a string with
``maxLength``, which sends the whole schema to llguidance by the "auto" rule (``--backend xgrammar``
measures xgrammar on it). ``--grammar-threads``: the libraries' mask-filling threads (llguidance:
4 template matchers a spec per thread, guidance_backend.py).

    python -m benchmarks structured                   # one H100: ~3 min with the warm-up
    python -m benchmarks structured --smoke           # CPU, tiny model, seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "status": {"enum": ["open", "closed", "pending"]},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                "admin": {"type": "boolean"}},
              "required": ["name", "admin"], "additionalProperties": False},
    "note": {"type": "string", "maxLength": 12}},
    "required": ["id", "status", "tags", "owner", "note"], "additionalProperties": False}
CONSTRAINED_MAX_TOKENS = 256  # the JSON ends well before (its worst case is ~110 one-byte tokens)


def valid(doc) -> bool:
    """The schema's rules (jsonschema when installed; the same checks by hand otherwise)."""
    try:
        import jsonschema
    except ImportError:
        o = doc
        return (isinstance(o, dict) and list(o) == list(SCHEMA["properties"]) and type(o["id"]) is int
                and 0 <= o["id"] <= 9999 and o["status"] in ("open", "closed", "pending")
                and 1 <= len(o["tags"]) <= 3 and all(t in ("red", "green", "blue") for t in o["tags"])
                and list(o["owner"]) == ["name", "admin"] and isinstance(o["owner"]["admin"], bool)
                and o["owner"]["name"].isalpha() and o["owner"]["name"].islower() and 1 <= len(o["owner"]["name"]) <= 8
                and isinstance(o["note"], str) and len(o["note"]) <= 12)
    try:
        jsonschema.validate(doc, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def build(args):
    """The engine, the tokenizer its grammars use, the workload."""
    from megatron_async import LLM, InferenceConfig
    from megatron_async.cli.workload import WorkloadRequest
    from megatron_async.inference.structured.grammars import Grammars

    if args.smoke:
        cfg = InferenceConfig(max_requests=8, max_tokens=256, max_sequence_length=512)
        llm = LLM(None, device="cpu", inference_config=cfg)
        # plain requests of 32 tokens: the constrained ones (JSON of ~30-110 tokens) still share their steps
        tok, n, lo, hi, vocab, out = llm.tokenizer.backend_tokenizer, 8, 8, 24, 1000, 32
    else:
        from benchmarks.synthetic_vocab import ENTRIES, synthetic_bpe

        cfg = InferenceConfig(max_requests=128, max_tokens=8192, max_sequence_length=2048)
        llm = LLM(None, device="cuda", dtype="bfloat16", default_model=args.default_model, inference_config=cfg)
        tok, n, lo, hi, vocab, out = synthetic_bpe(), 128, 100, 1024, ENTRIES, 128
    masks = llm.engine.masks
    masks.grammars = Grammars(tok, llm.runner.eos_ids, llm.runner.model.vocab_size, args.backend, args.grammar_threads)
    import random

    rng = random.Random(0)
    requests = [WorkloadRequest([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], out) for _ in range(n)]
    return llm, tok, requests


def params_maker(sampled: bool, constrained: set[int], lengths: dict[int, int] | None, index_of):
    """SamplingParams per request: constrained ones get the schema; with ``lengths`` (a matched
    plain cell) every request generates that many tokens, EOS ignored."""
    from megatron_async import SamplingParams
    from megatron_async.inference.structured.spec import StructuredOutputs

    spec = StructuredOutputs(json=SCHEMA)

    def make(req) -> SamplingParams:
        i = index_of[tuple(req.prompt)]
        sampling = dict(temperature=1.0, top_k=50, seed=1000 + i) if sampled else dict(temperature=0.0)
        if i in constrained and lengths is None:
            return SamplingParams(num_tokens_to_generate=CONSTRAINED_MAX_TOKENS, structured_outputs=spec, **sampling)
        n = lengths[i] if lengths is not None and i in lengths else req.output_len
        return SamplingParams(num_tokens_to_generate=n, ignore_eos=True, **sampling)

    return make


def run_cell(llm, tok, requests, make, constrained: set[int]) -> dict:
    import copy

    from megatron_async.cli.driver import run_workload

    st = llm.engine.stats
    before = {k: getattr(st, k) for k in ("decode_wall_time", "decode_steps", "overlapped_decode_steps",
                                          "grammar_steps", "grammar_fill_time", "grammar_fill_wait_time")}
    t0 = time.perf_counter()
    run = run_workload(llm.engine, copy.deepcopy(requests), make)
    wall = time.perf_counter() - t0
    d = {k: getattr(st, k) - v for k, v in before.items()}
    invalid = 0
    for i in constrained:
        o = run.outputs[i]
        try:
            ok = o.finish_reason == "stop" and valid(json.loads(tok.decode(o.generated_tokens[:-1])))
        except ValueError:
            ok = False
        invalid += not ok
    return {"tok_s": run.output_tokens / wall, "tokens": run.output_tokens,
            "decode_ms": 1e3 * d["decode_wall_time"] / max(1, d["decode_steps"]),
            "fill_ms": 1e3 * d["grammar_fill_time"] / max(1, d["grammar_steps"]),
            "wait_ms": 1e3 * d["grammar_fill_wait_time"] / max(1, d["grammar_steps"]),
            "overlap": d["overlapped_decode_steps"] / max(1, d["decode_steps"]), "invalid": invalid,
            "lengths": {i: len(run.outputs[i].generated_tokens) for i in constrained}}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model and its tokenizer")
    p.add_argument("--default-model", default="qwen3-0.6b")
    p.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "guidance"])
    p.add_argument("--grammar-threads", type=int, default=8, help="mask-filling threads (at most the CPU count)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell, interleaved (median)")
    p.add_argument("--out", default="structured_cost.json")
    args = p.parse_args(argv)
    llm, tok, requests = build(args)
    index_of = {tuple(r.prompt): i for i, r in enumerate(requests)}
    n = len(requests)
    shares = {"100 %": set(range(n)), "10 %": set(range(0, n, 10))}
    cells, lengths = {}, {}
    for sampled in (False, True):
        for share, constrained in shares.items():
            key = ("sampled" if sampled else "greedy", share)
            first = run_cell(llm, tok, requests, params_maker(sampled, constrained, None, index_of), constrained)
            lengths[key] = first["lengths"]  # deterministic (seeded), so every run has these
            cells[key] = (params_maker(sampled, constrained, None, index_of),
                          params_maker(sampled, constrained, lengths[key], index_of), constrained)
    results = {k: ([], []) for k in cells}
    for _ in range(args.repeats):
        for key, (json_make, plain_make, constrained) in cells.items():
            results[key][0].append(run_cell(llm, tok, requests, json_make, constrained))
            results[key][1].append(run_cell(llm, tok, requests, plain_make, set()))
    rows = _table(results, args)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    bad = sum(r["invalid"] for r in rows)
    llm.close()
    if bad:
        raise SystemExit(f"{bad} constrained outputs did not validate")
    return rows


def _table(results, args) -> list[dict]:
    rows = []
    print(f"\n| sampling | constrained | JSON tok/s | plain tok/s | ratio | decode ms JSON / plain | mask fill ms/step "
          f"| engine waited ms/step | launched ahead | invalid |  ({args.default_model if not args.smoke else 'tiny, CPU'}, backend "
          f"{args.backend}, {args.repeats} interleaved runs per cell, median)")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (sampling, share), (js, plain) in results.items():
        med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
        row = {"sampling": sampling, "constrained": share, "json_tok_s": med(js, "tok_s"), "plain_tok_s": med(plain, "tok_s"),
               "json_decode_ms": med(js, "decode_ms"), "plain_decode_ms": med(plain, "decode_ms"),
               "fill_ms": med(js, "fill_ms"), "wait_ms": med(js, "wait_ms"), "overlap": med(js, "overlap"), "invalid": sum(r["invalid"] for r in js),
               "tokens": js[0]["tokens"], "plain_tokens": plain[0]["tokens"]}
        row["ratio"] = row["json_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        print(f"| {sampling} | {share} | {row['json_tok_s']:,.0f} | {row['plain_tok_s']:,.0f} | {row['ratio']:.3f}x "
              f"| {row['json_decode_ms']:.2f} / {row['plain_decode_ms']:.2f} | {row['fill_ms']:.2f} | {row['wait_ms']:.2f} "
              f"| {100 * row['overlap']:.0f} % | {row['invalid']} |")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
