"""Hostile inputs and faults, end to end through `snapguard` and `snapguard-runc`, as root.

The threat model: root runs snapguard over paths that other users (here uid 65534, nobody)
control, and over input (configs, images, argv) that may be malformed. Every case asserts the
exit status, exactly one typed line `snapguard <REASON>: ...` on stderr, no traceback anywhere,
that nothing was created, run or changed that should not have been, and that nothing hangs.

The classes come from a security review's corpus (180 bad inputs and faults against main):
root code execution through config, libdir and state dir; the checked binary being the one that
runs; image directories another user controls; verification reading outside the image; hangs on
special files; tracebacks on bad input and faults (ENOSPC, a CRIU that lies); concurrency;
targets CRIU cannot take; the umask.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from snapguard import image

BIN = Path(sys.executable).parent
SNAPGUARD = str(BIN / "snapguard")
SNAPGUARD_RUNC = str(BIN / "snapguard-runc")
REAL_CRIU = "/usr/local/sbin/criu"
REAL_RUNC = "/usr/sbin/runc"
NOBODY = 65534
TYPED = re.compile(r"^snapguard ([A-Z][A-Z0-9_]+): \S")
MANIFEST = image.MANIFEST_NAME
MARKER = image.MARKER_NAME

pytestmark = pytest.mark.stack  # snapguard as root on the real runc and CRIU

COUNTER = """
import sys, time
i = 0
while True:
    i += 1
    with open(sys.argv[1], "a") as f:
        f.write(f"{i}\\n")
    time.sleep(0.01)
"""

EVIL_SO = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void snapguard_test_evil(void) {
    int fd = open(MARKER_PATH, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, "ran as root\n", 12); close(fd); }
}
"""

# A stand-in for a pinned binary: records each call's first argument, then does what it is told
# per verb, else execs the real binary.
WRAPPER = """#!/bin/sh
printf '%s\\n' "$1" >> {record}
case "$1" in
{cases}
esac
exec {real} "$@"
"""


# --- helpers ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the hostile-input tests run snapguard as root (that is the threat model)")


