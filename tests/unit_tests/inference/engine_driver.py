"""Step an engine to the end, collecting outputs and streaming updates (shared by tests)."""


def drive(eng, max_steps: int = 1000):
    """-> (outputs by request id, updates by request id in arrival order)."""
    outs, updates = {}, {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return outs, updates
        res = eng.step()
        for u in res.updates:
            updates.setdefault(u.request_id, []).append(u)
        for o in res.finished:
            assert o.request_id not in outs, "a request finished twice"
            outs[o.request_id] = o
    raise AssertionError("engine made no progress")
