"""``python -m tools.bench.transfer``: the same as ``python tools/bench_transfer.py``."""

import sys

from tools.bench.transfer.cli import main

if __name__ == "__main__":
    sys.exit(main())
