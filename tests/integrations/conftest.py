"""Integration tests need their stack installed; without it they are skipped, so the
core suite stays fast (CI installs the extras in their own venvs)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, module, how in (
        ("sglang", "sglang", "see docs/sglang.md"),
        ("vllm", "vllm", "see .ci/run"),
    ):
        try:
            __import__(module)
        except ImportError:
            skip = pytest.mark.skip(reason=f"{module} not installed: {how}")
            for item in items:
                if item.get_closest_marker(marker) is not None:
                    item.add_marker(skip)


@pytest.fixture(scope="session")
def sglang_pd(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Real SGLang servers for test_sglang_e2e and test_sglang_faults (one start for
    both: each server takes tens of seconds to start on a CPU host): a plain server, a
    kvstate prefill/decode pair and SGLang's router, on their own redis-server."""
    from kvstate.testing.process import RedisProcess
    from tests.integrations.sglang_servers import deploy

    tmp = tmp_path_factory.mktemp("sglang-pd")
    redis_proc = RedisProcess(tmp, unix_socket=False, port="auto")
    redis_proc.start()
    try:
        pd = deploy(tmp, redis_proc.tcp_url)
        try:
            yield pd
        finally:
            for proc in pd.procs():
                proc.stop()
    finally:
        redis_proc.stop()
