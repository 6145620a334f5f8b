"""MTP speculative decoding on a GPU: exactness with the device kernels, then its cost.

    python scripts/gpu_check.py mtp-speculation [--out DIR] [--skip-timing]

1. A tiny float32 Qwen3 with MTP heads on CUDA (Triton attention / sampling, async, CUDA
   graphs on and off): speculation on == off token for token, greedy and seeded sampling.
2. A Qwen3-0.6B-shaped random bf16 checkpoint with ``copy_next`` heads (main layers scaled
   down so that drafts are often right): output tok/s of plain decoding and of MTP
   speculation at k = 1 and 3, batch 1 / 16 / 64, with the acceptance rate. bf16 logits of a
   (k + 1)-token row may differ from a 1-token row's in the last bits, so equality there is
   reported as a share (exact equality needs batch_invariant=True)."""
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


DEVICE = "cuda"


def _llm(path, k, dtype="float32", **cfg):
    base = dict(max_requests=64, max_tokens=2048, max_sequence_length=512, num_kv_blocks=4096, block_size_tokens=16,
                num_speculative_tokens=k, speculative_method="mtp", speculative_min_acceptance=0.0)
    return LLM(model=str(path), device=DEVICE, dtype=dtype, inference_config=InferenceConfig(**{**base, **cfg}))


def exactness(root: Path) -> list[dict]:
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "tiny", seed=1)
    path = add_mtp_heads(base, root / "tiny_mtp", init="copy_next", scale_layers=0.01)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (12,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    rows = []
    for kind in ("greedy", "sampled"):
        params = [SamplingParams(top_k=1 if kind == "greedy" else 40, temperature=1.0, seed=i, ignore_eos=True,
                                 num_tokens_to_generate=32, return_log_probs=True) for i in range(len(prompts))]
        for graphs in (False, True):
            for async_ in (False, True):
                cfg = dict(cuda_graphs=graphs, async_scheduling=async_, max_tokens=64)
                plain = _llm(path, 0, **cfg).generate(prompts, params)
                llm = _llm(path, 3, **cfg)
                spec = llm.generate(prompts, params)
                st = llm.engine.stats
                same = sum(a.generated_tokens == b.generated_tokens for a, b in zip(plain, spec))
                lp = max(max(abs(x - y) for x, y in zip(a.generated_log_probs, b.generated_log_probs))
                         for a, b in zip(plain, spec))
                rows.append(dict(kind=kind, graphs=graphs, async_=async_, equal=f"{same}/{len(prompts)}",
                                 max_logprob_diff=lp, drafted=st.spec_draft_tokens, accepted=st.spec_accepted_tokens))
                print(rows[-1], flush=True)
    return rows


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timing(root: Path) -> list[dict]:
    cfg = dict(DEFAULT_CONFIGS["qwen3-0.6b"])
    arch = cfg.pop("architectures")[0]
    for key in ("model_type", "dtype", "bos_token_id"):
        cfg.pop(key, None)
    cfg.update(eos_token_id=None, max_position_embeddings=4096)
    base = make_tiny_checkpoint(arch, root / "q06", seed=1, **cfg)
    path = add_mtp_heads(base, root / "q06_mtp", init="copy_next", scale_layers=0.05)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in (1, 16, 64):
        prompts = [torch.randint(0, 150000, (128,), generator=gen).tolist() for _ in range(batch)]
        params = SamplingParams(top_k=1, ignore_eos=True, num_tokens_to_generate=128)
        ref = None
        for k in (0, 1, 3):
            llm = _llm(path, k, dtype="bfloat16")
            llm.generate(prompts[:2], params)  # compile the Triton kernels
            _sync()
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            _sync()
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write results.json here")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu runs the exactness part as a dry run")
    a = p.parse_args()
    DEVICE = a.device
    with tempfile.TemporaryDirectory() as tmp:
        res = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "exactness": exactness(Path(tmp))}
        if not a.skip_timing:
            res["timing"] = timing(Path(tmp))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "mtp_results.json").write_text(json.dumps(res, indent=2))