def env_for(tmp: Path, config: Path | None = None, state: Path | None = None, **extra: str) -> dict[str, str]:
    """The caller's environment without any SNAPGUARD_* variable, then the test's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPGUARD_")}
    env["SNAPGUARD_CONFIG"] = str(config or tmp / "config.toml")
    env["SNAPGUARD_STATE_DIR"] = str(state or tmp / "state")
    env.update(extra)
    return env


def write_config(path: Path, **values: Any) -> Path:
    """A root-owned 0644 TOML file; strings as JSON strings (valid TOML basic strings)."""
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
    os.chmod(path, 0o644)
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    write_config(tmp_path / "config.toml")
    return env_for(tmp_path)


def run(argv: list[str], env: dict[str, str], timeout: float = 90, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, errors="replace", timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def sg(*args: str, env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return run([SNAPGUARD, *args], env, **kw)


def sg_runc(log: Path, *args: str, env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """snapguard-runc with a --log as containerd gives one: the typed line then goes to stderr alone."""
    return run([SNAPGUARD_RUNC, "--log", str(log), "--log-format", "json", *args], env, **kw)


def assert_typed(out: subprocess.CompletedProcess[str], reasons: str | tuple[str, ...], rc: int,
                 allowed_extra: tuple[str, ...] = ()) -> str:
    """Exit status rc, stderr exactly one typed line with one of `reasons` (plus lines starting with
    one of `allowed_extra`), no traceback anywhere. Returns the typed line."""
    everything = out.stdout + out.stderr
    assert "Traceback" not in everything, everything
    lines = out.stderr.splitlines()
    typed = [line for line in lines if TYPED.match(line)]
    other = [line for line in lines if not TYPED.match(line) and not line.startswith(allowed_extra or ("\0",))]
    assert len(typed) == 1 and not other, f"stderr is not one typed line:\n{out.stderr}"
    m = TYPED.match(typed[0])
    assert m is not None
    wanted = (reasons,) if isinstance(reasons, str) else reasons
    assert m.group(1) in wanted, f"expected {wanted}, got: {typed[0]}"
    assert out.returncode == rc, f"exit {out.returncode}, expected {rc}: {out.stderr}"
    return typed[0]


def runc_log_line(log: Path) -> dict[str, Any]:
    """The last line snapguard-runc appended to --log (runc's JSON log contract)."""
    lines = log.read_text().splitlines()
    assert lines, f"{log} is empty"
    return json.loads(lines[-1])


def report(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    return json.loads(out.stdout)


def tree(root: Path) -> dict[str, tuple[int, int, int, bytes | str | None]]:
    """{relative path: (mode, uid, size, content or link target)} of everything under root."""
    found: dict[str, tuple[int, int, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            what: bytes | str | None = None
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                what = Path(p).read_bytes()
            found[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_size, what)
    return found


def nobody_dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, mode)
    return path


def as_nobody(*argv: str) -> None:
    """Run the hostile preparation as nobody (no supplementary groups)."""
    subprocess.run(list(argv), user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", check=True, timeout=30,
                   stdin=subprocess.DEVNULL)


@pytest.fixture
def hostile_root() -> Iterator[Path]:
    """A root-owned 0755 directory nobody can traverse (tmp_path's parents are root's 0700), on a
    path root alone controls (/tmp is root's sticky directory)."""
    path = Path(tempfile.mkdtemp(prefix="snapguard-hostile-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def wrapper(path: Path, real: str, record: Path, cases: str = "") -> Path:
    """A root-owned executable in a root-only directory standing in for a pinned binary."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(WRAPPER.format(record=record, real=real, cases=cases))
    os.chmod(path, 0o755)
    return path


def recorded(record: Path) -> list[str]:
    return record.read_text().split() if record.exists() else []


# --- processes -------------------------------------------------------------------------------------


def lines(log: Path) -> int:
    try:
        return len(log.read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_lines(log: Path, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while lines(log) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log} has fewer than {n} lines")
        time.sleep(0.01)


def still_counting(log: Path) -> bool:
    n = lines(log)
    try:
        wait_lines(log, n + 3, timeout=5)
    except TimeoutError:
        return False
    return True


class Counter:
    def __init__(self, log: Path, code: str = COUNTER) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(log)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        wait_lines(log, 5)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def counter(tmp_path: Path) -> Iterator[Counter]:
    c = Counter(tmp_path / "counter.log")
    yield c
    c.stop()


def assert_no_dump(*dirs: Path) -> None:
    for d in dirs:
        for name in ("dump.log", "stats-dump", MARKER):
            assert not (d / name).exists(), f"CRIU dumped: {d / name} exists"


def assert_no_restore(*dirs: Path) -> None:
    for d in dirs:
        for name in ("restore.log", "stats-restore", "restored.pid"):
            assert not (d / name).exists(), f"CRIU restored: {d / name} exists"


# --- a sealed image, taken once, copied per test ----------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real sealed image of a counter (leave-running), whose process is then gone: a restore of
    it would reach CRIU."""
    tmp = tmp_path_factory.mktemp("pristine")
    write_config(tmp / "config.toml")
    c = Counter(tmp / "counter.log")
    try:
        out = sg("checkpoint", "--pid", str(c.pid), "--images", str(tmp / "img"), "--leave-running",
                 env=env_for(tmp))
        assert out.returncode == 0, out.stderr
    finally:
        c.stop()
    assert (tmp / "img" / MARKER).is_file()
    return tmp / "img"


@pytest.fixture
def img(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "img"
    shutil.copytree(pristine, dst, symlinks=True)
    os.chmod(dst, 0o700)
    return dst


def reseal(img: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the manifest and the marker's sha256 of it, as image.seal writes them: a tampered
    image that the marker still vouches for."""
    manifest = json.loads((img / MANIFEST).read_text())
    mutate(manifest)
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    (img / MANIFEST).write_bytes(data)
    marker = {"manifest_sha256": hashlib.sha256(data).hexdigest(), "schema": image.SCHEMA}
    (img / MARKER).write_bytes((json.dumps(marker, indent=2, sort_keys=True) + "\n").encode())


def test_pristine_copy_verifies(img: Path, env: dict[str, str]) -> None:
    """The control for the image cases below: an untampered copy passes verification."""
    out = sg("preflight", "--manifest", str(img), "--json", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert report(out)["verdict"] == "ready"


# --- 1. root code execution ---------------------------------------------------------------------


def build_evil_so(out: Path, marker: Path) -> Path:
    src = out.with_suffix(".c")
    src.write_text(EVIL_SO)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKER_PATH="{marker}"', "-o", str(out), str(src)],
                   check=True, timeout=60)
    src.unlink()
    return out


@pytest.fixture
def evil_so(tmp_path: Path) -> tuple[Path, Path]:
    """(a shared object whose constructor writes the marker file, the marker's path)."""
    marker = tmp_path / "evil-ran"
    build = tmp_path / "build"
    build.mkdir(mode=0o755)
    return build_evil_so(build / "evil.so", marker), marker


def test_trusted_libdir_control_plugin_runs_as_root(evil_so: tuple[Path, Path], counter: Counter,
                                                     tmp_path: Path) -> None:
    """The control: CRIU does dlopen() every *.so of a libdir root controls, as root. So the
    refusals below are what stands between a planted plugin and root."""
    so, marker = evil_so
    libdir = tmp_path / "libdir"
    libdir.mkdir(mode=0o755)
    shutil.copy(so, libdir / "evil.so")
    os.chmod(libdir / "evil.so", 0o644)
    write_config(tmp_path / "config.toml", criu_libdir=str(libdir))
    sg("checkpoint", "--pid", str(counter.pid), "--images", str(tmp_path / "i"), "--leave-running",
       env=env_for(tmp_path))
    assert marker.exists(), "CRIU did not load the plugin: the libdir refusals below prove nothing"


LIBDIR_CASES = ["nobody-libdir", "nobody-plugin", "group-writable-plugin", "plugin-links-to-nobody-file",
                "libdir-through-nobody-dir"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", LIBDIR_CASES)
def test_untrusted_libdir_plugin_never_loads(case: str, evil_so: tuple[Path, Path], counter: Counter,
                                             tmp_path: Path, hostile_root: Path) -> None:
    so, marker = evil_so
    if case == "nobody-libdir":
        libdir = nobody_dir(hostile_root / "libdir")
        staged = shutil.copy(so, hostile_root / "staged.so")  # readable by nobody
        as_nobody("cp", str(staged), str(libdir / "evil.so"))  # nobody plants its plugin
    elif case == "libdir-through-nobody-dir":
        libdir = nobody_dir(hostile_root / "drop") / "libdir"
        libdir.mkdir(mode=0o755)
        shutil.copy(so, libdir / "evil.so")
    else:
        libdir = tmp_path / "libdir"
        libdir.mkdir(mode=0o755)
        if case == "plugin-links-to-nobody-file":
            target = nobody_dir(tmp_path / "elsewhere") / "real.so"
            shutil.copy(so, target)
            os.chown(target, NOBODY, NOBODY)
            (libdir / "evil.so").symlink_to(target)
        else:
            shutil.copy(so, libdir / "evil.so")
            if case == "nobody-plugin":
                os.chown(libdir / "evil.so", NOBODY, NOBODY)
                os.chmod(libdir / "evil.so", 0o644)
            else:
                os.chmod(libdir / "evil.so", 0o664)
    write_config(tmp_path / "config.toml", criu_libdir=str(libdir))
    images = tmp_path / "images"
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), "--leave-running",
             env=env_for(tmp_path))
    line = assert_typed(out, ("UNTRUSTED_PATH", "CONFIG_INVALID"), 2)
    assert "criu_libdir" in line
    assert not marker.exists(), "a plugin root does not control ran as root"
    assert not images.exists() and not (tmp_path / "state").exists()
    assert still_counting(counter.log)
    # the operator's preflight says the same
    assert_typed(sg("preflight", "--node", env=env_for(tmp_path)), ("UNTRUSTED_PATH", "CONFIG_INVALID"), 2)
    assert not marker.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["env", "config", "missing-under-nobody-parent"])
def test_untrusted_state_dir_refused_and_untouched(how: str, counter: Counter, tmp_path: Path) -> None:
    write_config(tmp_path / "config.toml")
    images = tmp_path / "images"
    if how == "missing-under-nobody-parent":
        parent = nobody_dir(tmp_path / "theirs")
        state = parent / "state"
    else:
        parent = state = nobody_dir(tmp_path / "theirs")
    env = env_for(tmp_path, state=state)
    if how == "config":
        write_config(tmp_path / "config.toml", state_dir=str(state))
        del env["SNAPGUARD_STATE_DIR"]
    before = tree(parent)
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), "--leave-running", env=env)
    assert "state_dir" in assert_typed(out, ("UNTRUSTED_PATH", "CONFIG_INVALID"), 2)
    assert tree(parent) == before, "root wrote into a directory nobody controls"
    assert not images.exists()
    assert still_counting(counter.log)


@pytest.mark.timeout(60)
def test_pass_through_never_caches_into_untrusted_state_dir(tmp_path: Path) -> None:
    """`snapguard-runc state` caches runc's path in the state dir: only in one root controls."""
    write_config(tmp_path / "config.toml", runc=REAL_RUNC)
    mine = tmp_path / "state"
    out = run([SNAPGUARD_RUNC, "state", "no-such-container"], env_for(tmp_path, state=mine))
    assert "Traceback" not in out.stderr and out.returncode != 0  # runc's own answer
    assert (mine / "runc-path.cache").is_file(), "control: the cache is written where root may"
    theirs = nobody_dir(tmp_path / "theirs")
    out = run([SNAPGUARD_RUNC, "state", "no-such-container"], env_for(tmp_path, state=theirs))
    assert "Traceback" not in out.stderr and out.returncode != 0
    assert "container does not exist" in out.stderr or "not exist" in out.stderr, out.stderr
    assert list(theirs.iterdir()) == []


@pytest.fixture
def marker_runc(tmp_path: Path) -> tuple[Path, Path]:
    """(a root-owned, trusted runc stand-in that writes a marker when run, the marker): what a
    config written by someone else would make root run."""
    ran = tmp_path / "runc-ran"
    path = tmp_path / "bin" / "runc"
    path.parent.mkdir(mode=0o700)
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {ran}\nexec {REAL_RUNC} \"$@\"\n")
    os.chmod(path, 0o755)
    return path, ran


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["nobody-owned-file", "root-file-in-nobody-dir", "nobody-writes-as-nobody"])
def test_config_others_control_is_refused(where: str, marker_runc: tuple[Path, Path], tmp_path: Path,
                                          hostile_root: Path) -> None:
    runc, ran = marker_runc
    if where == "nobody-owned-file":
        config = write_config(tmp_path / "config.toml", runc=str(runc))
        os.chown(config, NOBODY, NOBODY)
    elif where == "root-file-in-nobody-dir":
        config = write_config(nobody_dir(tmp_path / "etc") / "config.toml", runc=str(runc))
    else:
        drop = nobody_dir(hostile_root / "etc")
        config = drop / "config.toml"
        as_nobody("sh", "-c", f"printf 'runc = \"{runc}\"\\n' > {config}")
    env = env_for(tmp_path, config=config)
    log = tmp_path / "runc-log.json"

    out = sg("preflight", "--node", env=env)
    assert "config file" in assert_typed(out, "UNTRUSTED_PATH", 2)

    out = sg_runc(log, "checkpoint", "--image-path", str(tmp_path / "ck"), "c1", env=env)
    assert_typed(out, "UNTRUSTED_PATH", 2)
    assert runc_log_line(log)["msg"].startswith("snapguard UNTRUSTED_PATH: ")

    out = sg_runc(log, "state", "c1", env=env)  # the pass-through path reads the config too
    assert_typed(out, "UNTRUSTED_PATH", 2)
    assert not ran.exists(), "root ran the runc a config root does not control named"
    assert not (tmp_path / "state").exists()


# --- 2. the checked binary is the one that runs ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_who", ["chown", "nobody"])
def test_criu_symlink_in_nobody_dir_refused(as_who: str, counter: Counter, tmp_path: Path,
                                            hostile_root: Path) -> None:
    drop = nobody_dir(hostile_root / "bin")
    link = drop / "criu"
    if as_who == "nobody":
        as_nobody("ln", "-s", REAL_CRIU, str(link))
    else:
        link.symlink_to(REAL_CRIU)
        os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    write_config(tmp_path / "config.toml", criu=str(link))
    images = tmp_path / "images"
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), env=env_for(tmp_path))
    assert "`criu`" in assert_typed(out, "UNTRUSTED_PATH", 2)
    assert not images.exists()
    assert still_counting(counter.log)  # not dumped (no --leave-running: a dump would have killed it)
    assert_typed(sg("preflight", "--node", env=env_for(tmp_path)), "UNTRUSTED_PATH", 2)


