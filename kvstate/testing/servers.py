"""Old import path, kept while tests still use it: import from ``kvstate.testing``."""

from kvstate import testing as _testing
from kvstate.testing import *  # noqa: F403

__all__ = _testing.__all__
