#!/usr/bin/env python
"""An RL rollout loop: the engine generates, a Hugging Face trainer learns, weights go back in place.

    python examples/rl_rollout_loop.py                                       # CPU, built-in tiny model, seconds
    python examples/rl_rollout_loop.py --default-model qwen3-0.6b --device cuda
    python examples/rl_rollout_loop.py --model CKPT --device cuda            # any Llama / Qwen checkpoint

Every iteration:
  1. rollouts: N prompts x k seeded samples with the log-prob of every generated token;
  2. once part of them finished, ``engine.pause_generation("keep")``: the launch in flight lands,
     then nothing runs and the unfinished requests wait;
  3. check the finished rollouts: their log-probs against the trainer's recomputation of the same
     sequences with the weights that produced each token (``RequestOutput.weight_versions``);
  4. one optimizer step of the trainer (a Hugging Face ``transformers`` copy of the same
     checkpoint) on them: a policy-gradient loss with importance ratios against the rollout
     log-probs (tokens of an older version are off-policy);
  5. ``llm.update_weights(checkpoint_names(trainer.named_parameters()))`` copies the new weights into the engine
     in place (the requests still running recompute their KV with them, so every later token is
     exactly what the new weights give), and ``engine.resume_generation()``: their tokens carry
     two versions (partial rollouts).
After the last iteration the requests still running finish and are checked too. The job exits
with code 1 if a log-prob differs by more than ``--tolerance`` or a version is not as expected.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.request import RequestOutput

# float32: measured on CPU with the tiny model, max |engine - trainer| log-prob up to 8e-6. bf16 / fp16:
# loose bounds for GPU runs, where each side runs its own kernels.
DEFAULT_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 0.25, torch.float16: 0.1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint directory (default: the built-in model, written to a temp dir)")
    p.add_argument("--default-model", default="tiny", help="built-in model without --model (tiny, qwen3-0.6b, ...)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=4, help="N prompts per iteration")
    p.add_argument("--samples", type=int, default=2, help="k samples per prompt")
    p.add_argument("--prompt-len", type=int, default=12, help="longest prompt (tokens)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="longest rollout; each draws its own in [1/4, 1] of it")
    p.add_argument("--pause-after", type=float, default=0.5,
                   help="pause once this fraction of the iteration's requests finished (the rest span the update)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tolerance", type=float, default=None, help="max |engine - trainer| log-prob (default by dtype)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def checkpoint_dir(args: argparse.Namespace, dtype: torch.dtype, tmp: str) -> str:
    """The directory both sides load: ``--model``, or the built-in model written as an HF checkpoint."""
    if args.model:
        return args.model
    from megatron_async.models.default_checkpoint import save_default_checkpoint

    return str(save_default_checkpoint(args.default_model, tmp, torch.device(args.device), dtype, seed=args.seed))


def load_trainer(path: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)


def checkpoint_names(named_parameters):
    """The trainer's tensors under the checkpoint's names (what ``update_weights`` takes):
    transformers fuses each MoE layer's experts into [experts, ...] tensors, checkpoints name
    every expert's matrices. Views, no copies."""
    for name, tensor in named_parameters:
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2 * inter, hidden]: gate rows, then up rows
            base = name[:-len("gate_up_proj")]
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                yield f"{base}{e}.gate_proj.weight", gate
                yield f"{base}{e}.up_proj.weight", up
        elif name.endswith(".mlp.experts.down_proj"):  # [E, hidden, inter]
            base = name[:-len("down_proj")]
            for e, down in enumerate(tensor):
                yield f"{base}{e}.down_proj.weight", down
        else:
            yield name, tensor


