"""The targets as ratios of medians within one run, against each peer's best setting."""

from __future__ import annotations

from typing import Any


def best_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode, case and peer family: the fastest setting's row key and median GB/s."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if not r["family"]:
            continue
        key = f"{r['mode']} {r['case']} {r['family']}"
        if key not in out or r["gbps"] > out[key]["gbps"]:
            out[key] = {"system": r["system"], "label": r["label"], "gbps": r["gbps"]}
    return out


def ratios_of(
    rows: list[dict[str, Any]],
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """The targets (issues 13 and 22) as ratios of medians in this run, against each
    peer's best setting; and kvstate's ratio to every other row, setting by setting."""
    best = best_of(rows)

    def kv(mode: str, system: str, case: str) -> float | None:
        hits = [
            float(r["gbps"])
            for r in rows
            if r["mode"] == mode and r["system"] == system and r["case"] == case
        ]
        return hits[0] if hits else None

    def peer(mode: str, family: str, case: str) -> float | None:
        hit = best.get(f"{mode} {case} {family}") or best.get(f"{mode} one message {family}")
        return float(hit["gbps"]) if hit else None

    out: dict[str, float | None] = {}

    def ratio(key: str, a: float | None, b: float | None) -> None:
        out[key] = round(a / b, 3) if a and b else None

    targets = (
        ("nixl", "NIXL (best setting)", "[>= 1.0]"),
        ("mooncake", "Mooncake (best lane count)", "[>= 1.0]"),
        ("ucxx", "raw ucxx one message", "[>= 0.8]"),
        ("socket", "plain socket", ""),
    )
    for case in ("contiguous", "fragmented"):
        x = kv("cross-host", "kvstate-ucx", case)
        if x is not None:
            for family, name, bound in targets:
                ratio(
                    f"cross-host {case}: kvstate UCX / {name}  {bound}".rstrip(),
                    x,
                    peer("cross-host", family, case),
                )
        x = kv("same-host", "kvstate-cma", case)
        if x is not None:
            ratio(
                f"same host {case}: kvstate CMA / memcpy (timed in turn)  [>= 0.9]",
                x,
                peer("same-host", "memcpy", case),
            )
            ratio(
                f"same host {case}: kvstate CMA / memcpy alone after the run",
                x,
                peer("same-host", "memcpy-alone", case),
            )
            for family, name, bound in targets:
                bound = {"ucxx": "[>= 0.9]", "mooncake": "[>= 1.0]"}.get(family, bound)
                ratio(
                    f"same host {case}: kvstate CMA / {name}  {bound}".rstrip(),
                    x,
                    peer("same-host", family, case),
                )
            ratio(
                f"same host {case}: kvstate UCX path / NIXL (best setting)",
                kv("same-host", "kvstate-ucx", case),
                peer("same-host", "nixl", case),
            )
    each: dict[str, float | None] = {}
    for r in rows:
        if not r["family"]:
            continue
        mine = "kvstate-ucx" if r["mode"] == "cross-host" else "kvstate-cma"
        for case in ("contiguous", "fragmented"):
            if r["case"] not in (case, "one message"):
                continue
            x = kv(r["mode"], mine, case)
            key = f"{r['mode']} {case}: {mine} / {r['system']}"
            each[key] = round(x / r["gbps"], 3) if x and r["gbps"] else None
    return out, each