@pytest.fixture
def runc_recorder(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose pinned runc records every call (and then runs the real runc)."""
    record = tmp_path / "runc-calls"
    runc = wrapper(tmp_path / "bin" / "runc", REAL_RUNC, record)
    write_config(tmp_path / "config.toml", runc=str(runc))
    return env_for(tmp_path), record


@pytest.mark.timeout(60)
def test_relative_criu_flag_is_a_usage_error_and_runc_not_run(runc_recorder: tuple[dict[str, str], Path],
                                                               tmp_path: Path) -> None:
    env, record = runc_recorder
    log = tmp_path / "log.json"
    out = run([SNAPGUARD_RUNC, "--log", str(log), "--log-format", "json", "--criu", "criu", "checkpoint",
               "--image-path", str(tmp_path / "ck"), "c1"], env)
    assert "--criu" in assert_typed(out, "USAGE_ERROR", 2)
    assert recorded(record) == [], "runc ran"
    assert runc_log_line(log)["msg"].startswith("snapguard USAGE_ERROR: ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["root-link", "link-in-nobody-dir", "linked-parent-dir"])
def test_criu_flag_through_a_link_refused_and_runc_not_run(where: str, runc_recorder: tuple[dict[str, str], Path],
                                                           tmp_path: Path) -> None:
    env, record = runc_recorder
    if where == "root-link":
        links = tmp_path / "links"
        links.mkdir(mode=0o755)
        criu = links / "criu"
        criu.symlink_to(REAL_CRIU)
    elif where == "link-in-nobody-dir":
        criu = nobody_dir(tmp_path / "theirs") / "criu"
        criu.symlink_to(REAL_CRIU)
    else:
        # a real, trusted file named through a symlinked directory component
        (tmp_path / "sbin-link").symlink_to("/usr/local/sbin")
        criu = tmp_path / "sbin-link" / "criu"
    log = tmp_path / "log.json"
    out = run([SNAPGUARD_RUNC, "--log", str(log), "--log-format", "json", "--criu", str(criu), "checkpoint",
               "--image-path", str(tmp_path / "ck"), "c1"], env)
    assert_typed(out, "UNTRUSTED_PATH", 1)
    assert recorded(record) == [], "runc ran"


# --- 3. image directories another user controls --------------------------------------------------


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A root-owned 0644 file a planted link may point at."""
    path = tmp_path / "precious"
    path.write_bytes(b"root's own data\n")
    os.chmod(path, 0o644)
    return path


def fingerprint(path: Path) -> tuple[bytes, int, int]:
    st = os.stat(path)
    return path.read_bytes(), st.st_mode, st.st_uid


@pytest.mark.timeout(60)
@pytest.mark.parametrize("images_at", ["the-nobody-dir", "new-dir-inside-it", "nobody-subdir"])
def test_checkpoint_into_nobody_dir_with_planted_link(images_at: str, counter: Counter, env: dict[str, str],
                                                      precious: Path, hostile_root: Path) -> None:
    drop = nobody_dir(hostile_root / "drop")
    as_nobody("ln", "-s", str(precious), str(drop / "pages-1.img"))
    as_nobody("ln", "-s", str(precious), str(drop / "inventory.img"))
    if images_at == "the-nobody-dir":
        images = drop
    elif images_at == "new-dir-inside-it":
        images = drop / "img"
    else:
        images = drop / "img"
        as_nobody("mkdir", "-m", "0755", str(images))
        as_nobody("ln", "-s", str(precious), str(images / "pages-1.img"))
    before = fingerprint(precious), tree(drop)
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), env=env)
    assert_typed(out, "UNTRUSTED_PATH", 1)
    assert (fingerprint(precious), tree(drop)) == before, "root changed something through nobody's tree"
    assert_no_dump(drop, images) if images.exists() else assert_no_dump(drop)
    assert still_counting(counter.log)


