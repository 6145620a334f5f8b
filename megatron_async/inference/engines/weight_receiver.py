"""The engine's weight updates: every way new weights arrive ends in the one slab loader
(``models/slab_loading.py``) under the same rules: the weights must be resident
(``MemorySuspender.check_can_update_weights``), everything is checked before anything is copied,
and a completed update sets the weight version and the KV recompute rule (``set_weight_version``).

  ``update``            in-process tensors (HF or Megatron-Core names) or a checkpoint directory
  ``init_transfer``     join a transfer group with a trainer (``megatron_async.weight_transfer``)
  ``from_distributed``  a bucketed broadcast described by a manifest, copied bucket by bucket

Both transfer-group operations wait for the other side off the engine thread (``start_init`` /
``start_distributed`` return a ``PendingTransfer``; the engine's loops call its ``finish`` between
two steps once the wait ended): one at a time, each bounded by a timeout.
  ``from_ipc``          a colocated trainer's storages (CUDA IPC / shared memory), copied directly

The receiver keeps the copy plans of recent updates (``CopyPlanCache``; at start it plans the
update of every Megatron-Core tensor of this rank's TP shard, which a colocated trainer sends)
and the storages and copy lists of the last IPC payload (grouped into multi-tensor copies: ``copy_groups.py``), so an RL
loop that sends the same tensors every step pays for planning once. A transfer that fails after its first byte moved leaves the weights incomplete:
generation is refused (``weights_missing``) until an update completes."""
from __future__ import annotations

import logging
import numbers
import time

import torch

from megatron_async.inference import triton_builds
from megatron_async.models.megatron_layouts import NameMap, Shard
from megatron_async.models.slab_loading import WeightUpdateError
from megatron_async.models.weight_update import CopyPlanCache, megatron_metas, update_weights_in_place
from megatron_async.weight_transfer import ipc, table_copy
from megatron_async.weight_transfer.copy_groups import KERNELS, GroupedCopy
from megatron_async.weight_transfer.group import TransferFailed, check_group_args, check_timeout, init_transfer_group
from megatron_async.weight_transfer.manifest import _SHARD_FIELDS, DTYPES, Manifest, ManifestError
from megatron_async.weight_transfer.pending import PendingTransfer
from megatron_async.weight_transfer.per_rank import owned_copy
from megatron_async.weight_transfer.receiver import Refused, after_begin, plan_manifest, prepare_begin

log = logging.getLogger("megatron_async")

IPC_PHASES = ("parse", "plan", "open", "bind", "launch", "finish", "sync")
"""An IPC update's steps: the payload checked and keyed, the copy plan found or built, the storages
mapped, the source views made (first time only), the copies launched, checked and the version set
while they run, then waited for."""


def check_version(version) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, numbers.Integral)
                                or version < 0):
        raise ValueError(f"version must be an int >= 0 or None, got {version!r}")


def _bound(timeout_s: float) -> float:
    """How long a caller waits for a transfer-group wait whose torch timeouts are ``timeout_s``
    (a store's connection retries and a group's rendezvous each take up to about that)."""
    return 2 * timeout_s + 10.0


def _storages(model) -> list[int]:
    return [p.data_ptr() for p in model.parameters()]


