"""Specs, the two grammar libraries behind one interface, their error messages, stop ids, the
"auto" routing rule, and the device-side mask (torch reference and Triton kernel)."""
import pytest
import torch

from megatron_async.inference.structured.grammars import Grammars, fill_masks
from megatron_async.inference.structured.request_grammar import allows, bitmask_words
from megatron_async.inference.structured.spec import GrammarError, SpecError, StructuredOutputs, prefers_guidance
from megatron_async.kernels.token_mask import apply_token_bitmask
from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(1024)


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def grammars(request, tok):
    return Grammars(tok, (EOS_TOKEN_ID,), 1024 + 40, mode=request.param, threads=1)  # model rows > tokenizer's


def test_spec_key_is_canonical_and_exactly_one_kind():
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b) and a.kind == "json"
    c = StructuredOutputs(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert c != a  # key order kept: properties come out in the schema's order
    assert StructuredOutputs(choice=["x", "y"]).value == '["x","y"]'
    assert StructuredOutputs(json_object=True).kind == "json_object"
    for bad in [{}, {"regex": "a", "choice": ["b"]}, {"json_object": False}]:
        with pytest.raises(SpecError, match="exactly one"):
            StructuredOutputs(**bad)
    for bad in [{"choice": []}, {"choice": ["a", ""]}, {"json": "{"}, {"json": [1]}, {"regex": ""},
                {"regex": "a", "whitespace": "loose"}]:
        with pytest.raises(SpecError):
            StructuredOutputs(**bad)


@pytest.mark.parametrize("spec,needle", [
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (StructuredOutputs(json={"$ref": "#/$defs/missing"}), "missing"),
    (StructuredOutputs(regex="(ab["), "nclosed"),
    (StructuredOutputs(grammar='root ::= "a" undefined_rule'), "undefined_rule"),
])
def test_invalid_specs_raise_the_library_message(grammars, spec, needle):
    with pytest.raises(GrammarError) as e:
        grammars.validate(spec)
    msg = str(e.value)
    assert needle.lower() in msg.lower() and msg.startswith(f"invalid {spec.kind}:") and ".cc:" not in msg, msg


def _allowed(bm, row, V):
    return [t for t in range(V) if allows(bm, row, t)]


def test_choice_mask_then_end_allows_only_stop_ids(grammars, tok):
    V = grammars.vocab_size
    g = grammars.matcher(StructuredOutputs(choice=["yes", "no"]))
    bm = torch.zeros(2, bitmask_words(V), dtype=torch.int32)
    fill_masks([g], [0], bm)
    first = {tok.decode([t]) for t in _allowed(bm, 0, V)}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first), first
    assert g.accept(tok.encode("yes", add_special_tokens=False).ids)
    g.fill(bm, 1)
    assert _allowed(bm, 1, V) == [EOS_TOKEN_ID]
    assert g.accept([EOS_TOKEN_ID]) and g.ended
    g.fill(bm, 1)  # after the end: everything (its row is discarded), the library is not asked
    assert len(_allowed(bm, 1, V)) == V
    assert not g.accept([EOS_TOKEN_ID])  # nothing follows the end
    # a request that stops on its own id gets that id at the end instead of the tokenizer's EOS
    g2 = grammars.matcher(StructuredOutputs(choice=["yes", "no"]), stop_ids=[7])
    assert g2.accept(tok.encode("no", add_special_tokens=False).ids)
    fill_masks([g2], [0], bm)
    assert _allowed(bm, 0, V) == [7]
    assert g2.accept([7]) and g2.ended


def test_refused_token_is_reported(grammars, tok):
    g = grammars.matcher(StructuredOutputs(regex="[0-9]{2}"))
    assert not g.accept(tok.encode("ab", add_special_tokens=False).ids)


def test_auto_routing_rule():
    assert prefers_guidance(StructuredOutputs(json={"type": "string", "maxLength": 5}))
    assert prefers_guidance(StructuredOutputs(json={"properties": {"z": {"type": "string", "pattern": "^a{1,40}$"}}}))
    assert prefers_guidance(StructuredOutputs(regex=r"[a-z]{3,20}"))
    assert not prefers_guidance(StructuredOutputs(regex=r"[a-z]{3}-\d{2}"))
    assert not prefers_guidance(StructuredOutputs(json={"type": "object", "properties": {"a": {"enum": [1]}}}))
    assert prefers_guidance(StructuredOutputs(grammar='start: "a" | "b"'))
    assert not prefers_guidance(StructuredOutputs(grammar='root ::= "a" | "b"'))


