"""`snapguard completion zsh` in a real zsh: an interactive zsh (driven through zsh's own zpty
module, as a terminal would) runs compinit, loads the script as the completion's help says, and
completes `snapguard i<TAB>`, `snapguard push --s<TAB>` and a path after `--images`; what zsh's
completion system offers is recorded by a compadd wrapper. zsh comes from the test rig
(packaging/profiles/rig.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = os.path.dirname(sys.executable)
ZSH = "/usr/bin/zsh"
# each TAB starts snapguard's completer (a Python start): a few seconds for a whole drive, but a
# loaded 2-core machine (a CRIU dump of GiBs beside it) was seen past 60 s
DRIVE_S = 180

# the interactive zsh's startup: compinit, the script as the help says to load it, then a compadd
# that records each offer (one file per case: the driver names it in $SG_CASE), and a precmd that
# holds each prompt back a little, as a loaded machine does, so a driver that writes before zle
# reads again loses its typed case here every time (see DRIVER)
ZSHRC = """\
autoload -U compinit && compinit -u -d "$ZDOTDIR/.zcompdump"
{load}
compadd () {{
  local -a __offered
  builtin compadd -O __offered "$@"
  (( ${{#__offered}} )) && print -rl -- $__offered >> "$ZDOTDIR/offers.$SG_CASE"
  builtin compadd "$@"
}}
print -r -- "comps=${{_comps[snapguard]-none}}" > "$ZDOTDIR/comps"
precmd () {{ sleep 0.1 }}
PS1='sg-ready> '
"""

# the driver: each case is typed with a TAB, then the line is cleared and a command run whose
# output (sg-case-N-done, never in the typed text) says that the completion has ended. Every read
# runs up to the prompt that follows, so the next bytes are written only once zle is reading again:
# written while zsh still runs a command, they meet the terminal in cooked mode, where the ^U that
# clears the line is the tty's kill character and erases the typed case, TAB and all
DRIVER = """\
zmodload zsh/zpty
zpty sg env ZDOTDIR="$1" TERM=dumb HOME="$1" {zsh} -i
zpty -r sg line '*sg-ready> '
n=0
for typed in "${{@:2}}"; do
  n=$((n + 1))
  zpty -w sg "SG_CASE=$n"
  zpty -r sg line '*sg-ready> '
  zpty -w -n sg "$typed"$'\\t'
  zpty -w sg $'\\x15'"print -r -- sg-case-\\$((0 + $n))-done"
  zpty -r sg line "*sg-case-$n-done*sg-ready> "
done
zpty -d sg
"""


def _offers(tmp_path: Path, load: str, *typed: str) -> tuple[str, list[list[str]]]:
    """What zsh offers for each typed line (sorted, unique), and what $_comps says for snapguard."""
    if not os.path.exists(ZSH):
        pytest.fail(f"no {ZSH}: run packaging/setup.sh (the test rig's profile installs zsh)")
    home = tmp_path / "zdot"
    home.mkdir()
    (home / ".zshrc").write_text(ZSHRC.format(load=load))
    (home / "driver.zsh").write_text(DRIVER.format(zsh=ZSH))
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
    out = subprocess.run([ZSH, "-f", str(home / "driver.zsh"), str(home), *typed], capture_output=True,
                         text=True, timeout=DRIVE_S, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    found = []
    for n in range(1, len(typed) + 1):
        path = home / f"offers.{n}"
        found.append(sorted(set(path.read_text().split())) if path.exists() else [])
    return (home / "comps").read_text().strip(), found


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "snapguard.zsh"
    path.write_text(subprocess.run([os.path.join(BIN, "snapguard"), "completion", "zsh"], capture_output=True,
                                   text=True, timeout=60, check=True).stdout)
    return path


@pytest.mark.parametrize("how", ["source-process-substitution", "source-file"])
def test_zsh_loads_the_script_and_completes_commands_flags_and_paths(tmp_path: Path, how: str) -> None:
    if how == "source-file":
        load = f"source {_script(tmp_path)}"
    else:
        load = "source <(snapguard completion zsh)"
    (tmp_path / "imgdir").mkdir()
    comps, offers = _offers(tmp_path, load, "snapguard i", "snapguard push --s", "snapguard push --images img",
                            "snapguard ")
    assert comps == "comps=_bash_complete -F _snapguard", comps  # zsh's bashcompinit binds _snapguard
    assert offers[0] == ["images", "inspect", "install"]
    assert offers[1] == ["--store"]  # --to is hidden
    assert offers[2] == ["imgdir"]
    assert {"push", "pull", "restore", "images", "inspect", "agent", "completion"} <= set(offers[3])


def test_the_autoload_file_in_fpath_completes_from_the_first_tab(tmp_path: Path) -> None:
    """`snapguard completion zsh --autoload` as `_snapguard` in a directory of $fpath (as the Debian
    package installs it): compinit binds it by its #compdef line, the first TAB completes, and the
    later ones go through the bashcompinit binding it made."""
    site = tmp_path / "site-functions"
    site.mkdir()
    (site / "_snapguard").write_text(subprocess.run([os.path.join(BIN, "snapguard"), "completion", "zsh", "--autoload"],
                                                    capture_output=True, text=True, timeout=60, check=True).stdout)
    (tmp_path / "imgdir").mkdir()
    load = f'fpath=({site} $fpath); compinit -u -d "$ZDOTDIR/.zcompdump2"'
    comps, offers = _offers(tmp_path, load, "snapguard i", "snapguard push --s", "snapguard push --images img")
    assert comps == "comps=_snapguard", comps  # compinit's binding of the #compdef file
    assert offers[0] == ["images", "inspect", "install"]
    assert offers[1] == ["--store"]
    assert offers[2] == ["imgdir"]


def test_without_the_script_zsh_offers_nothing_of_snapguards(tmp_path: Path) -> None:
    """The recorder sees no snapguard command where no script is loaded: the offers above are the script's."""
    comps, offers = _offers(tmp_path, ":", "snapguard i")
    assert comps == "comps=none" and not {"images", "inspect", "install"} & set(offers[0])

