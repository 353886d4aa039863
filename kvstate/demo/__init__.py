"""``kvstate demo``: the end-to-end run, as a package (see ``command``)."""

from kvstate.demo.command import (
    Job,
    Result,
    _cuda_backend,
    _Track,
    decode_worker,
    demo,
    expected_pages,
    prefill_worker,
)

__all__ = ["Job", "Result", "decode_worker", "demo", "expected_pages", "prefill_worker"]
__all__ += ["_Track", "_cuda_backend"]
