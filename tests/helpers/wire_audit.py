"""Decoding under watch: an audit hook records every ``pickle.find_class``, ``exec``,
``compile``, ``import``, ``os.system``, ``subprocess.Popen`` and file open for writing while a
wire frame or record is decoded; there must be none (a ``pickle.loads`` planted in a reader fails
at once)."""
from __future__ import annotations

import sys

from megatron_async.inference.communication import wire

_WATCHING = [False]
_SEEN: list[str] = []
_FORBIDDEN = ("pickle.find_class", "exec", "compile", "import", "os.system", "subprocess.Popen", "os.exec",
              "os.posix_spawn", "ctypes.dlopen", "marshal.loads")


def _audit(event, args):
    if _WATCHING[0] and (event in _FORBIDDEN or (event == "open" and len(args) > 1 and args[1] not in (None, "r", "rb"))):
        _SEEN.append(event)


sys.addaudithook(_audit)


def watched(decode, *args):
    """``decode(*args)`` under the audit hook: its result, or the WireError's reason."""
    _SEEN.clear()
    _WATCHING[0] = True
    try:
        return decode(*args)
    except wire.WireError as e:
        return e.reason
    finally:
        _WATCHING[0] = False
        assert not _SEEN, f"decoding executed something: {_SEEN}"
