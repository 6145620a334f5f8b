"""Kernel tests run the Triton kernels compiled on CUDA, or in Triton's interpreter on a
CPU-only machine: TRITON_INTERPRET must be set before any kernel module is imported
(``triton.jit`` reads it when the kernels are decorated)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
