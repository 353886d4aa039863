"""The roles layer: an engine rank (``KVManager``) and one side of one room each
(``KVSender``, ``KVReceiver``), where room state and KV bytes meet.

One concept a module: ``contract`` (what a rank and its participants may ask of each
other), ``participant`` (what both sides share, the one clear), ``sender``,
``receiver`` and its ``binding``, ``manager`` (the rank), its ``steps`` (a scheduler
step's calls), its ``lease``, its ``peers`` watch and its ``batch`` planning.
docs/design.md, "Layers".
"""

from kvstate.roles.contract import Bound, LookupKey, Lookups, Rank, Step, StepInput
from kvstate.roles.manager import ROLES, KVManager
from kvstate.roles.participant import STATE_LOST, Participant
from kvstate.roles.receiver import KVReceiver
from kvstate.roles.sender import KVSender

__all__ = [
    "ROLES",
    "STATE_LOST",
    "Bound",
    "KVManager",
    "KVReceiver",
    "KVSender",
    "LookupKey",
    "Lookups",
    "Participant",
    "Rank",
    "Step",
    "StepInput",
]
