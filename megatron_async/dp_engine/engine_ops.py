"""The operations an engine runs between two steps at a caller's request: the admin and refit
operations (pause / resume, weight updates and transfers, suspend / resume of memory, the
generation epoch, aborts), the ``stats`` counters a coordinator asks for, and the loop of a
tensor-parallel rank > 0 that runs rank 0's steps and every-rank operations. Each operation takes
the engine, the LLM's ``update_weights`` and checked arguments; its outcome is an HTTP status and
a JSON body (the engine's state, or an OpenAI error object). Plain names and arguments, so that
the HTTP server's engine loop, a front-end process, a coordinator (link.py) and the follower ranks
of a TP job (no web framework here) ask for them alike."""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the server's front-end processes import this module and never torch
    from megatron_async.weight_transfer.pending import PendingTransfer

log = logging.getLogger("megatron_async.dp_engine")

EVERY_RANK_OPS = frozenset({"update_weights", "suspend", "resume", "init_weight_transfer",
                            "update_weights_from_distributed", "update_weights_from_ipc", "destroy_weight_transfer",
                            "set_generation_epoch", "load_lora_adapter", "unload_lora_adapter",
                            "update_lora_from_distributed", "update_lora_from_ipc"})
"""Operations every TP rank runs (each holds its own shard and memory); pause / resume and
aborts reach the other ranks through the engine's per-step exchange."""


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """The OpenAI error object (every refused operation's body, and the HTTP server's errors)."""
    kind = "not_found_error" if status == 404 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _distributed(engine, args: dict) -> PendingTransfer:
    """Joins the begin frame even for a refused body (``body_error``), so no sender waits."""
    return _with_body_error(args, lambda: engine.weights.start_distributed(
        args.get("metadata"), args.get("version"), args.get("recompute_kv", True)))


def _with_body_error(args: dict, action: Callable[[], Any]) -> Any:
    """``action()``; a refusal of a body that was not even readable says what was wrong with it."""
    try:
        return action()
    except ValueError:
        if "body_error" in args:
            raise ValueError(args["body_error"]) from None
        raise


class OpRefused(Exception):
    """An operation refused with an HTTP status of its own (``run_guarded`` answers it as is)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


ENGINES_REFUSED = "engines names engines behind a data-parallel coordinator; this server runs one engine"
"""Why an operation's ``engines`` argument reached an engine: a coordinator takes it off (it picks
the engines), so only a server with its own engine passes it on."""

JOINS_BEGIN_FRAME = frozenset({"update_weights_from_distributed", "update_lora_from_distributed"})
"""Operations whose refusal must still join the trainer's begin frame (its ``send`` fails, never waits)."""


# ---------------------------------------------------------------- LoRA adapters (docs/LORA.md)
def _load_lora(engine, args: dict) -> PendingTransfer:
    """Prepared off the engine thread, installed between two steps (lora_control.start_load). A
    refused adapter (missing, malformed, over-rank, another base model's) is a LoRAError: a 400."""
    return engine.lora.start_load(args["lora_name"], args["lora_path"])


def _unload_lora(engine, args: dict) -> None:
    """404 for a name not loaded, 409 while unfinished requests use it (LoRAError names them)."""
    name, adapters = args["lora_name"], engine.context.lora
    if adapters is not None and name not in adapters.loaded:
        raise OpRefused(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(adapters.loaded)})", 404)
    try:
        engine.lora.unload(name)
    except ValueError as e:  # LoRAError: without enable_lora a 400, else the adapter is in use
        if adapters is None:
            raise
        raise OpRefused(str(e), 409) from None


def _lora_distributed(engine, args: dict) -> PendingTransfer:
    """An adapter's refit (inference/engines/lora_refit.py); joins the begin frame like ``_distributed``."""
    from megatron_async.inference.engines import lora_refit

    return _with_body_error(args, lambda: lora_refit.start_distributed(
        engine.weights, engine.lora, args.get("lora_name"), args.get("metadata")))


class Deferred:
    """An admin operation that waits for another process off the engine thread: the transfer
    group's set-up (every rank joins) and an update's begin frame (the trainer's senders come),
    each bounded by its timeout (weight_receiver.py, weight_transfer/pending.py). The loop that
    started it keeps stepping and answering; once the wait ended (``when_done`` tells, from
    another thread) it calls ``settle()`` on the engine thread between two steps, which finishes
    the operation there (an update's buckets are copied then, never under a running step) and
    gives its (status, body) as ``run_admin_op`` would. Under TP every rank settles when rank 0
    does (``follow_rank0``)."""

    def __init__(self, engine, pending: PendingTransfer, op: str, args: dict):
        self.engine, self.pending, self._args = engine, pending, args
        self.key = op if "lora_name" not in args else f"{op}:{args['lora_name']}"
        """What the loops tell the other TP ranks to settle (adapters of different names load at once)."""

    def done(self) -> bool:
        return self.pending.done()

    def when_done(self, callback: Callable[[], None]) -> None:
        self.pending.when_done(callback)

    def settle(self) -> tuple[int, dict]:
        """The outcome; waits (bounded) for the wait to end if it has not."""
        return run_guarded(self.engine, lambda: _with_body_error(self._args, self.pending.finish))


def _set_generation_epoch(engine, args: dict) -> None:
    """The version stamped on every token from now on (the KV of running requests is kept)."""
    epoch = args.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
    engine.set_weight_version(epoch, recompute_kv=False)


