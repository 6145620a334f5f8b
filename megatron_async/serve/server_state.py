"""What the HTTP API serves with: the engine thread (or its stand-in), the model's name, its
tokenizer and chat template, and the server's limits and options."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron_async.models.chat_template import ChatTemplate
from megatron_async.serve.engine_loop import EngineLoop
from megatron_async.serve.http_guard import PROMPTS_PER_BODY_FACTOR, HttpPolicy



@dataclass
class ServerState:
    engine_loop: EngineLoop
    """The engine thread (engine_loop.py), or in a front-end process its stand-in (frontend.py)."""
    model_name: str
    tokenizer: object | None
    chat_template: ChatTemplate | None
    max_model_len: int
    """Most tokens (prompt + output) a request can reach: max_sequence_length capped by the KV pool."""
    max_requests: int
    """Requests the engine runs at once: the most choices (``n``) one request may ask for."""
    max_request_bytes: int
    """Largest body taken (413 beyond it)."""
    created: int = field(default_factory=lambda: int(time.time()))
    """Server start (Unix seconds): /v1/models' ``created``."""
    tool_call_parser: str | None = None
    """Parses tool calls out of chat answers to requests with tools (None: they stay text)."""
    reasoning_parser: str | None = None
    """Splits chat answers' reasoning sections into ``reasoning_content`` (None: left in content)."""
    admin_endpoints: bool = False
    """Serve the admin endpoints (admin_routes.py); off: 404."""
    grammars: object | None = None
    """The engine's ``structured.grammars.Grammars`` when it runs in this process: request handlers
    compile a request's constraint with it off the event loop (None: the engine checks it)."""
    policy: HttpPolicy = field(default_factory=HttpPolicy)
    """Keys, CORS, body timeout and the other checks every route gets (http_guard.py)."""

    @property
    def prompts_per_body(self) -> int:
        """Most engine requests (prompts x ``n``) one body may ask for; more is a 400."""
        return self.policy.max_prompts_per_body or PROMPTS_PER_BODY_FACTOR * self.max_requests
