"""KVPoll: the status values, shared with SGLang so schedulers can compare them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import IntEnum

from kvstate.errors import InvalidStatusError, KVStateError


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    def __str__(self) -> str:
        """``KVPoll.Success``, not ``4`` (an IntEnum prints as its int since Python
        3.11): logs and ``print()`` name the status. Comparisons and ``int()`` are
        SGLang's values still."""
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        """f-strings as ``str()``; a format spec (``{status:d}``) formats the int."""
        return str(self) if not spec else format(int(self), spec)

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)

    @classmethod
    def parse(cls, value: object) -> KVPoll:
        """Accept a member, its int value or its name; anything else is InvalidStatusError."""
        if isinstance(value, KVPoll):
            return value
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str) and value in cls.__members__:
            return cls[value]
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        raise InvalidStatusError(
            f"unknown status {value!r}; expected one of {', '.join(cls.__members__)}"
        )


class PollResults(dict[int, "KVPoll"]):
    """``KVManager.poll_many``'s answer: room -> KVPoll for every room whose Redis node
    answered, so it reads as a plain dict while Redis is healthy. On a Cluster with an
    unreachable node, that node's rooms are absent (their status is unknown, not
    Failed) and ``errors`` maps each of them to the node's StateConnectionError."""

    def __init__(
        self,
        statuses: Iterable[tuple[int, KVPoll]] | Mapping[int, KVPoll] = (),
        errors: Mapping[int, KVStateError] | None = None,
    ) -> None:
        super().__init__(statuses)
        self.errors: dict[int, KVStateError] = dict(errors or {})

    def __repr__(self) -> str:
        return f"PollResults({dict.__repr__(self)}, errors={self.errors!r})"
