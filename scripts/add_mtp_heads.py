"""Add multi-token-prediction heads (mtp.* tensors, Qwen3-Next names) to a checkpoint, for tests
and benchmarks of speculative decoding with speculative_method="mtp":
    python scripts/add_mtp_heads.py CKPT_IN CKPT_OUT [--depths N] [--seed S] [--init random|copy_next]
"random" heads draft badly; "copy_next" heads draft lm_head(final_norm(embed(token))), which
is often right on a model whose layers add little (--scale-layers 0.05 makes one)."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root, for tests.helpers

from tests.helpers.mtp_heads import INITS, add_mtp_heads  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_in")
    p.add_argument("ckpt_out")
    p.add_argument("--depths", type=int, default=1, help="MTP depths to add (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--init", choices=INITS, default="random", help="head weights (default random)")
    p.add_argument("--scale-layers", type=float, default=None,
                   help="also multiply the main layers' o_proj / down_proj by this factor")
    a = p.parse_args()
    print(add_mtp_heads(a.ckpt_in, a.ckpt_out, a.depths, a.seed, a.init, a.scale_layers))
