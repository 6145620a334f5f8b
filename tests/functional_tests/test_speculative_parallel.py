"""Speculative decoding under tensor and expert parallelism, CPU (gloo + ZMQ, 2 spawned ranks).

TP=2 with n-gram or MTP speculation gives the tokens, finish reasons and log-probs of TP=1
without speculation (greedy and seeded top-p, launch-ahead and serial), identically on every
rank: the ranks sample from the same gathered logits, so drafts, acceptance and the host's
corrections agree by construction. Data-parallel engines (EP=2, a MoE checkpoint with MTP
heads) with speculation give the tokens of one engine without it, whichever rank serves a
request, also while one rank idles for many steps: its dummy forwards must match a verify
step's MoE exchanges, and with MTP heads (a MoE layer of their own) the drafter's too."""
from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.speculative.oracle import OracleDrafter
from megatron_async.inference.step_plan import StepAgreement
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.hf_moe_models import make_tiny_moe_checkpoint
from tests.helpers.mtp_heads import add_mtp_heads
from tests.helpers.multiprocess import run_ranks

K = 3
CONFIG = dict(block_size_tokens=4, num_kv_blocks=160, max_requests=4, max_tokens=24, max_sequence_length=96,
              speculative_min_acceptance=0.0)
PROMPTS = [[3, 17, 42, 9, 3, 17, 42, 9, 3], [25, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65], [8, 9, 8, 9, 8]]
GREEDY = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True, return_log_probs=True)
          for n in (14, 17, 9, 12, 16)]
SEEDED = [SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=n, ignore_eos=True, seed=1000 + i,
                         return_log_probs=True) for i, n in enumerate((13, 8, 15, 11, 16))]
IDLE = SamplingParams(top_k=1, num_tokens_to_generate=40, ignore_eos=True)  # plain greedy: may replay graphs
LOG_PROB_TOL = 1e-4  # a (k + 1)-token row's logits vs a 1-token row's, and TP's summation order


def _outputs(outs) -> list[tuple]:
    return [(o.generated_tokens, o.finish_reason, o.generated_log_probs) for o in outs]


def with_eos(params: list[SamplingParams], eos: int | None) -> list[SamplingParams]:
    """``params`` ending at ``eos`` (None: as they are)."""
    return params if eos is None else [replace(p, ignore_eos=False, termination_id=eos) for p in params]


def run_cases(llm: LLM, idle: bool, eos: int | None = None) -> dict:
    """Greedy and seeded batches, launch-ahead then serial; ``idle``: then one long request
    alone (data-parallel engines: the other rank idles). ``eos``: the batches end at it."""
    result = {}
    for mode in ("async", "serial"):
        llm.engine.async_scheduling = mode == "async"
        result[f"{mode}_greedy"] = _outputs(llm.generate(PROMPTS, with_eos(GREEDY, eos)))
        result[f"{mode}_seeded"] = _outputs(llm.generate(PROMPTS, with_eos(SEEDED, eos)))
    llm.engine.async_scheduling = True
    st = llm.engine.stats
    dummy_before = st.dummy_steps
    if idle:
        result["idle"] = _outputs(llm.generate([PROMPTS[1]], IDLE))
    result["stats"] = dict(drafted=st.spec_draft_tokens, accepted=st.spec_accepted_tokens,
                           accepted_per_depth=list(st.spec_accepted_tokens_per_depth),
                           overlapped=st.overlapped_steps, dummy=st.dummy_steps, idle_dummy=st.dummy_steps - dummy_before,
                           served=st.finished_requests, off_rows=sum(st.spec_off_rows.values()), graph_replays=st.graph_replays,
                           padding_replays=graphs.num_padding_replays if (graphs := llm.runner.graphs) else 0)
    return result


