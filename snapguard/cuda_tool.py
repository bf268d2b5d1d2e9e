"""`snapguard-cuda-checkpoint`, the cuda-checkpoint CRIU's plugin runs where NVIDIA's is not
installed (snapguard.cuda.cli has its flags and outputs).

Run by CRIU under snapguard, whose environment names the executor's broker (snapguard.wire.BROKER_ENV,
snapguard.cuda._broker), it sends its arguments there and prints the answer: no libcuda load and
no driver start-up per run. Anything else, or a broker that cannot be reached, and it answers
itself. Kept to the standard library until then: it starts several times inside a trainer's stall.
"""

from __future__ import annotations

import os
import sys

from .devicemap import DeviceMap
from .wire import BROKER_ENV as ENV  # standard library only, unlike snapguard.cuda (cffi)
REPLY_MAX = 1 << 20  # the help text and a line of output or error fit many times over
REPLY_WAIT_S = 900.0  # a restore of a large GPU state takes minutes at most; the broker ends with its run


def _ask(path: str, argv: list[str], device_map: str | None) -> tuple[int, str, str] | None:
    """The broker's answer; None when it cannot be reached (then nothing was asked)."""
    import json
    import socket

    from .wire import peer_uid, recv_line

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(5.0)
        try:
            s.connect(path)
            # only the executor's broker, which runs as this tool's user (root under CRIU): a
            # socket anyone else listens on is not asked, and nothing has been sent yet
            uid = peer_uid(s)
        except OSError:
            return None
        if uid != os.geteuid():
            return None
        try:
            s.sendall(json.dumps({"argv": argv, "device_map": device_map}).encode() + b"\n")
            s.settimeout(REPLY_WAIT_S)
            reply = json.loads(recv_line(s, REPLY_MAX))
            return int(reply["rc"]), str(reply["stdout"]), str(reply["stderr"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            # asked, so never asked again here: a lock or a restore must not run twice
            return 1, "", f"cuda-checkpoint: no answer from the executor's broker at {path}: {e}\n"


def main() -> int:
    argv = sys.argv[1:]
    path = os.environ.get(ENV)
    got = _ask(path, argv, os.environ.get(DeviceMap.ENV)) if path else None
    if got is None:
        from .cuda.cli import main as answer_here

        return answer_here(argv)
    rc, out, err = got
    sys.stdout.write(out)
    sys.stderr.write(err)
    return rc


if __name__ == "__main__":
    sys.exit(main())
