from setuptools import find_packages, setup

setup(
    name="megatron_async",
    version="0.1.0",
    description="Megatron-Core-style dynamic-batching LLM inference with async launch-ahead scheduling",
    packages=find_packages(include=["megatron_async", "megatron_async.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "safetensors", "tokenizers", "pyzmq"],
    extras_require={
        "test": ["pytest", "hypothesis", "transformers>=4.50", "triton"],
        "gpu": ["triton"],
        "bench": ["matplotlib", "transformers>=4.50"],
    },
)
