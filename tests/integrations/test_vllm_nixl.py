"""kvstate's connector beside vLLM's NixlConnector under the same harness: how long the
prefill engine keeps a request's blocks after each kind of abort. NixlConnector's
scheduler side runs here as it does in vLLM (NIXL itself is not installed, so its
workers are not run: its hold is the lease deadline its scheduler hands them, which
only a notification from the decode's NIXL worker cuts short). Prints docs/vllm.md's
table rows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.vllm_rig import module_redis, prompt

pytestmark = pytest.mark.vllm


url = pytest.fixture(scope="module")(module_redis)


@pytest.fixture(scope="module")
def engines(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec, write_model

    model = write_model(tmp_path_factory.mktemp("model"))
    specs = {
        "kv-p": Spec("kv_producer", "cmp-p", url, model, chunk=16),
        "kv-d": Spec("kv_consumer", "cmp-d", url, model),
        "nixl-p": Spec("kv_producer", "nixl-p", url, model, chunk=16, connector="NixlConnector"),
        "nixl-d": Spec("kv_consumer", "nixl-d", url, model, connector="NixlConnector"),
    }
    out = dict(zip(specs, start(list(specs.values())), strict=True))
    yield out
    for e in out.values():
        e.close()


def kvstate_hold(p: Any, until_freed: Any) -> tuple[float, int]:
    from tests.integrations.vllm_engine import drive

    t0 = time.monotonic()
    steps = drive([p], until_freed, max_steps=50)
    return time.monotonic() - t0, steps


def nixl_lease(p: Any, rid: str) -> float:
    """The deadline NixlConnector's scheduler gave its workers for ``rid``'s blocks."""
    meta = p.meta
    return float(meta.reqs_to_send[rid] - meta.scheduler_clock)


def test_block_hold_after_each_kind_of_abort(engines: dict[str, Any]) -> None:
    from tests.integrations.vllm_engine import prefill, settle

    kp, kd, np_, nd = (engines[k] for k in ("kv-p", "kv-d", "nixl-p", "nixl-d"))
    rows = []

    # 1. the decode aborts a request still queued there (never scheduled)
    params = prefill(kp, "q", prompt(1, 14))
    kd.add("q", prompt(1, 14), 4, params)
    kd.abort("q")
    k_s, k_steps = kvstate_hold(kp, lambda: kp.held() == 0)
    nparams = prefill(np_, "q", prompt(1, 14))
    np_.step()
    lease = nixl_lease(np_, "q")
    nd.add("q", prompt(1, 14), 4, nparams)
    nd.abort("q")
    nd.step()
    [(rid, req)] = nd.meta.reqs_to_recv.items()  # an empty read: "free them" to P
    assert rid == "q" and not any(req.local_block_ids)
    assert np_.held() > 0  # until that notification, or the lease
    rows.append(("decode abort, request queued on the decode", k_s, k_steps, lease))

    # 2. the decode aborts a request whose load started (published / reading)
    params = prefill(kp, "l", prompt(2, 14))
    kp.step()
    kd.add("l", prompt(2, 14), 4, params)
    kd.step()
    kd.abort("l")
    kd.step()
    k_s, k_steps = kvstate_hold(kp, lambda: kp.held() == 0)
    nparams = prefill(np_, "l", prompt(2, 14))
    np_.step()
    lease = nixl_lease(np_, "l")
    nd.add("l", prompt(2, 14), 4, nparams)
    nd.step()
    nd.abort("l")
    rows.append(("decode abort, load started", k_s, k_steps, lease))

    # 3. the prefill aborts a request mid-prefill (chunk 1 of 3): both free at once
    for p in (kp, np_):
        before = p.held()
        p.add("a", list(range(40)), 1, {"do_remote_decode": True})
        p.step()
        p.abort("a")
        assert p.held() == before and "a" not in p.params
    rows.append(("prefill abort, mid-prefill", 0.0, 0, 0.0))

    settle(kp, kd)
    assert kp.problems() == [] and kd.problems() == []
    print("\n| abort | kvstate: prefill holds | NixlConnector: prefill holds |")
    for what, s, steps, nixl in rows:
        n = f"{nixl:.0f} s lease unless D's worker notifies" if nixl else "0 (freed at once)"
        print(f"| {what} | {s * 1000:.0f} ms, {steps} step(s) | {n} |")
    assert all(steps <= 2 for _, _, steps, _ in rows)
    assert all(n == pytest.approx(30.0, abs=1.0) for _, _, _, n in rows[:2])