@pytest.mark.timeout(60)
def test_runc_checkpoint_work_path_in_nobody_dir_is_typed(runc_recorder: tuple[dict[str, str], Path],
                                                          tmp_path: Path, hostile_root: Path) -> None:
    """A failing snapguard-runc checkpoint writes its record into the work path, creating it when
    missing (runc's contract): never under a directory another user controls, and never a traceback."""
    env, _ = runc_recorder
    drop = nobody_dir(hostile_root / "drop")
    log = tmp_path / "log.json"
    out = sg_runc(log, "checkpoint", "--image-path", str(drop / "img"), "no-such-container", env=env)
    assert_typed(out, "CONTAINER_NOT_FOUND", 1)
    assert list(drop.iterdir()) == []


def chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for p in path.iterdir():
        os.chown(p, uid, uid, follow_symlinks=False)


@pytest.fixture
def criu_recorder(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose pinned CRIU records the verb of every call, then runs the real one."""
    record = tmp_path / "criu-calls"
    criu = wrapper(tmp_path / "bin" / "criu", REAL_CRIU, record)
    write_config(tmp_path / "config.toml", criu=str(criu))
    return env_for(tmp_path), record


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["nobody-owned-dir", "nobody-owned-files", "group-writable-dir",
                                 "world-writable-file", "inside-nobody-dir"])
def test_restore_from_image_others_control(how: str, img: Path, criu_recorder: tuple[dict[str, str], Path],
                                           tmp_path: Path) -> None:
    env, record = criu_recorder
    target = img
    if how == "nobody-owned-dir":
        os.chown(img, NOBODY, NOBODY)
    elif how == "nobody-owned-files":
        chown_tree(img, NOBODY)
        os.chown(img, 0, 0)
    elif how == "group-writable-dir":
        os.chmod(img, 0o770)
    elif how == "world-writable-file":
        pages = max(img.glob("pages-*.img"), key=lambda p: p.stat().st_size)
        os.chmod(pages, 0o666)
    else:
        target = nobody_dir(tmp_path / "theirs") / "img"
        img.rename(target)
    out = sg("restore", "--images", str(target), env=env)
    assert_typed(out, "UNTRUSTED_PATH", 1)
    assert "restore" not in recorded(record)
    assert_no_restore(target)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["root-link", "link-in-nobody-dir", "nobody-link-in-sticky-dir"])
def test_images_that_is_a_symlink_refused_before_criu(how: str, counter: Counter, env: dict[str, str],
                                                      tmp_path: Path, hostile_root: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    if how == "root-link":
        link = tmp_path / "link"
        link.symlink_to(real)
    elif how == "link-in-nobody-dir":
        link = nobody_dir(tmp_path / "theirs") / "link"
        link.symlink_to(real)
    else:
        sticky = hostile_root / "sticky"
        sticky.mkdir()
        os.chmod(sticky, 0o1777)
        link = sticky / "link"
        as_nobody("ln", "-s", str(real), str(link))
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(link), "--json", env=env)
    assert_typed(out, ("UNTRUSTED_PATH", "IMAGE_WRITE_FAILED", "USAGE_ERROR"), 1)
    alive = still_counting(counter.log)
    assert report(out)["workload_intact"] is alive, "the failure record misstates the workload's fate"
    assert list(real.iterdir()) == [], "CRIU dumped through the link before snapguard refused it"
    assert alive, "the workload was dumped (and so killed) through a link snapguard then refused to seal"
    out = sg("restore", "--images", str(link), env=env)
    assert_typed(out, ("UNTRUSTED_PATH", "IMAGE_INCOMPLETE"), 1)
    assert list(real.iterdir()) == []


# --- 4. verification never reads outside the image ----------------------------------------------------


SECRET_SIZE = 4243


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["sub/secret", "../secret", "/etc/shadow", "..", "."])
def test_manifest_name_outside_the_image(name: str, img: Path, criu_recorder: tuple[dict[str, str], Path],
                                         tmp_path: Path) -> None:
    """A manifest entry that is no plain file name: refused from the manifest alone; nothing of the
    file it names (its size, its digest) leaks into the message or the record."""
    env, record = criu_recorder
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    secret = os.urandom(SECRET_SIZE)
    for where in (outside / "secret", tmp_path / "secret"):
        where.write_bytes(secret)
        os.chmod(where, 0o600)
    (img / "sub").symlink_to(outside)  # the component a multi-part name would go through
    digest = hashlib.sha256(secret).hexdigest()
    reseal(img, lambda m: m["files"].__setitem__(name, {"size": 1, "sha256": "0" * 64}))
    for out in (sg("restore", "--images", str(img), "--json", env=env),
                sg("preflight", "--manifest", str(img), "--json", env=env)):
        text = out.stdout + out.stderr
        assert not re.search(rf"(?<![\d.]){SECRET_SIZE}(?![\d.])", text), f"the outside file's size leaked: {text}"
        assert digest[:12] not in text and hashlib.sha256(hashlib.sha256(secret).digest()).hexdigest()[:12] not in text
        assert "Traceback" not in text
    restore = sg("restore", "--images", str(img), env=env)
    assert_typed(restore, "MANIFEST_INVALID", 1)
    blockers = report(sg("preflight", "--manifest", str(img), "--json", env=env))["blockers"]
    assert [b["reason"] for b in blockers] == ["MANIFEST_INVALID"]
    assert "restore" not in recorded(record)
    assert_no_restore(img)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["cgroup.img", "pages-99.img"])
def test_unlisted_image_file_planted(planted: str, img: Path, criu_recorder: tuple[dict[str, str], Path]) -> None:
    env, record = criu_recorder
    (img / planted).write_bytes(b"\x00" * 64)
    os.chmod(img / planted, 0o600)
    line = assert_typed(sg("restore", "--images", str(img), env=env), "IMAGE_CORRUPT", 1)
    assert planted in line
    assert "restore" not in recorded(record)
    assert_no_restore(img)


# --- 5. special files never hang a run ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fifo", "reason"), [(MARKER, "IMAGE_CORRUPT"), (MANIFEST, "MANIFEST_INVALID"),
                                              ("pages-1.img", "IMAGE_CORRUPT")])
def test_fifo_in_the_image_does_not_hang(fifo: str, reason: str, img: Path,
                                         criu_recorder: tuple[dict[str, str], Path]) -> None:
    env, record = criu_recorder
    (img / fifo).unlink()
    os.mkfifo(img / fifo, 0o600)
    for target in (img, img / MANIFEST):
        t = time.monotonic()
        out = sg("preflight", "--manifest", str(target), "--json", env=env, timeout=30)
        assert time.monotonic() - t < 20
        assert out.returncode == 1, out.stdout + out.stderr
        assert [b["reason"] for b in report(out)["blockers"]] == [reason]
    t = time.monotonic()
    out = sg("restore", "--images", str(img), env=env, timeout=30)
    assert time.monotonic() - t < 20
    assert_typed(out, reason, 1)
    assert "restore" not in recorded(record)
    assert stat.S_ISFIFO(os.lstat(img / fifo).st_mode)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-null"])
def test_config_that_is_no_regular_file(kind: str, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    if kind == "fifo":
        os.mkfifo(config, 0o644)
    elif kind == "directory":
        config.mkdir(mode=0o755)
    else:
        config = Path("/dev/null")
    env = env_for(tmp_path, config=config)
    # /dev/null is writable by all: that it is no config file is the second thing wrong with it
    reasons = ("CONFIG_INVALID", "UNTRUSTED_PATH") if kind == "dev-null" else ("CONFIG_INVALID",)
    assert_typed(sg("preflight", "--node", env=env, timeout=30), reasons, 2)
    log = tmp_path / "log.json"
    assert_typed(sg_runc(log, "state", "x", env=env, timeout=30), reasons, 2)
    assert runc_log_line(log)["msg"].startswith(tuple(f"snapguard {r}: " for r in reasons))


# --- 6. bad input and faults are typed, never a traceback --------------------------------------------


BAD_CONFIGS = {
    "non-utf8": b'runc = "/usr/sbin/runc"\n# caf\xe9\n',
    "nul": b'runc = "/usr/sbin/runc"\x00\n',
    "bad-toml": b"runc = [\n",
    "deep-nesting": b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "unknown-key": b'runc = "/usr/sbin/runc"\nrunc_extra = 1\n',
    "relative-runc": b'runc = "runc"\n',
    "bool-timeout": b"criu_timeout_s = true\n",
    "huge": b"# " + b"x" * (2 << 20) + b"\n",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_one_typed_line(name: str, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_bytes(BAD_CONFIGS[name])
    os.chmod(config, 0o644)
    env = env_for(tmp_path)
    assert_typed(sg("preflight", "--node", env=env), "CONFIG_INVALID", 2)
    log = tmp_path / "log.json"
    out = sg_runc(log, "state", "x", env=env)  # the pass-through path: every container operation
    assert_typed(out, "CONFIG_INVALID", 2)
    assert runc_log_line(log)["msg"].startswith("snapguard CONFIG_INVALID: ")
    # without --log the line goes to stderr in runc's own format, still one line
    out = run([SNAPGUARD_RUNC, "state", "x"], env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) == 1 and 'msg="snapguard CONFIG_INVALID: ' in out.stderr, out.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb", ["checkpoint", "restore"])
def test_images_name_too_long(verb: str, counter: Counter, env: dict[str, str], tmp_path: Path) -> None:
    images = tmp_path / ("x" * 300)
    args = ["--pid", str(counter.pid), "--leave-running"] if verb == "checkpoint" else []
    out = sg(verb, *args, "--images", str(images), env=env)
    assert_typed(out, "IMAGE_WRITE_FAILED" if verb == "checkpoint" else "IMAGE_INCOMPLETE", 1)
    assert still_counting(counter.log)


@pytest.mark.timeout(60)
def test_images_with_a_newline(counter: Counter, env: dict[str, str], tmp_path: Path) -> None:
    """A newline is a legal file name byte: the snapshot is taken, and any message stays one line."""
    images = tmp_path / "a\nb"
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), "--leave-running", env=env)
    assert "Traceback" not in out.stdout + out.stderr
    assert out.returncode == 0, out.stderr
    assert (images / MARKER).is_file()
    os.unlink(images / MARKER)
    out = sg("restore", "--images", str(images), env=env)
    assert "\\n" in assert_typed(out, "IMAGE_INCOMPLETE", 1) or "a b" in out.stderr


@pytest.mark.timeout(60)
def test_images_that_is_a_regular_file(counter: Counter, env: dict[str, str], tmp_path: Path) -> None:
    images = tmp_path / "file"
    images.write_bytes(b"not an image\n")
    os.chmod(images, 0o644)
    before = fingerprint(images)
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), env=env)
    assert_typed(out, "IMAGE_WRITE_FAILED", 1)
    assert fingerprint(images) == before
    assert still_counting(counter.log)
    out = sg("restore", "--images", str(images), env=env)
    assert_typed(out, "IMAGE_INCOMPLETE", 1)
    assert fingerprint(images) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [MANIFEST, "pages-1.img", "no-such-dir"])
def test_restore_images_naming_a_path_inside_a_sealed_image(name: str, img: Path,
                                                            criu_recorder: tuple[dict[str, str], Path]) -> None:
    """`--images` names a file of a sealed image (or a missing entry in it): the directory
    verified must be the one CRIU reads, so this is no image directory, refused before CRIU."""
    env, record = criu_recorder
    before = tree(img)
    out = sg("restore", "--images", str(img / name), env=env)
    assert_typed(out, "IMAGE_INCOMPLETE", 1)
    assert "restore" not in recorded(record)
    assert tree(img) == before


@pytest.mark.timeout(60)
def test_manifest_that_is_a_directory(img: Path, criu_recorder: tuple[dict[str, str], Path]) -> None:
    env, record = criu_recorder
    (img / MANIFEST).unlink()
    (img / MANIFEST).mkdir(mode=0o700)
    assert_typed(sg("restore", "--images", str(img), env=env), "MANIFEST_INVALID", 1)
    out = sg("preflight", "--manifest", str(img), "--json", env=env)
    assert out.returncode == 1 and [b["reason"] for b in report(out)["blockers"]] == ["MANIFEST_INVALID"]
    # named by its path, the directory is taken for an image directory of its own (no marker)
    out = sg("preflight", "--manifest", str(img / MANIFEST), "--json", env=env)
    assert out.returncode == 1
    assert [b["reason"] for b in report(out)["blockers"]] in (["MANIFEST_INVALID"], ["IMAGE_INCOMPLETE"])
    assert "restore" not in recorded(record)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--container", ""], ["--pid", "-1"], ["--pid", "99999999999999999999"],
                                  ["--manifest", ""]])
def test_preflight_bad_target_is_typed(args: list[str], env: dict[str, str]) -> None:
    out = sg("preflight", *args, env=env)
    assert "Traceback" not in out.stdout + out.stderr
    if args == ["--container", ""]:
        assert_typed(out, "USAGE_ERROR", 2)
    else:
        assert out.returncode in (1, 2), out.stdout + out.stderr
        if out.stderr:
            assert_typed(out, ("USAGE_ERROR", "PROCESS_NOT_FOUND", "IMAGE_INCOMPLETE"), out.returncode)
        else:
            assert out.stdout.startswith("snapguard preflight ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [5, None, "x", [5], [{"pid": 1.5, "comm": "c", "gpu": False,
                                                         "gpu_memory_bytes": 0, "rss_bytes": 0}]])
def test_resealed_manifest_processes_malformed(value: Any, img: Path,
                                               criu_recorder: tuple[dict[str, str], Path]) -> None:
    env, record = criu_recorder
    reseal(img, lambda m: m.__setitem__("processes", value))
    assert "processes" in assert_typed(sg("restore", "--images", str(img), env=env), "MANIFEST_INVALID", 1)
    out = sg("preflight", "--manifest", str(img), "--json", env=env)
    assert out.returncode == 1 and [b["reason"] for b in report(out)["blockers"]] == ["MANIFEST_INVALID"]
    assert "restore" not in recorded(record)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["drop-files", "files-null", "size-float", "sha-upper", "schema-2",
                                    "not-an-object", "nan"])
def test_resealed_manifest_other_malformations(change: str, img: Path,
                                               criu_recorder: tuple[dict[str, str], Path]) -> None:
    env, record = criu_recorder
    if change == "not-an-object":
        data = b"[1, 2, 3]\n"
    elif change == "nan":
        data = (img / MANIFEST).read_bytes().replace(b'"epoch": ', b'"epoch": NaN, "was": ', 1)
    else:
        m = json.loads((img / MANIFEST).read_text())
        first = sorted(m["files"])[0]
        if change == "drop-files":
            del m["files"]
        elif change == "files-null":
            m["files"] = None
        elif change == "size-float":
            m["files"][first]["size"] = float(m["files"][first]["size"])
        elif change == "sha-upper":
            m["files"][first]["sha256"] = m["files"][first]["sha256"].upper()
        else:
            m["schema"] = "snapguard.manifest/2"
        data = json.dumps(m).encode()
    (img / MANIFEST).write_bytes(data)
    marker = {"manifest_sha256": hashlib.sha256(data).hexdigest(), "schema": image.SCHEMA}
    (img / MARKER).write_text(json.dumps(marker))
    assert_typed(sg("restore", "--images", str(img), env=env), "MANIFEST_INVALID", 1)
    assert "restore" not in recorded(record)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """mount(size) -> a fresh tmpfs of that size, root's 0700, unmounted at the end."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir(mode=0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       check=True, timeout=30)
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in reversed(mounted):
            if subprocess.run(["umount", str(where)], timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(where)], timeout=30)


