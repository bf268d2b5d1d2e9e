"""snapguard's take point, loaded at interpreter start through PYTHONPATH (see snapguard.hooks)."""

import os

if os.environ.get("SNAPGUARD_TAKE_DIR"):
    try:
        from snapguard.hooks import _workload

        _workload.start(os.environ["SNAPGUARD_TAKE_DIR"])
    except Exception as e:  # the trainer must start even when the hook cannot
        import sys

        print(f"snapguard take point disabled: {e}", file=sys.stderr)
