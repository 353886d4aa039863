"""How a room ended, from what the router saw: each side's result, or the death of its
prefill. The router counts these as rooms finish; the summary reports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstate.demo.messages import INTERRUPTED, Job, Result

__all__ = ["ABORT_KINDS", "OUTCOMES", "Track"]

ABORT_KINDS = ("prefill", "decode", "router")  # who aborts a room when a fault is injected
OUTCOMES = ("done", "failed", "aborted", "killed", "corrupt", "interrupted")


@dataclass
class Track:
    """The router's view of one room: what it dispatched and what each side reported."""

    job: Job
    decode: str
    sent_at: float
    abort: str = ""
    results: dict[str, Result] = field(default_factory=dict)
    prefill_dead: bool = False
    done_at: float = 0.0

    @property
    def complete(self) -> bool:
        return "decode" in self.results and ("prefill" in self.results or self.prefill_dead)

    def outcome(self, killed: str | None) -> str:
        """done, corrupt, interrupted, aborted, killed (its prefill was) or failed."""
        rx, tx = self.results.get("decode"), self.results.get("prefill")
        sides = [r for r in (rx, tx) if r is not None]
        received = rx is not None and rx.status == "Success"
        if rx is not None and received and not rx.verified:
            return "corrupt"
        cut = not self.complete or any(r.reason == INTERRUPTED for r in sides)
        if cut and not (received and tx is not None):
            return "interrupted"
        failed = [r for r in sides if r.status == "Failed"]
        if not failed and (tx is not None or self.prefill_dead):
            return "done" if rx is not None and rx.verified else "failed"
        return self._why_failed(failed, killed)

    def _why_failed(self, failed: list[Result], killed: str | None) -> str:
        if self.abort and any("abort" in r.reason for r in failed):
            return "aborted"
        if killed is not None and self.job.prefill == killed:
            return "killed"
        return "failed"
