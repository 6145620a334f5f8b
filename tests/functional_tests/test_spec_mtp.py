"""Speculative decoding with the checkpoint's MTP heads (speculative_method="mtp"): output equal
to plain decoding token for token (and log-prob for log-prob), serial and launch-ahead, greedy
and seeded sampling, with chunked prefill; the engine's drafts equal a dense reference's."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.inference.speculative.mtp_drafter import MTPDrafter  # noqa: E402
from tests.helpers.engine_harness import make_llm, random_prompts  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.mtp_heads import add_mtp_heads  # noqa: E402
from tests.helpers.mtp_reference import MTPReference  # noqa: E402

torch.set_num_threads(1)
K = 3
PROMPTS = random_prompts(6, 3, 30, 256, seed=4)
CFG = dict(max_tokens=24, speculative_method="mtp", speculative_min_acceptance=0.0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_mtp")
    base = make_tiny_checkpoint("LlamaForCausalLM", root / "base", seed=1)
    return {
        "base": base,
        "random": add_mtp_heads(base, root / "random", depths=1, seed=3),
        # weak main layers + a head that drafts lm_head(final_norm(embed(t))): about half accepted
        "good": add_mtp_heads(base, root / "good", init="copy_next", scale_layers=0.01),
        # the same with two depths: the second head drafts from the first one's draft
        "two_depths": add_mtp_heads(base, root / "two_depths", depths=2, init="copy_next", scale_layers=0.01),
    }


def _params(kind: str) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(top_k=1, num_tokens_to_generate=20 + i, ignore_eos=True, return_log_probs=True)
                for i in range(len(PROMPTS))]
    return [SamplingParams(temperature=0.9, top_k=[0, 20][i % 2], top_p=[0.0, 0.9][i % 2], seed=100 + i,
                           num_tokens_to_generate=20 + i, ignore_eos=True, return_log_probs=True)
            for i in range(len(PROMPTS))]


def _run(path, k: int, async_scheduling: bool, kind: str):
    llm = make_llm(path, num_speculative_tokens=k, async_scheduling=async_scheduling, **CFG)
    outs = llm.generate(PROMPTS, _params(kind))
    return [(o.generated_tokens, o.generated_log_probs) for o in outs], llm.engine.stats


@pytest.mark.parametrize("heads", ["random", "good", "two_depths"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mtp_speculation_equals_plain_decoding(ckpts, heads, kind, async_scheduling):
    plain, _ = _run(ckpts[heads], 0, async_scheduling, kind)
    spec, st = _run(ckpts[heads], K, async_scheduling, kind)
    for (tok_a, lp_a), (tok_b, lp_b) in zip(plain, spec):
        assert tok_b == tok_a
        assert torch.allclose(torch.tensor(lp_b), torch.tensor(lp_a), atol=1e-5)
    assert st.spec_draft_tokens > 0 and st.spec_verify_rows > 0
    assert st.spec_accepted_tokens < st.spec_draft_tokens
    if heads != "random":  # strictly between 0 and 1: every accept / reject path ran
        assert st.spec_accepted_tokens_per_depth[K - 1 if kind == "greedy" else 0] > 0
    if heads == "two_depths":  # drafts of the second head were accepted
        assert st.spec_accepted_tokens_per_depth[1] > 0
    if async_scheduling:
        assert st.overlapped_decode_steps > 0


class RecordingMTPDrafter(MTPDrafter):
    """Records every sampling row's (prompt, newest token's position, drafts) (host syncs: tests only)."""

    def __init__(self, model, max_sequence_length):
        super().__init__(model, max_sequence_length)
        self.prompt_of_slot: dict[int, tuple[int, ...]] = {}
        self.records: list[tuple[tuple[int, ...], int, int, list[int], bool]] = []

    def on_admit(self, req, slot):
        super().on_admit(req, slot)
        self.prompt_of_slot[slot] = tuple(req.prompt_tokens)

    def propose(self, out):
        drafts = super().propose(out)
        a = out.batch.attn
        width = a.block_table.shape[1]
        last_chain = (out.last_pos + K - 2).clamp(max=width * a.block_size - 1)
        owned = a.block_table[: out.num_rows].long().gather(1, (last_chain // a.block_size)[:, None])[:, 0] != 0
        for slot, pos, tok, d, ok in zip(out.slots.tolist(), out.last_pos.tolist(), out.last_token.tolist(),
                                         drafts.tolist(), owned.tolist()):
            if slot != self.spec.padding_slot:
                self.records.append((self.prompt_of_slot[slot], pos, tok, d, ok))
        return drafts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mtp_drafts_equal_dense_reference(ckpts, async_scheduling, monkeypatch):
    """Draft 1 of every row (and the whole chain where its KV blocks are reserved) equals the
    dense reference's greedy drafts from the final sequence: the teacher-forced MTP KV of every
    prefill chunk and verify window holds the true next tokens, rejected positions overwritten."""
    from megatron_async.inference.speculative import factory

    monkeypatch.setattr(factory, "MTPDrafter", RecordingMTPDrafter)  # what the drafter factory builds
    path = ckpts["random"]
    llm = make_llm(path, num_speculative_tokens=K, async_scheduling=async_scheduling, **CFG)
    drafter = llm.context.spec.drafter
    assert isinstance(drafter, RecordingMTPDrafter)
    outs = llm.generate(PROMPTS, _params("sampled"))
    seqs = {tuple(p): p + o.generated_tokens for p, o in zip(PROMPTS, outs)}
    ref = MTPReference(path)
    checked = chained = 0
    for prompt, pos, tok, drafts, owned in drafter.records:
        seq = seqs[prompt]
        if pos >= len(seq):  # a launch past the request's end (discarded)
            continue
        assert seq[pos] == tok
        expect = ref.greedy_drafts(seq[: pos + 1], K if owned else 1)
        assert drafts[: len(expect)] == expect, (prompt, pos)
        checked += 1
        chained += owned
    assert checked > 50 and chained > 20


def test_mtp_method_needs_heads(ckpts):
    with pytest.raises(ValueError, match="MTP heads"):
        make_llm(ckpts["base"], num_speculative_tokens=2, **CFG)


def test_mtp_heads_of_a_moe_model(tmp_path):
    """Qwen3-MoE: the MTP layer's MLP is a mixture of experts (mtp.layers.0.mlp.experts.*)."""
    from tests.helpers.hf_moe_models import make_tiny_moe_checkpoint

    base = make_tiny_moe_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe", seed=1)
    path = add_mtp_heads(base, tmp_path / "moe_mtp", init="copy_next", scale_layers=0.01)
    prompts = random_prompts(4, 3, 20, 200, seed=1)
    params = SamplingParams(top_k=1, num_tokens_to_generate=12, ignore_eos=True)
    plain = make_llm(path, num_speculative_tokens=0).generate(prompts, params)
    llm = make_llm(path, num_speculative_tokens=2, **CFG)
    spec = llm.generate(prompts, params)
    assert [o.generated_tokens for o in spec] == [o.generated_tokens for o in plain]
    assert 0 < llm.engine.stats.spec_accepted_tokens < llm.engine.stats.spec_draft_tokens


