"""The start-up dry pass under expert parallelism (collective_prebuild.py), on the CPU over two
gloo ranks with the tiny MoE model: every shape the collective graph plan captures (decode
graphs of every variant, the collective mixed graphs) runs once with the real EP exchange
(both ranks together) and once with the dry pass's stand-ins and every collective raising. Each
MoE layer's exchange results, the routed experts' inputs and the step's samples have the same
shapes, strides, dtypes and alignment both ways (what the kernels after the exchange specialize
on), and the model holds its own exchange again afterwards. The dry pass's CUDA captures and
builds need a GPU: tests/functional_tests/test_multigpu_startup.py."""
from __future__ import annotations

import torch

from megatron_async import LLM, InferenceConfig
from megatron_async.inference.text_generation_controllers.collective_prebuild import collective_shapes
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from megatron_async.parallel.dry_exchange import ep_state, local_exchange
from tests.helpers.exchange_signatures import no_collectives, recording, signature
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=16, max_sequence_length=64)


def _step(llm: LLM, shape, width: int) -> list:
    runner, ctx = llm.runner, llm.context
    ctx.gpu_view.buffer.copy_(ctx.padding_snapshot(shape.num_rows, shape.num_tokens, width))
    if shape.any_penalties:
        ctx.sampling_state.ensure_allocated()
    with recording() as seen, torch.inference_mode():
        out = runner.compute_step(shape)
    return seen + [("samples", signature(out[0]))]


def _worker(rank: int, world: int) -> dict:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe", expert_parallel_size=world)
    try:
        graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, collective=True, emulate=True)
        shapes = collective_shapes(graphs)
        real = [_step(llm, s, w) for s, w in shapes]  # every rank at once: the real exchanges
        parallel = ep_state(llm.runner.model)
        with no_collectives(), local_exchange(llm.runner.model) as swapped:
            dry = [_step(llm, s, w) for s, w in shapes]
        return {"shapes": [(s.num_tokens, s.num_rows, s.is_decode_only) for s, _ in shapes], "real": real,
                "dry": dry, "swapped": swapped, "restored": ep_state(llm.runner.model) is parallel}
    finally:
        llm.close()


def test_the_dry_pass_meets_the_real_exchanges_tensors_on_every_collective_graph_shape():
    for r in run_ranks(_worker, 2, timeout_s=300):
        assert any(not decode for _, _, decode in r["shapes"]) and any(decode for _, _, decode in r["shapes"])
        assert r["swapped"] > 0 and r["restored"]
        for shape, real, dry in zip(r["shapes"], r["real"], r["dry"]):
            assert sum(name == "experts" for name, *_ in real) >= 1, shape  # the MoE layers ran
            assert dry == real, shape
