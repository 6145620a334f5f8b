"""Structured outputs in the engine (built-in tiny model and its tokenizer, CPU): every output
matches its spec, launch-ahead == serial token for token with grammar rows in most steps (and
the steps really overlapped), logits-only graphs (emulated) == eager, speculative decoding with
grammar rows == plain, invalid specs refused per request while the others run."""
import json
import re

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.request import InvalidRequestError
from megatron_async.inference.structured.spec import StructuredOutputs
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from tests.helpers.engine_harness import Arrival, count_replays_by_variant, run_arrivals, tokens_of

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False},
    "name": {"type": "string", "maxLength": 6}},
    "required": ["id", "kind", "tags", "inner", "name"], "additionalProperties": False}
REGEX = r"[a-z]{3}-[0-9]{2}"
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "ab"'
SPECS = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=["left", "right"]),
         StructuredOutputs(grammar=GBNF)]


def check_output(spec: StructuredOutputs, out) -> None:
    text = out.generated_text
    assert out.finish_reason == "stop", (out.finish_reason, text)
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif spec.kind == "choice":
        assert text in ("left", "right"), text
    else:
        assert re.fullmatch(r"\((?:[0-9]|ab)(?:,(?:[0-9]|ab))*\)", text), text


def make(async_scheduling=True, graphs=False, **cfg) -> LLM:
    base = dict(block_size_tokens=4, num_kv_blocks=400, max_requests=8, max_tokens=64, max_sequence_length=256)
    llm = LLM(None, inference_config=InferenceConfig(**{**base, **cfg}, async_scheduling=async_scheduling))
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, emulate=True,
                                            logits_only=True)
    return llm


def arrivals(llm, n: int, constrained_every: int = 1, stagger: int = 2, max_tokens: int = 120) -> list[Arrival]:
    out = []
    for i in range(n):
        spec = SPECS[i % len(SPECS)] if i % constrained_every == 0 else None
        sp = SamplingParams(num_tokens_to_generate=max_tokens if spec else 20, seed=100 + i,
                            temperature=0.0 if i % 3 == 0 else 0.9, top_k=0 if i % 2 else 40, structured_outputs=spec)
        out.append(Arrival(stagger * i, llm.tokenizer.encode(f"request {i}: say something"), sp))
    return out


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_output_matches_its_spec(async_scheduling):
    llm = make(async_scheduling)
    arr = arrivals(llm, 10, stagger=0)
    outs = run_arrivals(llm, arr)
    for i, a in enumerate(arr):
        check_output(a.params.structured_outputs, outs[i])
    st = llm.engine.stats
    assert st.grammar_steps > 0 and st.grammar_rows >= st.grammar_steps and st.grammar_fill_time > 0


@pytest.mark.parametrize("constrained_every,cfg", [(1, {}), (3, {}), (1, dict(num_kv_blocks=40, max_tokens=24))])
def test_launch_ahead_equals_serial(constrained_every, cfg):
    runs = {}
    for mode in (False, True):
        llm = make(mode, **cfg)
        arr = arrivals(llm, 12, constrained_every)
        runs[mode] = (arr, run_arrivals(llm, arr), llm.engine.stats)
    (arr, serial, s), (_, asyn, a) = runs[False], runs[True]
    assert tokens_of(asyn) == tokens_of(serial)
    for i, x in enumerate(arr):
        if x.params.structured_outputs is not None:
            check_output(x.params.structured_outputs, asyn[i])
    assert s.overlapped_steps == 0 and a.grammar_steps > 0.5 * a.steps, a.as_dict()
    assert a.overlapped_decode_steps > 0.8 * a.decode_steps, a.as_dict()
    # launch-ahead fills a launch's masks on the worker thread as soon as the launch before lands
    assert s.grammar_early_fills == 0 and a.grammar_early_fills > 0.8 * a.grammar_steps, a.as_dict()
    if cfg:  # a small pool: requests paused and evicted (recomputed) mid-output
        assert a.paused > 0 and a.evicted > 0 and s.evicted > 0, a.as_dict()


def test_logits_only_graphs_equal_eager():
    """Emulated graphs: steps with grammar rows replay logits-only graphs (decode and mixed) and
    sample eagerly; the tokens are the eager engine's."""
    eager = make()
    arr = arrivals(eager, 8, constrained_every=2)
    want = tokens_of(run_arrivals(eager, arr))
    llm = make(graphs=True)
    replays = count_replays_by_variant(llm.runner.graphs)
    got = run_arrivals(llm, arrivals(llm, 8, constrained_every=2))
    assert tokens_of(got) == want
    assert replays["logits"] > 0, replays
    assert any(k.logits_only and not k.decode_only for k in llm.runner.graphs.graphs), llm.runner.graphs.graphs


def test_speculative_decoding_beside_grammar_rows_equals_plain():
    plain = make()
    arr = arrivals(plain, 8, constrained_every=2)
    want = tokens_of(run_arrivals(plain, arr))
    llm = make(num_speculative_tokens=2, speculative_method="ngram", speculative_min_acceptance=0.0)
    got = run_arrivals(llm, arrivals(llm, 8, constrained_every=2))
    assert tokens_of(got) == want
    st = llm.engine.stats
    assert st.spec_off_rows["grammar"] > 0 and st.spec_draft_tokens > 0 and st.grammar_steps > 0, st.as_dict()