def test_xgrammar_length_bounded_strings_allow_control_chars_so_auto_avoids_them(tok):
    """xgrammar 0.2.8 allows raw U+0000-U+001F inside a string with maxLength (invalid JSON);
    llguidance does not, and "auto" routes such schemas to it. When this fails because xgrammar
    was fixed, the routing rule may be narrowed."""
    V = 1024
    ctrl = [i for i in range(V) if any(ord(c) < 32 for c in tok.decode([i]))]
    assert ctrl
    spec = StructuredOutputs(json={"type": "string", "maxLength": 5})
    prefix = tok.encode('"ab', add_special_tokens=False).ids
    bm = torch.zeros(1, bitmask_words(V), dtype=torch.int32)
    counts = {}
    for mode in ("xgrammar", "guidance", "auto"):
        g = Grammars(tok, (EOS_TOKEN_ID,), V, mode=mode, threads=1).matcher(spec)
        assert g.accept(prefix)
        g.fill(bm, 0)
        counts[mode] = sum(allows(bm, 0, i) for i in ctrl)
    assert counts["guidance"] == counts["auto"] == 0
    assert counts["xgrammar"] > 0


def test_missing_library_is_a_clear_error(tok, monkeypatch):
    from megatron_async.inference.structured import grammars as mod

    monkeypatch.setattr(mod, "installed", lambda name: name != "guidance")
    g = Grammars(tok, (EOS_TOKEN_ID,), 1024)
    with pytest.raises(GrammarError, match="llguidance.*not installed"):
        g.validate(StructuredOutputs(json={"type": "string", "maxLength": 3}))
    g.validate(StructuredOutputs(regex="[ab]"))  # xgrammar serves the rest
    monkeypatch.setattr(mod, "installed", lambda name: name == "guidance")
    assert Grammars(tok, (EOS_TOKEN_ID,), 1024).backend_name(StructuredOutputs(regex="a")) == "guidance"
    with pytest.raises(GrammarError, match="tokenizer"):
        Grammars(None, (EOS_TOKEN_ID,), 1024).validate(StructuredOutputs(regex="a"))


def _random_bitmask(rows, V, seed):
    g = torch.Generator().manual_seed(seed)
    bm = torch.randint(-2**31, 2**31 - 1, (rows, bitmask_words(V)), generator=g, dtype=torch.int64).to(torch.int32)
    bm[0, 0] = -1  # bit 31 set: a negative word
    return bm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_reference_and_triton_kernel(dtype):
    V, S = 3000, 5
    bm = _random_bitmask(4, V, 1)
    row_map = torch.tensor([3, -1, 0, 0, 2], dtype=torch.int32)
    logits = torch.randn(S, V, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = apply_token_bitmask(logits, bm, row_map)
    assert torch.equal(ref[1], logits[1]) and ref.dtype == dtype
    for s, r in ((0, 3), (2, 0), (4, 2)):
        allowed = torch.tensor([allows(bm, r, t) for t in range(V)])
        assert torch.equal(ref[s][allowed], logits[s][allowed])
        assert bool((ref[s][~allowed] == float("-inf")).all())
    fast = apply_token_bitmask(logits, bm, row_map, triton=True)
    assert torch.equal(fast, ref)


def test_spec_crosses_the_coordinator_wire():
    """Sampling parameters travel between processes as msgpack maps of plain values."""
    from megatron_async.inference.communication import wire
    from megatron_async.inference.records import encode_sampling, sampling_fields
    from megatron_async.inference.request import SamplingParams

    for spec in [StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}}),
                 StructuredOutputs(choice=["x", "y"]), StructuredOutputs(json_object=True),
                 StructuredOutputs(regex="a+", whitespace="flexible"), StructuredOutputs(grammar='root ::= "a"')]:
        fields = wire.unpack(wire.pack(encode_sampling(SamplingParams(structured_outputs=spec, seed=3))), 1 << 20)
        back = SamplingParams(**sampling_fields(fields))
        assert back.structured_outputs == spec and back.structured_outputs.key == spec.key and back.seed == 3


def test_guidance_requests_spread_over_independent_templates(tok):
    """TEMPLATES_PER_THREAD templates per fill thread, requests dealt round robin (the executor's
    threads serialize on the copies of one template); every family gives the same masks."""
    from megatron_async.inference.structured.guidance_backend import TEMPLATES_PER_THREAD, GuidanceBackend

    V = 1024 + 40
    b = GuidanceBackend(tok, (EOS_TOKEN_ID,), V, threads=2)
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
                                   "required": ["a", "b"]})
    F = 2 * TEMPLATES_PER_THREAD
    gs = [b.matcher(spec) for _ in range(F + 3)]
    assert [g.family for g in gs] == list(range(F)) + [0, 1, 2]
    assert len({id(t) for t in b._templates[spec.key][1:]}) == F
    bm = torch.zeros(len(gs), bitmask_words(V), dtype=torch.int32)
    for t in tok.encode('{"a": 12, "b": "yz"}', add_special_tokens=False).ids + [EOS_TOKEN_ID]:
        fill_masks(gs, list(range(len(gs))), bm)
        assert (bm == bm[0]).all() and allows(bm, 0, t), t
        assert all(g.accept([t]) for g in gs)
    assert all(g.ended for g in gs)


