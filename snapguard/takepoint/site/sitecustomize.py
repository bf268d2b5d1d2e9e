"""snapguard's take point, loaded at interpreter start through PYTHONPATH (see snapguard.takepoint).

With the take point's directory set in the environment (protocol.TAKE_DIR_ENV) it starts the take
point, which (unless protocol.RESOLVE_ENV is 0) also registers the fork handler that drops
inherited GPU handles in forked children and watches torch.compile's worker pool
(snapguard.takepoint.workload).

Python imports one `sitecustomize`: the first on sys.path. This one, first through PYTHONPATH,
would hide the distribution's, a venv's or the workload's own, so it runs that one after itself.
"""

import os
import sys


def _start_take_point() -> None:
    try:
        from snapguard.takepoint import TAKE_DIR_ENV, start

        start(os.environ[TAKE_DIR_ENV])
    except Exception as e:  # the trainer must start even when the hook cannot
        print(f"snapguard take point disabled: {e}", file=sys.stderr)


def _wanted() -> bool:
    """Whether the take point's directory is set in the environment (snapguard.takepoint.protocol
    names the variable: it alone is imported, the standard library's modules aside); True when
    snapguard cannot be imported, so that `_start_take_point` says why."""
    try:
        from snapguard.takepoint.protocol import TAKE_DIR_ENV
    except Exception:
        return True
    return bool(os.environ.get(TAKE_DIR_ENV))


def _chain() -> None:
    """Run the sitecustomize this one shadows, as site would have; its errors are reported as
    site reports them, in one line, and the interpreter goes on."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as e:
        print(f"Error in sitecustomize (chained by snapguard); {type(e).__name__}: {e}", file=sys.stderr)


if _wanted():
    _start_take_point()
_chain()