# ---------------------------------------------------------------------------- rollouts
def submit(llm: LLM, args: argparse.Namespace, rng: random.Random) -> dict[int, int]:
    """Add N prompts x k samples; -> {request id: the weight version when it was added}."""
    eng, vocab = llm.engine, llm.model.vocab_size
    added = {}
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(max(1, args.prompt_len // 2), args.prompt_len))]
        for _ in range(args.samples):
            params = SamplingParams(temperature=1.0, seed=rng.randrange(2**62), return_log_probs=True,
                                    num_tokens_to_generate=rng.randint(max(1, args.max_new_tokens // 4),
                                                                       args.max_new_tokens))
            added[eng.add_request(prompt, params)] = eng.weight_version
    return added


def pause(engine, finished: list[RequestOutput]) -> None:
    """Pause keeping the running requests: the launch in flight (launch-ahead) lands at the next
    ``step()``; after it nothing runs until ``resume_generation``."""
    engine.pause_generation("keep")
    while not engine.is_paused:  # under TP / EP the pause reaches every rank at a per-step exchange
        finished += engine.step().finished
    finished += engine.step().finished


# ---------------------------------------------------------------------------- the trainer
def token_log_probs(trainer, weights: dict[str, torch.Tensor] | None, outs: list[RequestOutput],
                    device: str) -> list[torch.Tensor]:
    """log P(generated token | everything before it) for each output, teacher-forced in one padded
    batch, with ``weights`` (HF name -> tensor; None: the trainer's own, with gradients)."""
    seqs = [o.prompt_tokens + o.generated_tokens for o in outs]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    ids, mask = ids.to(device), mask.to(device)
    if weights is None:
        logits = trainer(input_ids=ids, attention_mask=mask).logits
    else:
        logits = torch.func.functional_call(trainer, weights, (), {"input_ids": ids, "attention_mask": mask}).logits
    lp = torch.log_softmax(logits.float(), dim=-1)
    result = []
    for i, o in enumerate(outs):
        start, n = len(o.prompt_tokens), len(o.generated_tokens)
        targets = ids[i, start:start + n]
        result.append(lp[i, start - 1:start - 1 + n].gather(-1, targets[:, None])[:, 0])
    return result


def reward(out: RequestOutput) -> float:
    """A toy reward the trainer can learn: the fraction of even token ids."""
    return sum(t % 2 == 0 for t in out.generated_tokens) / max(1, len(out.generated_tokens))


def train_step(trainer, optimizer, outs: list[RequestOutput], device: str) -> float:
    """One policy-gradient step: advantage = reward - batch mean; importance ratio = exp(trainer
    log-prob - rollout log-prob), which corrects the tokens an older version generated."""
    rewards = torch.tensor([reward(o) for o in outs], device=device)
    advantages = rewards - rewards.mean()
    trainer.train()
    loss, count = 0.0, sum(len(o.generated_tokens) for o in outs)
    for lp, out, adv in zip(token_log_probs(trainer, None, outs, device), outs, advantages):
        rollout = torch.tensor(out.generated_log_probs, device=device)
        loss = loss - (torch.exp(lp - rollout) * adv).sum() / count
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    trainer.eval()
    return float(loss.detach())


# ---------------------------------------------------------------------------- the checks
class CheckFailed(Exception):
    pass


@torch.no_grad()
def check(trainer, snapshots: dict[int, dict[str, torch.Tensor]], outs: list[RequestOutput],
          added: dict[int, int], current: int, device: str) -> float:
    """Versions as expected, and every generated token's log-prob equal to the trainer's with the
    weights of the version that produced it. Returns the max |difference|."""
    for o in outs:
        v = o.weight_versions
        if len(v) != len(o.generated_tokens) or v != sorted(v) or v[0] < added[o.request_id] or v[-1] > current:
            raise CheckFailed(f"request {o.request_id}: weight versions {v} (added at version "
                              f"{added[o.request_id]}, current {current})")
    worst = 0.0
    for version in sorted({v for o in outs for v in o.weight_versions}):
        mine = [o for o in outs if version in o.weight_versions]
        for o, lp in zip(mine, token_log_probs(trainer, snapshots[version], mine, device)):
            at = torch.tensor([v == version for v in o.weight_versions], device=device)
            engine_lp = torch.tensor(o.generated_log_probs, device=device, dtype=torch.float32)
            worst = max(worst, float((lp - engine_lp)[at].abs().max()))
    return worst


# ---------------------------------------------------------------------------- the loop
@dataclass
class Row:
    iteration: str
    requests: int
    tokens: int
    per_version: str
    max_diff: float
    seconds: float


def print_table(rows: list[Row]) -> None:
    print(f"{'iteration':>9} {'requests':>8} {'tokens':>6}  {'tokens per version':<28} {'max |Δlogprob|':>14} {'seconds':>7}")
    for r in rows:
        print(f"{r.iteration:>9} {r.requests:>8} {r.tokens:>6}  {r.per_version:<28} {r.max_diff:>14.2e} {r.seconds:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if args.device == "cpu" else torch.bfloat16
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[dtype]
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint_dir(args, dtype, tmp)
        # On a GPU the trainer shares the device: leave it room (the KV pool is sized from this fraction).
        config = InferenceConfig(max_requests=64, gpu_memory_utilization=0.5)
        llm = LLM(path, device=args.device, dtype=dtype, inference_config=config)
        trainer = load_trainer(path, args.device, dtype)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr, weight_decay=0.0)
    eng = llm.engine
    # The weights of every version some unchecked token may come from (HF names; version 0 = the checkpoint).
    snapshots = {0: {n: p.detach().clone() for n, p in trainer.named_parameters()}}
    added: dict[int, int] = {}
    finished: list[RequestOutput] = []
    done: set[int] = set()
    rows, spanned = [], 0

    def report(name: str, outs: list[RequestOutput], t0: float) -> None:
        nonlocal spanned
        diff = check(trainer, snapshots, outs, added, eng.weight_version, args.device)
        versions = Counter(v for o in outs for v in o.weight_versions)
        spanned += sum(len(set(o.weight_versions)) > 1 for o in outs)
        rows.append(Row(name, len(outs), sum(versions.values()), " ".join(f"v{v}:{n}" for v, n in sorted(versions.items())),
                        diff, time.perf_counter() - t0))
        if diff > tolerance:
            raise CheckFailed(f"iteration {name}: engine and trainer log-probs differ by {diff:.3g} > {tolerance:g}")

    try:
        for it in range(args.iterations):
            t0 = time.perf_counter()
            new = submit(llm, args, rng)
            added.update(new)
            want = math.ceil(args.pause_after * len(new))
            while len(finished) < want:  # rollouts until enough finished
                finished += eng.step().finished
            pause(eng, finished)
            batch, finished = finished, []
            report(str(it), batch, t0)
            train_step(trainer, optimizer, batch, args.device)
            version = llm.update_weights(checkpoint_names(trainer.named_parameters()))  # every rank under TP / EP
            if version != it + 1:
                raise CheckFailed(f"update_weights returned version {version}, expected {it + 1}")
            snapshots[version] = {n: p.detach().clone() for n, p in trainer.named_parameters()}
            done.update(o.request_id for o in batch)
            oldest = min((v for rid, v in added.items() if rid not in done), default=version)  # running ones may need it
            snapshots = {v: w for v, w in snapshots.items() if v >= oldest}
            eng.resume_generation()
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():  # the requests that span the last update
            finished += eng.step().finished
        report("rest", finished, t0)
        if args.iterations and not spanned:
            raise CheckFailed("no request spanned a weight update (lengthen --max-new-tokens or lower --pause-after)")
    except CheckFailed as e:
        print_table(rows)
        print(f"FAILED: {e}")
        return 1
    finally:
        llm.close()  # graphs first: a caller running the loop again gets the device back
    print_table(rows)
    print(f"ok: {spanned} requests spanned an update; max |Δlogprob| {max(r.max_diff for r in rows):.2e} "
          f"<= {tolerance:g} ({dtype}, {args.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