NO_RECORD = ("snapguard: cannot write the record",)  # the CLI's note when the record itself cannot be written


@pytest.mark.timeout(90)
def test_enospc_during_dump(small_fs: Callable[[str], Path], counter: Counter, env: dict[str, str]) -> None:
    images = small_fs("2m") / "img"
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), "--json", env=env)
    assert_typed(out, ("CRIU_DUMP_FAILED", "IMAGE_WRITE_FAILED"), 1, allowed_extra=NO_RECORD)
    assert still_counting(counter.log), "a failed dump must leave the workload running"
    assert not (images / MARKER).exists() and not (images / MANIFEST).exists()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("leave_running", [True, False])
def test_enospc_while_sealing(leave_running: bool, small_fs: Callable[[str], Path], counter: Counter,
                              tmp_path: Path) -> None:
    """CRIU's dump fits; then the file system fills before the manifest is written. The record
    must say what became of the workload: a stop dump has ended it."""
    fs = small_fs("64m")
    record = tmp_path / "criu-calls"
    fill = (f'dump) {REAL_CRIU} "$@"; rc=$?; dd if=/dev/zero of={fs}/filler bs=64k >/dev/null 2>&1; '
            'exit $rc ;;')
    criu = wrapper(tmp_path / "bin" / "criu", REAL_CRIU, record, fill)
    write_config(tmp_path / "config.toml", criu=str(criu))
    images = fs / "img"
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), "--json",
             *(["--leave-running"] if leave_running else []), env=env_for(tmp_path))
    assert "dump" in recorded(record)
    assert "No space left" in assert_typed(out, "IMAGE_WRITE_FAILED", 1, allowed_extra=NO_RECORD)
    assert still_counting(counter.log) is leave_running
    assert report(out)["workload_intact"] is leave_running, "the failure record misstates the workload's fate"
    assert (images / "pages-1.img").exists(), "control: CRIU's dump fitted"
    assert not (images / MARKER).exists() and not (images / MANIFEST).exists()
    assert [p.name for p in images.iterdir() if ".tmp." in p.name] == []


