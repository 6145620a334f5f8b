"""Speculative decoding's rooms alone: the device verify step (acceptance, position
correction, input gathering), the n-gram drafter, the switch-off policy, config checks."""
from types import SimpleNamespace

import pytest
import torch

from megatron_async import InferenceConfig, SamplingParams
from megatron_async.inference.contexts.spec_state import SpecState
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.speculative.acceptance import emitted_tokens
from megatron_async.inference.speculative.drafter import VerifyOutputs
from megatron_async.inference.speculative.ngram import NGramDrafter
from megatron_async.inference.speculative.policy import SpecPolicy
from megatron_async.inference.speculative.verify import SpecVerifier

L = torch.tensor


def _state(k=3, slots=4):
    return SpecState(slots, k, DeviceFacade("cpu"))


def test_verify_accepts_the_matching_prefix_plus_one():
    spec = _state()
    v = SpecVerifier(spec, block_size=4)
    # rows: k=3 (drafts 7 8 9; samples 7 8 5 1 -> 2 accepted), k=0, k=2 (all accepted), k=3 (none)
    nd = L([3, 0, 2, 3])
    qlen = nd + 1
    cu = torch.cat([L([0]), qlen.cumsum(0)]).to(torch.int32)
    input_ids = L([4, 7, 8, 9, 6, 3, 2, 1, 5, 5, 5, 5])
    samples = L([7, 8, 5, 1, 11, 2, 1, 0, 9, 9, 9, 9])
    base = L([0, 4, 5, 8])
    pos0 = L([10, 20, 30, 40])  # each row's first sampled position
    sample_pos = torch.cat([pos0[r] + torch.arange(int(qlen[r])) for r in range(4)])
    g = SimpleNamespace(sample_base=base, num_drafts=nd, spec_slot=L([0, 1, 2, 3]), spec_owner_slot=L([0, 1, 2, 3]),
                        cu_query_lens=cu,
                        sample_position=sample_pos, sample_token_idx=torch.arange(12))
    acc = torch.zeros(4, dtype=torch.int64)
    out = v.verify(g, 4, input_ids, samples, torch.zeros(12, 2), None, acc)
    assert acc.tolist() == [2, 0, 2, 0]
    assert out.last_token.tolist() == [5, 11, 0, 9]
    assert out.last_pos.tolist() == [12, 20, 32, 40]
    assert spec.shortfall[:4].tolist() == [1, 0, 0, 3]
    assert spec.last_token[:4].tolist() == [5, 11, 0, 9]
    assert out.hidden_idx.tolist() == [2, 4, 7, 8]
    assert out.tokens[1].tolist() == [11, 11, 11, 11]  # past the row's drafts: its last sample repeated
    assert list(emitted_tokens(int(base[0]), 2)) == [0, 1, 2]


def test_prepare_corrects_in_flight_rows_and_gathers_inputs():
    spec = _state()
    spec.shortfall[:2] = L([2, 1])
    spec.last_token[:2] = L([50, 60])
    spec.drafts[:2] = L([[1, 2, 3], [4, 5, 6]])
    v = SpecVerifier(spec, block_size=4)
    # row 0: in flight, 3 drafts, host positions 8..11; row 1: not in flight (host-known token), 1 draft
    bt = torch.tensor([[0, 5, 6, 7], [9, 3, 0, 0]], dtype=torch.int32)
    g = SimpleNamespace(
        spec_slot=L([0, 1]), spec_inflight=L([True, False]), token_to_row=L([0, 0, 0, 0, 1, 1]).int(),
        positions=L([8, 9, 10, 11, 4, 5]), block_table=bt, slot_mapping=torch.zeros(6, dtype=torch.int64),
        kv_lens=L([12, 6]).int(), sample_position=L([9, 10, 11, 12, 5, 6]), sample_to_row=L([0, 0, 0, 0, 1, 1]),
        spec_src=L([0, 1, 2, 3, -1, 1]))
    ids = v.prepare(g, 6, 2, 6, L([0, 0, 0, 0, 77, 0]))
    assert ids.tolist() == [50, 1, 2, 3, 77, 4]
    assert g.positions.tolist() == [6, 7, 8, 9, 4, 5]
    assert g.slot_mapping.tolist() == [5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1, 3 * 4 + 0, 3 * 4 + 1]
    assert g.kv_lens.tolist() == [10, 6]
    assert g.sample_position.tolist() == [7, 8, 9, 10, 5, 6]


