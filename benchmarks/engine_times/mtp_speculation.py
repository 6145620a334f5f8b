"""MTP speculative decoding on a GPU: its cost. A Qwen3-0.6B-shaped random bf16 checkpoint with
``copy_next`` heads (main layers scaled down so that drafts are often right): output tok/s of
plain decoding and of MTP speculation at k = 1 and 3, batch 1 / 16 / 64, with the acceptance rate.
bf16 logits of a (k + 1)-token row may differ from a 1-token row's in the last bits, so equality
with plain decoding is reported as a share (exact equality needs batch_invariant=True; the float32
equality is tests/functional_tests/test_spec_mtp.py's gpu test).

    python -m benchmarks engine-times mtp-speculation [--batches 1 16 64] [--out DIR]"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.models.default_model import DEFAULT_CONFIGS
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.mtp_heads import add_mtp_heads


def _llm(path, k: int) -> LLM:
    cfg = InferenceConfig(max_requests=64, max_tokens=2048, max_sequence_length=512, num_kv_blocks=4096,
                          block_size_tokens=16, num_speculative_tokens=k, speculative_method="mtp",
                          speculative_min_acceptance=0.0)
    return LLM(model=str(path), device="cuda", dtype="bfloat16", inference_config=cfg)


def timing(root: Path, batches: list[int]) -> list[dict]:
    cfg = dict(DEFAULT_CONFIGS["qwen3-0.6b"])
    arch = cfg.pop("architectures")[0]
    for key in ("model_type", "dtype", "bos_token_id"):
        cfg.pop(key, None)
    cfg.update(eos_token_id=None, max_position_embeddings=4096)
    base = make_tiny_checkpoint(arch, root / "q06", seed=1, **cfg)
    path = add_mtp_heads(base, root / "q06_mtp", init="copy_next", scale_layers=0.05)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in batches:
        prompts = [torch.randint(0, 150000, (128,), generator=gen).tolist() for _ in range(batch)]
        params = SamplingParams(top_k=1, ignore_eos=True, num_tokens_to_generate=128)
        ref = None
        for k in (0, 1, 3):
            llm = _llm(path, k)
            llm.generate(prompts[:2], params)  # compile the Triton kernels
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            st = llm.engine.stats
            toks = [o.generated_tokens for o in outs]
            ref = toks if k == 0 else ref
            rows.append(dict(batch=batch, k=k, tok_s=round(batch * 128 / wall, 1),
                             acceptance=round(st.spec_acceptance_rate, 3),
                             equal_to_plain=f"{sum(a == b for a, b in zip(toks, ref))}/{batch}"))
            print(rows[-1], flush=True)
            del llm
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out", default=None, help="write mtp_results.json here")


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        res = {"device": torch.cuda.get_device_name(), "timing": timing(Path(tmp), args.batches)}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mtp_results.json").write_text(json.dumps(res, indent=2))
