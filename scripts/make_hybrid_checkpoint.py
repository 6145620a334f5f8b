"""Write a random-weight hybrid (NemotronH by default) HF checkpoint of a realistic size, for
GPU benchmarks of hybrid models (nothing is downloaded):
    python scripts/make_hybrid_checkpoint.py OUT_DIR [--size small|medium]"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root, for tests.helpers

from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint  # noqa: E402

SIZES = {
    # ~0.3B: 16 layers (8 Mamba2, 6 MLP, 2 attention), Mamba 32 heads x 64, d_state 128
    "small": dict(hidden_size=1024, num_hidden_layers=16, hybrid_override_pattern="M-M-M*-M-M-M*-M-",
                  mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128, n_groups=8, intermediate_size=4096,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                  max_position_embeddings=8192, initializer_range=0.02),
    # the small one's layer pattern at tiny widths: the host's work per step on a CPU (host-step --model)
    "tiny": dict(hidden_size=64, num_hidden_layers=16, hybrid_override_pattern="M-M-M*-M-M-M*-M-",
                 mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
                 max_position_embeddings=2048),
}

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--arch", default="NemotronHForCausalLM")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    a = p.parse_args()
    print(make_tiny_hybrid_checkpoint(a.arch, a.out, **SIZES[a.size]))