def test_invalid_specs_are_refused_while_others_run():
    llm = make()
    eng = llm.engine
    good = [eng.add_request(f"good {i}", SamplingParams(num_tokens_to_generate=60, structured_outputs=SPECS[i]))
            for i in range(3)]
    bad = {"json": ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"), "regex": ("(ab[", "nclosed"),
           "grammar": ('root ::= "a" undefined_rule', "undefined_rule")}
    eng.step()
    for kind, (value, needle) in bad.items():
        with pytest.raises(InvalidRequestError, match=f"invalid {kind}:.*{needle}"):
            eng.add_request("bad", SamplingParams(structured_outputs=StructuredOutputs(**{kind: value})))
    for sp, needle in [(SamplingParams(ignore_eos=True, structured_outputs=SPECS[1]), "ignore_eos"),
                       (SamplingParams(min_tokens=2, structured_outputs=SPECS[1]), "min_tokens"),
                       (SamplingParams(structured_outputs={"json": SCHEMA}), "structured_outputs")]:
        with pytest.raises(InvalidRequestError, match=needle):
            eng.add_request("bad", sp)
    outs = eng.run_requests(good)
    for i, rid in enumerate(good):
        check_output(SPECS[i], outs[rid])
    assert eng.stats.rejected_requests == 6


def test_termination_id_ends_the_grammar():
    """A request that stops on its own id gets that id where the grammar may end."""
    llm = make()
    stop = llm.tokenizer.encode("!")[0]
    sp = SamplingParams(num_tokens_to_generate=40, termination_id=stop, structured_outputs=SPECS[2])
    out = llm.generate(["which way?"], sp)[0]
    assert out.finish_reason == "stop" and out.generated_tokens[-1] == stop
    assert llm.tokenizer.decode(out.generated_tokens[:-1]) in ("left", "right")


def test_fill_beside_the_engine_thread_gets_the_gil_within_the_fill_interval():
    """While a fill runs on the worker the GIL switch interval is at most FILL_SWITCH_INTERVAL_S
    (the worker waits that long at most for the GIL while the engine thread runs Python); the
    interval the process had comes back when the fill is taken, and fills on the engine thread
    (serial mode) leave it alone."""
    import sys
    import threading

    from megatron_async.inference.engines.grammar_masks import FILL_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default
    try:
        for mode in (True, False):
            llm = make(mode)
            masks, seen = llm.engine.masks, []
            fill = masks.fill

            def recording(*a, fill=fill):
                seen.append((threading.current_thread() is threading.main_thread(), sys.getswitchinterval()))
                return fill(*a)

            masks.fill = recording
            run_arrivals(llm, arrivals(llm, 6))
            on_worker = [i for main, i in seen if not main]
            assert sys.getswitchinterval() == 0.005
            if mode:
                assert len(on_worker) > 0.8 * len(seen) and max(on_worker) <= FILL_SWITCH_INTERVAL_S, seen
            else:
                assert seen and not on_worker and {i for _, i in seen} == {0.005}, seen
    finally:
        sys.setswitchinterval(before)


def test_fill_starts_as_soon_as_the_launch_before_lands():
    """The next launch's fill starts right after the landing's tokens are in the requests, before
    the rest of the landing's bookkeeping (reports, text updates) that the fill can run beside."""
    llm = make(True)
    eng, events = llm.engine, []
    land, start, log_step = eng.book.land, eng.masks.start, eng.accounting.log_step

    def landing(*a):
        events.append("land")
        return land(*a)

    def starting(runner, pending):
        if pending is not None and pending.awaiting_masks is not None:
            events.append("fill")
        return start(runner, pending)

    def logging(*a):
        events.append("bookkept")
        return log_step(*a)

    eng.book.land, eng.masks.start, eng.accounting.log_step = landing, starting, logging
    run_arrivals(llm, arrivals(llm, 6))
    fills = [i for i, e in enumerate(events) if e == "fill"]
    assert len(fills) > 0.8 * eng.stats.grammar_steps and all(events[i - 1] == "land" for i in fills), events


def test_switch_interval_comes_back_when_the_last_fill_in_the_process_is_taken():
    """Engines sharing a process share its one switch interval: fills of two engines overlapping
    (A starts, B starts, A is taken, B is taken) keep it low until the last is taken, then the
    interval before the first comes back."""
    import sys

    from megatron_async.inference.engines.grammar_masks import FILL_SWITCH_INTERVAL_S, FillSwitchInterval

    before, gil = sys.getswitchinterval(), FillSwitchInterval()
    try:
        sys.setswitchinterval(0.005)
        gil.fill_started()
        gil.fill_started()
        gil.fill_taken()
        assert sys.getswitchinterval() <= FILL_SWITCH_INTERVAL_S
        gil.fill_taken()
        assert sys.getswitchinterval() == 0.005
        sys.setswitchinterval(FILL_SWITCH_INTERVAL_S / 2)  # already below: left as it is
        low = sys.getswitchinterval()
        gil.fill_started()
        assert sys.getswitchinterval() == low
        gil.fill_taken()
        assert sys.getswitchinterval() == low
    finally:
        sys.setswitchinterval(before)


def test_an_engine_closed_with_a_fill_in_flight_gives_the_switch_interval_back():
    """LLM.close waits for a fill still on the worker, restores the process's switch interval
    and ends the worker thread (the fill's launch is never sampled)."""
    import sys

    from megatron_async.inference.engines.grammar_masks import FILL_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        llm = make(True)
        eng = llm.engine
        for a in arrivals(llm, 4, stagger=0):
            eng.add_request(a.prompt, a.params)
        for _ in range(50):
            eng.step()
            if eng.masks._job is not None:
                break
        assert eng.masks._job is not None and sys.getswitchinterval() <= FILL_SWITCH_INTERVAL_S
        worker = eng.masks._worker
        llm.close()
        assert sys.getswitchinterval() == 0.005 and eng.masks._job is None and eng.masks._worker is None
        assert worker._shutdown
    finally:
        sys.setswitchinterval(before)
