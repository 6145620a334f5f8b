"""``python -m benchmarks kernel-times kv-chunks --nccl``: a Qwen3-8B-shaped request's
blocks through the engine's own transfer code (kv_stream.send_blocks / recv_blocks) between two
processes over one NCCL pair, each on a side stream as a pair connection's thread is; with the
per-layer torch ops, with the one-launch kernel, and the bare chunk sends (no gather or scatter),
next to one NCCL send of all the request's bytes. Times are the slower rank's, from a barrier to
its stream's end."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.kernel_times.kv_chunks import REQUEST_BLOCKS, _pool
from megatron_async.disaggregation.kv_layout import KVLayout
from megatron_async.disaggregation.kv_stream import Clock, Staging, recv_blocks, send_blocks
from tests.helpers.multiprocess import run_ranks

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROUNDS = 5


def _worker(rank: int, world: int, chunk_mibs: list[int]) -> dict:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    try:
        stream = torch.cuda.Stream(dev)
        torch.cuda.set_stream(stream)
        ctx = _pool(dev, rank + 1)
        layouts = {"torch": KVLayout(ctx, one_launch=False), "kernel": KVLayout(ctx, one_launch=True)}
        perm = torch.randperm(ctx.kv_caches[0].shape[1], generator=torch.Generator().manual_seed(0))
        ids = (perm if rank == 0 else perm.flip(0))[:REQUEST_BLOCKS].tolist()
        staging = Staging(dev, dev)
        size = layouts["torch"].block_bytes()

        def op(kind, t):
            return dist.isend(t, 1 - rank) if kind == "send" else dist.irecv(t, 1 - rank)

        def timed(fn) -> float:
            fn()  # (warm: connections, compiles, staging)
            times = []
            for _ in range(ROUNDS):
                dist.barrier()
                torch.cuda.synchronize(dev)
                start = time.perf_counter()
                fn()
                stream.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)

        whole = torch.empty(REQUEST_BLOCKS * size, dtype=torch.uint8, device=dev)
        out = {"one send": timed(lambda: op("send" if rank == 0 else "recv", whole).wait())}
        for mib in chunk_mibs:
            chunk = mib << 20
            for name, layout in layouts.items():
                def move(layout=layout):
                    if rank == 0:
                        send_blocks(op, staging, layout, ids, None, chunk, Clock(True))
                    else:
                        recv_blocks(op, staging, layout, ids, chunk)
                out[(mib, name)] = timed(move)
            chunks = layouts["torch"].chunks(REQUEST_BLOCKS, chunk)

            def bare():
                kind = "send" if rank == 0 else "recv"
                works = [op(kind, staging.get(i, n * size)[0]) for i, (_, n) in enumerate(chunks)]
                for w in works:
                    w.wait()
            out[(mib, "bare")] = timed(bare)
        return out
    finally:
        dist.destroy_process_group()


def wire_table(chunk_mibs: list[int], request_copy: float) -> None:
    ranks = run_ranks(_worker, 2, chunk_mibs, timeout_s=300, env=NCCL_ENV)
    worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
    print(f"\nNCCL pair, the engine's transfer code, {REQUEST_BLOCKS} blocks: one NCCL send of all its bytes "
          f"{worst['one send']:.2f} ms (one plain copy {request_copy:.2f} ms)")
    print("| chunk MiB | bare chunk sends | stream torch | stream kernel | kernel / copy |")
    print("|---:|---:|---:|---:|---:|")
    for mib in chunk_mibs:
        print(f"| {mib} | {worst[(mib, 'bare')]:.2f} | {worst[(mib, 'torch')]:.2f} | {worst[(mib, 'kernel')]:.2f} | "
              f"{worst[(mib, 'kernel')] / request_copy:.1f}x |")
