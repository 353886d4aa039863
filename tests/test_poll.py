"""KVPoll and PollResults without a server: the status values SGLang compares against,
what parse() accepts and refuses, and poll_many's answer reading as a plain dict."""

from __future__ import annotations

import pytest

from kvstate import KVPoll
from kvstate.errors import InvalidStatusError, StateConnectionError
from kvstate.poll import PollResults


def test_values_order_and_terminal() -> None:
    assert [int(s) for s in KVPoll] == [0, 1, 2, 3, 4]  # SGLang's numbering
    assert KVPoll.Failed < KVPoll.Bootstrapping < KVPoll.Success  # forward means larger
    assert {s for s in KVPoll if s.terminal} == {KVPoll.Failed, KVPoll.Success}


@pytest.mark.parametrize("status", list(KVPoll))
def test_parse_accepts_member_value_and_name(status: KVPoll) -> None:
    for form in (status, int(status), status.name, status.name.encode()):
        assert KVPoll.parse(form) is status


@pytest.mark.parametrize(
    "bad", [True, False, None, 5, -1, 2.0, "failed", "Done", b"\xff", "", [1], KVPoll]
)
def test_parse_refuses_everything_else(bad: object) -> None:
    with pytest.raises(InvalidStatusError, match="expected one of Failed, Bootstrapping"):
        KVPoll.parse(bad)


def test_poll_results_read_as_a_dict_with_errors_aside() -> None:
    ok = PollResults({1: KVPoll.Success, 2: KVPoll.Transferring})
    assert ok == {1: KVPoll.Success, 2: KVPoll.Transferring} and ok.errors == {}
    down = StateConnectionError("node 127.0.0.1:7001 did not answer")
    partial = PollResults([(1, KVPoll.Failed)], errors={3: down})
    assert dict(partial) == {1: KVPoll.Failed} and 3 not in partial  # unknown, not Failed
    assert partial.errors == {3: down}
    assert "errors={3:" in repr(partial) and "Failed" in repr(partial)
