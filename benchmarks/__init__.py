"""Measurements of megatron_async: benchmarks, load generators, HF peers, rooflines, profilers and
reports, reached through one entry point, ``python -m benchmarks`` (see ``__main__.py``). They import
the package; the package never imports them, and ``pip install`` does not install them."""