ADMIN_OPS: dict[str, Callable[[Any, Callable[..., int] | None, dict], Any]] = {
    "pause_generation": lambda engine, _, args: engine.pause_generation(**args),
    "resume_generation": lambda engine, _, args: engine.resume_generation(),
    "update_weights": lambda _, update_weights, args: update_weights(args["path"], version=args.get("version")),
    "suspend": lambda engine, _, args: engine.suspend(**args),
    "resume": lambda engine, _, args: engine.resume(**args),
    "set_generation_epoch": lambda engine, _, args: _set_generation_epoch(engine, args),
    "init_weight_transfer": lambda engine, _, args: engine.weights.start_init(**args),
    "update_weights_from_distributed": lambda engine, _, args: _distributed(engine, args),
    "update_weights_from_ipc": lambda engine, _, args: engine.update_weights_from_ipc(**args),
    "destroy_weight_transfer": lambda engine, _, args: engine.destroy_weight_transfer(),
    "abort_requests": lambda engine, _, args: engine.abort_requests(args.get("request_ids")),
    "load_lora_adapter": lambda engine, _, args: _load_lora(engine, args),
    "unload_lora_adapter": lambda engine, _, args: _unload_lora(engine, args),
    "update_lora_from_distributed": lambda engine, _, args: _lora_distributed(engine, args),
    "update_lora_from_ipc": lambda engine, _, args: engine.update_lora_from_ipc(args["lora_name"], args["handles"]),
}
"""Operation name (also its HTTP route: POST /NAME) -> what it runs. The server's route checks
give the engine methods' keyword arguments (a missing one: the engine's default). The transfer
group's set-up and distributed updates start here and end in a ``Deferred``."""


def engine_status(engine) -> dict:
    return {"paused": engine.is_paused, "suspended": sorted(engine.memory.suspended),
            "weight_version": engine.weight_version}


def engine_counters(engine) -> dict:
    """The engine's ``EngineStats`` counters (its scalar fields) as plain values."""
    stats = engine.stats
    return {f.name: v for f in dataclasses.fields(stats)
            if isinstance(v := getattr(stats, f.name), (int, float)) and not isinstance(v, bool)}


def run_admin_op(engine, update_weights: Callable[..., int] | None, op: str, args: dict
                 ) -> tuple[int, dict] | Deferred:
    """(200, the engine's state) once ``op`` ran; 400 for bad input (WeightUpdateError is a
    ValueError), 409 for an operation the engine's state refuses (wrong order, not paused, a
    transfer-group operation in progress) or that failed (a transfer group not set up within its
    timeout, senders that never began: the message names the address, the port and the timeout),
    never a 5xx. An operation that waits for another process returns a ``Deferred`` instead."""
    from megatron_async.weight_transfer.pending import PendingTransfer  # the engine's process: torch is there

    if "engines" in args:
        if op not in JOINS_BEGIN_FRAME:
            return 400, error_body(ENGINES_REFUSED, 400)
        args = {"metadata": None, "body_error": ENGINES_REFUSED}
    started = []
    status, body = run_guarded(engine, lambda: started.append(ADMIN_OPS[op](engine, update_weights, args)))
    if started and isinstance(started[0], PendingTransfer):
        return Deferred(engine, started[0], op, args)
    return status, body


def run_engine_op(engine, op: str, args: dict, update_weights: Callable[..., int] | None = None
                  ) -> tuple[int, dict] | Deferred:
    """A data-parallel coordinator's control operation (coordinator/controls.py) on this engine:
    the admin operations (the refit ones included), and ``stats`` (its ``EngineStats`` counters)."""
    if op == "stats":
        return 200, engine_counters(engine)
    if op not in ADMIN_OPS:
        return 400, error_body(f"unknown operation {op!r}", 400)
    return run_admin_op(engine, update_weights, op, args)


def run_guarded(engine, action: Callable[[], Any]) -> tuple[int, dict]:
    """``action()``'s outcome as (status, body): see ``run_admin_op``."""
    try:
        action()
        return 200, engine_status(engine)
    except OpRefused as e:
        return e.status, error_body(str(e), e.status)
    except (ValueError, TypeError, OSError) as e:  # OSError: a checkpoint path that cannot be read
        return 400, error_body(str(e), 400)
    except Exception as e:  # noqa: BLE001 -- reported to the caller, the loop keeps serving: never a 5xx
        if not isinstance(e, (RuntimeError, NotImplementedError)):
            log.exception("admin operation failed")
        return 409, error_body(f"{type(e).__name__}: {e}", 409)


def follow_rank0(engine, communicator, update_weights: Callable | None = None) -> None:
    """A tensor-parallel rank > 0 (of the HTTP server or of an engine serving a coordinator): step
    whenever rank 0's loop steps (the engine receives rank 0's new requests and aborts inside
    ``step``), run the operations every rank runs (``EVERY_RANK_OPS``: weight updates, transfers,
    suspend / resume) when rank 0 does, settle a ``Deferred`` one when rank 0 settles its own
    (``("settle", op)``: between the same two steps on every rank), until rank 0 says stop."""
    deferred: dict[str, Deferred] = {}
    while True:
        command = communicator.broadcast_object(None)
        if command == "stop":
            return
        if command == "step":
            engine.step()
        elif isinstance(command, list) and command[0] == "hold":  # (a tuple arrives as a list)
            engine.scheduler.hold(command[1])
        elif isinstance(command, list) and command[0] in ("admin", "settle"):
            if command[0] == "admin":
                outcome = run_admin_op(engine, update_weights, command[1], command[2])
                if isinstance(outcome, Deferred):
                    deferred[outcome.key] = outcome
                    continue
            elif command[1] in deferred:
                outcome = deferred.pop(command[1]).settle()
            else:  # this rank refused it when it started (and said so then)
                continue
            status, body = outcome
            if status != 200:
                log.warning("admin operation %s on this rank: %s", command[1], body)
