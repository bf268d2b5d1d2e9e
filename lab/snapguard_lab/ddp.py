"""The ddp workload (torch.distributed, gloo) as a job of the lab: launched with or without the take
point's hook, its ranks' loss bits per step compared with an uninterrupted reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from snapguard.takepoint import site_dir

from . import workloads
from .testbed import product_root

__all__ = ["DDP_LAUNCH", "DdpJob"]

DDP_LAUNCH = workloads.path("ddp", "launch.py")


@dataclass
class DdpJob:
    """A run of the ddp workload (torch.distributed, gloo) whose ranks log their loss bits per step."""

    out: Path
    world: int
    steps: int
    device: str = "cpu"
    backend: str = "gloo"

    def start(self, take_dir: str | None) -> subprocess.Popen[bytes]:
        """Launch it; with take_dir, every process runs snapguard's take-point hook."""
        self.out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if take_dir:
            env["PYTHONPATH"] = os.pathsep.join([site_dir(), product_root()])
            env["SNAPGUARD_TAKE_DIR"] = take_dir
        log = open(self.out / "launcher.out", "ab")
        proc = subprocess.Popen([sys.executable, str(DDP_LAUNCH), "--world", str(self.world), "--out", str(self.out),
                                 "--steps", str(self.steps), "--device", self.device, "--backend", self.backend],
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        return proc

    def run_uninterrupted(self, timeout: float = 300) -> DdpJob:
        """Run it to the end without the hook: the reference a snapshotted run is compared with."""
        rc = self.start(None).wait(timeout=timeout)
        if rc != 0:
            raise RuntimeError(f"reference job in {self.out} exited {rc}")
        self.results()
        return self

    def rows(self, rank: int) -> dict[int, list[str]]:
        """{step: [loss bits, ...]}: a step logged twice (a restore went back) has two entries."""
        got: dict[int, list[str]] = {}
        try:
            lines = (self.out / f"rank{rank}.log").read_text().splitlines()
        except FileNotFoundError:
            return got
        for line in lines:
            _, step, bits, _ = line.split()
            got.setdefault(int(step), []).append(bits)
        return got

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(max(self.rows(r), default=0) >= step for r in range(self.world)):
                return
            time.sleep(0.02)
        raise TimeoutError(f"job in {self.out} did not reach step {step}")

    def results(self, timeout: float = 120) -> list[dict[str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            paths = [self.out / f"rank{r}.result.json" for r in range(self.world)]
            if all(p.exists() for p in paths):
                return [json.loads(p.read_text()) for p in paths]
            time.sleep(0.05)
        raise TimeoutError(f"job in {self.out} did not finish")

    def mismatches(self, reference: DdpJob) -> list[str]:
        """Where this run differs from the reference: steps, loss bits, final digests."""
        errors = []
        if self.results() != reference.results():
            errors.append("final digests differ")
        for r in range(self.world):
            want, got = reference.rows(r), self.rows(r)
            if set(got) != set(want):
                errors.append(f"rank {r}: steps {sorted(set(want) ^ set(got))[:5]} differ")
            errors += [f"rank {r} step {s}: {bits} != {want.get(s)}" for s, bits in sorted(got.items())
                       if set(bits) != set(want.get(s, []))][:5]
        return errors
