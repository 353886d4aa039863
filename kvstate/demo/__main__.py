"""``python -m kvstate.demo``: the same command as ``kvstate demo``."""

from kvstate.demo.command import demo

if __name__ == "__main__":
    demo()
