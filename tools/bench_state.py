#!/usr/bin/env python3
"""Control-plane benchmark: what a room lifecycle costs the client and Redis.

The code is the package ``tools/bench/state/`` (what is measured: its ``__init__``, or
``--help``); this script runs it, as ``python -m tools.bench.state`` does.

    python tools/bench_state.py [--quick] [--smoke] [--json] [--lifecycles 2000] ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench.state.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
