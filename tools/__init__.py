"""Benchmarks and development scripts (not part of the kvstate wheel).

The benchmarks live in ``tools.bench`` as small modules; ``tools/bench_state.py`` and
``tools/bench_transfer.py`` are their entry scripts, as docs/development.md runs them.
"""
