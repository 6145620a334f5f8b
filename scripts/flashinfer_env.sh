# Sourced on the GPU machine from the project root (after carrying .fi and .whl, see
# scripts/flashinfer_pack.sh): FlashInfer unpacked into /tmp/fisite, importable, its JIT builds
# under /tmp/fiws (a kept build in .fi/cache/.cache copied there first).
mkdir -p /tmp/fisite && tar -xJf .fi/fi_trim.tar.xz -C /tmp/fisite
python -m pip install -q --no-index --no-deps --target /tmp/fisite .fi/*.whl .whl/apache_tvm_ffi-*.whl .whl/click-*.whl \
  2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/fisite:${PYTHONPATH:-} PATH=/tmp/fisite/bin:$PATH
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
if [ -d .fi/cache/.cache ]; then mkdir -p /tmp/fiws && cp -r .fi/cache/.cache /tmp/fiws/; fi
