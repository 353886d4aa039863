"""``python -m tools.bench.steps``: the same as tools/bench_vllm_steps.py."""

from tools.bench.steps.cli import main

main()