def _worker(rank: int, world: int, ckpt: str, tp: int, ep: int, method: str, drafter=None, device: str = "cpu",
            dtype: str = "float32", graphs: bool = False, overrides: dict | None = None, eos: int | None = None) -> dict:
    cfg = InferenceConfig(**{**CONFIG, **(overrides or {})}, num_speculative_tokens=K, speculative_method=method,
                          cuda_graphs=graphs)
    llm = LLM(ckpt, device=device, dtype=dtype, inference_config=cfg, tensor_parallel_size=tp,
              expert_parallel_size=ep, drafter=drafter)
    try:
        return run_cases(llm, idle=ep > 1, eos=eos)
    finally:
        llm.close()


def assert_same(expected: list[tuple], got: list[tuple], what: str, log_prob_tol: float = LOG_PROB_TOL) -> None:
    assert len(expected) == len(got), what
    for i, ((tok_a, fin_a, lp_a), (tok_b, fin_b, lp_b)) in enumerate(zip(expected, got)):
        assert tok_b == tok_a, (what, i, tok_a, tok_b)
        assert fin_b == fin_a, (what, i)
        if lp_a is None:
            assert lp_b is None, (what, i)
            continue
        assert len(lp_a) == len(lp_b) and max(abs(x - y) for x, y in zip(lp_a, lp_b)) <= log_prob_tol, (what, i)


def reference(ckpt: str, ep: int, device: str = "cpu", dtype: str = "float32", overrides: dict | None = None,
              eos: int | None = None) -> dict:
    """One process, no speculation."""
    cfg = InferenceConfig(**{**CONFIG, **(overrides or {})})
    return run_cases(LLM(ckpt, device=device, dtype=dtype, inference_config=cfg), idle=ep > 1, eos=eos)


def check_parallel(ckpt: str, tp: int, ep: int, method: str, drafter=None, device: str = "cpu",
                   dtype: str = "float32", graphs: bool = False, overrides: dict | None = None,
                   env: dict | None = None, expected: dict | None = None,
                   log_prob_tol: float = LOG_PROB_TOL) -> list[dict]:
    """Speculation on ``tp`` x ``ep`` ranks == one process without it (``expected``), on every
    rank (data parallel: ``generate`` hands every rank all outputs); drafts accepted and
    rejected, steps overlapped. Returns every rank's results."""
    expected = expected or reference(ckpt, ep, device, dtype, overrides)
    ranks = run_ranks(_worker, tp * ep, ckpt, tp, ep, method, drafter, device, dtype, graphs, overrides,
                      timeout_s=180, env=env)
    for rank, got in enumerate(ranks):
        for case in expected:
            if case != "stats":
                assert_same(expected[case], got[case], f"rank {rank}, {case}", log_prob_tol)
        st = got["stats"]
        assert 0 < st["accepted"] < st["drafted"], (rank, st)  # drafts accepted and rejected
        assert st["overlapped"] > 0, (rank, st)
    return ranks


@pytest.fixture(scope="module")
def gpt_mtp(tmp_path_factory) -> str:
    """Qwen3 (4 heads / 2 KV heads: TP=2 splits them) whose weak layers make copy_next MTP heads
    and repetition-seeking n-gram drafts land about half the time."""
    root = tmp_path_factory.mktemp("spec_tp")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base", num_attention_heads=4, num_key_value_heads=2)
    return str(add_mtp_heads(base, root / "mtp", depths=2, init="copy_next", scale_layers=0.01))


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_tp2_speculation_equals_tp1_plain(gpt_mtp, method):
    ranks = check_parallel(gpt_mtp, tp=2, ep=1, method=method)
    assert ranks[0]["stats"] == ranks[1]["stats"]  # replicas: the same drafts, acceptance and steps


