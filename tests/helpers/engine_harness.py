"""Shared helpers for engine-level tests and GPU check scripts: tiny checkpoints, staggered runs, comparisons."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from megatron_async import LLM, InferenceConfig, SamplingParams


@dataclass
class Arrival:
    step: int  # engine.step() calls made before this request is added
    prompt: list[int]
    params: SamplingParams


def make_llm(path, drafter=None, device: str = "cpu", dtype: str = "float32", **cfg) -> LLM:
    """``drafter``: speculative decoding's drafter (needs ``num_speculative_tokens`` in ``cfg``).
    Settings ``cfg`` leaves out take the device's defaults (on CUDA: graphs on)."""
    base = dict(block_size_tokens=4, num_kv_blocks=256, max_requests=16, max_tokens=64, max_sequence_length=256)
    if cfg.get("num_speculative_tokens"):  # the drafting itself under test: drafts whether or not they pay
        base["speculative_adaptive"] = False  # (the adaptive rule has its own tests)
    base.update(cfg)
    return LLM(model=str(path), device=device, dtype=dtype, inference_config=InferenceConfig(**base), drafter=drafter)


def run_arrivals(llm: LLM, arrivals: list[Arrival], max_steps: int = 5000) -> dict[int, object]:
    """Add requests at their arrival step while stepping; returns outputs by arrival index."""
    eng = llm.engine
    pending = sorted(enumerate(arrivals), key=lambda x: x[1].step)
    ids: dict[int, int] = {}
    outs: dict[int, object] = {}
    steps = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1].step <= steps:
            i, a = pending.pop(0)
            ids[eng.add_request(a.prompt, a.params)] = i
        for o in eng.step().finished:
            outs[ids[o.request_id]] = o
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return outs


def run_leader_arrivals(llm: LLM, rank: int, arrivals: list[tuple[int, list[int], SamplingParams]],
                        max_steps: int = 500) -> dict[int, list[int]]:
    """Multi-rank: every rank runs this same loop (the same collective calls); only rank 0 adds
    the (step, prompt, params) arrivals. Returns tokens by request id."""
    eng, steps, outs = llm.engine, 0, {}
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= steps:
            _, prompt, params = pending.pop(0)
            if rank == 0:
                eng.add_request(prompt, params)
        for out in eng.step().finished:
            outs[out.request_id] = out.generated_tokens
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return outs


def decode_steps_without_host_sync(engine, steps: int, warm_steps: int = 4) -> int:
    """CUDA: ``warm_steps`` steps (prefill into steady decode), then ``steps`` more under torch's
    sync debug mode "error" (any device-to-host sync raises). Returns how many of those were
    decode-only. The detector is checked first on a deliberate sync."""
    import torch

    for _ in range(warm_steps):
        engine.step()
    probe = torch.ones(1, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:  # the detector itself: a deliberate sync must raise, or the check proves nothing
            probe.item()
        except RuntimeError:
            pass
        else:
            raise AssertionError("sync debug mode 'error' let a device-to-host sync through")
        return sum(engine.step().is_decode_only for _ in range(steps))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def count_replays_by_variant(runner) -> Counter:
    """From now on, count the steps that replay a graph of ``runner`` (a CudaGraphRunner) by the
    graph's sampling (``GraphKey.label``: "greedy", ..., "full", "greedy+log_probs", ...):
    captured keys alone say nothing about which graphs served steps."""
    counts: Counter = Counter()
    lookup = runner.lookup

    def counting_lookup(*args, **kwargs):
        step = lookup(*args, **kwargs)
        if step is not None:
            counts[step.key.label] += 1
        return step

    runner.lookup = counting_lookup
    return counts


def prefix_agreement(expected: list[list[int]], got: list[list[int]]) -> float:
    """Mean over requests of the share of tokens two runs agree on before their first
    difference (of the longer list): 1.0 when equal, about 0 for another model's tokens."""
    shares = []
    for a, b in zip(expected, got, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(a), len(b), 1))
    return sum(shares) / max(len(shares), 1)


