"""One POST through an ASGI app in the test's own event loop (no server, no socket): for the route
tests of the HTTP server that need neither a port nor a process."""
from __future__ import annotations

import json


async def post(app, path: str, body=None) -> tuple[int, dict | None]:
    """(status, the JSON body or None when empty); ``body``: a JSON-able value or raw bytes."""
    raw = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    out = {"body": b""}

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m):
        if m["type"] == "http.response.start":
            out["status"] = m["status"]
        elif m["type"] == "http.response.body":
            out["body"] += m.get("body", b"")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("test", 80), "client": ("test", 1)}
    await app(scope, receive, send)
    return out["status"], json.loads(out["body"]) if out["body"] else None
