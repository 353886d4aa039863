#!/usr/bin/env python3
"""Start a local Redis Cluster for development and benchmarks.

    tools/redis_cluster.py start --primaries 3 --replicas 0 [--dir D]
        prints the redis+cluster:// URL, stays in the foreground until Ctrl-C,
        then stops every node.
    tools/redis_cluster.py start --detach --dir D
        prints the URL, writes D/cluster.json and exits; the nodes keep running.
    tools/redis_cluster.py status --dir D
    tools/redis_cluster.py stop --dir D

Only the URL goes to stdout (``URL=$(tools/redis_cluster.py start --detach --dir d)``);
everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

try:
    from kvstate.testing import RedisCluster, RedisServerError, find_redis_server
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvstate.testing import RedisCluster, RedisServerError, find_redis_server

STATE_FILE = "cluster.json"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _is_our_server(pid: int, port: int) -> bool:
    """Whether ``pid`` is still a redis-server on ``port`` (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True  # no /proc (not Linux): trust the state file
    # redis-server rewrites its title to "redis-server 127.0.0.1:PORT [cluster]"
    joined = b" ".join(cmdline)
    return b"redis-server" in joined and str(port).encode() in joined


def cmd_start(args: argparse.Namespace) -> int:
    detach: bool = args.detach
    owned_dir = args.dir is None
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvstate-cluster-"))
    directory.mkdir(parents=True, exist_ok=True)
    state_path = directory / STATE_FILE
    if state_path.exists():
        _say(f"{state_path} exists: a cluster may already run there (stop it first)")
        return 1
    cluster = RedisCluster(
        args.primaries,
        args.replicas,
        directory,
        node_timeout_ms=args.node_timeout,
        binary=args.redis_server,
        die_with_parent=not detach,  # a detached cluster must outlive this command
    )
    started = time.monotonic()
    try:
        cluster.start()
    except RedisServerError as exc:
        _say(f"could not start the cluster: {exc}")
        if owned_dir:
            shutil.rmtree(directory, ignore_errors=True)
        return 1
    _say(
        f"cluster of {args.primaries} primaries x {args.replicas} replicas ready in "
        f"{time.monotonic() - started:.1f} s, redis-server {'.'.join(map(str, cluster.version))},"
        f" ports {', '.join(map(str, cluster.ports))}, dir {directory}"
    )
    print(cluster.url, flush=True)

    if detach:
        state = {
            "url": cluster.url,
            "owned_dir": owned_dir,
            "nodes": [{"pid": n.pid, "port": n.port} for n in cluster.nodes],
        }
        state_path.write_text(json.dumps(state, indent=2) + "\n")
        _say(f"detached; stop with: {sys.argv[0]} stop --dir {directory}")
        return 0

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    _say("Ctrl-C stops the cluster")
    try:
        while all(n.alive for n in cluster.nodes):
            time.sleep(0.5)
        _say("a node exited; stopping the cluster")
        return 1
    except KeyboardInterrupt:
        _say("stopping")
        return 0
    finally:
        cluster.stop()
        if owned_dir:
            shutil.rmtree(directory, ignore_errors=True)


def _load_state(directory: Path) -> dict[str, object] | None:
    try:
        state: dict[str, object] = json.loads((directory / STATE_FILE).read_text())
    except FileNotFoundError:
        _say(f"no {STATE_FILE} in {directory}: nothing detached there")
        return None
    return state


def _nodes(state: dict[str, object]) -> list[tuple[int, int]]:
    nodes = state.get("nodes")
    assert isinstance(nodes, list)
    return [(int(n["pid"]), int(n["port"])) for n in nodes]


def cmd_stop(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    state = _load_state(directory)
    if state is None:
        return 1
    running = [(pid, port) for pid, port in _nodes(state) if _is_our_server(pid, port)]
    for pid, _ in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [(pid, port) for pid, port in running if _is_our_server(pid, port)]
    for pid, _ in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    (directory / STATE_FILE).unlink()
    if state.get("owned_dir"):
        shutil.rmtree(directory, ignore_errors=True)
    _say(f"stopped {len(_nodes(state))} nodes" + (f" ({len(running)} killed)" if running else ""))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import redis

    directory = Path(args.dir)
    state = _load_state(directory)
    if state is None:
        return 1
    print(state["url"])
    healthy = True
    for pid, port in _nodes(state):
        if not _is_our_server(pid, port):
            _say(f"  {port}: not running (pid {pid})")
            healthy = False
            continue
        try:
            with redis.Redis(port=port, socket_timeout=2.0, decode_responses=True) as c:
                role = c.execute_command("ROLE")[0]
                info = c.execute_command("CLUSTER INFO")
                cstate = info.get("cluster_state") if isinstance(info, dict) else "?"
        except redis.RedisError as exc:
            _say(f"  {port}: pid {pid}, not answering ({exc})")
            healthy = False
            continue
        healthy = healthy and cstate == "ok"
        _say(f"  {port}: pid {pid}, {role}, cluster_state:{cstate}")
    return 0 if healthy else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    start = sub.add_parser("start", help="start a cluster")
    start.add_argument("--primaries", type=int, default=3, help="primaries (>= 3; default 3)")
    start.add_argument("--replicas", type=int, default=0, help="replicas per primary")
    start.add_argument("--dir", help="directory for node data and logs (default: temporary)")
    start.add_argument("--detach", action="store_true", help="leave it running and exit")
    start.add_argument("--node-timeout", type=int, default=2000, help="cluster-node-timeout ms")
    start.add_argument(
        "--redis-server", default=None, help=f"binary (default: {_default_binary()})"
    )
    start.set_defaults(func=cmd_start)

    stop = sub.add_parser("stop", help="stop a detached cluster")
    stop.add_argument("--dir", required=True)
    stop.add_argument("--timeout", type=float, default=10.0, help="seconds before SIGKILL")
    stop.set_defaults(func=cmd_stop)

    status = sub.add_parser("status", help="roles and state of a detached cluster's nodes")
    status.add_argument("--dir", required=True)
    status.set_defaults(func=cmd_status)

    args = parser.parse_args(argv)
    if getattr(args, "primaries", 3) < 3:
        parser.error("--primaries must be at least 3")
    rc: int = args.func(args)
    return rc


def _default_binary() -> str:
    try:
        return find_redis_server()
    except RedisServerError:
        return "none found"


if __name__ == "__main__":
    sys.exit(main())
