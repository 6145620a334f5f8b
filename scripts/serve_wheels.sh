#!/usr/bin/env bash
# Downloads, into ./.whl (git-ignored), the wheels that the offline GPU machine lacks for the HTTP
# server and its load test (python 3.12, x86-64): FastAPI / uvicorn / the openai client and what
# they need, plus pyzmq and msgpack (the wire), torch-memory-saver for engine.suspend on CUDA, and the grammar libraries of
# structured outputs (xgrammar with apache-tvm-ffi, llguidance) with jsonschema for their checks, and megatron-core
# for the Megatron-Core reference tests on CUDA (it needs numpy, packaging, torch and einops, all in the GPU image).
# Versions are those the CPU tests run with (torch-memory-saver: the release its Python API was read from). Run from
# the project root:
#   bash scripts/serve_wheels.sh
# then carry ".whl" with the device call; scripts/gpu_load_test.sh installs them there.
set -euo pipefail
mkdir -p .whl
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  annotated-doc==0.0.7 opentelemetry-api==1.45.2 typing-extensions==4.16.0 anyio==4.16.0 idna==3.20
  openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
  pyzmq==27.3.0 msgpack==1.2.4 torch-memory-saver==0.0.10 uvloop==0.23.0 httptools==0.9.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1
  jsonschema==4.26.0 referencing==0.37.0 rpds-py==0.30.0 jsonschema-specifications==2025.9.1 attrs==26.1.0
  megatron-core==0.16.1
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
ls -la .whl
