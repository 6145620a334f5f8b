from setuptools import find_packages, setup

SERVE = ["fastapi", "uvicorn", "prometheus-client", "jinja2", "uvloop", "httptools"]  # uvicorn uses the last two when present
REAL = ["gguf", "accelerate", "transformers>=4.50"]
# Grammar libraries of SamplingParams.structured_outputs (xgrammar reads tokenizers through transformers).
STRUCTURED = ["xgrammar==0.2.8", "llguidance==1.9.1", "transformers>=4.50"]
# Megatron-Core as the reference of the refit tests (tests/functional_tests/test_megatron_reference.py,
# the Megatron-Core trainer of examples/rl_megatron_refit.py): it runs on CPU without Transformer-Engine.
MEGATRON = ["megatron-core==0.16.1", "einops"]

setup(
    name="megatron_async",
    version="0.1.0",
    description="Megatron-Core-style dynamic-batching LLM inference with async launch-ahead scheduling",
    packages=find_packages(include=["megatron_async", "megatron_async.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "safetensors", "tokenizers>=0.21", "pyzmq", "msgpack>=1.0"],
    extras_require={
        # The server (python -m megatron_async.serve).
        "serve": SERVE,
        # The real-model checkpoint builder (scripts/fetch_smollm2.py): transformers reads GGUF.
        "real": REAL,
        # Structured outputs (JSON schema, regex, choice, grammar): optional; without them such requests are refused.
        "structured": STRUCTURED,
        "test": ["pytest", "pytest-xdist", "hypothesis", "transformers>=4.50", "peft", "triton", "openai", "jsonschema", *SERVE,
                 *REAL, *STRUCTURED, *MEGATRON],
        "gpu": ["triton"],
        # engine.suspend / resume on CUDA (InferenceConfig.enable_suspend): device memory by tag.
        "suspend": ["torch-memory-saver>=0.0.10"],
        "bench": ["matplotlib", "transformers>=4.50"],
        # install with --no-deps where its pins clash with torch
        "megatron": MEGATRON,
    },
)
