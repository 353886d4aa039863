"""The README's examples are produced by the code they describe: the "Using it" example
runs as written against a real redis-server, and the room shown with redis-cli has
exactly the keys and fields that code writes. The README stays a ten-minute read (at most
400 lines, a contents list that resolves) and no link in it or in docs/ is broken."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import redis

import kvstate
from tests.helpers import scaled

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def _block(text: str, lang: str, after: str = "") -> str:
    text = text[text.index(after) :] if after else text
    match = re.search(rf"```{lang}\n(.*?)```", text, re.S)
    assert match, f"no ```{lang} block"
    return match.group(1)


def test_using_it_example_runs_as_written(tmp_path: Path, redis_tcp_url: str) -> None:
    script = tmp_path / "example.py"
    script.write_text(_block(_section("Using it"), "python"))
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_NAMESPACE"}
    env["KVSTATE_REDIS_URL"] = redis_tcp_url
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(120),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "room 42: 64 pages moved and verified, state cleared" in result.stdout
    with redis.Redis.from_url(redis_tcp_url) as c:
        assert list(c.scan_iter("kvstate:prod:*")) == []  # cleared, leases dropped


def test_using_it_example_without_a_url_stops_naming_the_variable(tmp_path: Path) -> None:
    """Issue 31: without $KVSTATE_REDIS_URL the example fell back to
    redis://127.0.0.1:6379/0 and ran, with no warning, on whatever server was there (or
    failed with "connection refused" naming no variable). It must stop at once, naming
    the variable, before touching any Redis."""
    script = tmp_path / "example.py"
    script.write_text(_block(_section("Using it"), "python"))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KVSTATE_NAMESPACE", "KVSTATE_REDIS_URL", "KVSTATE_REDIS_PASSWORD")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(60),
        cwd=tmp_path,
    )
    assert result.returncode != 0, result.stdout
    assert "InvalidURLError" in result.stderr and "$KVSTATE_REDIS_URL" in result.stderr
    assert "6379" not in _block(_section("Using it"), "python")  # no default server
    assert "pages moved" not in result.stdout


def test_redis_cli_example_matches_what_the_code_writes(redis_url: str) -> None:
    """Make the example's room (receiver published, sender inside send()) and compare the
    key names and the receiver's fields with the README's redis-cli session."""
    text = _block(_section("What a room looks like in Redis"), "console")
    scan = text.split("$ redis-cli --scan", 1)[1].split("$", 1)[0].splitlines()[1:]
    hgetall = text.split("$ redis-cli HGETALL", 1)[1].split("$", 1)[0]
    shown_fields = re.findall(r'\d+\) "([^"]*)"', hgetall)[0::2]

    store = kvstate.connect(redis_url, namespace="prod", room_ttl=900)
    with (
        kvstate.KVManager(store, "prefill", "prefill-a.tp0", "10.0.0.1:8998") as p,
        kvstate.KVManager(store, "decode", "decode-b.tp0", "10.0.0.2:8998") as d,
    ):
        rcv = d.receiver(42, "10.0.0.1:8998")
        rcv.init(np.arange(128, 192), prefix_len=16)
        snd = p.sender(42)
        assert snd.poll() == kvstate.KVPoll.WaitingForInput
        assert snd.begin_transfer() == kvstate.KVPoll.Transferring
        keys = sorted(store.scan(store.keys.room_prefix(42) + "*"))
        raw = store.client.hgetall("kvstate:prod:{42}:rx:decode-b.tp0")
        # since_ms is written only when the receiver's first status change (its
        # publish) falls in another millisecond than its creation (issue 33)
        fields = [k.decode() for k in raw if k != b"since_ms"]
        status = store.client.hget("kvstate:prod:{42}:tx:prefill-a.tp0", "status")
        snd.abort("test over")
        snd.clear()
        rcv.clear()
    store.close()
    assert sorted(scan) == keys, f"README lists {sorted(scan)}, the code writes {keys}"
    assert sorted(shown_fields) == sorted(fields), (
        f"README shows fields {shown_fields}; the code writes {raw!r}"
    )
    assert status == b"Transferring"


DOCS = sorted((ROOT / "docs").glob("*.md"))
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text less its code blocks and code spans: no heading or link is read in code."""
    return _CODE.sub("", _FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the file's headings (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_readme_is_short_with_a_contents_list_that_resolves() -> None:
    lines = README.splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines: move material to docs/"
    contents = _section("Contents")
    targets = [t for t in _LINK.findall(_prose(contents)) if t.startswith("#")]
    assert len(targets) >= 5, contents
    missing = [t for t in targets if t[1:] not in _anchors(ROOT / "README.md")]
    assert not missing, f"README's contents link to no heading: {missing}"
    pages = {t.split("#")[0] for t in _LINK.findall(contents) if t.startswith("docs/")}
    unlisted = {f"docs/{p.name}" for p in DOCS} - pages
    assert not unlisted, f"docs pages missing from README's contents: {sorted(unlisted)}"


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for doc in [ROOT / "README.md", *DOCS]:
        for target in _LINK.findall(_prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:: not checked here
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
