"""How big the KV pool is on a GPU when the user gives no size: plain arithmetic over measured
numbers (``plan_kv_pool``), and the device-memory reader it is measured with.

The budget is ``gpu_memory_utilization x total device memory`` (vLLM's meaning). Out of it come
what is not ours to give (the CUDA context, other processes), the tensors that stay (weights,
bookkeeping, sampler state), the measured peak of the largest step the configuration allows,
and the CUDA graph pools; the KV pool takes the rest. ``memory_profiling.py`` measures the
numbers; this module only adds them up and says, with the numbers, when they cannot fit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

GiB = 2**30


class MemoryPlanError(ValueError):
    """The model, or one request of ``max_sequence_length``, does not fit the device."""


@dataclass(frozen=True)
class MemoryReading:
    """One look at the device: bytes."""

    total: int
    free: int
    allocated: int
    """Held by live tensors of this process (the caching allocator's view)."""
    reserved: int
    """Held by this process's caching allocator (allocated + cached)."""
    peak_allocated: int
    """Most ``allocated`` since the last ``reset_peak``."""


class DeviceMemoryReader(Protocol):
    def read(self) -> MemoryReading: ...

    def reset_peak(self) -> None: ...

    def release_cached(self) -> None:
        """Hand cached, unused allocator blocks back to the device."""


class CudaMemoryReader:
    def __init__(self, device):
        self.device = device

    def read(self) -> MemoryReading:
        import torch

        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryReading(total, free, torch.cuda.memory_allocated(self.device),
                             torch.cuda.memory_reserved(self.device), torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    utilization: float
    others: int
    """Device memory this process's allocator does not hold: CUDA context, NCCL, other processes."""
    weights: int
    resident: int
    """Tensors that stay besides the weights and the KV pool: bookkeeping, sampler state, Mamba states."""
    peak_step: int
    graph_pools: int
    bytes_per_block: int
    num_blocks: int
    """KV blocks, the dummy block included."""
    block_size: int
    max_sequence_length: int
    max_requests: int
    probe_build: str = ""
    """How the probe step's Triton kernels were built (the dry pass's report, kernel_prebuild.py);
    empty: one by one, as the step met them."""
    prebuilt_shapes: frozenset = frozenset()
    """``kernel_prebuild.shape_key``s of the warm-up shapes whose kernels that dry pass built too."""

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def kv_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def full_length_requests(self) -> int:
        """Most requests of ``max_sequence_length`` tokens whose KV fits at once (capped by max_requests)."""
        per_request = -(-self.max_sequence_length // self.block_size)
        return min(self.max_requests, (self.num_blocks - 1) // per_request)

    def describe(self) -> str:
        return (f"memory: weights {self.weights / GiB:.2f} GiB, peak step {self.peak_step / GiB:.2f} GiB, "
                f"graph pools {self.graph_pools / GiB:.2f} GiB, other {(self.others + self.resident) / GiB:.2f} GiB; "
                f"KV {self.kv_bytes / GiB:.2f} GiB = {self.num_blocks:,} blocks = {self.kv_tokens:,} tokens: "
                f"{self.full_length_requests} concurrent requests of {self.max_sequence_length:,} tokens "
                f"(gpu_memory_utilization {self.utilization:g} of {self.total / GiB:.1f} GiB)"
                + (f"; probe step: {self.probe_build}" if self.probe_build else ""))


def check_weights_fit(weights: int, total: int, free: int) -> None:
    """Before building: the weights alone must fit the device's free memory."""
    if weights > free:
        raise MemoryPlanError(f"model needs {weights / GiB:.2f} GiB for its weights, device has {free / GiB:.2f} GiB "
                              f"free of {total / GiB:.2f} GiB")


def plan_kv_pool(*, total: int, utilization: float, others: int, weights: int, resident: int, peak_step: int,
                 graph_pools: int, bytes_per_block: int, block_size: int, max_sequence_length: int,
                 max_requests: int) -> MemoryPlan:
    """The KV pool that fills ``utilization x total`` after everything else; raises
    ``MemoryPlanError`` (with the numbers) when not even one request of ``max_sequence_length``
    fits. ``bytes_per_block`` 0 (no attention layers) gives one block per request position."""
    budget = int(utilization * total)
    fixed = others + weights + resident + peak_step + graph_pools
    blocks_per_request = -(-max_sequence_length // block_size)
    plan = dict(total=total, utilization=utilization, others=others, weights=weights, resident=resident,
                peak_step=peak_step, graph_pools=graph_pools, bytes_per_block=bytes_per_block, block_size=block_size,
                max_sequence_length=max_sequence_length, max_requests=max_requests)
    if fixed > budget:
        raise MemoryPlanError(
            f"model needs {fixed / GiB:.2f} GiB (weights {weights / GiB:.2f}, peak step {peak_step / GiB:.2f}, graph "
            f"pools {graph_pools / GiB:.2f}, other {(others + resident) / GiB:.2f}) before its KV cache, device has "
            f"{budget / GiB:.2f} GiB (gpu_memory_utilization {utilization:g} of {total / GiB:.2f} GiB)")
    if bytes_per_block == 0:
        return MemoryPlan(num_blocks=max_requests * blocks_per_request + 1, **plan)
    num_blocks = (budget - fixed) // bytes_per_block  # one of them is the dummy block
    if num_blocks - 1 < blocks_per_request:
        one = (blocks_per_request + 1) * bytes_per_block
        raise MemoryPlanError(
            f"gpu_memory_utilization {utilization:g} leaves {(budget - fixed) / GiB:.2f} GiB for the KV cache, one request "
            f"of max_sequence_length {max_sequence_length:,} tokens needs {one / GiB:.2f} GiB: raise "
            f"gpu_memory_utilization, lower max_sequence_length or max_tokens, or turn CUDA graphs off")
    return MemoryPlan(num_blocks=num_blocks, **plan)
