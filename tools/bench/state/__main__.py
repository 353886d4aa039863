"""``python -m tools.bench.state``: the same as ``python tools/bench_state.py``."""

from tools.bench.state.cli import main

if __name__ == "__main__":
    main()
