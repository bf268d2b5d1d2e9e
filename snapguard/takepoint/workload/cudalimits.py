"""The CUDA runtime's per-thread stack reservation, lowered at the hold and put back at the release.

The runtime reserves local memory for every thread the device can run at once (the stack size
limit times threads per SM times SMs: 0.28 GB on an H200 at the default 1 KiB), and the CUDA
plugin's checkpoint copies that reservation into the image like any device memory. No kernel runs
while the trainer is held, so the take point sets the limit to 0 after its trim (the reservation is
freed) and sets it back to what it was before the trainer's next kernel, after the release (the
runtime reserves it again; a kernel that needs more grows it, as it always does).

Through the CUDA runtime PyTorch loaded (found among this process's mappings and opened by that
path, never by a name looked up elsewhere); where there is none, or a call fails, nothing is changed.
"""

from __future__ import annotations

import ctypes
import os

from .. import protocol
from .env import switch

__all__ = ["StackLimit"]

_STACK_SIZE = 0  # cudaLimitStackSize


def _runtime() -> ctypes.CDLL | None:
    """The libcudart this process has mapped (PyTorch's), or None."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            paths = sorted({ln.split()[-1] for ln in f if "/libcudart.so" in ln and ln.split()[-1].startswith("/")})
    except OSError:
        return None
    if not paths:
        return None
    try:
        return ctypes.CDLL(paths[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


class StackLimit:
    """One hold's lowering: `lower()` after the trim, `restore()` after the release (a no-op
    when nothing was lowered). `figures` says what was done."""

    def __init__(self) -> None:
        self.before: int | None = None
        self.figures: dict[str, object] = {}
        self._rt: ctypes.CDLL | None = None

    def lower(self) -> None:
        if not switch(protocol.CUDA_STACK_ENV, True):
            self.figures = {"state": "off"}
            return
        rt = _runtime()
        if rt is None:
            self.figures = {"state": "no-runtime"}
            return
        value = ctypes.c_size_t()
        rc = rt.cudaDeviceGetLimit(ctypes.byref(value), _STACK_SIZE)
        if rc != 0:
            self.figures = {"state": "unread", "rc": int(rc)}
            return
        if value.value == 0:
            self.figures = {"state": "already-0"}
            return
        rc = rt.cudaDeviceSetLimit(_STACK_SIZE, ctypes.c_size_t(0))
        if rc != 0:
            self.figures = {"state": "kept", "rc": int(rc), "stack_bytes": value.value}
            return
        self._rt, self.before = rt, value.value
        self.figures = {"state": "lowered", "stack_bytes": value.value}

    def restore(self) -> None:
        """The limit as it was; raises when the runtime refuses (the trainer's kernels may need it)."""
        if self._rt is None or self.before is None:
            return
        rt, before, self._rt, self.before = self._rt, self.before, None, None
        rc = rt.cudaDeviceSetLimit(_STACK_SIZE, ctypes.c_size_t(before))
        if rc != 0:
            raise RuntimeError(f"cudaDeviceSetLimit(stack size, {before}) returned {rc}")
        self.figures["restored"] = True
