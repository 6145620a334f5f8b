"""Per-request device rows of penalties / min_tokens: filled at assignment from the host's
tokens, advanced by device scatter-adds, freed and reused clean."""
import torch

from megatron_async.inference.contexts.sampling_state import SamplingStateSlots, stop_ids
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.request import DynamicInferenceRequest, SamplingParams


def _req(rid, prompt, sp, generated=(), eos=7, stops=()):
    req = DynamicInferenceRequest(rid, list(prompt), sp, seed=1, eos_ids=frozenset([eos]), stop_sequences=[list(s) for s in stops])
    req.generated_tokens = list(generated)
    return req


def test_assign_fills_rows_from_known_tokens_and_skips_requests_without_penalties():
    st = SamplingStateSlots(max_requests=3, vocab_size=12, device=DeviceFacade("cpu"))
    plain = _req(0, [1, 2], SamplingParams())
    st.assign(plain)
    assert plain.sampling_slot == -1 and not st.allocated  # nothing allocated for plain requests
    req = _req(1, [1, 2, 2], SamplingParams(presence_penalty=0.5, min_tokens=2), generated=[3, 3, 5],
               stops=[[9], [10, 11]])
    st.assign(req)
    s = req.sampling_slot
    assert s >= 0 and st.counts[s].tolist() == [0, 0, 0, 2, 0, 1] + [0] * 6
    assert st.prompt_mask[s].nonzero()[:, 0].tolist() == [1, 2]
    assert st.stop_mask[s].nonzero()[:, 0].tolist() == [7, 9]  # EOS and the single-token stop only
    assert stop_ids(_req(2, [1], SamplingParams(ignore_eos=True), stops=[[4]])) == [4]


def test_count_samples_scatter_adds_and_freed_slots_come_back_clean():
    st = SamplingStateSlots(max_requests=2, vocab_size=6, device=DeviceFacade("cpu"))
    a = _req(0, [0], SamplingParams(frequency_penalty=1.0), eos=3)
    st.assign(a)
    pad = st.padding_slot
    st.count_samples(torch.tensor([a.sampling_slot, pad, pad]), torch.tensor([4, 1, 1]))
    st.count_samples(torch.tensor([a.sampling_slot]), torch.tensor([4]))
    assert st.counts[a.sampling_slot, 4] == 2 and st.counts[pad, 1] == 2
    slot = a.sampling_slot
    st.free(a)
    assert a.sampling_slot == -1
    b = _req(1, [5], SamplingParams(repetition_penalty=1.3), eos=3)
    st.assign(b)
    assert b.sampling_slot == slot and st.counts[slot].sum() == 0 and st.prompt_mask[slot].tolist() == [False] * 5 + [True]
    assert st.num_assigned == 2