class WeightReceiver:
    def __init__(self, engine, timeout_s: float = 30.0):
        """``timeout_s``: how long joining a transfer group waits for the other ranks, unless
        the call gives its own (``InferenceConfig.weight_transfer_timeout_s``)."""
        self.engine = engine
        self.timeout_s = timeout_s
        self.model = engine.runner.model
        self.plans = CopyPlanCache()
        try:  # the model's name lookups and views now, not at the first update
            self.plans.table(self.model)
            self._prepare_plan()
        except Exception as e:  # noqa: BLE001 -- a model that cannot take updates still serves; an update says why
            log.debug("weight update lookups not built at start: %s", e)
        self.group = None
        self.pending: PendingTransfer | None = None
        """The set-up or update of the transfer group that waits for the other side, if any."""
        self.last_receive = None
        """``ReceiveStats`` of the last distributed update on this rank."""
        self._storages = ipc.IpcStorages()
        self._payloads = ipc.CheckedPayloads()
        self.last_ipc_ms: dict[str, float] = {}
        """Host time of the last IPC update by phase (``IPC_PHASES``), in ms."""
        self._bound = None  # (program, GroupedCopy, kernel) of the last IPC payload
        self._ipc_kernel = "auto"
        cuda = self._cuda_params()
        self.table_compile = None
        if cuda and table_copy.kernel_available():  # its builds are no kernels the warm-up missed
            self.table_compile = table_copy.TableCompile(cuda[0][0], {d for _, d in cuda}, triton_builds.uncounted)
        """The IPC table kernel compiling off the start-up path; "auto" copies take it once ready."""
        self._uuid: str | None = None

    def _cuda_params(self) -> list[tuple[torch.device, torch.dtype]]:
        """The (device, dtype) pairs of the model's CUDA parameters, in a fixed order."""
        return sorted({(p.device, p.dtype) for p in self.model.parameters() if p.device.type == "cuda"}, key=str)

    def _prepare_plan(self) -> None:
        """Plan ahead the update a colocated trainer of this rank's TP shard sends most likely:
        every Megatron-Core tensor, in the parameters' dtype (a trainer's payload of other
        tensors, dtypes or shards plans at its first update, as before)."""
        par = self.model.parallel
        if par.ep_size != 1 or not hasattr(self.model, "megatron_dims"):
            return
        shard = Shard(tp_rank=par.tp_rank, tp_size=par.tp_size)
        dtype = next(self.model.parameters()).dtype
        self.plans.prepare(self.model, megatron_metas(self.model, shard, dtype), "megatron")

    def commit(self, version: int | None, recompute_kv: bool) -> int:
        """The update completed: the new version (None: the current one + 1)."""
        new = self.engine.weight_version + 1 if version is None else int(version)
        self.engine.set_weight_version(new, recompute_kv)
        return new

    def update(self, weights, version: int | None = None, recompute_kv: bool = True,
               weights_format: str | None = None) -> int:
        """``LLM.update_weights``: copy ``weights`` in place and return the new weight version."""
        check_version(version)
        self.engine.memory.check_can_update_weights()
        update_weights_in_place(self.model, weights, weights_format=weights_format, cache=self.plans)
        return self.commit(version, recompute_kv)

    # ------------------------------------------------------------------ transfer group
    def _check_no_pending(self) -> None:
        if self.pending is not None:
            raise TransferFailed(f"{self.pending.what} is in progress: wait for its answer")

    def start_init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   backend: str | None = None, timeout_s: float | None = None) -> PendingTransfer:
        """Begin joining the trainer's transfer group as rank ``rank_offset`` + this engine rank's
        global rank; the joining runs off this thread (``PendingTransfer``), and its ``finish()``
        keeps the group and returns the rank. ``backend`` None: NCCL on CUDA, gloo on CPU;
        ``timeout_s`` None: the engine's ``weight_transfer_timeout_s``."""
        check_group_args(master_address, master_port, rank_offset, world_size, backend)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        check_timeout(timeout_s)
        self._check_no_pending()
        if self.group is not None:
            raise ValueError("a weight transfer group is already set up: destroy_weight_transfer() first")
        device = next(self.model.parameters()).device
        rank = rank_offset + self.model.parallel.global_rank
        if rank >= world_size:
            raise ValueError(f"engine rank {rank} (rank_offset + global rank) is outside world_size {world_size}")
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")

        def join():
            return init_transfer_group(master_address, master_port, rank, world_size, backend, timeout_s,
                                       device if device.type == "cuda" else None)

        def finish(group, error):
            self.pending = None
            if error is not None:
                raise error
            self.group = group
            return rank

        self.pending = PendingTransfer(f"a transfer group set-up to {master_address}:{master_port}", join, finish,
                                       _bound(timeout_s), discard=lambda group: group.close())
        return self.pending

    def init_transfer(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                      backend: str | None = None, timeout_s: float | None = None) -> int:
        """``start_init`` and wait for it: the rank in the group once every rank joined."""
        return self.start_init(master_address, master_port, rank_offset, world_size, backend, timeout_s).finish()

    def destroy(self) -> None:
        self._check_no_pending()
        if self.group is not None:
            self.group.close()
        self.group = None

    def start_distributed(self, metadata, version: int | None = None, recompute_kv: bool = True) -> PendingTransfer:
        """Begin receiving the update ``metadata`` (a ``Manifest``, its dict or JSON) describes:
        the plan is made here, the begin frame (waiting for the trainer's senders, up to the
        group's timeout) runs off this thread, and ``finish()`` copies the buckets as they arrive
        and returns the new version (call it between two steps: the weights change there). A bad
        manifest or a state that forbids updates is refused in the begin frame (the trainer's
        ``send`` fails, nothing is copied) and raised by ``finish``; ``TransferFailed`` after that."""
        self._check_no_pending()
        if self.group is None:
            raise ValueError("no weight transfer group: call init_weight_transfer first")
        manifest, error = None, None
        try:
            check_version(version)
            if not isinstance(recompute_kv, bool):
                raise ValueError(f"recompute_kv must be True or False, got {recompute_kv!r}")
            if metadata is None:
                raise ManifestError("no manifest was given")
            manifest = Manifest.from_json(metadata)
            if version is None and manifest.version is not None:
                version = manifest.version
        except (ManifestError, ValueError) as e:
            error = e

        def prepare():
            if error is not None:
                raise error
            self.engine.memory.check_can_update_weights()
            return plan_manifest(self.model, manifest, self.plans)

        group, begin, storages = self.group, prepare_begin(manifest, prepare), _storages(self.model)

        def finish(frames, failed):
            self.pending = None
            if failed is not None:  # the group's collectives are out of step: it is of no more use
                self.destroy()
                raise TransferFailed(
                    f"no weight update began on the transfer group at {group.where} within its timeout of "
                    f"{group.timeout_s:g} s (the trainer's senders did not come: {failed}); the group is closed: "
                    "init_weight_transfer again") from None
            late = None
            if begin.error is None:  # the memory may have changed while the senders were awaited
                try:
                    self.engine.memory.check_can_update_weights()
                    if _storages(self.model) != storages:  # the plan's views are stale (suspended, resumed)
                        begin.plan, begin.program = prepare()
                except Exception as e:  # noqa: BLE001 -- reported at the end frame, after the buckets
                    late = e
            try:
                self.last_receive = after_begin(group, begin, frames, late)
            except Refused as r:
                raise r.error from None
            except TransferFailed:
                self.engine.memory.weights_missing = True
                log.error("weight transfer failed after it began: generation is refused until an update completes")
                raise
            return self.commit(version, recompute_kv)

        self.pending = PendingTransfer(f"a weight update from the transfer group at {group.where}",
                                       lambda: group.frame(*begin.frame), finish, _bound(group.timeout_s))
        return self.pending

    def from_distributed(self, metadata, version: int | None = None, recompute_kv: bool = True) -> int:
        """``start_distributed`` and wait for it: the new weight version."""
        return self.start_distributed(metadata, version, recompute_kv).finish()

    # ------------------------------------------------------------------ IPC
    def from_ipc(self, handles, version: int | None = None, recompute_kv: bool = True) -> int:
        """Copy from a colocated trainer's shared storages (``weight_transfer.ipc`` payloads: one
        or a list, one per trainer rank; payloads naming an ``engine_rank``: this rank takes its
        own, ``weight_transfer/per_rank.py``). Everything is validated before any storage is mapped."""
        check_version(version)
        if not isinstance(recompute_kv, bool):
            raise ValueError(f"recompute_kv must be True or False, got {recompute_kv!r}")
        self.engine.memory.check_can_update_weights()
        times = [time.perf_counter()]
        u = self._payloads.checked(handles, self.model.parallel.global_rank, self._device_uuid())
        times.append(time.perf_counter())

        def metas():
            names = NameMap.for_arch(self.model.spec.name) if u.per_rank and u.weights_format == "megatron" else None
            return [(t["name"], tuple(t["shape"]), DTYPES[t["dtype"]],
                     owned_copy(names, t["name"], _shard(t)) if names else _shard(t)) for t in u.tensors]

        plan, program = self.plans.get(self.model, u.key, metas, u.weights_format)
        times.append(time.perf_counter())
        opened = self._storages.open(u.storages)
        times.append(time.perf_counter())
        kernel = self.ipc_copy_kernel()
        if self._bound is None or self._bound[0] is not program or self._bound[2] != kernel:  # same storages, views
            self._bound = (program, GroupedCopy(program.bind(ipc.sources(opened, u.tensors)), kernel), kernel)
        times.append(time.perf_counter())
        program.begin()
        copied = self._bound[1].run()
        times.append(time.perf_counter())
        try:  # the host's part of the end while the device copies (later launches follow on its stream)
            plan.finish(copied)
            version = self.commit(version, recompute_kv)
            times.append(time.perf_counter())
        finally:
            if any(st.device.type == "cuda" for st in opened):
                torch.cuda.current_stream(opened[0].device).synchronize()  # done reading before the trainer moves on
            if u.release_after:
                self.release_ipc()
        times.append(time.perf_counter())
        self.last_ipc_ms = {k: 1e3 * (b - a) for k, a, b in zip(IPC_PHASES, times, times[1:])}
        return version

    @property
    def ipc_kernel(self) -> str:
        """How an IPC update launches its copies (``copy_groups.KERNELS``); a change binds anew."""
        return self._ipc_kernel

    @ipc_kernel.setter
    def ipc_kernel(self, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"ipc_kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == self._ipc_kernel:  # the bound copies stay
            return
        if kernel == "table":
            try:
                for device, dtype in self._cuda_params() if table_copy.kernel_available() else ():
                    table_copy.warm_up(device, dtype)  # the next update does not wait for the compiler
            except Exception as e:  # noqa: BLE001 -- the multi-tensor copies serve instead
                log.warning("the IPC table copy kernel did not build (%s): IPC updates use foreach copies", e)
                kernel = "foreach"
        self._ipc_kernel, self._bound = kernel, None

    def ipc_copy_kernel(self) -> str:
        """The kernel the next IPC update launches: ``ipc_kernel``, with "auto" the table once its
        compile finished (``table_compile``), else the foreach lists."""
        if self._ipc_kernel != "auto":
            return self._ipc_kernel
        return "table" if self.table_compile is not None and self.table_compile.ready() else "foreach"

    def _device_uuid(self) -> str | None:
        """This rank's GPU (per-rank payloads must share memory of this GPU only)."""
        if self._uuid is None:
            device = next(self.model.parameters()).device
            self._uuid = ipc.device_uuid(device.index if device.index is not None else torch.cuda.current_device()) \
                if device.type == "cuda" else ""
        return self._uuid or None

    def release_ipc(self) -> None:
        """Unmap the trainer's storages kept from the last IPC update."""
        self._storages.release()
        self._bound = None


_SHARDS: dict[tuple, Shard] = {}
"""Shards by their fields: a payload names a few in all its tensors."""


def _shard(t: dict) -> Shard:
    fields = tuple((k, t[k]) for k in _SHARD_FIELDS if k in t)
    shard = _SHARDS.get(fields)  # parse checked the fields: ints or None
    if shard is None:
        try:
            shard = Shard(**dict(fields))
        except ValueError as e:
            raise WeightUpdateError(str(e)) from None
        if len(_SHARDS) < 4096:
            _SHARDS[fields] = shard
    return shard
