"""The requirements a wheelhouse lacks for one Python version: packaging/build-deb.sh's check.

`pip download --python-version X.Y` evaluates the environment markers of the requirements it
walks with the running interpreter's version, not X.Y: a dependency marked `python_version <
"3.11"` (tomli) is left out when the package is built with 3.11 for 3.10. This reads every wheel's
METADATA in the wheelhouse and prints, one a line, each requirement whose marker holds for X.Y
(with the extras named) and that no wheel in the wheelhouse provides; build-deb.sh downloads
those and asks again until nothing is printed.

    python packaging/marker_deps.py WHEELHOUSE X.Y [EXTRA ...]
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip's own copy, where the packaging distribution is not installed
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename


def missing(wheelhouse: Path, version: str, extras: list[str]) -> list[str]:
    env = {"python_version": version, "python_full_version": f"{version}.0", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix"}
    have = {parse_wheel_filename(w.name)[0] for w in wheelhouse.glob("*.whl")}
    out: list[str] = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        name = parse_wheel_filename(wheel.name)[0]
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            lines = z.read(meta).decode("utf-8", "replace").split("\n\n", 1)[0].splitlines()
        wanted = extras if name == canonicalize_name("snapguard") else []
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or canonicalize_name(req.name) in have:
                continue
            if any(req.marker.evaluate({**env, "extra": e}) for e in ["", *wanted]):
                text = str(req).split(";", 1)[0].strip()
                if text not in out:
                    out.append(text)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__.rsplit("\n\n", 1)[1].strip())
    print("\n".join(missing(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])))