LYING_RESTORES = {
    "exit-0-no-pidfile": "restore) exit 0 ;;",
    "exit-0-garbage-pidfile": ('restore) while [ $# -gt 0 ]; do [ "$1" = --pidfile ] && echo nonsense > "$2"; '
                               "shift; done; exit 0 ;;"),
    "exit-0-pidfile-names-init": ('restore) while [ $# -gt 0 ]; do [ "$1" = --pidfile ] && echo 1 > "$2"; '
                                  "shift; done; exit 0 ;;"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lie", sorted(LYING_RESTORES))
def test_criu_restore_that_lies(lie: str, img: Path, tmp_path: Path) -> None:
    record = tmp_path / "criu-calls"
    criu = wrapper(tmp_path / "bin" / "criu", REAL_CRIU, record, LYING_RESTORES[lie])
    write_config(tmp_path / "config.toml", criu=str(criu))
    out = sg("restore", "--images", str(img), "--json", env=env_for(tmp_path))
    assert "restore" in recorded(record), out.stderr
    assert_typed(out, "CRIU_RESTORE_FAILED", 1)
    assert report(out)["ok"] is False


# --- 7. concurrency ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_checkpoints_of_one_pid_at_once(counter: Counter, tmp_path: Path) -> None:
    """The dump is made slow (the pinned CRIU sleeps 3 s before dumping) so that the runs overlap."""
    record = tmp_path / "criu-calls"
    criu = wrapper(tmp_path / "bin" / "criu", REAL_CRIU, record, "dump) sleep 3 ;;")
    write_config(tmp_path / "config.toml", criu=str(criu))
    env = env_for(tmp_path)
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([SNAPGUARD, "checkpoint", "--pid", str(counter.pid), "--images", str(d),
                               "--leave-running"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL) for d in dirs]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=100)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    assert sorted(o.returncode for o in outs) == [0, 1], [o.stderr for o in outs]
    winner, loser = (0, 1) if outs[0].returncode == 0 else (1, 0)
    assert "Traceback" not in outs[winner].stdout + outs[winner].stderr
    assert_typed(outs[loser], "SNAPSHOT_IN_PROGRESS", 1)
    assert (dirs[winner] / MARKER).is_file()
    assert not dirs[loser].exists(), "the refused run created its image directory"
    assert recorded(record).count("dump") == 1
    assert still_counting(counter.log)


@pytest.mark.timeout(180)
def test_eight_checkpoints_share_one_state_dir(tmp_path: Path) -> None:
    write_config(tmp_path / "config.toml")
    env = env_for(tmp_path)
    counters = [Counter(tmp_path / f"counter{i}.log") for i in range(8)]
    try:
        procs = [subprocess.Popen([SNAPGUARD, "checkpoint", "--pid", str(c.pid), "--images", str(tmp_path / f"i{i}"),
                                   "--leave-running"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, stdin=subprocess.DEVNULL) for i, c in enumerate(counters)]
        results = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=170)
            results.append((p.returncode, stdout, stderr))
        for rc, stdout, stderr in results:
            assert "Traceback" not in stdout + stderr and "FileExistsError" not in stdout + stderr, stderr
            assert rc == 0, stderr
        for i, c in enumerate(counters):
            assert (tmp_path / f"i{i}" / MARKER).is_file()
            assert still_counting(c.log)
        # every run's private directory was removed; only shared, fixed names remain
        state = tmp_path / "state"
        assert not [p for p in state.iterdir() if p.name.startswith("run-")]
    finally:
        for c in counters:
            c.stop()


# --- 8. targets CRIU cannot take ----------------------------------------------------------------------


THREADED = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
open(sys.argv[1], "w").write("1\\n")
time.sleep(600)
"""


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[dict[str, int]]:
    zombie = subprocess.Popen(["true"])  # never waited for until the end: a zombie of this process
    threaded = subprocess.Popen([sys.executable, "-c", THREADED, str(tmp_path / "threaded")],
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_lines(tmp_path / "threaded", 1)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tids = [int(t) for t in os.listdir(f"/proc/{threaded.pid}/task") if int(t) != threaded.pid]
        assert tids
        assert "kthreadd" in Path("/proc/2/status").read_text().splitlines()[0]
        yield {"KERNEL_THREAD": 2, "ZOMBIE_PROCESS": zombie.pid, "NOT_THREAD_GROUP_LEADER": tids[0]}
    finally:
        threaded.kill()
        threaded.wait()
        zombie.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reason", ["KERNEL_THREAD", "ZOMBIE_PROCESS", "NOT_THREAD_GROUP_LEADER"])
def test_pid_criu_cannot_take(reason: str, targets: dict[str, int], env: dict[str, str], tmp_path: Path) -> None:
    pid = targets[reason]
    out = sg("preflight", "--pid", str(pid), "--json", env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert [b["reason"] for b in report(out)["blockers"]] == [reason]
    text = sg("preflight", "--pid", str(pid), env=env)
    assert text.returncode == 1 and reason in text.stdout and "Traceback" not in text.stdout + text.stderr
    images = tmp_path / "images"
    assert_typed(sg("checkpoint", "--pid", str(pid), "--images", str(images), env=env), reason, 1)
    assert not images.exists()


# --- 9. the umask ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_umask_000_everything_private(counter: Counter, env: dict[str, str], tmp_path: Path) -> None:
    images = tmp_path / "a" / "b" / "c" / "img"
    out = sg("checkpoint", "--pid", str(counter.pid), "--images", str(images), "--leave-running", env=env, umask=0)
    assert out.returncode == 0, out.stderr
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c", images):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, f"{d} is {stat.S_IMODE(os.stat(d).st_mode):04o}"
    for root in (images, tmp_path / "state"):
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                mode = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
                assert mode & 0o077 == 0, f"{os.path.join(dirpath, name)} is {mode:04o}"
