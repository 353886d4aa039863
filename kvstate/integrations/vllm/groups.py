"""vLLM's KV cache groups (its hybrid KV cache manager): which kvstate moves, and which
of a request's blocks each group keeps.

With the hybrid manager on, a request holds one block list per KV cache group, all
from one block pool whose pages the groups' layers overlay (a block belongs to one
group at a time). What a decode needs of each group:

- full attention (and MLA): every block of the prompt;
- sliding window: the blocks of the last window, ``cdiv(window, block_size) + 1``
  of them (vLLM's own bound); older slots are vLLM's null block (id 0) on the prefill
  (freed) and never read on the decode;
- Mamba (and linear attention): the one block holding the running state (the last,
  before the speculative scratch slots vLLM appends).

The prefill hands the decode its kept blocks' count per group (``kvstate_blocks``);
a decode that has part of the prompt cached needs the last ``min(m, n_g)`` blocks of
group ``g``, where ``m`` is how many new blocks it has in each attention group. It
publishes those blocks, group after group, as one page list; the prefill recovers
``m`` from the list's length (``split``) and sends its blocks in the same order, so
the state core carries one page list whatever the groups. A count no ``m`` gives is
refused (the room fails), never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstate.errors import LayoutRefusedError

NULL_BLOCK = 0  # vLLM's block pool hands out block 0 as its null block, never as a page

MOVES = (
    "full attention, MLA, sliding window and Mamba / linear-attention state groups "
    "(FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, MambaSpec)"
)


@dataclass(frozen=True)
class Group:
    """One KV cache group as both engines must see it: ``kind`` (full, window, state),
    ``keep`` (blocks of a request a decode needs: 0 all of them), ``scratch``
    (speculative slots after a Mamba state) and ``spec`` (vLLM's spec, named with
    what must be equal on both engines)."""

    kind: str
    keep: int
    scratch: int
    spec: str

    def clip(self, ids: Sequence[int]) -> list[int]:
        """The blocks of this group a decode needs, of a request's block list."""
        ids = list(ids)
        if self.kind == "state":
            if self.scratch:
                ids = ids[: max(1, len(ids) - self.scratch)]
            ids = ids[-1:]
        elif self.keep:
            ids = ids[-self.keep :]
        while ids and ids[0] == NULL_BLOCK:  # out of the window on this engine
            ids = ids[1:]
        if NULL_BLOCK in ids:
            raise LayoutRefusedError(
                f"a {self.spec} block list with vLLM's null block inside the blocks a "
                f"decode needs: {ids}"
            )
        return ids


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_of(spec: Any, index: int, layers: Sequence[str]) -> Group:
    """The Group of one KV cache group's spec, or LayoutRefusedError naming it."""
    name = type(spec).__name__  # exact: a subclass may keep other blocks (refused)
    if name == "SlidingWindowSpec":
        window = int(spec.sliding_window)
        keep = _cdiv(window, int(spec.block_size)) + 1
        return Group("window", keep, 0, f"{name}(window {window})")
    if name in ("FullAttentionSpec", "MLAAttentionSpec"):
        return Group("full", 0, 0, name)
    if name == "MambaSpec":
        mode = str(getattr(spec, "mamba_cache_mode", "none"))
        if mode != "none":
            raise _refuse(
                index,
                name,
                layers,
                f"mamba_cache_mode {mode!r} keeps state checkpoints at block positions; "
                "kvstate moves the running state (mamba_cache_mode 'none', vLLM's "
                "default without prefix caching)",
            )
        shapes = [list(s) for s in spec.shapes]
        dtypes = [str(d).replace("torch.", "") for d in spec.dtypes]
        scratch = int(spec.num_speculative_blocks)
        return Group("state", 1, scratch, f"{name}({shapes}, {dtypes}, {spec.page_size_bytes} B)")
    raise _refuse(index, name, layers, f"kvstate moves {MOVES}")


def _refuse(index: int, name: str, layers: Sequence[str], what: str) -> LayoutRefusedError:
    shown = ", ".join(list(layers)[:3]) + (", ..." if len(layers) > 3 else "")
    return LayoutRefusedError(
        f"KV cache group {index} ({name}: {shown}) cannot be moved: {what}; serve this "
        "model with a connector that moves it (NixlConnector) or without disaggregation"
    )


def groups_of(kv_cache_config: Any) -> list[Group]:
    """The transferable KV cache groups of an engine, in vLLM's order; a group kvstate
    cannot move refuses the engine at start-up (LayoutRefusedError)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        raise LayoutRefusedError("the KV cache has no KV cache groups")
    out = []
    for index in transfer_ids(kv_cache_config):
        g = groups[index]
        out.append(group_of(g.kv_cache_spec, index, g.layer_names))
    return out


def transfer_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The groups vLLM moves between engines (all of them before it marked some)."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    if ids is None:
        return tuple(range(len(kv_cache_config.kv_cache_groups)))
    return tuple(ids)


def wanted(counts: Sequence[int], m: int) -> list[int]:
    """Blocks of each group a decode with ``m`` new blocks per attention group needs of
    a prefill that kept ``counts``."""
    return [min(m, n) for n in counts]


def split(counts: Sequence[int], total: int) -> list[int] | None:
    """How a decode's page list of length ``total`` splits over the groups (the
    smallest ``m`` whose ``wanted`` adds up to it), or None when none does."""
    for m in range(max(counts, default=0) + 1):
        want = wanted(counts, m)
        if sum(want) == total:
            return want
    return None


def flatten(lists: Sequence[Sequence[int]], take: Sequence[int]) -> list[int]:
    """The last ``take[g]`` blocks of each group's list, group after group."""
    out: list[int] = []
    for ids, n in zip(lists, take, strict=True):
        out += list(ids[len(ids) - n :]) if n else []
    return out


__all__ = [
    "MOVES",
    "NULL_BLOCK",
    "Group",
    "flatten",
    "group_of",
    "groups_of",
    "split",
    "transfer_ids",
    "wanted",
]
