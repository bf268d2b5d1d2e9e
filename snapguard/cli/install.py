"""`snapguard install`: add the snapguard runtime to containerd and write snapguard's config.

Its flags become one install.Options; install.plan_install (or plan_uninstall) makes the plan,
install.apply writes it unless --dry-run."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..reasons import Reason, SnapguardError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    from ..install import (DEFAULT_CC, DEFAULT_CONTAINERD_CONFIG, DEFAULT_RUNTIME_NAME, DEFAULT_SNAPGUARD_CONFIG,
                          DEFAULT_STATE_FILE, DEFAULT_SYSTEMD_DIR, LAUNCHER_NAME)

    ins = sub.add_parser("install", help="add the snapguard runtime to containerd and write /etc/snapguard/config.toml",
                         description=(
                             "Put snapguard on this node (as root): a containerd drop-in adding the CRI runtime "
                             "NAME (runc v2 shim, BinaryName this install's snapguard-runc, SystemdCgroup as the "
                             "default runtime has it), the main config's imports where it lacks the drop-in, and "
                             "/etc/snapguard/config.toml with the pinned paths found here (`runc` = NVIDIA's runtime "
                             "where that is containerd's default). Prints the RuntimeClass. A second run changes "
                             "nothing; --uninstall reverses what it recorded. Restart containerd afterwards."))
    ins.add_argument("--dry-run", action="store_true", help="print the change as a diff and write nothing")
    ins.add_argument("--uninstall", action="store_true", help="reverse what snapguard install wrote")
    ins.add_argument("--containerd-config", default=DEFAULT_CONTAINERD_CONFIG, metavar="PATH",
                     help=f"containerd's main config (default {DEFAULT_CONTAINERD_CONFIG}); its `version` decides "
                          "the drop-in's (2: containerd 1.6/1.7, 3: 2.x)")
    ins.add_argument("--dropin-dir", metavar="DIR", help="where the drop-in goes (default: conf.d beside PATH)")
    ins.add_argument("--runtime-name", default=DEFAULT_RUNTIME_NAME, metavar="NAME",
                     help=f"the runtime, and the RuntimeClass handler (default {DEFAULT_RUNTIME_NAME})")
    ins.add_argument("--config", default=DEFAULT_SNAPGUARD_CONFIG, metavar="PATH",
                     help=f"snapguard's config to write (default {DEFAULT_SNAPGUARD_CONFIG})")
    ins.add_argument("--state-file", default=DEFAULT_STATE_FILE, metavar="PATH",
                     help=f"where what was written is recorded, root-only (default {DEFAULT_STATE_FILE})")
    ins.add_argument("--containerd", metavar="PATH",
                     help="the containerd binary whose version is read (default /usr/bin/containerd, /usr/local/bin/containerd)")
    ins.add_argument("--snapguard-runc", metavar="PATH",
                     help="the Python snapguard-runc (default: the one beside this snapguard); given without "
                          "--launcher, it is BinaryName as given and the launcher is not built")
    launcher = ins.add_argument_group(
        "snapguard-runc's C launcher",
        "A small C program, compiled here from the sources installed with snapguard (snapguard/_c_helpers/ in a "
        "wheel or the Debian package, c_helpers/ in a source or editable install) and made containerd's "
        "BinaryName: it execs runc for every verb but checkpoint and restore without starting Python, and the "
        "Python snapguard-runc for those two. By default it is built where its sources are found (and "
        "--snapguard-runc is not given); otherwise BinaryName is the Python snapguard-runc.")
    choice = launcher.add_mutually_exclusive_group()
    choice.add_argument("--launcher", dest="launcher", action="store_const", const=True, default=None,
                        help="require the launcher: fail where its sources or the compiler are missing")
    choice.add_argument("--no-launcher", dest="launcher", action="store_const", const=False,
                        help="do not build it: BinaryName is the Python snapguard-runc (a launcher an earlier run "
                             "installed is removed)")
    launcher.add_argument("--launcher-path", metavar="PATH",
                          help=f"where the launcher is installed, an absolute path (default: {LAUNCHER_NAME} beside "
                               "snapguard-runc)")
    launcher.add_argument("--cc", default=DEFAULT_CC, metavar="PATH",
                          help=f"the pinned C compiler that builds it, root's alone, run with a PATH of root's "
                               f"directories only (default {DEFAULT_CC})")
    ins.add_argument("--store", metavar="URL",
                     help="the image store a pod's restore fences its epoch in (file:///dir or s3://bucket/prefix): "
                          "written as SNAPGUARD_STORE into a systemd drop-in for containerd's unit, which its "
                          "runc shim and snapguard-runc inherit; without it (and no drop-in from an earlier run) a "
                          "pod restored under snapguard.io/epoch is refused, and the plan's next steps say so")
    ins.add_argument("--systemd-dir", default=DEFAULT_SYSTEMD_DIR, metavar="DIR",
                     help=f"where that drop-in goes (default {DEFAULT_SYSTEMD_DIR})")
    ins.add_argument("--json", action="store_true",
                     help="print the plan as JSON (its `next`: what the operator must still do)")


def run(args: argparse.Namespace) -> int:
    from .. import install

    if args.launcher is False and args.launcher_path is not None and not args.uninstall:
        raise SnapguardError(Reason.USAGE_ERROR,
                             "--launcher-path names where the launcher goes: not with --no-launcher")
    opts = install.Options(containerd_config=args.containerd_config, dropin_dir=args.dropin_dir,
                           snapguard_config=args.config, state_file=args.state_file, runtime_name=args.runtime_name,
                           containerd=args.containerd, snapguard_runc=args.snapguard_runc, launcher=args.launcher,
                           launcher_path=args.launcher_path, cc=args.cc, store=args.store,
                           systemd_dir=args.systemd_dir)
    plan = install.plan_uninstall(opts) if args.uninstall else install.plan_install(opts)
    if not args.dry_run:
        install.apply(plan)
    print(json.dumps(plan.to_dict(), indent=2, sort_keys=True, default=str) if args.json
          else plan.to_text(args.dry_run), end="" if not args.json else "\n")
    return 0
