"""Shared by the deb and wheel tests: whether `snapguard install` can build the launcher here."""

from __future__ import annotations

from snapguard.install import DEFAULT_CC
from snapguard.trust import UntrustedPathError, resolve_trusted


def pinned_compiler_usable() -> bool:
    """The pinned C compiler `snapguard install` builds the launcher with is here and trusted."""
    try:
        resolve_trusted(DEFAULT_CC, "exec")
        return True
    except UntrustedPathError:
        return False
