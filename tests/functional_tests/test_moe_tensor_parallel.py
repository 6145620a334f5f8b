"""MoE checkpoints under tensor parallelism on CPU (gloo + ZMQ): experts TP-split inside (gate/up
columns, down rows; router and NemotronH's correction bias replicated, shared expert split like
an MLP), 2 ranks produce exactly the tokens of the single-process model on every rank (greedy,
seeded sampling, staggered arrivals, launch-ahead and serial)."""
from __future__ import annotations

import pytest

from tests.helpers.hf_moe_models import make_tiny_moe_checkpoint
from tests.functional_tests.test_tensor_parallel import _check_tp

MOE_CASES = {
    "qwen3moe-tp2": ("Qwen3MoeForCausalLM", {}),  # sparse, dense, sparse layers
    "nemotron_h-moe-tp2": ("NemotronHForCausalLM", {}),  # grouped sigmoid router, shared expert
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_tp2_matches_single_process(case, tmp_path):
    arch, overrides = MOE_CASES[case]
    ckpt = make_tiny_moe_checkpoint(arch, tmp_path / "ckpt", **overrides)
    _check_tp(str(ckpt), 2, sharded_heads=(3, 1))
