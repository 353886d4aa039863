"""The systems compared: kvstate's paths, raw ucxx, the peers, a socket, memcpy."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

# How to install each optional peer (docs/development.md). No pip extra does:
# NIXL's requirements pull a torch built for CUDA 13, which breaks kvstate[ucx]'s CUDA 12
# build (ucxx-cu12); --no-deps leaves the [test] environment as it is.
INSTALL = {
    "nixl": "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1",
    "mooncake": "pip install mooncake-transfer-engine-non-cuda, with libibverbs1 from apt",
}


@dataclass(frozen=True)
class System:
    """One row group of the report: who moves the bytes, and with which settings."""

    key: str
    label: str
    kind: str  # receiver/sender implementation
    path: str = "-"  # for kvstate: which path the row measures (CMA or UCX)
    env: dict[str, str] = field(default_factory=dict)
    module: str = ""  # optional peer: skipped with a note when not importable
    nixl_error_handling: str = "none"  # NIXL's ucx_error_handling_mode
    family: str = ""  # the peer a ratio compares with: the best of its settings counts

    def settings(self) -> dict[str, str]:
        """What this row was run with, for the JSON (environment and peer options)."""
        out = dict(self.env)
        if self.kind == "nixl":
            out["ucx_error_handling_mode"] = self.nixl_error_handling
        return out


#: NIXL with the UCX TCP segment sizes kvstate exports by default (transports.ucx.settings)
KVSTATE_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "512K"}


def systems(
    mode: str, lanes: list[int], extras: tuple[tuple[str, dict[str, str]], ...] = ()
) -> list[System]:
    """The systems a mode compares. Peers run with every setting that was their best in
    some run here: NIXL with error handling off and on, each with UCX's own TCP
    segment sizes and with kvstate's; Mooncake at every lane count in ``lanes``.
    Ratios take each peer's best setting in the run; the rows show them all."""
    cross = mode == "cross-host"
    tcp = {"UCX_TLS": "tcp"} if cross else {}
    # Raw ucxx tuned: put_zcopy rendezvous beat the default scheme over TCP (facts file and
    # a sweep here); blocking progress beat polling on 2 loaded cores; kvstate's TCP segment
    # defaults apply (it runs on the transport's UCX thread).
    # The one message takes UCX's rendezvous: ucxx's own threshold (8192), not the
    # "inf" kvstate's puts run with (transports.ucx.settings), which would send it eager.
    tuned = {"UCX_RNDV_SCHEME": "put_zcopy", "KVSTATE_UCX_RNDV_THRESH": "8192"}
    out = []
    if not cross:
        out.append(
            System("kvstate-cma", "kvstate, same host (CMA path, default)", "kvstate", "CMA")
        )
    out.append(
        System(
            "kvstate-ucx",
            "kvstate, UCX put path"
            + (" (default across hosts)" if cross else " (KVSTATE_UCX_CMA=0)"),
            "kvstate",
            "UCX",
            {"KVSTATE_UCX_CMA": "0"} | tcp,
        )
    )
    for name, env in extras:  # --extra: kvstate with other settings, timed in turn
        # UCX path unless the extra turns CMA back on (same host only).
        cma_row = env.get("KVSTATE_UCX_CMA") == "1"
        if cma_row and cross:
            continue  # the namespaces share a kernel: CMA would reach across them
        out.append(
            System(
                f"kvstate-{name}",
                f"kvstate, {'CMA' if cma_row else 'UCX put'} path, "
                + " ".join(f"{k}={v}" for k, v in env.items()),
                "kvstate",
                "CMA" if cma_row else "UCX",
                {"KVSTATE_UCX_CMA": "0"} | tcp | env,
            )
        )
    out += [
        System(
            "ucxx",
            "raw ucxx, one tag message, tuned, error handling off",
            "ucxx",
            env=tuned | tcp,
            family="ucxx",
        ),
        System(
            "ucxx-eh",
            "raw ucxx, one tag message, tuned, error handling on",
            "ucxx",
            env=tuned | tcp,
            family="ucxx",
        ),
    ]
    # NIXL's UCX backend reads the UCX_* variables: error handling off and on (its
    # default; over TCP either was faster in some runs), each with UCX's segment sizes
    # and with kvstate's.
    for eh, eh_label in (("none", "error handling off"), ("peer", "error handling on")):
        for segs, seg_label in (({}, "UCX's TCP segments"), (KVSTATE_SEGMENTS, "256K/512K")):
            out.append(
                System(
                    "nixl" + ("-eh" if eh == "peer" else "") + ("-seg" if segs else ""),
                    f"NIXL 1.5.1, UCX backend, {eh_label}, {seg_label}",
                    "nixl",
                    env=tcp | segs,
                    module="nixl",
                    nixl_error_handling=eh,
                    family="nixl",
                )
            )
    for n in lanes:
        out.append(
            System(
                f"mooncake-{n}",
                f"Mooncake TE, tcp, {n} lane{'s' if n > 1 else ''}",
                "mooncake",
                env={"MC_TCP_LANES_PER_PEER": str(n)},
                module="mooncake",
                family="mooncake",
            )
        )
    out.append(
        System("socket", "plain TCP socket (sendmsg / recv_into)", "socket", family="socket")
    )
    if not cross:
        out.append(
            System(
                "memcpy",
                "numpy memcpy in one process (timed in turn)",
                "memcpy",
                family="memcpy",
            )
        )
    return out


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
