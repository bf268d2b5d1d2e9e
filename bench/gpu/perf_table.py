"""The trainer-shape table of docs/benchmarks.md, made from scaling.py's JSON runs (never by hand):
one row per (run, size, arm) with the preflight before the snapshot and the page cache each
restore ran with, then each target of the 85 M rows against what was measured; and the table of
what each leave-running snapguard image holds (scaling.py's `image_parts`, from
bench/gpu/image_parts.py), for the runs that carry it.

    .venv/bin/python bench/gpu/perf_table.py "drill, fresh=R/85m-fresh.json" "host data=R/hd.json" \\
        [--write docs/benchmarks.md]

With --write the blocks between `<!-- perf-table:begin -->` and `<!-- perf-table:end -->`, and
between `<!-- image-parts:begin -->` and `<!-- image-parts:end -->`, in that file are replaced;
without, the tables are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"
PARTS_BEGIN, PARTS_END = "<!-- image-parts:begin -->", "<!-- image-parts:end -->"
# image_parts' page kinds, in the table's columns: the CUDA plugin's copy of the device (VMAs there
# only while the process was suspended), the C heap, the rest of the anonymous memory, the rest
PARTS = (("CUDA plugin's device copy", ("anon private, gone after the dump",)), ("heap", ("heap",)),
         ("other anon", ("anon private", "anon shared (shmem)", "stack")))
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


def parts_rows(label: str, report: dict[str, Any]) -> list[str]:
    """One table row per size whose snapguard leave-running snapshot carries `image_parts`."""
    out = []
    for size in report.get("sizes", []):
        lr = size.get("arms", {}).get("snapguard", {}).get("leave_running", {})
        ip = lr.get("image_parts")
        if not isinstance(ip, dict) or "files_bytes" not in ip:
            continue
        kinds = dict(ip.get("pages_by_kind", {}))
        cols = [sum(kinds.pop(k, 0) for k in names) for _, names in PARTS]
        offload = next(iter(lr.get("take_point", {}).values()), {}).get("offload", {})
        halved = offload.get("halved", {})
        files = ip["files_bytes"]
        gb = [files.get("spill", 0), *cols, sum(kinds.values()) + files.get("other", 0), ip.get("total_bytes", 0)]
        out.append(f"| {label} | {size.get('label', size.get('size'))} | " + " | ".join(_f(v / 1e9) for v in gb)
                   + f" | {halved.get('storages', 0)}, {_f(halved.get('saved_bytes', 0) / 1e9)} |")
    return out


def render_parts(lines: list[str]) -> str:
    head = ["| run | size | spill GB | " + " | ".join(f"{name} GB" for name, _ in PARTS)
            + " | files, libraries' pages GB | image GB | gradients halved (storages, GB saved) |",
            "|---|---|---|" + "---|" * len(PARTS) + "---|---|---|"]
    return "\n".join(head + lines) + "\n"


def _replace(text: str, begin: str, end: str, block: str) -> str | None:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        return None
    head, rest = text.split(begin)
    return f"{head}{begin}\n{block}{end}{rest.split(end, 1)[1]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=JSON", help="a label for the run and scaling.py's JSON of it")
    ap.add_argument("--write", metavar="MD", help=f"replace the block between {BEGIN} and {END} in this file")
    args = ap.parse_args()
    all_rows, parts = [], []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            print(f"perf_table.py: {spec!r} is not LABEL=JSON", file=sys.stderr)
            return 2
        try:
            report = json.loads(Path(path).read_text())
            all_rows += rows(label, report)
            parts += parts_rows(label, report)
        except (OSError, ValueError) as e:
            print(f"perf_table.py: {path}: {e}", file=sys.stderr)
            return 2
    table, parts_table = render(all_rows), render_parts(parts) if parts else None
    if not args.write:
        sys.stdout.write(table + ("\n" + parts_table if parts_table else ""))
        return 0
    md = Path(args.write)
    text: str | None = _replace(md.read_text(), BEGIN, END, table)
    if text is None:
        print(f"perf_table.py: {md} has no single {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    if parts_table is not None:
        text = _replace(text, PARTS_BEGIN, PARTS_END, parts_table)
        if text is None:
            print(f"perf_table.py: {md} has no single {PARTS_BEGIN} ... {PARTS_END} block", file=sys.stderr)
            return 2
    md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
