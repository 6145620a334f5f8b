"""Rank 0's own work in a data-parallel round over ZMQ, measured in one process
(``python -m benchmarks consensus --decode``): the communicator's real code, its transport fed
with recorded frames, so that no socket and no other process (nor the load of a shared box)
hides what reading the other ranks' uploads costs."""
from __future__ import annotations

import time

from megatron_async.inference.communication import wire
from megatron_async.inference.communication.zmq_communicator import EXCHANGE, ZMQCommunicator
from megatron_async.inference.communication.zmq_transport import MAX_FRAME_BYTES
from megatron_async.inference.engines.dynamic_engine import StepResult
from megatron_async.inference.engines.step_consensus import StepConsensus
from megatron_async.inference.request import RequestUpdate


class _RecordedFrames:
    """Rank 0's transport, fed in one process: each gather returns every other rank's recorded
    frame of that round (decoded by ``wire.decode`` as the listener decodes them); sends go nowhere."""

    def __init__(self, frames: list[bytes]):
        self.frames, self.waited_ns = frames, 0

    def recv_from_peers(self, what: str) -> list:
        return [(peer, *wire.decode(memoryview(frame), MAX_FRAME_BYTES)) for peer, frame in enumerate(self.frames, 1)]

    def send_to_peers(self, frame: bytes) -> None:
        pass

    def take_waiting(self) -> list:
        return []


def decode_table(ranks: list[int], sizes: list[int], iters: int) -> None:
    """Rank 0's own work in a data-parallel round over ZMQ, in one process (no socket, no other
    process: the box's load hides nothing): ``StepConsensus.exchange`` reading the other ranks'
    recorded frames ([seq, ints, upload of ``n`` streaming updates] each), then ``take_uploads``
    reading their upload records. Best of 9 means of ``iters // 9`` rounds."""
    from megatron_async.inference.engines import step_records

    print("\n| ranks | updates per upload | exchange us | take_uploads us | both us |")
    print("|---:|---:|---:|---:|---:|")
    for world in ranks:
        for n in sizes:
            updates = [RequestUpdate(i, (1000 + i,), None, False, None) for i in range(n)]
            up = step_records.encode_upload(StepResult(updates=updates))
            comm = ZMQCommunicator(0, 1)  # then made rank 0 of ``world`` over the recorded frames
            comm.world_size, comm.exchange_path = world, "zmq"
            sync = StepConsensus(comm, data_parallel=True)
            record = [1, 64, 0, 0, 0, 0, 0, *[3] * world, time.monotonic_ns() // 1000]
            comm.transport = feed = _RecordedFrames([])
            best = (float("inf"), 0.0, 0.0)
            for _ in range(9):
                ex = take = 0.0
                for _ in range(max(1, iters // 9)):
                    feed.frames = [wire.encode(EXCHANGE, comm._seq + 1, record, up)] * (world - 1)
                    t0 = time.perf_counter()
                    sync.exchange(True, num_tokens=64, load=3)
                    t1 = time.perf_counter()
                    got = sync.take_uploads()
                    take, ex = take + time.perf_counter() - t1, ex + t1 - t0
                assert len(got) == world - 1 and got[0].updates == updates
                best = min(best, (ex + take, ex, take))
            k = 1e6 / max(1, iters // 9)
            print(f"| {world} | {n} | {best[1] * k:.1f} | {best[2] * k:.1f} | {best[0] * k:.1f} |", flush=True)
