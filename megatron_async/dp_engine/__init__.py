"""An engine serving a data-parallel coordinator: its connection and registration, the
coordinator process an engine job starts for itself (join.py), the serving loop (link.py), final
outputs sent straight to same-host clients (direct_replies.py), and the operations an engine runs
between two steps for any caller, the HTTP server included (engine_ops.py). The web server's
package is no part of it."""
