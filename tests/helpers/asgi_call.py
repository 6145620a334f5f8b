"""One request through an ASGI app in the test's own event loop (no server, no socket): for the
route tests of the HTTP server that need neither a port nor a process. The client stays connected
until the answer is complete, as a real one does (a route that watches for a gone client sees none)."""
from __future__ import annotations

import asyncio
import json


async def call(app, method: str, path: str, body=None) -> tuple[int, dict | None]:
    """(status, the JSON body or None when empty); ``body``: a JSON-able value, raw bytes, or None (empty)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    out, answered = {"body": b""}, asyncio.Event()

    async def receive():
        if messages:
            return messages.pop(0)
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(m):
        if m["type"] == "http.response.start":
            out["status"] = m["status"]
        elif m["type"] == "http.response.body":
            out["body"] += m.get("body", b"")
            if not m.get("more_body", False):
                answered.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("test", 80), "client": ("test", 1)}
    await app(scope, receive, send)
    return out["status"], json.loads(out["body"]) if out["body"] else None


async def post(app, path: str, body=None) -> tuple[int, dict | None]:
    """POST ``body`` (None: an empty JSON object)."""
    return await call(app, "POST", path, {} if body is None else body)


async def get(app, path: str) -> tuple[int, dict | None]:
    return await call(app, "GET", path)
