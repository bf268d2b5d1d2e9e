"""The take point as a directory a container's PYTHONPATH holds alone: what a node keeps at
HOOK_DIR for the pods it runs, and what `snapguard webhook` mounts into them (a hostPath,
read-only).

    <dir>/sitecustomize.py                       the site hook (snapguard/takepoint/site/)
    <dir>/snapguard/__init__.py                  snapguard's import-free package root
    <dir>/snapguard/takepoint/__init__.py        the take point's package: it loads `protocol` alone
    <dir>/snapguard/takepoint/protocol.py
    <dir>/snapguard/takepoint/workload/*.py      the trainer's side

Nothing else: no site-packages of the node's, nothing outside the standard library (the workload
side imports only `protocol`; torch is the trainer's own, imported lazily), so the container's
own interpreter (Python 3.9 or newer: the take point passes descriptors with socket.send_fds)
finds its own packages first and this directory only for `sitecustomize` and
`snapguard.takepoint`. `lay_out` writes it; `HOOK_FILES` lists its files.
"""

from __future__ import annotations

import os
import stat

from ..files import write_atomic

__all__ = ["HOOK_DIR", "HOOK_FILES", "lay_out"]

HOOK_DIR = "/var/lib/snapguard/takepoint"  # where a node keeps it, and where a pod mounts it

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)  # the snapguard package


def _sources() -> dict[str, str]:
    """{name in the layout: source path}."""
    files = {"sitecustomize.py": os.path.join(_HERE, "site", "sitecustomize.py"),
             "snapguard/__init__.py": os.path.join(_ROOT, "__init__.py"),
             "snapguard/takepoint/__init__.py": os.path.join(_HERE, "__init__.py"),
             "snapguard/takepoint/protocol.py": os.path.join(_HERE, "protocol.py")}
    workload = os.path.join(_HERE, "workload")
    for name in sorted(os.listdir(workload)):
        if name.endswith(".py"):
            files[f"snapguard/takepoint/workload/{name}"] = os.path.join(workload, name)
    return files


HOOK_FILES = tuple(_sources())


def _directory(path: str) -> None:
    """`path` a real directory, 0755 (made so when missing); never a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.mkdir(path, 0o755)
        os.chmod(path, 0o755)  # whatever the umask
        return
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory (a link or a file): the take point's directory is not written")


def lay_out(dest: str = HOOK_DIR) -> list[str]:
    """Write the take point into `dest` (made when missing, its parents too), each file 0644
    and replaced atomically, so that a pod starting meanwhile imports either the old file or the
    new one; `.py` files of the layout's own directories that the take point no longer has are
    removed. Returns the layout's names. Raises OSError."""
    dest = os.path.abspath(dest)
    os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
    _directory(dest)
    sources = _sources()
    for sub in ("snapguard", "snapguard/takepoint", "snapguard/takepoint/workload"):
        _directory(os.path.join(dest, sub))
    for name, src in sources.items():
        with open(src, "rb") as f:
            write_atomic(os.path.join(dest, name), f.read(), 0o644)
    for sub in ("", "snapguard", "snapguard/takepoint", "snapguard/takepoint/workload"):
        for name in os.listdir(os.path.join(dest, sub)):
            rel = f"{sub}/{name}" if sub else name
            if name.endswith(".py") and rel not in sources:
                os.unlink(os.path.join(dest, rel))
    return list(sources)