@pytest.mark.parametrize("case", ["small_pool", "prefix_caching"])
def test_mtp_through_pauses_evictions_and_prefix_hits(ckpts, case):
    """The drafter's per-slot state survives the lifecycle: evicted requests are re-admitted
    with their generated tokens (on_admit refills the history), prefix hits skip prefill (the
    MTP KV of the shared blocks comes from the cache)."""
    from tests.helpers.engine_harness import Arrival
    from tests.helpers.spec_harness import run_plain_and_spec

    if case == "small_pool":
        arr = [Arrival(i, p, SamplingParams(top_k=1, num_tokens_to_generate=24))
               for i, p in enumerate(random_prompts(10, 5, 30, 256, seed=5))]
        cfg = dict(num_kv_blocks=24, max_tokens=32)
    else:
        shared = random_prompts(1, 12, 12, 256, seed=34)[0]
        arr = [Arrival(2 * i, shared + p, SamplingParams(top_k=1, num_tokens_to_generate=14))
               for i, p in enumerate(random_prompts(6, 2, 9, 256, seed=35))]
        cfg = dict(enable_prefix_caching=True)
    for _, _, st in run_plain_and_spec(ckpts["good"], arr, k=3, drafter_rate=None, method="mtp", **cfg).values():
        assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
        if case == "small_pool":
            assert st.paused > 0 and st.evicted > 0, st.as_dict()
        else:
            assert st.prefix_hit_tokens > 0, st.as_dict()


@pytest.fixture(scope="module")
def qwen3_mtp_ckpt(tmp_path_factory):
    """A tiny float32 Qwen3 with copy_next MTP heads over weak main layers (drafts often right)."""
    root = tmp_path_factory.mktemp("qwen3_mtp")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base", seed=1)
    return add_mtp_heads(base, root / "mtp", init="copy_next", scale_layers=0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_cuda_mtp_speculation_equals_plain_decoding(qwen3_mtp_ckpt, kind, async_scheduling, graphs):
    """On CUDA (Triton attention and sampling), eager and with CUDA graphs: 12 prompts of 3-59
    tokens, 32 tokens each, greedy or top-k 40 seeded: tokens equal plain decoding's, log-probs
    within 1e-3 (a (k + 1)-token row's GEMMs round otherwise than a 1-token row's). Times:
    ``python -m benchmarks engine-times mtp-speculation``."""
    from megatron_async import LLM, InferenceConfig

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist()
               for n in torch.randint(3, 60, (12,), generator=gen).tolist()]
    params = [SamplingParams(top_k=1 if kind == "greedy" else 40, temperature=1.0, seed=i, ignore_eos=True,
                             num_tokens_to_generate=32, return_log_probs=True) for i in range(len(prompts))]

    def llm(k: int) -> LLM:
        cfg = InferenceConfig(max_requests=64, max_tokens=64, max_sequence_length=512, num_kv_blocks=4096,
                              block_size_tokens=16, num_speculative_tokens=k, speculative_method="mtp",
                              speculative_min_acceptance=0.0, speculative_adaptive=False, cuda_graphs=graphs,
                              async_scheduling=async_scheduling)
        return LLM(model=str(qwen3_mtp_ckpt), device="cuda", dtype="float32", inference_config=cfg)

    plain = llm(0).generate(prompts, params)
    spec_llm = llm(K)
    spec = spec_llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert b.generated_tokens == a.generated_tokens
        assert max(abs(x - y) for x, y in zip(a.generated_log_probs, b.generated_log_probs)) < 1e-3
    st = spec_llm.engine.stats
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
