"""Adapters that let serving stacks use kvstate without patching them.

Each submodule imports its stack on first use, so ``import kvstate`` never pulls
SGLang or vLLM in; install the matching extra (``kvstate[sglang]``).
"""