def assert_outputs_close(expected: list[tuple], got: list[tuple], what: str, min_agreement: float,
                         log_prob_atol: float) -> None:
    """Runs whose reduction order differs (bf16 under tensor parallelism), each output
    ``(tokens, finish_reason, log_probs)``: the tokens agree on at least ``min_agreement``
    (``prefix_agreement``), log-probs within ``log_prob_atol`` wherever the tokens agree, and
    requests with equal tokens finish for the same reason."""
    share = prefix_agreement([o[0] for o in expected], [o[0] for o in got])
    assert share >= min_agreement, (what, share)
    for i, ((tok_a, fin_a, lp_a), (tok_b, fin_b, lp_b)) in enumerate(zip(expected, got)):
        same = next((j for j, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y), min(len(tok_a), len(tok_b)))
        if tok_a == tok_b:
            assert fin_a == fin_b, (what, i, fin_a, fin_b)
        diffs = [abs(x - y) for x, y in zip(lp_a[:same], lp_b[:same])]
        assert not diffs or max(diffs) <= log_prob_atol, (what, i, max(diffs))


def assert_equal_up_to_near_ties(expected, got: list[list[int]], gap: float) -> None:
    """Greedy tokens of a run whose sums round differently (another batch shape or reduction
    order, amplified by FP8's activation quantization) against ``expected`` (RequestOutputs with
    ``generated_top_n_logprobs``): equal, or equal up to the first difference, where the expected
    run's log-prob of the other token is within ``gap`` of its own choice (a near tie). Nothing
    after that position is compared: the requests went different ways."""
    for i, (want, tokens) in enumerate(zip(expected, got)):
        if tokens == want.generated_tokens:
            continue
        j = next((j for j, (x, y) in enumerate(zip(want.generated_tokens, tokens)) if x != y), None)
        assert j is not None, (i, "lengths differ", want.generated_tokens, tokens)
        top = want.generated_top_n_logprobs[j]
        chosen = top[want.generated_tokens[j]]
        assert tokens[j] in top and chosen - top[tokens[j]] <= gap, (i, j, tokens[j], top)


def most_frequent_token(outputs: list[list[int]]) -> int:
    """The token the runs generated most often (lowest id on ties): an EOS id that ends some
    requests early and lets others run to their length."""
    counts = Counter(t for toks in outputs for t in toks)
    return min(counts, key=lambda t: (-counts[t], t))


def tokens_of(outs: dict[int, object]) -> dict[int, list[int]]:
    return {i: o.generated_tokens for i, o in outs.items()}


def sampling_mix(n: int) -> list[SamplingParams]:
    """One request kind per sampling feature (greedy, temperature, top-p + log-probs, top-k +
    min-p + presence penalty, repetition penalty + top-n log-probs, min_tokens), n tokens each."""
    return [
        SamplingParams(top_k=1, num_tokens_to_generate=n),
        SamplingParams(temperature=0.9, seed=3, num_tokens_to_generate=n),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4, num_tokens_to_generate=n, return_log_probs=True),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.05, presence_penalty=0.5, seed=5, num_tokens_to_generate=n),
        SamplingParams(top_k=1, repetition_penalty=1.3, top_n_logprobs=3, num_tokens_to_generate=n),
        SamplingParams(temperature=0.8, top_k=40, seed=6, min_tokens=4, num_tokens_to_generate=n),
    ]


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
HOST_DATA = ("tensor", "as_tensor", "from_numpy")  # a tensor made from host data: an H2D copy on CUDA


def forbid_host_traffic(model, monkeypatch, on_forward=None) -> None:
    """Make any host read of a tensor value (a device sync on CUDA) or any tensor built from host
    data (an extra H2D copy on CUDA) inside ``model.forward`` raise. ``on_forward(*args)`` is
    called at each forward (to record what ran)."""
    import torch

    forward = model.forward

    def fail(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"forward read a tensor on the host or copied host data ({name})")

        return raise_

    def guarded(*args, **kwargs):
        if on_forward is not None:
            on_forward(*args)
        with monkeypatch.context() as m:
            for name in HOST_READS:
                m.setattr(torch.Tensor, name, fail(name))
            for name in HOST_DATA:
                m.setattr(torch, name, fail(name))
            return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", guarded)
