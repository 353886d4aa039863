"""``python -m kvstate.cli``: the same as the ``kvstate`` console script."""

from kvstate.cli import main

main()
