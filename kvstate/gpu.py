"""GPU facts for the engine registry, from NVML (``pynvml`` of nvidia-ml-py).

Without a driver or a GPU the answer is an empty list; nothing fails.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_facts() -> list[dict[str, Any]]:
    """One dict per visible GPU: index, name, uuid, pci bus id, memory, NVLink links up."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver, no device: all mean "no GPU facts"
        log.debug("NVML unavailable: %s", exc)
        return []
    try:
        facts = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            links = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 0)):
                try:
                    links += int(pynvml.nvmlDeviceGetNvLinkState(h, link) == 1)
                except pynvml.NVMLError:
                    break
            facts.append(
                {
                    "index": i,
                    "name": _text(pynvml.nvmlDeviceGetName(h)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                    "pci_bus_id": _text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                    "memory_total": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    "nvlinks_up": links,
                }
            )
        return facts
    except Exception as exc:
        log.warning("reading GPU facts failed: %s", exc)
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
