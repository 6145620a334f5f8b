"""OpenAI-compatible HTTP server: ``python -m megatron_async.serve --model CKPT --port P``."""
