"""The "ipc" transfer: the prefill engine's packed blocks stay in its memory, shared (CUDA IPC on
a GPU, shared memory on the CPU), and the decode engine maps them and copies them into its pool;
the description travels as weight_transfer/ipc.py's payload (plain values, checked before
anything is mapped), through the coordinator (kv_shared). For engines on one host (on GPUs: the
decode engine must see the prefill engine's GPU, by UUID)."""
from __future__ import annotations

import torch
import torch.multiprocessing

from megatron_async.weight_transfer import ipc


def prepare_host_sharing() -> None:
    """CPU tensors are shared by file name (what weight_transfer/ipc.py maps)."""
    torch.multiprocessing.set_sharing_strategy("file_system")


def share(buf: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The flat uint8 ``buf`` (written on the caller's current stream) in shared memory, as the
    float32 words the payload format names (padded to whole words), and its payload; the caller
    keeps the tensor alive until the decode engine copied it."""
    pad = -buf.numel() % 4
    if pad:
        buf = torch.cat([buf, buf.new_zeros(pad)])
    words = buf.view(torch.float32)
    if words.is_cuda:
        torch.cuda.current_stream(words.device).synchronize()  # (another process reads it)
    else:
        words.share_memory_()
    return words, ipc.share([("kv", words)])


def open_shared(payload: dict, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the shared buffer ``payload`` describes, mapped (no copy);
    IpcHandleError for a bad one."""
    _, storages, tensors = ipc.parse(payload)
    if len(tensors) != 1 or tensors[0]["dtype"] != "float32" or tensors[0]["shape"] != [-(-nbytes // 4)]:
        raise ipc.IpcHandleError(f"a KV transfer of {nbytes} bytes shares one flat tensor of their float32 words")
    return ipc.views(ipc.IpcStorages().open(storages), tensors)[0].view(torch.uint8)[:nbytes]
