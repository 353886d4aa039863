#!/usr/bin/env python3
"""Data-plane benchmark: KV pages between two processes, side by side with baselines.

The code is the package ``tools/bench/transfer/`` (what is measured: its ``__init__``);
this script runs it, as ``python -m tools.bench.transfer`` does.

    python tools/bench_transfer.py [--cross-host] [--json] [--plot out.png] [--reps N] ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench.transfer.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
