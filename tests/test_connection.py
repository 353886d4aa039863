"""kvstate.store.connection without a server: URL checks and their one-line errors, redaction
(design rule 8), Options and the URL parameters that override them, the per-call
deadline and the retry policy that keeps within it."""

from __future__ import annotations

import ssl
import time
from urllib.parse import quote

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import AuthenticationError

import kvstate
from kvstate.errors import InvalidOptionError, InvalidURLError, KVStateError
from kvstate.store.connection import Options, check_url, effective_options, make_client, redact
from kvstate.store.deadline import (
    DeadlineExceeded,
    deadline,
    is_tls_refusal,
    paused,
    refused_for_maxclients,
    time_left,
)
from tests.helpers import scaled

# --------------------------------------------------------------------------- redaction


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=4, max_size=20))
def test_redact_never_shows_the_password(password: str) -> None:
    secret = quote(password, safe="")
    for before, after in (
        ("redis://:", "@h:6379/0"),
        ("rediss://user:", "@h:6380?ssl_cert_reqs=none"),
        ("redis+cluster://u:", "@10.0.0.1:7000"),
    ):
        assert redact(before + secret + after) == before + "***" + after


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://:pw@h:6379", "redis://:***@h:6379"),
        ("redis://alice:pw@h:6379", "redis://alice:***@h:6379"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("redis://h?password=pw&db=1", "redis://h?password=***&db=1"),
        ("redis://[::1", "<unparseable URL>"),
    ],
)
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


# --------------------------------------------------------------------------- URL checks


@pytest.mark.parametrize(
    "url, cluster",
    [
        ("redis://h:6379", False),
        ("rediss://h:6380/2", False),
        ("unix:///tmp/r.sock", False),
        ("redis+cluster://h:7000", True),
        ("rediss+cluster://h:7000", True),
        ("redis://h:7000?cluster=true", True),
        ("redis://h:7000?cluster=no", False),
    ],
)
def test_check_url_says_whether_it_is_a_cluster(url: str, cluster: bool) -> None:
    assert check_url(url) is cluster


