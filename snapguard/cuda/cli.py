"""`snapguard-cuda-checkpoint`: NVIDIA's cuda-checkpoint flags and outputs, on the driver API.

CRIU's CUDA plugin runs `cuda-checkpoint` from its PATH and reads its stdout: `-h` must mention
--action, `--get-state` prints running|locked|checkpointed|failed, `--get-restore-tid` prints a
thread id, and a non-zero exit means "not a CUDA process" or failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from ..devicemap import DeviceMap
from ._driver import CudaError, Driver, load

HELP = f"""CUDA checkpoint and restore utility (snapguard's, on the cuCheckpointProcess* driver API).
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

When CRIU's CUDA plugin runs it, a device map also comes from {DeviceMap.ENV} (same format),
which snapguard sets for a restore onto other GPUs of the same model: the plugin passes none.
"""

ACTIONS = ("lock", "checkpoint", "restore", "unlock")


class UsageError(Exception):
    """Bad arguments: exit 2 with one line (never SystemExit: the broker answers in the executor)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)

    def format_help(self) -> str:
        return HELP


def _device_map(text: str) -> DeviceMap:
    try:
        return DeviceMap.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _pairs(device_map: DeviceMap | None) -> list[tuple[str, str]] | None:
    return list(device_map.pairs) if device_map else None


def _parser() -> _Parser:
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
    return p


def answer(argv: list[str], device_map: str | None, driver: Callable[[], Driver] = load) -> tuple[int, str, str]:
    """What `cuda-checkpoint ARGV` exits with and prints, as (exit code, stdout, stderr), with
    `device_map` as the environment's DeviceMap.ENV. The tool itself and the executor's broker (the same
    answers to CRIU's plugin without a process per call, snapguard.cuda._broker) both use it."""
    try:
        args = _parser().parse_args(argv)
        if args.help or not (args.toggle or args.get_state or args.get_restore_tid or args.action):
            return 0, HELP, ""
        if args.pid is None:
            raise UsageError("--pid is required")
        if args.device_map is None and device_map:
            try:
                args.device_map = DeviceMap.parse(device_map)
            except ValueError as e:
                raise UsageError(f"{DeviceMap.ENV}: {e}") from None
    except UsageError as e:
        return 2, "", f"cuda-checkpoint: {e}\n"
    out = ""
    try:
        d = driver()
        if args.get_state:
            out = f"{d.state(args.pid)}\n"
        elif args.get_restore_tid:
            out = f"{d.restore_thread_id(args.pid)}\n"
        elif args.action == "lock":
            d.lock(args.pid, args.timeout)
        elif args.action == "checkpoint":
            d.checkpoint(args.pid)
        elif args.action == "restore":
            d.restore(args.pid, _pairs(args.device_map))
        elif args.action == "unlock":
            d.unlock(args.pid)
        elif d.state(args.pid) == "running":
            d.lock(args.pid, args.timeout)
            d.checkpoint(args.pid)
        else:
            d.restore(args.pid, _pairs(args.device_map))
            d.unlock(args.pid)
    except CudaError as e:
        return 1, out, f"cuda-checkpoint: {e}\n"
    except OSError as e:
        return 1, out, f"cuda-checkpoint: cannot load the CUDA driver: {e}\n"
    except (ValueError, OverflowError, TypeError) as e:  # a UUID or a number the driver's types refuse
        return 2, out, f"cuda-checkpoint: {type(e).__name__}: {' '.join(str(e).split())}\n"
    return 0, out, ""


def main(argv: list[str] | None = None) -> int:
    rc, out, err = answer(sys.argv[1:] if argv is None else argv, os.environ.get(DeviceMap.ENV))
    sys.stdout.write(out)
    sys.stderr.write(err)
    return rc


if __name__ == "__main__":
    sys.exit(main())
