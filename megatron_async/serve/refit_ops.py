"""The refit admin operations (routes: refit_routes.py), run on the engine thread between two
steps by admin_ops.py; plain names and arguments, so a front-end process or rank 0 of a TP server
can ask for one. No web framework here: the follower ranks of a TP server import it."""
from __future__ import annotations

from typing import Any, Callable

EVERY_RANK_OPS = frozenset({"update_weights", "suspend", "resume", "init_weight_transfer",
                            "update_weights_from_distributed", "update_weights_from_ipc", "destroy_weight_transfer",
                            "set_generation_epoch"})
"""Admin operations every TP rank runs (each holds its own shard and memory); pause / resume and
aborts reach the other ranks through the engine's per-step exchange."""


def _distributed(engine, args: dict) -> Any:
    """Joins the begin frame even for a refused body (``body_error``), so no sender waits."""
    try:
        return engine.update_weights_from_distributed(args.get("metadata"), args.get("version"),
                                                      args.get("recompute_kv", True))
    except ValueError:
        if "body_error" in args:
            raise ValueError(args["body_error"]) from None
        raise


REFIT_OPS: dict[str, Callable[[Any, Any, dict], Any]] = {
    "init_weight_transfer": lambda engine, _, args: engine.init_weight_transfer(**args),
    "update_weights_from_distributed": lambda engine, _, args: _distributed(engine, args),
    "update_weights_from_ipc": lambda engine, _, args: engine.update_weights_from_ipc(**args),
    "destroy_weight_transfer": lambda engine, _, args: engine.destroy_weight_transfer(),
    "abort_requests": lambda engine, _, args: engine.abort_requests(args.get("request_ids")),
}
"""Operation (also its route) -> what it runs (admin_ops.py registers them)."""
