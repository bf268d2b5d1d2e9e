"""`snapguard-cuda-checkpoint`: NVIDIA's cuda-checkpoint flags and outputs, on the driver API.

CRIU's CUDA plugin runs `cuda-checkpoint` from its PATH and reads its stdout: `-h` must mention
--action, `--get-state` prints running|locked|checkpointed|failed, `--get-restore-tid` prints a
thread id, and a non-zero exit means "not a CUDA process" or failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from ._driver import CudaError, load

HELP = """CUDA checkpoint and restore utility (snapguard's, on the cuCheckpointProcess* driver API).
Toggles the state of CUDA within a process between suspended and running.

    --toggle --pid <value> [--timeout <ms>] [--device-map <old=new,...>]
        Toggle the state of CUDA in the process: lock and checkpoint it, or restore and unlock it.
    --get-state --pid <value>
        Print the state of CUDA in the process: running, locked, checkpointed or failed.
    --get-restore-tid --pid <value>
        Print the id of the process's CUDA restore thread.
    --action <lock|checkpoint|restore|unlock> --pid <value> [--timeout <ms>] [--device-map <old=new,...>]
        Perform one checkpoint action. --timeout applies to lock (0: no timeout). --device-map
        remaps GPUs at restore by UUID (GPU-... as nvidia-smi -L prints them) and must list every
        checkpointed GPU.
    --help, -h
        Print this help.

When CRIU's CUDA plugin runs it, a device map also comes from SNAPGUARD_DEVICE_MAP (same format),
which snapguard sets for a restore onto other GPUs of the same model: the plugin passes none.
"""

ACTIONS = ("lock", "checkpoint", "restore", "unlock")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"cuda-checkpoint: {message}", file=sys.stderr)
        sys.exit(2)

    def format_help(self) -> str:
        return HELP


def _device_map(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in text.split(","):
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise argparse.ArgumentTypeError(f"device map entry {item!r} is not OLD_UUID=NEW_UUID")
        pairs.append((old.strip(), new.strip()))
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="cuda-checkpoint", add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--toggle", action="store_true")
    what.add_argument("--get-state", action="store_true")
    what.add_argument("--get-restore-tid", action="store_true")
    what.add_argument("--action", choices=ACTIONS)
    p.add_argument("--pid", type=int)
    p.add_argument("--timeout", type=int, default=0)
    p.add_argument("--device-map", type=_device_map)
    args = p.parse_args(argv)
    if args.help or not (args.toggle or args.get_state or args.get_restore_tid or args.action):
        print(HELP, end="")
        return 0
    if args.pid is None:
        p.error("--pid is required")
    if args.device_map is None and os.environ.get("SNAPGUARD_DEVICE_MAP"):
        try:
            args.device_map = _device_map(os.environ["SNAPGUARD_DEVICE_MAP"])
        except argparse.ArgumentTypeError as e:
            p.error(f"SNAPGUARD_DEVICE_MAP: {e}")
    try:
        driver = load()
        if args.get_state:
            print(driver.state(args.pid))
        elif args.get_restore_tid:
            print(driver.restore_thread_id(args.pid))
        elif args.action == "lock":
            driver.lock(args.pid, args.timeout)
        elif args.action == "checkpoint":
            driver.checkpoint(args.pid)
        elif args.action == "restore":
            driver.restore(args.pid, args.device_map)
        elif args.action == "unlock":
            driver.unlock(args.pid)
        elif driver.state(args.pid) == "running":
            driver.lock(args.pid, args.timeout)
            driver.checkpoint(args.pid)
        else:
            driver.restore(args.pid, args.device_map)
            driver.unlock(args.pid)
    except CudaError as e:
        print(f"cuda-checkpoint: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"cuda-checkpoint: cannot load the CUDA driver: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
