#!/usr/bin/env bash
# FlashInfer's FA3 prefill kernel for the offline GPU machine, within the device tool's 64 MiB carry:
# flashinfer-python's wheel (62 MB) trimmed to its Python code, its headers (its own, CUTLASS, CCCL,
# spdlog) and the sm90 batch-prefill sources its JIT compiles (11 MB as .tar.xz), plus the small
# wheels it imports (ninja, nvidia-ml-py, tabulate, einops; apache-tvm-ffi and click come with
# scripts/serve_wheels.sh), into ./.fi (git-ignored). Run from the project root:
#   bash scripts/flashinfer_pack.sh
# then carry ".fi" and ".whl", and on the device, before the command:
#   source scripts/flashinfer_env.sh
# which unpacks it into /tmp/fisite and sets PYTHONPATH / FLASHINFER_WORKSPACE_BASE. FlashInfer
# builds the kernel there with nvcc on first use (86 s on 16 cores); a build kept under
# .fi/cache/.cache (copied back from the device's /tmp/fiws/.cache) is reused.
set -euo pipefail
VERSION=0.7.2.post1
root=$(pwd)
work=$(mktemp -d)
mkdir -p .fi
python3 -m pip download -q --no-deps flashinfer-python==$VERSION -d "$work"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .fi \
  ninja==1.13.2 nvidia-ml-py==13.615.71 tabulate==0.10.0 einops==0.8.2
(cd "$work" && python3 -m zipfile -e flashinfer_python-*.whl x >/dev/null && cd x && {
  find flashinfer -path flashinfer/data -prune -o \( -name "*.py" -o -name "*.json" \) -print
  ls flashinfer/data/*.py
  echo flashinfer/data/include
  echo flashinfer/data/cutlass/include
  echo flashinfer/data/cutlass/tools/util/include
  echo flashinfer/data/cccl/cub
  echo flashinfer/data/cccl/libcudacxx/include
  echo flashinfer/data/cccl/thrust
  echo flashinfer/data/spdlog/include
  ls flashinfer/data/csrc/batch_prefill_sm90* flashinfer/data/csrc/*.jinja flashinfer/data/csrc/*.h \
    flashinfer/data/csrc/*.cuh 2>/dev/null || true
} > ../list.txt && tar -cf - -T ../list.txt | xz -T2 -6 > "$root/.fi/fi_trim.tar.xz")
rm -rf "$work"
ls -la .fi
