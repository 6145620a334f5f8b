"""Each component receives the part of ``InferenceConfig`` it reads (``config.cache_sizing()``,
``scheduling()``, ``speculation()``, ``graph_sizing()``, ``kernels()``, ``communication()``,
``lora()``) and reads no other component's: checked on the source, like test_import_graph.py."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_async.config import (AttentionBackend, CacheSizing, Communication, GraphSizing, InferenceConfig,
                                   KernelChoice, LoRASizing, Scheduling, SpeculativeMethod, Speculation)

ROOT = Path(__file__).resolve().parents[2]
INFERENCE = ROOT / "megatron_async" / "inference"

WHOLE_CONFIG_READERS = {"memory_profiling.py"}
"""Modules of inference/ given the whole InferenceConfig: memory planning sizes a probe context
and runner from it (the LLM, above inference/, is the other one)."""


def _sources(*roots: Path, needle: str = ""):
    """(path, syntax tree) of every Python file under ``roots`` whose text contains ``needle``."""
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if needle in (text := path.read_text()):
                yield path, ast.parse(text)


def foreign_config_reads(tree: ast.Module) -> list[str]:
    """``x.config`` where x is not ``self``: a read of another component's configuration."""
    return [ast.unparse(n) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "config"
            and not (isinstance(n.value, ast.Name) and n.value.id == "self")]


def config_field_writes(tree: ast.Module) -> list[str]:
    """``x.config.field = ...``: changes a built LLM's or component's config, which nothing reads again."""
    targets = [t for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    return [ast.unparse(t) for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and t.value.attr == "config"]


def test_no_component_reads_another_components_config():
    bad = {str(p.relative_to(ROOT)): reads for p, tree in _sources(INFERENCE, needle=".config")
           if (reads := foreign_config_reads(tree))}
    assert not bad, f"reads of another component's config (pass the part it needs instead): {bad}"


def test_only_memory_planning_takes_the_whole_config():
    bad = [str(p.relative_to(ROOT)) for p, tree in _sources(INFERENCE, needle="InferenceConfig")
           if p.name not in WHOLE_CONFIG_READERS and "InferenceConfig" in {
               n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
               a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}]
    assert not bad, f"inference modules given the whole InferenceConfig: {bad}"


def test_nobody_changes_a_built_config():
    roots = ROOT / "megatron_async", ROOT / "tests", ROOT / "scripts", ROOT / "benchmarks"
    bad = {str(p.relative_to(ROOT)): w for p, tree in _sources(*roots, needle=".config.") if (w := config_field_writes(tree))}
    assert not bad, f"components hold frozen parts of the config: set the component's own attribute instead: {bad}"


def test_the_checks_catch_what_they_claim():
    tree = ast.parse("a = self.context.config.max_tokens\nb = ctx.config\nc = self.config.x\nllm.config.seed = 3")
    assert sorted(foreign_config_reads(tree)) == ["ctx.config", "llm.config", "self.context.config"]
    assert config_field_writes(tree) == ["llm.config.seed"]


def test_parts_are_frozen_copies_of_the_config():
    cfg = InferenceConfig(max_requests=8, max_tokens=32, num_speculative_tokens=2, attention_backend="torch",
                          speculative_method="ngram", cuda_graph_batch_sizes=(1, 2))
    parts = [cfg.cache_sizing(), cfg.scheduling(), cfg.speculation(), cfg.graph_sizing(), cfg.kernels(),
             cfg.communication(), cfg.lora()]
    assert [type(p) for p in parts] == [CacheSizing, Scheduling, Speculation, GraphSizing, KernelChoice, Communication,
                                        LoRASizing]
    for part in parts:
        for f in dataclasses.fields(part):
            assert getattr(part, f.name) == getattr(cfg, f.name), f.name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, dataclasses.fields(part)[0].name, None)
    assert cfg.cache_sizing().max_samples == 24 and cfg.kernels().attention_backend is AttentionBackend.TORCH
    assert cfg.speculation().speculative_method is SpeculativeMethod.NGRAM


def test_validate_changes_nothing():
    cfg = InferenceConfig(attention_backend="triton")
    assert cfg.attention_backend is AttentionBackend.TRITON  # normalized at construction
    cfg.mamba_backend = "torch"  # assigned after construction: validate checks it, leaves it
    before = dataclasses.asdict(cfg)
    cfg.validate()
    assert dataclasses.asdict(cfg) == before and cfg.kernels().mamba_backend.value == "torch"
    cfg.sampling_backend = "cuda"
    with pytest.raises(ValueError):
        cfg.validate()
