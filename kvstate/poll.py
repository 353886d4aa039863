"""KVPoll: the status values, shared with SGLang so schedulers can compare them."""

from __future__ import annotations

from enum import IntEnum

from kvstate.errors import InvalidStatusError


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

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
