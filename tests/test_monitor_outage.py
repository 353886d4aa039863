"""`kvstate monitor` across a Redis outage that spans its start (issue 31 item 2): it
serves `kvstate_up 0` instead of exiting 2, says when Redis is back, stamps each line
with the time, and its labelled counters have a 0 sample from the start. The monitor
runs as a user runs it (the console script), against a real redis-server killed and
restarted, scraped over HTTP."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvstate.testing import RedisProcess
from tests.helpers import demo_env, scaled, wait_for

KVSTATE_BIN = Path(sys.executable).with_name("kvstate")
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text: str = r.read().decode()
        return text


def _sample(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_monitor_outlives_an_outage_that_spans_its_start(
    redis_server_factory: Callable[..., RedisProcess], tmp_path: Path
) -> None:
    proc = redis_server_factory(port="auto")
    url = proc.tcp_url
    proc.kill()  # down before the monitor starts
    err_path = tmp_path / "err"
    with err_path.open("w") as err_file:
        mon = subprocess.Popen(
            [str(KVSTATE_BIN), "--url", url, "monitor", "--interval", "200ms"]
            + ["--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--json"],
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            env=demo_env(),
            stdin=subprocess.DEVNULL,
        )
    try:
        # it did not exit 2: it serves kvstate_up 0 and says why, with the time
        assert wait_for(lambda: "metrics on http://127.0.0.1:" in err_path.read_text(), 30), (
            err_path.read_text(),
            mon.poll(),
        )
        assert mon.poll() is None, err_path.read_text()
        port = int(re.findall(r"127\.0\.0\.1:(\d+)/metrics", err_path.read_text())[0])
        assert wait_for(lambda: "unreachable at start" in err_path.read_text(), 30)
        down = _scrape(port)
        assert _sample(down, "kvstate_up") == 0.0, down
        assert (_sample(down, "kvstate_monitor_sweep_failures_total") or 0) >= 1
        # labelled counters have their 0 from the start (the dashboard's panel showed
        # "No data" and increase() missed the first reap)
        assert _sample(down, 'kvstate_rooms_reaped_total{status="Bootstrapping"}') == 0.0
        assert _sample(down, 'kvstate_participants_reaped_total{side="rx",status="Success"}') == 0.0

        proc.restart()  # Redis comes back: the monitor connects and says so
        assert wait_for(lambda: "is back after" in err_path.read_text(), scaled(30))
        assert wait_for(lambda: _sample(_scrape(port), "kvstate_up") == 1.0, scaled(30))

        proc.kill()  # and a later outage: down, then back, each said once
        assert wait_for(lambda: _sample(_scrape(port), "kvstate_up") == 0.0, scaled(30))
        assert wait_for(
            lambda: "kvstate monitor: Redis unreachable: " in err_path.read_text(), scaled(30)
        )
        proc.restart()
        assert wait_for(lambda: "failed sweep(s))" in err_path.read_text(), scaled(30))
        assert wait_for(lambda: _sample(_scrape(port), "kvstate_up") == 1.0, scaled(30))
        mon.send_signal(signal.SIGINT)
        mon.communicate(timeout=scaled(30))
    finally:
        if mon.poll() is None:
            mon.kill()
            mon.wait()
    assert mon.returncode == 130, err_path.read_text()
    lines = [line for line in err_path.read_text().splitlines() if line.strip()]
    assert lines and all(STAMP.match(line) for line in lines), lines
    text = "\n".join(lines)
    assert "connect(url=" not in text and "--url or $KVSTATE_REDIS_URL" in text, text
    assert text.count("Redis unreachable at start") == 1
    assert text.count("kvstate monitor: Redis unreachable: ") == 1