def test_landed_tokens_accepted_in_one_batch_as_one_by_one(tok):
    """accept_landed (llguidance: a decode step's single tokens consumed in one executor call)
    advances each grammar as ``accept`` does: the request's own stop id as the library's end,
    nothing after the end, a refused token refused."""
    from megatron_async.inference.structured.grammars import accept_landed

    spec = StructuredOutputs(choice=["yes", "no"])
    batched, serial = (Grammars(tok, (EOS_TOKEN_ID,), 1024 + 40, mode="guidance", threads=2) for _ in range(2))
    backend, calls = batched.backend_for(spec), []

    class Counting:  # the executor, counting the batched consumes
        def __init__(self, real):
            self.real = real

        def consume_token_par(self, items):
            calls.append(len(items))
            return self.real.consume_token_par(items)

    backend.executor = Counting(backend.executor)
    ids = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    seqs = [ids("yes") + [EOS_TOKEN_ID], ids("no") + [7], ids("yes") + [EOS_TOKEN_ID, EOS_TOKEN_ID], ids("zz")]
    stops = [None, [7], None, None]
    gs = {name: [gr.matcher(spec, stop_ids=s) for s in stops] for name, gr in (("batched", batched), ("serial", serial))}
    alive = set(range(len(seqs)))
    for step in range(max(map(len, seqs))):
        now = [k for k in sorted(alive) if step < len(seqs[k])]
        got = accept_landed([gs["batched"][k] for k in now], [[seqs[k][step]] for k in now])
        want = [gs["serial"][k].accept([seqs[k][step]]) for k in now]
        assert got == want, (step, got, want)
        alive -= {k for k, ok in zip(now, got) if not ok}
    for b, s in zip(gs["batched"], gs["serial"]):
        assert (b.num_accepted, b.ended) == (s.num_accepted, s.ended)
    assert [g.ended for g in gs["batched"]] == [True, True, True, False] and alive == {0, 1}
    assert sum(calls) >= len(seqs[0]) * 2, calls


def test_guidance_executor_gets_rows_grouped_by_template(tok):
    """The executor's threads each take a contiguous run of its list and a template's lock is held
    for a whole mask or consume, so the rows go to it grouped by template; masks land in their own
    rows and consume results on their own grammars all the same."""
    from megatron_async.inference.structured.grammars import accept_landed
    from megatron_async.inference.structured.guidance_backend import GuidanceBackend

    V = 1024 + 40
    b = GuidanceBackend(tok, (EOS_TOKEN_ID,), V, threads=3)
    calls = []

    class Recording:  # the executor, recording the order of the matchers it is given
        def __init__(self, real):
            self.real = real

        def unsafe_compute_mask_ptr(self, items, *rest):
            calls.append(("fill", [family[id(m)] for m, _ in items]))
            return self.real.unsafe_compute_mask_ptr(items, *rest)

        def consume_token_par(self, items):
            calls.append(("consume", [family[id(m)] for m, _ in items]))
            return self.real.consume_token_par(items)

    b.executor = Recording(b.executor)
    ids = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    specs = [StructuredOutputs(choice=["yes", "no"]), StructuredOutputs(choice=["maybe", "yes"])]
    gs = [b.matcher(specs[k % 2]) for k in range(8)]  # two specs, families 0 1 2 dealt per spec
    family = {id(g.m): g.family for g in gs}
    texts = ["yes", "maybe", "no", "yes", "yes", "maybe", "no", "yes"]
    seqs = [ids(t) + [EOS_TOKEN_ID] for t in texts]
    bm, alone = (torch.zeros(9, bitmask_words(V), dtype=torch.int32) for _ in range(2))
    rows = [8, 0, 5, 1, 7, 2, 6, 3]  # bitmask rows out of order
    for step in range(max(map(len, seqs))):
        now = [k for k in range(8) if step < len(seqs[k])]
        fill_masks([gs[k] for k in now], [rows[k] for k in now], bm)
        for k in now:
            gs[k].fill(alone, rows[k])
            assert torch.equal(bm[rows[k]], alone[rows[k]]) and allows(bm, rows[k], seqs[k][step]), (step, k)
        bad = [k for k in now if k % 3 == 0 and step == 1]  # some rows land a refused token
        landed = [[EOS_TOKEN_ID + 1 if k in bad else seqs[k][step]] for k in now]
        assert accept_landed([gs[k] for k in now], landed) == [k not in bad for k in now], step
        for k in bad:
            seqs[k] = seqs[k][:step]  # refused: the request would end here
    assert [g.ended for g in gs] == [k % 3 != 0 for k in range(8)]
    assert len(calls) >= 6 and all(fams == sorted(fams) for _, fams in calls), calls
    assert any(len(set(fams)) > 1 for _, fams in calls)
