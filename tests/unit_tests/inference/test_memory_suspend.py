"""The suspend backends alone: the emulated one frees and restores the very tensors (same Python
objects, same views); on CUDA without torch-memory-saver the error names the pip package."""
import sys

import pytest
import torch

from megatron_async.inference.memory_suspend import PIP_PACKAGE, EmulatedBackend, TorchMemorySaverBackend
from tests.helpers.requirements import need


def test_emulated_backend_frees_and_restores_the_same_tensors():
    pool = torch.arange(24, dtype=torch.float32).reshape(2, 12)
    view, other = pool[1], torch.ones(3)
    backend = EmulatedBackend()
    backend.release("kv_cache", [pool, view])  # a view of a released storage is counted once
    assert pool.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 12
    backend.restore("kv_cache", [pool, view])
    assert pool.untyped_storage().nbytes() == 96
    pool.copy_(torch.full((2, 12), 7.0))
    assert view.shape == (12,) and torch.equal(view, torch.full((12,), 7.0))  # the view sees the new memory


def test_missing_package_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_memory_saver", None)  # import fails
    with pytest.raises(ImportError, match=f"pip install {PIP_PACKAGE}"):
        TorchMemorySaverBackend()


def test_preload_env_adds_the_library_once():
    need("torch_memory_saver")
    from megatron_async.inference.memory_suspend import preload_env

    env = preload_env({"LD_PRELOAD": "/x/other.so"})
    assert env["LD_PRELOAD"].count("torch_memory_saver") == 1 and env["LD_PRELOAD"].endswith(":/x/other.so")
    assert preload_env(env)["LD_PRELOAD"] == env["LD_PRELOAD"]
