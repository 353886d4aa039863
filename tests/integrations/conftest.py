"""Integration tests need their stack installed; without it they are skipped, so the
core suite stays fast (CI installs the extras in their own venvs)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, module, how in (
        ("sglang", "sglang", 'see README "SGLang backend"'),
        ("vllm", "vllm", "see .ci/run"),
    ):
        try:
            __import__(module)
        except ImportError:
            skip = pytest.mark.skip(reason=f"{module} not installed: {how}")
            for item in items:
                if item.get_closest_marker(marker) is not None:
                    item.add_marker(skip)
