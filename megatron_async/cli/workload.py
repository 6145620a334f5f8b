"""Workloads: synthetic random-token prompts or a prompt file, with seeded Poisson arrivals."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: list[int]
    output_len: int
    """Tokens to generate (exact when EOS is ignored)."""
    arrival_step: int = 0
    """Engine step before which the request is added (0 = at the start)."""
    arrival_time: float = 0.0
    """Seconds after the run starts before which the request is not added (wall clock)."""
    prompt_text: str | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len_min: int
    prompt_len_max: int
    output_len_min: int
    output_len_max: int
    arrival_rate: float = 0.0
    """Mean requests arriving per engine step (Poisson); 0 = all arrive at once. Deterministic
    schedules (parity checks); use ``request_rate`` for a serving-like load."""
    seed: int = 0
    request_rate: float = 0.0
    """Mean requests arriving per second of wall clock (Poisson process: exponential gaps,
    the first at t=0, drawn from their own generator so the prompts do not change); 0 = no
    wall-clock pacing."""

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(f"need 1 <= prompt_len_min <= prompt_len_max, got {self.prompt_len_min}..{self.prompt_len_max}")
        if not 1 <= self.output_len_min <= self.output_len_max:
            raise ValueError(f"need 1 <= output_len_min <= output_len_max, got {self.output_len_min}..{self.output_len_max}")
        if self.arrival_rate < 0 or self.request_rate < 0:
            raise ValueError(f"arrival rates must be >= 0, got {self.arrival_rate} per step, {self.request_rate} per s")


def arrival_steps(num_requests: int, rate: float, rng: np.random.Generator) -> list[int]:
    """Non-decreasing arrival steps: Poisson(rate) requests arrive before each step."""
    if rate <= 0:
        return [0] * num_requests
    steps: list[int] = []
    step = 0
    while len(steps) < num_requests:
        steps.extend([step] * int(rng.poisson(rate)))
        step += 1
    return steps[:num_requests]


def arrival_times(num_requests: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Poisson arrivals at ``rate`` requests/s: the first at 0, then exponential gaps."""
    if rate <= 0:
        return [0.0] * num_requests
    gaps = rng.exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def synthetic_workload(spec: WorkloadSpec, vocab_size: int) -> list[WorkloadRequest]:
    """Random-token prompts with uniform lengths; everything drawn from one seeded generator."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prompt_lens = rng.integers(spec.prompt_len_min, spec.prompt_len_max + 1, size=n)
    output_lens = rng.integers(spec.output_len_min, spec.output_len_max + 1, size=n)
    arrivals = arrival_steps(n, spec.arrival_rate, rng)
    times = arrival_times(n, spec.request_rate, np.random.default_rng([spec.seed, 1]))  # prompts stay the same
    return [
        WorkloadRequest(rng.integers(0, vocab_size, size=int(p)).tolist(), int(o), a, t)
        for p, o, a, t in zip(prompt_lens, output_lens, arrivals, times)
    ]


def file_workload(path: str | Path, tokenizer, spec: WorkloadSpec) -> list[WorkloadRequest]:
    """One prompt per non-empty line of ``path``, tokenized; output lengths and arrivals as
    for synthetic prompts. ``spec.num_requests`` caps how many lines are used."""
    if tokenizer is None:
        raise ValueError("--prompt-file needs a tokenizer: pass a checkpoint with tokenizer.json")
    lines = [ln.rstrip("\n") for ln in Path(path).read_text().splitlines() if ln.strip()][: spec.num_requests]
    if not lines:
        raise ValueError(f"{path} has no prompts")
    rng = np.random.default_rng(spec.seed)
    output_lens = rng.integers(spec.output_len_min, spec.output_len_max + 1, size=len(lines))
    arrivals = arrival_steps(len(lines), spec.arrival_rate, rng)
    times = arrival_times(len(lines), spec.request_rate, np.random.default_rng([spec.seed, 1]))
    return [
        WorkloadRequest(tokenizer.encode(text), int(o), a, t, prompt_text=text)
        for text, o, a, t in zip(lines, output_lens, arrivals, times)
    ]


def twin_workload(requests: list[WorkloadRequest], vocab_size: int, seed: int) -> list[WorkloadRequest]:
    """Warm-up twin of a workload: the same prompt and output lengths with fresh random tokens
    (so a prefix cache cannot hit the timed prompts), everything arriving at once. Warming
    every side on it compiles the kernels and captures the graphs the timed shapes need."""
    rng = np.random.default_rng([seed, 0x7717])
    return [WorkloadRequest(rng.integers(0, vocab_size, size=len(r.prompt)).tolist(), r.output_len) for r in requests]
