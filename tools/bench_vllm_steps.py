#!/usr/bin/env python3
"""What kvstate's vLLM connector costs a scheduler step, beside NixlConnector's.

The code is the package ``tools/bench/steps/`` (what is measured: its ``__init__``, or
``--help``); this script runs it, as ``python -m tools.bench.steps`` does.

    python tools/bench_vllm_steps.py [--counts 0 1 64 256] [--steps 20] [--forward-ms 0]
        [--layers 2] [--json] [--smoke]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench.steps.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
