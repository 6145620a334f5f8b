"""What an HTTP front-end process (frontend.py) is told by the engine's process (launch.py): one
JSON document written to the child's stdin pipe and read once before it serves. Plain values
only (no pickle): the tokenizer travels as its ``tokenizer.json`` text and EOS ids, the
secret as hex; keys travel in this pipe, never on a command line."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from megatron_async.serve.http_guard import HttpPolicy


@dataclass
class FrontendConfig:
    index: int
    directory: str
    """The ipc sockets' private directory (ipc.Endpoints)."""
    secret: bytes
    """What the front-end proves to the engine process's bridge (communication/handshake.py)."""
    fd: int
    """Its listening socket, inherited (its own, or the one all front-ends share: launch.bind_group)."""
    parent_pid: int
    model_name: str
    tokenizer: Any
    """models/tokenizer.py's ``Tokenizer``, or None."""
    chat_template: tuple[str, dict] | None
    """(source, special tokens) of the ChatTemplate."""
    max_model_len: int
    max_requests: int
    max_request_bytes: int
    created: int
    tool_call_parser: str | None
    reasoning_parser: str | None
    admin_endpoints: bool
    grammars: tuple | None = None
    """The engine's ``Grammars.settings()`` (None: structured outputs off): the front-end checks
    a request's constraint with a ``Grammars`` of its own."""
    policy: HttpPolicy = HttpPolicy()
    """Keys, limits, TLS."""
    log_level: str = "warning"
    http: str = "auto"
    loop: str = "auto"

    def to_json(self) -> bytes:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        tok = self.tokenizer
        out.update(secret=self.secret.hex(), policy=dataclasses.asdict(self.policy), tokenizer=None if tok is None else {
            "json": tok.backend_tokenizer.to_str(), "eos_token_ids": list(tok.eos_token_ids)})
        return json.dumps(out).encode()

    @classmethod
    def from_json(cls, data: bytes) -> FrontendConfig:
        """``to_json``'s config back (ValueError / TypeError / KeyError for anything else)."""
        fields = json.loads(data)
        if type(fields) is not dict:
            raise ValueError("a front-end's configuration is a JSON object")
        policy = fields.pop("policy")
        policy["allowed_origins"] = tuple(policy["allowed_origins"])
        tok = fields.pop("tokenizer")
        if tok is not None:
            import tokenizers

            from megatron_async.models.tokenizer import Tokenizer

            tok = Tokenizer(tokenizers.Tokenizer.from_str(tok["json"]), tuple(tok["eos_token_ids"]))
        secret, template, grammars = fields.pop("secret"), fields.pop("chat_template"), fields.pop("grammars")
        return cls(**fields, secret=bytes.fromhex(secret), policy=HttpPolicy(**policy), tokenizer=tok,
                   chat_template=None if template is None else tuple(template),
                   grammars=None if grammars is None else (tuple(grammars[0]), *grammars[1:]))
