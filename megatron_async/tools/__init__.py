"""Shared code of the example main job, the benchmark and the profiler: workloads, the
arrival-driven engine driver, summaries, HF peer runners, GPU idle share and roofline numbers."""
