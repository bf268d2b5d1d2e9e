"""The deadline snapguard enforces on a whole runc or CRIU run: ten times `criu_timeout_s`, at most
`run_timeout_s` (the fault tests' hang rows set a short one); a dump whose workload died under it
gets a tenth of it, at most 10 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapguard.config import ConfigError, load
from snapguard.pipeline import Timeouts


def _timeouts(tmp_path: Path, text: str) -> Timeouts:
    f = tmp_path / "config.toml"
    f.write_text(text)
    return Timeouts.from_config(load({"SNAPGUARD_CONFIG": str(f)}))


def test_run_deadline_is_ten_times_criu_timeout_by_default(tmp_path: Path) -> None:
    assert _timeouts(tmp_path, "").run_s == 600.0
    assert _timeouts(tmp_path, "criu_timeout_s = 3600\n").run_s == 36000.0


def test_run_timeout_caps_the_run_deadline(tmp_path: Path) -> None:
    t = _timeouts(tmp_path, "criu_timeout_s = 1\nrun_timeout_s = 4\n")
    assert (t.criu_s, t.run_s) == (1, 4.0)
    assert _timeouts(tmp_path, "criu_timeout_s = 2\nrun_timeout_s = 60\n").run_s == 20.0  # a cap, not a floor


def test_a_dead_workloads_dump_gets_a_tenth_of_the_deadline_at_most_10_s(tmp_path: Path) -> None:
    assert _timeouts(tmp_path, "").died_grace_s == 10.0
    assert _timeouts(tmp_path, "run_timeout_s = 30\n").died_grace_s == 3.0


@pytest.mark.parametrize("text", ["run_timeout_s = 0\n", "run_timeout_s = 36001\n", 'run_timeout_s = "4"\n'])
def test_run_timeout_out_of_range_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as e:
        _timeouts(tmp_path, text)
    assert "run_timeout_s" in str(e.value)
