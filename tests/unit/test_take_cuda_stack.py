"""The take point's StackLimit against a stand-in CUDA runtime: a shared library named libcudart.so
with the two calls it makes, built here with the C compiler and loaded into this process (so it is
among the process's mappings, where StackLimit looks): lowered to 0 at the hold, set back to what
it was at the release, nothing changed when there is no runtime, when it is switched off, or when
the runtime refuses."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from snapguard.takepoint.workload.cudalimits import StackLimit

SOURCE = r"""
#include <stddef.h>
static size_t stack = 1024; static int refuse_set = 0;
int cudaDeviceGetLimit(size_t *v, int what) { if (what != 0) return 1; *v = stack; return 0; }
int cudaDeviceSetLimit(int what, size_t v) { if (what != 0 || refuse_set) return 1; stack = v; return 0; }
void stand_in_refuse(int on) { refuse_set = on; }
size_t stand_in_stack(void) { return stack; }
"""


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cc = shutil.which("cc", path="/usr/bin:/bin")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("cudart")
    (d / "stand_in.c").write_text(SOURCE)
    lib = d / "libcudart.so.13"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(d / "stand_in.c")], check=True, timeout=60)
    return ctypes.CDLL(str(lib))


def test_no_runtime_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("snapguard.takepoint.workload.cudalimits._runtime", lambda: None)
    s = StackLimit()
    s.lower()
    s.restore()
    assert s.figures == {"state": "no-runtime"}


def test_lowered_at_the_hold_and_set_back_at_the_release(runtime: ctypes.CDLL) -> None:
    runtime.stand_in_stack.restype = ctypes.c_size_t
    s = StackLimit()
    s.lower()
    assert s.figures == {"state": "lowered", "stack_bytes": 1024}
    assert runtime.stand_in_stack() == 0
    s.restore()
    assert runtime.stand_in_stack() == 1024 and s.figures["restored"] is True
    s.restore()  # once only
    assert runtime.stand_in_stack() == 1024


def test_switched_off(runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.stand_in_stack.restype = ctypes.c_size_t
    monkeypatch.setenv("SNAPGUARD_TAKE_CUDA_STACK", "0")
    s = StackLimit()
    s.lower()
    assert s.figures == {"state": "off"} and runtime.stand_in_stack() == 1024


def test_a_refused_lowering_keeps_the_limit_and_a_refused_restore_raises(runtime: ctypes.CDLL) -> None:
    runtime.stand_in_stack.restype = ctypes.c_size_t
    runtime.stand_in_refuse(1)
    try:
        s = StackLimit()
        s.lower()
        assert s.figures["state"] == "kept" and runtime.stand_in_stack() == 1024
        s.restore()  # nothing was lowered: nothing to set back
    finally:
        runtime.stand_in_refuse(0)
    s = StackLimit()
    s.lower()
    runtime.stand_in_refuse(1)
    try:
        with pytest.raises(RuntimeError, match="returned 1"):
            s.restore()
    finally:
        runtime.stand_in_refuse(0)
