"""The subcommands of ``python -m benchmarks``, one module each."""
