"""Helpers only tests use (tiny checkpoints of other families, references, chat templates)."""
