"""The trainer-shape table of docs/benchmarks.md, made from scaling.py's JSON runs (never by hand):
one row per (run, size, arm) with the preflight before the snapshot and the page cache each
restore ran with, then each target of the 85 M rows against what was measured.

    .venv/bin/python bench/gpu/perf_table.py "drill, fresh=R/85m-fresh.json" "host data=R/hd.json" \\
        [--write docs/benchmarks.md]

With --write the block between `<!-- perf-table:begin -->` and `<!-- perf-table:end -->` in that file
is replaced; without, the table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"
# (what, the summary's key or a function of the snapguard arm, the target, lower is better)
TARGETS = (
    ("leave-running stall <= torch.save + fsync's stall (same run)", "stall", None),
    ("stop -> image <= 2.0 s", "stop", 2.0),
    ("restore cold -> first step <= 2.5 s", "cold", 2.5),
    ("restore warm -> first step <= 1.5 s", "warm", 1.5),
    ("image <= 2.4 GB", "gb", 2.4),
    ("preflight before the snapshot <= 0.1 s warm / 0.3 s cold", "preflight", None),
)


def _f(v: Any, prec: int = 2) -> str:
    return f"{v:.{prec}f}" if isinstance(v, (int, float)) else "-"


def _preflight(arm: dict[str, Any]) -> tuple[float | None, float | None]:
    """(the first snapshot's preflight, the last one's) of a snapguard or raw arm: the first runs
    the host checks cold (criu check, the cuda-checkpoint probe), later ones reuse the boot's cache."""
    seen = [ph.get("checkpoint_timings", {}).get("preflight_s")
            for ph in (arm.get("leave_running", {}), arm.get("stop_warm", {}), arm.get("stop_cold", {}))]
    seen = [s for s in seen if isinstance(s, (int, float))]
    return (seen[0], seen[-1]) if seen else (None, None)


def rows(label: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    import scaling

    out = []
    for size in report.get("sizes", []):
        for name, r in scaling.arm_rows(size):
            arm = size.get("arms", {}).get("snapguard", {}) if name.startswith("snapguard") else {}
            first, last = _preflight(arm) if arm else (None, None)
            out.append({"run": label, "size": size.get("label", size.get("size")), "arm": name,
                        "stall": r.get("stall"), "stop": r.get("stop"),
                        "gb": r["bytes"] / 1e9 if isinstance(r.get("bytes"), (int, float)) else None,
                        "warm": r.get("warm"), "cold": r.get("cold"), "preflight": (first, last),
                        "note": r.get("note", "")})
    return out


def render(all_rows: list[dict[str, Any]]) -> str:
    lines = ["| run | size | arm | stall s | stop -> image s | GB | restore warm s | restore cold s "
             "| preflight s (first, last) | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        pf = r["preflight"]
        lines.append(f"| {r['run']} | {r['size']} | {r['arm']} | {_f(r['stall'])} | {_f(r['stop'])} | "
                     f"{_f(r['gb'])} | {_f(r['warm'])} | {_f(r['cold'])} | "
                     f"{_f(pf[0], 3) if pf[0] is not None else '-'}, {_f(pf[1], 3) if pf[1] is not None else '-'} "
                     f"| {r['note']} |")
    lines += ["", "Targets, snapguard's rows against them (met / NOT met):", ""]
    for run in dict.fromkeys(r["run"] for r in all_rows):
        sg = [r for r in all_rows if r["run"] == run and r["arm"].startswith("snapguard")]
        save = [r for r in all_rows if r["run"] == run and r["arm"].startswith("torch.save")]
        for r in sg:
            said = []
            for what, key, limit in TARGETS:
                if key == "stall":
                    limit = save[0]["stall"] if save and isinstance(save[0]["stall"], (int, float)) else None
                    v = r["stall"]
                elif key == "preflight":
                    first, last = r["preflight"]
                    ok = None if first is None else (first <= 0.3 and (last if last is not None else first) <= 0.1)
                    said.append(f"{what}: {_f(first, 3)} / {_f(last, 3)} s, "
                                f"{'-' if ok is None else 'met' if ok else 'NOT met'}")
                    continue
                else:
                    v = r[key]
                ok = None if limit is None or not isinstance(v, (int, float)) else v <= limit
                said.append(f"{what}: {_f(v)}{' vs ' + _f(limit) if key == 'stall' else ''}, "
                            f"{'-' if ok is None else 'met' if ok else 'NOT met'}")
            lines.append(f"- {run}, {r['size']}: " + "; ".join(said))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=JSON", help="a label for the run and scaling.py's JSON of it")
    ap.add_argument("--write", metavar="MD", help=f"replace the block between {BEGIN} and {END} in this file")
    args = ap.parse_args()
    all_rows = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            print(f"perf_table.py: {spec!r} is not LABEL=JSON", file=sys.stderr)
            return 2
        try:
            all_rows += rows(label, json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"perf_table.py: {path}: {e}", file=sys.stderr)
            return 2
    table = render(all_rows)
    if not args.write:
        sys.stdout.write(table)
        return 0
    md = Path(args.write)
    text = md.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        print(f"perf_table.py: {md} has no single {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN)
    md.write_text(f"{head}{BEGIN}\n{table}{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