@pytest.fixture(scope="module")
def moe_mtp(tmp_path_factory) -> str:
    """Qwen3-MoE (8 experts: 4 per EP rank) with an MTP head whose layer is a MoE layer too."""
    root = tmp_path_factory.mktemp("spec_ep")
    base = make_tiny_moe_checkpoint("Qwen3MoeForCausalLM", root / "base", seed=1)
    return str(add_mtp_heads(base, root / "mtp", init="copy_next", scale_layers=0.01))


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_ep2_speculation_equals_one_engine_plain(moe_mtp, method):
    r0, r1 = check_parallel(moe_mtp, tp=1, ep=2, method=method)
    assert r0["stats"]["served"] > 0 and r1["stats"]["served"] > 0
    # the long request alone went to one rank; the other matched each of its launches with a dummy
    assert r1["stats"]["idle_dummy"] > 0 and r0["stats"]["idle_dummy"] == 0, (r0["stats"], r1["stats"])


def test_hybrid_tp2_speculation_equals_tp1_plain(tmp_path):
    """NemotronH under TP=2 (Mamba heads and groups split): verify rows run as Mamba windows over
    this rank's heads and commit the accepted state. An oracle drafter (the greedy continuation,
    30% of tokens corrupted) makes long accepted runs, so commits land deep in the window."""
    ckpt = str(make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "ckpt"))
    expected = reference(ckpt, ep=1)
    greedy = {tuple(p): toks for p, (toks, _, _) in zip(PROMPTS, expected["async_greedy"])}
    drafter = OracleDrafter(greedy, corrupt_rate=0.3, vocab_size=128, max_generated=64)
    ranks = check_parallel(ckpt, tp=2, ep=1, method="ngram", drafter=drafter, expected=expected)
    assert ranks[0]["stats"] == ranks[1]["stats"]
    assert ranks[0]["stats"]["accepted_per_depth"][K - 1] > 10, ranks[0]["stats"]  # whole windows accepted


def test_tp2_x_ep2_mtp_speculation_equals_one_engine_plain(moe_mtp):
    """4 ranks: 2 data-parallel engines, each a TP=2 group; the idle replica's two ranks both run
    the dummy forward and the MTP heads' exchanges."""
    ranks = check_parallel(moe_mtp, tp=2, ep=2, method="mtp")
    for a, b in ((0, 1), (2, 3)):  # TP peers: replicas of one engine
        assert ranks[a]["stats"] == ranks[b]["stats"], (a, b)
    assert ranks[2]["stats"]["idle_dummy"] > 0 and ranks[0]["stats"]["idle_dummy"] == 0


def test_dummy_forward_runs_the_mtp_heads_k_times_on_padding_only(gpt_mtp, monkeypatch):
    """An idle data-parallel rank's dummy forward: the main model once, then the MTP heads K times
    (``propose``'s passes: depth 0, then the chain at depths 1, 1 for K = 3 and 2 depths), writing
    KV only to the dummy block, so the requests' KV (and the drafter's state) are untouched."""
    llm = LLM(gpt_mtp, inference_config=InferenceConfig(**CONFIG, num_speculative_tokens=K, speculative_method="mtp",
                                                       async_scheduling=False))
    eng, model = llm.engine, llm.model
    for prompt in PROMPTS[:2]:
        eng.add_request(prompt, GREEDY[0])
    for _ in range(3):
        eng.step()
    depths = []
    real_mtp_forward = model.mtp_forward
    monkeypatch.setattr(model, "mtp_forward", lambda d, *a: depths.append(d) or real_mtp_forward(d, *a))
    kv = [c[:, 1:].clone() for c in llm.context.kv_caches]  # every block but the dummy block 0
    history = llm.context.spec.drafter.history.tokens.clone()
    llm.runner.dummy_forward(StepAgreement(max_tokens=5))
    assert depths == [0, 1, 1]
    assert all(c[:, 1:].equal(before) for c, before in zip(llm.context.kv_caches, kv))
    assert llm.context.spec.drafter.history.tokens.equal(history)
    outs = eng.run_until_done()  # and the requests go on as if nothing happened
    plain = LLM(gpt_mtp, inference_config=InferenceConfig(**CONFIG)).generate(PROMPTS[:2], [GREEDY[0]] * 2)
    assert sorted(o.generated_tokens for o in outs) == sorted(o.generated_tokens for o in plain)
