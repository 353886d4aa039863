"""Where the two processes run: one host, or two network namespaces over a veth pair."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

NETNS_ADDR = ("10.231.0.1", "10.231.0.2")  # sender, receiver: inside the namespaces only


@dataclass(frozen=True)
class Site:
    """Where the two processes run: their network namespaces and addresses."""

    mode: str  # "same-host" or "cross-host"
    tx_ns: str = ""
    rx_ns: str = ""
    tx_addr: str = "127.0.0.1"
    rx_addr: str = "127.0.0.1"
    note: str = ""


def enter_netns(name: str) -> None:
    """Move this (still single-threaded) process into network namespace ``name``.

    As ``ip netns exec`` does, /sys is remounted in a private mount namespace:
    UCX finds its network devices under /sys/class/net, which otherwise still
    shows the host's devices.
    """
    if not name:
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, 0x40000000), f"setns into {name}")  # CLONE_NEWNET
    finally:
        os.close(fd)
    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, 0x4000 | 0x80000, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", 2), "umount /sys")  # MNT_DETACH
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


@contextlib.contextmanager
def cross_host_site() -> Iterator[Site]:
    """Two network namespaces joined by a veth pair, removed on exit; loopback if not."""
    tag = f"kvb{os.getpid()}"
    rx_ns, tx_ns = f"{tag}rx", f"{tag}tx"
    made: list[str] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        try:
            if shutil.which("ip") is None:
                raise OSError("no `ip` command")
            for ns in (tx_ns, rx_ns):
                ip("netns", "add", ns)
                made.append(ns)
            ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
            for ns, dev, addr in (
                (tx_ns, f"{tag}a", NETNS_ADDR[0]),
                (rx_ns, f"{tag}b", NETNS_ADDR[1]),
            ):
                ip("link", "set", dev, "netns", ns)
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
            site = Site(
                "cross-host",
                tx_ns,
                rx_ns,
                NETNS_ADDR[0],
                NETNS_ADDR[1],
                f"two network namespaces over a veth pair ({NETNS_ADDR[0]} -> "
                f"{NETNS_ADDR[1]}, MTU 1500), CMA off, UCX_TLS=tcp",
            )
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            reason = err.decode(errors="replace").strip() or str(exc)
            site = Site(
                "cross-host",
                note=f"network namespaces unavailable ({reason}): "
                "loopback with CMA off, UCX_TLS=tcp",
            )
        yield site
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def site(mode: str) -> contextlib.AbstractContextManager[Site]:
    """The site of a mode: namespaces made for cross-host (and removed after), none else."""
    if mode == "cross-host":
        return cross_host_site()
    return contextlib.nullcontext(Site("same-host", note="one host, loopback / shared memory"))
