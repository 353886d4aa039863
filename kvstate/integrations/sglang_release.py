"""Which SGLang releases the backend supports, apart from both the entry point
(``sglang_plugin``) and the backend package (``sglang/``), which each check it: neither
imports the other for it, and importing this touches no SGLang module."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from kvstate.errors import UnsupportedSGLangError

BACKEND = "kvstate"
# Exact releases whose interfaces the backend was tested against.
SUPPORTED_SGLANG = ("0.5.23",)


def check_version(found: str | None = None) -> str:
    """Return the SGLang version, or raise naming the supported ones."""
    if found is None:
        try:
            found = version("sglang")
        except PackageNotFoundError:
            raise UnsupportedSGLangError(
                "SGLang is not installed: pip install 'kvstate[sglang]' "
                f"sglang=={SUPPORTED_SGLANG[-1]}"
            ) from None
    if found not in SUPPORTED_SGLANG:
        raise UnsupportedSGLangError(
            f"kvstate's SGLang backend supports sglang {', '.join(SUPPORTED_SGLANG)}; found "
            f"{found}. Install a supported release (pip install sglang=={SUPPORTED_SGLANG[-1]}) "
            "or use another --disaggregation-transfer-backend"
        )
    return found


__all__ = ["BACKEND", "SUPPORTED_SGLANG", "UnsupportedSGLangError", "check_version"]
