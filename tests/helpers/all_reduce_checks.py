"""GPU checks and timings of the P2P all-reduce (``parallel/p2p_all_reduce.py``) against NCCL,
run on spawned ranks (``run_ranks``) by ``tests/functional_tests/test_multigpu_p2p_all_reduce.py``
and ``python -m benchmarks all-reduce``. One spawn covers several group sizes: a group of the first
``g`` ranks per size, the other ranks waiting at a barrier. ``engine_worker`` runs a checkpoint
under TP with CUDA graphs on either backend (its tokens are compared with TP=1)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megatron_async.parallel.p2p_all_reduce import P2PAllReduce
from megatron_async.parallel.state import ParallelState
from tests.helpers import fused_norm_checks

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""For every process of a multi-GPU run: NVLink multicast can take a shared host's GPUs down."""
HIDDEN = 4096
MAX_BYTES = 8 << 20
# (dtype, numel): tiny, unaligned (fp32 4-byte vectors), the one-shot / two-shot edge, the
# largest P2P message, and sizes that must fall back to NCCL (odd bf16 size, beyond max, fp16)
CASES = [(torch.float32, 7), (torch.bfloat16, 6), (torch.float32, 4097), (torch.bfloat16, 4097),
         (torch.bfloat16, 32 * HIDDEN), (torch.float32, 32 * HIDDEN), (torch.bfloat16, 64 * HIDDEN),
         (torch.bfloat16, 64 * HIDDEN + 8), (torch.bfloat16, 128 * HIDDEN), (torch.float32, 3 * 256 * HIDDEN // 4 + 4),
         (torch.bfloat16, MAX_BYTES // 2), (torch.bfloat16, MAX_BYTES // 2 + 8), (torch.float16, 1024)]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _gathered(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def _sum64(x: torch.Tensor, group) -> torch.Tensor:
    return torch.stack([p.double() for p in _gathered(x, group)]).sum(0)


def _reduce(reducer: P2PAllReduce, x: torch.Tensor, group) -> str:
    if reducer.accepts(x):
        reducer.all_reduce(x)
        return "p2p"
    dist.all_reduce(x, group=group)
    return "nccl"


def check_values(reducer: P2PAllReduce, group, seed: int) -> list[dict]:
    """Every case on fresh random data: the result against a float64 sum of all ranks' inputs
    and against NCCL; every rank ends with the same bits."""
    rank, rows = dist.get_rank(group), []
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000 * rank)
    for dtype, numel in CASES:
        x = torch.randn(numel, device="cuda", generator=gen).to(dtype)
        ref = _sum64(x, group)
        nccl = x.clone()
        dist.all_reduce(nccl, group=group)
        got = x.clone()
        path = _reduce(reducer, got, group)
        same = torch.stack([t.float() for t in _gathered(got, group)])  # exact for these dtypes
        rows.append({"dtype": str(dtype).split(".")[-1], "bytes": numel * x.element_size(), "path": path,
                     "rel_err": _rel(got, ref), "nccl_rel_err": _rel(nccl, ref),
                     "ranks_equal": bool((same == same[0]).all())})
    return rows


def check_graph_replay(reducer: P2PAllReduce, group, seed: int, replays: int = 3) -> list[float]:
    """A CUDA graph holding a one-shot, a two-shot and an NCCL all-reduce, replayed on fresh
    inputs copied into its static buffers: each replay equals eager NCCL on the same inputs.
    Returns the largest relative error per replay."""
    rank = dist.get_rank(group)
    gen = torch.Generator(device="cuda").manual_seed(seed + 7 + 1000 * rank)
    shapes = [(4, HIDDEN), (128, HIDDEN), (1024, HIDDEN + 64)]  # one-shot, two-shot, NCCL (beyond max)
    static = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (NCCL communicator, kernels)
        for t in static:
            t.normal_(generator=gen)
            _reduce(reducer, t, group)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        paths = [_reduce(reducer, t, group) for t in static]
    assert paths == ["p2p", "p2p", "nccl"], paths
    errors = []
    for _ in range(replays):
        fresh = [torch.randn(s, device="cuda", generator=gen).bfloat16() for s in shapes]
        for t, f in zip(static, fresh):
            t.copy_(f)
        graph.replay()
        worst = 0.0
        for t, f in zip(static, fresh):
            dist.all_reduce(f, group=group)
            worst = max(worst, _rel(t, f.double()))
        errors.append(worst)
    torch.cuda.synchronize()
    return errors


def _graph_us(ops, iters: int) -> float:
    """Median time of one op in us, from replays of a graph that runs every op once."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for op in ops:
            op()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for op in ops:
            op()
    times = []
    for i in range(iters + 2):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        if i >= 2:
            times.append(1e3 * start.elapsed_time(stop) / len(ops))
    return statistics.median(times)


def time_sizes(reducer: P2PAllReduce, group, sizes: list[int], iters: int, ops_per_graph: int = 16) -> list[dict]:
    """Per message size (bytes, bf16): us per all-reduce inside a CUDA graph for NCCL, one-shot
    and two-shot, and eager (one launch, event-timed) for NCCL and the default P2P path. Each
    graph reduces ``ops_per_graph`` different buffers (values stay finite over the replays)."""
    rows = []
    keep = reducer.one_shot_max_bytes
    for nbytes in sizes:
        bufs = [torch.randn(nbytes // 2, device="cuda").bfloat16() for _ in range(ops_per_graph)]
        nccl = [lambda b=b: dist.all_reduce(b, group=group) for b in bufs]
        p2p = [lambda b=b: reducer.all_reduce(b) for b in bufs]
        row = {"bytes": nbytes, "nccl_graph_us": _graph_us(nccl, iters)}
        for name, limit in (("one_shot_graph_us", nbytes), ("two_shot_graph_us", 0)):
            reducer.one_shot_max_bytes = limit
            for b in bufs:
                b.normal_()
            row[name] = _graph_us(p2p, iters)
        reducer.one_shot_max_bytes = keep
        for name, op in (("nccl_eager_us", nccl[0]), ("p2p_eager_us", p2p[0])):
            bufs[0].normal_()
            row[name] = _eager_us(op, iters)
        rows.append(row)
    return rows


def _eager_us(op, iters: int) -> float:
    times = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        stop.record()
        stop.synchronize()
        if i >= 2:
            times.append(1e3 * start.elapsed_time(stop))
    return statistics.median(times)


def all_reduce_worker(rank: int, world: int, group_sizes: list[int], time_sizes_bytes: list[int], iters: int,
                      seed: int = 0, engine_ckpt: str | None = None, fused_rows: list[int] | None = None) -> dict:
    """One spawned rank: for each group size, build the P2P all-reduce on the first ``g`` ranks
    (``required``: no silent NCCL), check values and graph replay (plain and fused with add +
    RMSNorm), then time ``time_sizes_bytes`` and, with ``fused_rows``, fused vs unfused layers.
    Last, with ``engine_ckpt``: ``engine_worker`` on the whole world with P2P (report["engine"])."""
    t0 = time.perf_counter()
    say = (lambda msg: print(f"[rank 0, {time.perf_counter() - t0:5.1f} s] {msg}", flush=True)) if rank == 0 else (
        lambda msg: None)
    torch.cuda.set_device(rank)
    world_state = ParallelState.from_torchrun(world, "cuda")
    report = {}
    try:
        for g in group_sizes:
            group = dist.group.WORLD if g == world else dist.new_group(list(range(g)))
            if rank < g:
                reducer = P2PAllReduce.create(group, torch.device("cuda", rank), MAX_BYTES, required=True)
                say(f"group {g}: P2P buffers exchanged, self-test passed")
                rep = report[g] = {"values": check_values(reducer, group, seed),
                                   "graph_errors": check_graph_replay(reducer, group, seed), "times": []}
                say(f"group {g}: " + ", ".join(f"{r['dtype']} {r['bytes']} B {r['path']} err {r['rel_err']:.1e}"
                                              for r in rep["values"]))
                say(f"group {g}: graph replay errors {rep['graph_errors']}")
                rep["fused_values"] = fused_norm_checks.check_fused_norm(reducer, group, seed)
                rep["fused_replays"] = fused_norm_checks.check_fused_graph_replay(reducer, group, seed)
                say(f"group {g}: fused norm {rep['fused_values']}, graph replays {rep['fused_replays']}")
                rep["fused_times"] = fused_norm_checks.time_layer_halves(reducer, group, fused_rows or [], iters,
                                                                        _graph_us)
                for row in rep["fused_times"]:
                    say(f"group {g}: {row}")
                for nbytes in time_sizes_bytes:
                    rep["times"] += time_sizes(reducer, group, [nbytes], iters)
                    say(f"group {g}: {rep['times'][-1]}")
                rep["calls"] = dict(reducer.calls)
                reducer.close()
            dist.barrier()
        if engine_ckpt is not None:  # the LLM joins this world's process group and leaves it at close
            say("engine check: TP=world, CUDA graphs, P2P")
            report["engine"] = engine_worker(rank, world, engine_ckpt, "p2p")
            say(f"engine check done: {report['engine']['p2p_calls']}, {report['engine']['graph_replays']} replays")
        return report
    finally:
        world_state.destroy()


def expected_path(dtype: str, nbytes: int) -> str:
    """The path a CASES entry must take (the rules of ``P2PAllReduce.accepts``)."""
    return "p2p" if dtype in ("float32", "bfloat16") and nbytes <= MAX_BYTES and nbytes % 4 == 0 else "nccl"


def assert_group_report(report: dict) -> None:
    """What one rank's report of one group must show (raises AssertionError with the row)."""
    for row in report["values"]:
        assert row["path"] == expected_path(row["dtype"], row["bytes"]), row
        assert row["ranks_equal"], row
        tol = 1e-6 if row["dtype"] == "float32" else max(2 * row["nccl_rel_err"], 4e-3)
        assert row["rel_err"] <= tol, row
    assert max(report["graph_errors"]) < 8e-3, report["graph_errors"]  # bf16 P2P sums vs NCCL's
    assert report["calls"].get("one_shot", 0) > 0 and report["calls"].get("two_shot", 0) > 0, report["calls"]
    fused_norm_checks.assert_fused_report(report["fused_values"], report["fused_replays"])


ENGINE_CONFIG = dict(block_size_tokens=16, num_kv_blocks=64, max_requests=4, max_tokens=64, max_sequence_length=128,
                     cuda_graph_batch_sizes=(1, 2, 4))
ENGINE_PROMPTS = [[3, 17, 42, 9, 100, 7], [25, 1, 2], [5] * 23, [60, 61, 62, 63, 64, 65, 66, 67, 68]]


def engine_outputs(llm) -> dict:
    """Greedy and seeded-sampled tokens, launch-ahead then serial, of ``ENGINE_PROMPTS``."""
    from megatron_async import SamplingParams

    greedy = SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=8, ignore_eos=True, seed=50 + i)
               for i in range(len(ENGINE_PROMPTS))]
    outs = {}
    for mode in ("async", "serial"):
        llm.engine.async_scheduling = mode == "async"
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            outs[f"{mode}_{name}"] = [o.generated_tokens for o in llm.generate(ENGINE_PROMPTS, params)]
    return outs


def engine_worker(rank: int, world: int, ckpt: str, backend: str, fused_norm: bool = True) -> dict:
    """The fp32 checkpoint under TP=world with CUDA graphs and the given all-reduce backend
    (``fused_norm``: InferenceConfig.tp_fused_norm; its calls count as p2p_calls["fused_norm"])."""
    from megatron_async import LLM, InferenceConfig

    cfg = InferenceConfig(**ENGINE_CONFIG, cuda_graphs=True, tp_all_reduce=backend, tp_fused_norm=fused_norm)
    llm = LLM(ckpt, device="cuda", dtype="float32", inference_config=cfg, tensor_parallel_size=world)
    try:
        reducer = llm.parallel.tp_reducer
        return {"outputs": engine_outputs(llm), "p2p_calls": dict(reducer.calls) if reducer else {},
                "graph_replays": llm.runner.graphs.num_replays,
                "fused_on": bool(reducer and reducer.fused_max_bytes)}  # its self-test passed on every rank
    finally:
        llm.close()