def _ngram_outputs(slots, last_pos, k):
    R = len(slots)
    t = torch.zeros(R, k + 1, dtype=torch.int64)
    return VerifyOutputs(R, L(slots), t, L(last_pos)[:, None].expand(R, k + 1).clone(), torch.zeros(R, dtype=torch.int64),
                         torch.zeros(R, dtype=torch.int64), t[:, 0], L(last_pos), torch.zeros(1, 1), L([0] * R), None)


def test_ngram_proposes_what_followed_the_latest_match():
    spec = _state(k=3)
    d = NGramDrafter(max_ngram=2, max_sequence_length=32)
    spec.set_drafter(d)
    seqs = {0: [1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 1, 2],  # "1 2" last seen at 5..6 -> 3 4 5
            1: [7, 8, 7, 8, 7],  # period 2 -> 8 7 8
            2: [1, 2, 3, 4, 5]}  # no match: the last token repeated
    for slot, seq in seqs.items():
        d.on_admit(DynamicInferenceRequest(slot, seq, SamplingParams(), seed=0), slot)
    out = _ngram_outputs([0, 1, 2], [len(s) - 1 for s in seqs.values()], 3)
    out.tokens[:] = L([2, 7, 5])[:, None]  # each row's newest token again (written at its position)
    drafts = d.propose(out)
    assert drafts.tolist() == [[3, 4, 5], [8, 7, 8], [5, 5, 5]]


def test_policy_switches_off_and_counts():
    pol = SpecPolicy(InferenceConfig(num_speculative_tokens=3, speculative_min_acceptance=0.5,
                                     speculative_probe_interval=3, speculative_max_batch_size=8).speculation())
    req = DynamicInferenceRequest(0, [1], SamplingParams(), seed=0)
    req.spec_drafts_fresh = True  # its latest launch ran the drafter
    assert pol.drafts_for(req, 4, room=2) == 2 and pol.drafts_for(req, 4, room=0) == 0
    assert pol.drafts_for(req, 9, room=5) == 0 and pol.off_rows["batch"] == 1
    pen = DynamicInferenceRequest(1, [1], SamplingParams(presence_penalty=0.1), seed=0)
    assert pol.drafts_for(pen, 1, room=5) == 0 and pol.off_rows["penalties"] == 1
    for _ in range(4):
        pol.observe(req, 3, 0)
    assert req.spec_acceptance < 0.5
    late = DynamicInferenceRequest(2, [1], SamplingParams(), seed=0)  # switched off at another time
    late.spec_acceptance, late.spec_drafts_fresh = 0.0, True

    def step(r):
        pol.begin_step()
        return pol.drafts_for(r, 1, room=5)

    pol.step = 0
    assert [step(req) for _ in range(6)] == [0, 0, 1, 0, 0, 1]  # probes (one draft) every 3rd step
    assert pol.off_rows["acceptance"] == 4
    pol.step = 1  # another phase of arrivals: the probes still fall on the same steps for everyone
    got = []
    for _ in range(6):
        pol.begin_step()
        got.append((pol.drafts_for(req, 2, room=5), pol.drafts_for(late, 2, room=5)))
    assert got == [(0, 0), (1, 1), (0, 0), (0, 0), (1, 1), (0, 0)]


def test_config_checks():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        InferenceConfig(num_speculative_tokens=-1).validate()
    with pytest.raises(ValueError):
        InferenceConfig(speculative_method="medusa").validate()
    cfg = InferenceConfig(num_speculative_tokens=3, max_requests=8, max_tokens=16)
    assert cfg.max_samples == 16 and InferenceConfig(max_requests=8).max_samples == 8