@pytest.mark.parametrize(
    "url, says",
    [
        ("", "non-empty string"),
        ("http://h:1", "unsupported scheme"),
        ("redis://", "has no host"),
        ("redis://h:0", "port 0"),
        ("redis://h:99999", "malformed Redis URL"),
        ("redis://h/notadb", "must be a number"),
        ("redis://h/1?db=2", "names its database twice"),
        ("redis+cluster://h:7000/3", "only database 0"),
        ("unix://", "no socket path"),
        ("unix:///tmp/r.sock?cluster=true", "over TCP, not a unix socket"),
        ("redis://:Secret-pw@h?foo=1", "unknown parameter 'foo'"),
        ("redis://:Secret-pw@h?ssl_ca_certs=/ca.pem", "needs TLS"),
        ("rediss://h?ssl_cert_reqs=maybe", "none, optional or required"),
        ("redis://h?retries=-1", "integer >= 0"),
        ("redis://h?connect_timeout=0", "seconds > 0"),
        ("redis://h?durable=maybe", "use true or false"),
    ],
)
def test_bad_urls_are_one_line_that_hides_the_password(url: str, says: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        check_url(url)
    text = str(info.value)
    assert says in text and "\n" not in text and "Secret-pw" not in text, text


def test_a_non_string_url_is_refused() -> None:
    with pytest.raises(InvalidURLError, match="got int"):
        check_url(6379)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- Options


def test_url_parameters_override_options_field_by_field() -> None:
    base = Options(socket_timeout=9.0, retries=7, call_timeout=20.0)
    got = effective_options("redis://h?socket_connect_timeout=1.5&retries=0&call_timeout=3", base)
    assert (got.connect_timeout, got.retries, got.call_timeout) == (1.5, 0, 3.0)
    assert got.socket_timeout == 9.0  # not in the URL: the caller's
    assert effective_options("redis://h") == Options()
    assert effective_options("redis://h?durable=true").durable is True
    assert effective_options("redis://h?durable=no", Options(durable=True)).durable is False


@pytest.mark.parametrize(
    "field, value",
    [
        ("socket_timeout", 0),
        ("connect_timeout", -1.0),
        ("call_timeout", True),
        ("call_timeout", "8"),
        ("retries", -1),
        ("retries", 1.5),
        ("retries", False),
        ("durable", "yes"),
    ],
)
def test_bad_options_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidOptionError, match=f"Options.{field} must be") as info:
        Options(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, KVStateError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("ttl", [0, -1.0, "900", True])
def test_a_bad_room_ttl_is_refused_before_connecting(ttl: object) -> None:
    with pytest.raises(InvalidOptionError, match="room_ttl must be"):
        kvstate.connect("redis://127.0.0.1:1", room_ttl=ttl)  # type: ignore[arg-type]


def test_make_client_takes_the_url_settings_without_connecting() -> None:
    client = make_client("redis://127.0.0.1:1/3?socket_timeout=2.5&connect_timeout=0.5")
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (2.5, 0.5)
        assert kwargs["db"] == 3
        assert client.connection_pool.connection_class.__name__.startswith("Bounded")
    finally:
        client.close()


# --------------------------------------------------------------------------- deadlines


def test_deadline_bounds_a_block_and_nests_to_the_earlier_end() -> None:
    assert time_left() is None
    with deadline(30.0):
        outer = time_left()
        assert outer is not None and 0 < outer <= 30.0
        with deadline(60.0):  # a longer inner call keeps the outer end
            inner = time_left()
            assert inner is not None and inner <= outer
        with deadline(0.5):  # a shorter one ends first, then the outer holds again
            short = time_left()
            assert short is not None and short <= 0.5
        again = time_left()
        assert again is not None and again > 1.0
    assert time_left() is None


def test_paused_stops_the_call_clock_for_a_block() -> None:
    """What a transport's write takes inside send() does not count against the call's
    Redis time; the time left before the block is left after it."""
    with paused():  # outside a call: nothing to stop
        assert time_left() is None
    with deadline(0.5):
        before = time_left()
        with paused():
            assert time_left() is None
            time.sleep(0.6)  # longer than the whole deadline
        after = time_left()
        assert before is not None and after is not None and 0 < after <= before
    assert time_left() is None


def _attempts(options: Options, exc: Exception, within: float | None = None) -> int:
    calls = 0

    def do() -> None:
        nonlocal calls
        calls += 1
        raise exc

    retry = options.retry()
    with pytest.raises(type(exc)):
        if within is None:
            retry.call_with_retry(do, lambda _: None)
        else:
            with deadline(within):
                retry.call_with_retry(do, lambda _: None)
    return calls


FAST = {"backoff_base": 0.001, "backoff_cap": 0.001}


def test_retry_policy() -> None:
    # a lost connection is tried again, retries + 1 times in all
    assert _attempts(Options(retries=3, **FAST), redis.ConnectionError("reset")) == 4
    # what waiting cannot fix is not retried: a wrong password, a refused TLS handshake
    assert _attempts(Options(retries=3, **FAST), AuthenticationError("WRONGPASS")) == 1
    tls = redis.ConnectionError("Error 1 connecting: [SSL: WRONG_VERSION_NUMBER]")
    assert _attempts(Options(retries=3, **FAST), tls) == 1
    assert _attempts(Options(retries=3, **FAST), DeadlineExceeded("late")) == 1


def test_retries_stop_at_the_deadline() -> None:
    opts = Options(retries=1000, backoff_base=0.01, backoff_cap=0.01)
    t0 = time.monotonic()
    calls = _attempts(opts, redis.ConnectionError("reset"), within=0.2)
    assert calls < 1000 and time.monotonic() - t0 < 0.2 + scaled(5.0)


def test_a_deadline_says_what_was_being_retried() -> None:
    """A server at maxclients answers every new connection with an error, retried until
    the call's time runs out: the DeadlineExceeded raised then carries that error, so
    the message can name the limit instead of only the time."""
    refusals = 0

    def do() -> None:
        nonlocal refusals
        left = time_left()
        if left is not None and left <= 0:
            raise DeadlineExceeded("no answer within the call's time limit")
        refusals += 1
        raise redis.ConnectionError("max number of clients reached")

    with pytest.raises(DeadlineExceeded) as info, deadline(0.2):
        Options(retries=1000, backoff_base=0.01, backoff_cap=0.01).retry().call_with_retry(
            do, lambda _: None
        )
    assert refusals > 1 and refused_for_maxclients(info.value)
    assert not refused_for_maxclients(DeadlineExceeded("late"))


def test_tls_refusal_is_found_in_the_cause_chain() -> None:
    try:
        try:
            raise ssl.SSLError(1, "wrong version number")
        except ssl.SSLError as inner:
            raise redis.ConnectionError("connection lost") from inner
    except redis.ConnectionError as outer:
        assert is_tls_refusal(outer)
    assert is_tls_refusal(redis.ConnectionError("Error 1: [SSL: CERTIFICATE_VERIFY_FAILED]"))
    assert not is_tls_refusal(redis.ConnectionError("Connection refused"))
