"""Integration tests need their stack installed; without it they are skipped, so the
core suite stays fast (CI installs the extras in their own venvs)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import sglang  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="SGLang not installed: pip install -e '.[sglang,test]'")
        for item in items:
            if "sglang" in item.keywords:
                item.add_marker(skip)
