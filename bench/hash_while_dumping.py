"""A stop snapshot of a bare process holding GB of memory through `snapguard checkpoint`, with the
page files hashed while CRIU writes them (config `hash_while_dumping`, the default) and without,
interleaved in one run: CRIU's run (`criu_s`), the seal after it (`seal_s`) and the request to the
complete image (`total_s`, from the result's timings), and how many 64 MiB spans were hashed before
the seal. The images go to the directory given (default: one under /var/tmp, on this machine's
disk); the page cache is warm (each image is read back only by the seal). Prints a table and
writes JSON under bench/results/.

    python3 bench/hash_while_dumping.py [--gb 3.4] [--pairs 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, write  # noqa: E402

from snapguard_lab.targets import BareTarget  # noqa: E402

# the workload: `mib` MiB of memory CRIU must dump (not zero pages: those are never present),
# then a counter line every 10 ms
HOLDER = """
import sys, time
mib = int({mib})
block = bytes(range(256)) * 4096  # 1 MiB
held = [bytearray(block) for _ in range(mib)]
for i, b in enumerate(held):
    b[0] = i & 0xFF
n = 0
while True:
    n += 1
    with open(sys.argv[1], "a") as f:
        f.write(f"{{n}} 0\\n")
    time.sleep(0.01)
"""

COLUMNS = ("criu_s", "seal_s", "total_s", "spans_early", "image_gb")


def one(base: Path, mib: int, on: bool, name: str) -> dict[str, float]:
    t = BareTarget(base / name, script=HOLDER.format(mib=mib), timeout=600)
    t.configure(hash_while_dumping=on)
    images = base / name / "img"
    try:
        t.start(lines=3)
        out = t.checkpoint(images, images)
        if out.returncode != 0:
            raise SystemExit(f"hash_while_dumping.py: the checkpoint failed: {out.stderr.strip()}")
        result = json.loads(out.stdout)
        timings, counts = result["timings"], result.get("counts", {})
        if on != ("spans_hashed_while_dumping" in counts):
            raise SystemExit(f"hash_while_dumping.py: run {name} did not do what its name says: {counts}")
        return {"criu_s": timings["criu_s"], "seal_s": timings["seal_s"], "total_s": timings["total_s"],
                "spans_early": counts.get("spans_hashed_while_dumping", 0),
                "image_gb": result["image_bytes"] / 1e9}
    finally:
        t.stop()
        shutil.rmtree(base / name, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=3.4, help="memory the process holds, GB (default 3.4: the 85 M "
                    "trainer's image on the H200)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--dir", default="/var/tmp", help="where the images go (default /var/tmp)")
    args = ap.parse_args()
    if args.pairs < 1 or not 0 < args.gb <= 64:
        ap.error("--pairs must be at least 1 and --gb within (0, 64]")
    base = Path(tempfile.mkdtemp(prefix="sg-hash-", dir=args.dir))
    mib = int(args.gb * 1e9 / (1 << 20))
    rows: list[dict] = []
    try:
        for i in range(args.pairs):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                name = f"pair{i + 1}-{'on' if on else 'off'}"
                t0 = time.monotonic()
                rows.append({"run": name, "on": on, **one(base, mib, on, name)})
                print(f"{name}: {rows[-1]} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    medians = {way: {c: statistics.median(r[c] for r in rows if r["on"] == (way == "on")) for c in COLUMNS}
               for way in ("off", "on")}
    print(f"{'run':<12}" + "".join(f"{c:>12}" for c in COLUMNS))
    for r in rows:
        print(f"{r['run']:<12}" + "".join(f"{r[c]:>12.2f}" for c in COLUMNS))
    for way in ("off", "on"):
        print(f"{'median ' + way:<12}" + "".join(f"{medians[way][c]:>12.2f}" for c in COLUMNS))
    path = write("hash-while-dumping", {"rev": git_rev(), "argv": sys.argv[1:], "gb": args.gb, "dir": args.dir,
                                        "page_cache": "warm (each image read back by its seal only)",
                                        "runs": rows, "medians": medians})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
