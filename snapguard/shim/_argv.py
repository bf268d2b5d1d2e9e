"""Parsing runc's command line the way runc does, for the executor's one decision: which verb?

runc 1.1 parses its argv with urfave/cli v1, which hands every flag set to Go's `flag` package.
This module reproduces both, from their source:

- Go `flag` (src/flag/flag.go, FlagSet.parseOne): `-x` and `--x` are the same flag; a value flag
  takes `-x=v` or the next token, whatever it looks like (`--root --log` sets root to "--log");
  a bool flag takes only `-x=v`, v as strconv.ParseBool reads it, never a separate token; `--`
  ends the flags and is consumed; a lone `-`, an empty string or any token without a leading
  dash ends the flags and is kept; `---x`, `-=x` are errors ("bad flag syntax").
- urfave/cli v1 (app.go App.Run, command.go Command.Run/parseFlags, context.go normalizeFlags):
  the global flags are parsed with no reordering, the first token left is the command, looked up
  by exact name or alias (no prefix matching; runc does not set UseShortOptionHandling or
  EnableBashCompletion). Two names of one flag both given (`-b x --bundle y`) are an error.
  The built-in help flag (`--help`, `-h`) is added to the app and to every command, and
  `--version`/`-v` to the app; when one is set, runc prints help or its version and runs no
  command. Before parsing a command's own flags, urfave moves flags written after the
  positionals in front of them (reorderArgs), so `runc checkpoint c1 --image-path /x` works.
  How differs between the urfave version runc 1.1 vendors (v1.22.1: every dash token moves) and
  v1.22.2 and later (only the command's own flags move; Debian's runc 1.1.5 is built with 1.22.9,
  runc 1.2 to 1.4 vendor 1.22.14 to 1.22.17). `parse_subcommand` parses both ways and refuses a
  command line on which they disagree.

This module imports only `os`: the pass-through path, taken on every container operation, uses
`split_global`.
"""

from __future__ import annotations

import os

__all__ = [
    "ArgvError", "GlobalOptions", "SubcommandArgs", "VERB_TABLE", "GUARDED_VERBS", "PASS_THROUGH_VERBS", "ENTRY_VERBS",
    "MAX_VALUE_BYTES", "one_line", "split_global", "parse_subcommand",
]

# The verb table, the single source of which runc command lines snapguard guards. A launcher
# written in another language must carry exactly this table (a test compares the two).
# runc 1.1's commands (main.go, app.Commands; none has an alias or a short name) and urfave/cli's
# built-in help command ("help", alias "h"). "guard": checkpoint and restore run through
# snapguard's checks; "pass": runc is exec'd with argv unchanged; "entry": passed through as well,
# but by the Python entry, which first does the verb's own step (resume: a pause that a killed
# executor lifted is put back, snapguard.shim._resume), so a launcher sends it there and not to
# runc. A verb not in the table (a typo, or a command a later runc adds) is treated as "cannot
# tell": see the executor's decide().
VERB_TABLE: tuple[tuple[str, str], ...] = (
    ("checkpoint", "guard"), ("create", "pass"), ("delete", "pass"), ("events", "pass"), ("exec", "pass"),
    ("kill", "pass"), ("list", "pass"), ("pause", "pass"), ("ps", "pass"), ("restore", "guard"),
    ("resume", "entry"), ("run", "pass"), ("spec", "pass"), ("start", "pass"), ("state", "pass"),
    ("update", "pass"), ("features", "pass"), ("help", "pass"), ("h", "pass"),
)
GUARDED_VERBS: tuple[str, ...] = tuple(verb for verb, how in VERB_TABLE if how == "guard")
PASS_THROUGH_VERBS: tuple[str, ...] = tuple(verb for verb, how in VERB_TABLE if how in ("pass", "entry"))
ENTRY_VERBS: tuple[str, ...] = tuple(verb for verb, how in VERB_TABLE if how == "entry")

# Longer flag values are refused: PATH_MAX, and no flag of runc's wants more.
MAX_VALUE_BYTES = 4096

BOOL, STRING, INT, SLICE = "bool", "string", "int", "slice"
_HELP = (("help", "h"), BOOL)  # urfave/cli's HelpFlag, added to the app and to every command

# Flags as urfave/cli declares them: (names, kind); the first name is the one values are kept under.
# runc 1.1 main.go app.Flags, and urfave/cli's HelpFlag and VersionFlag.
GLOBAL_FLAGS = (
    (("debug",), BOOL), (("log",), STRING), (("log-format",), STRING), (("root",), STRING),
    (("criu",), STRING), (("systemd-cgroup",), BOOL), (("rootless",), STRING),
    _HELP, (("version", "v"), BOOL),
)
# runc 1.1 checkpoint.go, checkpointCommand.Flags.
CHECKPOINT_FLAGS = (
    (("image-path",), STRING), (("work-path",), STRING), (("parent-path",), STRING),
    (("leave-running",), BOOL), (("tcp-established",), BOOL), (("ext-unix-sk",), BOOL), (("shell-job",), BOOL),
    (("lazy-pages",), BOOL), (("status-fd",), INT), (("page-server",), STRING), (("file-locks",), BOOL),
    (("pre-dump",), BOOL), (("manage-cgroups-mode",), STRING), (("empty-ns",), SLICE), (("auto-dedup",), BOOL),
    _HELP,
)
DEPRECATED_RESTORE_FLAGS = {"from": "store", "from-job": "job", "from-image": "image"}
# runc 1.1 restore.go, restoreCommand.Flags (no --parent-path: runc restore rejects it).
RESTORE_FLAGS = (
    (("console-socket",), STRING), (("image-path",), STRING), (("work-path",), STRING),
    (("tcp-established",), BOOL), (("ext-unix-sk",), BOOL), (("shell-job",), BOOL), (("file-locks",), BOOL),
    (("manage-cgroups-mode",), STRING), (("bundle", "b"), STRING), (("detach", "d"), BOOL),
    (("pid-file",), STRING), (("no-subreaper",), BOOL), (("no-pivot",), BOOL), (("empty-ns",), SLICE),
    (("auto-dedup",), BOOL), (("lazy-pages",), BOOL), (("lsm-profile",), STRING), (("lsm-mount-context",), STRING),
    _HELP,
    # snapguard's own (runc never sees them: shim/restore.py takes them out): restore from an
    # image store, fetched into --image-path, fenced. --store, --job, --image; the first names are
    # the old spellings, which say they are deprecated (values are keyed by the first name)
    *((((old, new), STRING) for old, new in DEPRECATED_RESTORE_FLAGS.items())),
)
OWN_RESTORE_FLAGS = tuple(name for pair in DEPRECATED_RESTORE_FLAGS.items() for name in pair)
_SUBCOMMAND_FLAGS = {"checkpoint": CHECKPOINT_FLAGS, "restore": RESTORE_FLAGS}


def _spec(flags: tuple[tuple[tuple[str, ...], str], ...]) -> dict[str, tuple[str, str]]:
    """name -> (the flag's first name, kind), for every name of every flag."""
    return {name: (names[0], kind) for names, kind in flags for name in names}


_GLOBAL_SPEC = _spec(GLOBAL_FLAGS)
_SUBCOMMAND_SPECS = {verb: _spec(flags) for verb, flags in _SUBCOMMAND_FLAGS.items()}

# Old names, kept for callers: runc's global flags that take a value, and its global booleans.
GLOBAL_VALUE_FLAGS = frozenset(name for name, (_, kind) in _GLOBAL_SPEC.items() if kind != BOOL)
GLOBAL_BOOL_FLAGS = frozenset(name for name, (_, kind) in _GLOBAL_SPEC.items() if kind == BOOL)


class ArgvError(Exception):
    """The command line is not one runc would act on as written; the message is one line.

    `opts` holds the global options parsed before the error, when split_global raised it (so
    that a refusal can still be written to the --log that containerd reads).
    """

    def __init__(self, message: str, opts: GlobalOptions | None = None) -> None:
        super().__init__(message)
        self.opts = opts


def one_line(text: str, limit: int = 80) -> str:
    """`text` shortened and escaped so that it fits in a one-line message."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return text if text.isprintable() else ascii(text)[1:-1]


class GlobalOptions:
    """runc's global flags, with the verb and its index in argv (argv without argv[0])."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.bools: set[str] = set()  # the boolean flags that are true, by their first name
        self.subcommand: str | None = None
        self.subcommand_index = 0

    @property
    def verb(self) -> str | None:
        return self.subcommand

    @property
    def verb_index(self) -> int:
        return self.subcommand_index

    @property
    def root(self) -> str | None:
        return self.values.get("root")

    @property
    def log(self) -> str | None:
        return self.values.get("log")

    @property
    def log_format(self) -> str:
        return self.values.get("log-format", "text")

    @property
    def criu(self) -> str | None:
        return self.values.get("criu")

    @property
    def help_or_version(self) -> bool:
        """--help or --version is set: runc prints help or its version and runs no command."""
        return bool(self.bools & {"help", "version"})


class _Parsed:
    """What Go's FlagSet holds after Parse: the flags set, by their first name."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.bools: dict[str, bool] = {}
        self.multi: dict[str, list[str]] = {}
        self.seen: list[str] = []  # names as written, for urfave's normalizeFlags
        self.rest: list[str] = []

    def key(self) -> tuple[object, ...]:
        return (sorted(self.values.items()), sorted(self.bools.items()), sorted(self.multi.items()), self.rest)


def _parse_bool(text: str) -> bool | None:
    """Go's strconv.ParseBool; None where it fails."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    return None


def _parse_int(text: str) -> int | None:
    """Go's strconv.ParseInt(text, 0, 64) (the flag package's int flag), but for `_` digit
    separators, which are refused; None where it fails."""
    s = text
    negative = False
    if s and s[0] in "+-":
        negative, s = s[0] == "-", s[1:]
    base = 10
    if len(s) >= 2 and s[0] == "0":
        prefix = s[1].lower()
        base, s = {"x": (16, s[2:]), "b": (2, s[2:]), "o": (8, s[2:])}.get(prefix, (8, s[1:]))
    digits = "0123456789abcdef"[:base]
    if not s or any(c.lower() not in digits for c in s):
        return None
    value = -int(s, base) if negative else int(s, base)
    return value if -(1 << 63) <= value < (1 << 63) else None


def _check_value(value: str, name: str, where: str) -> None:
    if "\0" in value:
        raise ArgvError(f"{where}the value of -{name} contains a NUL byte")
    if len(os.fsencode(value)) > MAX_VALUE_BYTES:
        raise ArgvError(f"{where}the value of -{name} is longer than {MAX_VALUE_BYTES} bytes")


def _go_parse(args: list[str], spec: dict[str, tuple[str, str]], where: str, out: _Parsed) -> int:
    """Go's FlagSet.Parse over args into `out`; the index of the first argument after the flags
    (after the `--` that ended them, if one did). Errors are Go's, prefixed with `where`."""
    i = 0
    while i < len(args):
        s = args[i]
        if "\0" in s:
            raise ArgvError(f"{where}argument {i + 1} contains a NUL byte")
        if len(s) < 2 or s[0] != "-":
            return i
        dashes = 2 if s[1] == "-" else 1
        if s == "--":
            return i + 1
        name = s[dashes:]
        if name[0] in "-=":
            raise ArgvError(f"{where}bad flag syntax: {one_line(s)}")
        i += 1
        value: str | None = None
        equals = name.find("=", 1)
        if equals > 0:
            name, value = name[:equals], name[equals + 1:]
        if name not in spec:
            raise ArgvError(f"{where}flag provided but not defined: {s[:dashes]}{one_line(name)}")
        first, kind = spec[name]
        if kind == BOOL:
            setting = True if value is None else _parse_bool(value)
            if setting is None:
                raise ArgvError(f'{where}invalid boolean value "{one_line(value or "")}" for -{name}: parse error')
            out.bools[first] = setting
        else:
            if value is None:
                if i == len(args):
                    raise ArgvError(f"{where}flag needs an argument: -{name}")
                value = args[i]
                i += 1
            _check_value(value, name, where)
            if kind == INT and _parse_int(value) is None:
                raise ArgvError(f'{where}invalid value "{one_line(value)}" for flag -{name}: '
                                "not an integer snapguard reads")
            if kind == SLICE:
                out.multi.setdefault(first, []).append(value)
            out.values[first] = value
        out.seen.append(name)
    return i


def _normalize(flags: tuple[tuple[tuple[str, ...], str], ...], seen: list[str], where: str) -> None:
    """urfave/cli's normalizeFlags: two names of one flag may not both be given."""
    for names, _ in flags:
        given = None
        for name in names:
            if name in seen:
                if given is not None:
                    raise ArgvError(f"{where}Cannot use two forms of the same flag: {name} {given}")
                given = name


def split_global(args: list[str]) -> GlobalOptions:
    """Parse runc's global flags in args (argv without argv[0]); find the verb as runc would.

    The verb is the first argument after the flags, `subcommand_index` its index in args; None
    (and the index len(args)) when nothing follows the flags. Raises ArgvError where runc's
    parsing fails (an unknown flag, a missing value, a bad boolean), for a NUL byte anywhere in
    args and for values over MAX_VALUE_BYTES; the error's `opts` holds what was parsed before.
    """
    parsed = _Parsed()

    def options() -> GlobalOptions:
        opts = GlobalOptions()
        opts.values = dict(parsed.values)
        opts.bools = {name for name, on in parsed.bools.items() if on}
        return opts

    try:
        index = _go_parse(args, _GLOBAL_SPEC, "", parsed)
        _normalize(GLOBAL_FLAGS, parsed.seen, "")
    except ArgvError as e:
        raise ArgvError(str(e), options()) from None
    opts = options()
    for j in range(index, len(args)):
        if "\0" in args[j]:
            raise ArgvError(f"argument {j + 1} contains a NUL byte", opts)
    opts.subcommand_index = index
    opts.subcommand = args[index] if index < len(args) else None
    return opts


class SubcommandArgs:
    """The flags and container id of a checkpoint or restore command line."""

    def __init__(self, subcommand: str) -> None:
        self.subcommand = subcommand
        self.values: dict[str, str] = {}  # value flags, the last value given (all of them in multi)
        self.multi: dict[str, list[str]] = {}
        self.bools: set[str] = set()  # the boolean flags that are true
        self.container_id = ""

    def value(self, name: str) -> str | None:
        return self.values.get(name)

    def flag(self, name: str) -> bool:
        return name in self.bools

    @property
    def image_path(self) -> str:
        # runc's defaults: ./checkpoint for images, the image directory for logs and work files.
        return os.path.abspath(self.values.get("image-path") or "checkpoint")

    @property
    def work_path(self) -> str:
        return os.path.abspath(self.values.get("work-path") or self.image_path)


def _reorder_v1_22_1(args: list[str]) -> list[str]:
    """urfave/cli v1.22.1's reorderArgs (the version runc 1.1 vendors): every dash token (and the
    token after one without `=`, unless it starts with a dash) moves in front of the rest; from
    `--` on, nothing moves and the `--` stays where it was."""
    flags: list[str] = []
    rest: list[str] = []
    read_value = False
    for i, arg in enumerate(args):
        if arg == "--":
            rest += args[i:]
            break
        if read_value and not arg.startswith("-"):
            read_value = False
            flags.append(arg)
            continue
        read_value = False
        if arg != "-" and arg.startswith("-"):
            flags.append(arg)
            read_value = "=" not in arg
        else:
            rest.append(arg)
    return flags + rest


def _arg_is_flag(spec: dict[str, tuple[str, str]], arg: str) -> bool:
    """urfave/cli v1.22.2+'s argIsFlag: is arg one of the command's flags, by name?"""
    if arg in ("-", "--") or not arg.startswith("-"):
        return False
    if arg.startswith("--"):
        arg = arg.replace("-", "", 2)
    if arg.startswith("-"):
        arg = arg.replace("-", "", 1)
    return arg.split("=")[0] in spec


def _reorder_v1_22_2(args: list[str], spec: dict[str, tuple[str, str]]) -> list[str]:
    """urfave/cli v1.22.2+'s reorderArgs: only the command's own flags (and the token after one
    without `=`, unless it is one of the command's flags) move in front; a `--` outside a flag's
    value moves to the front of the rest, and nothing after it moves."""
    flags: list[str] = []
    rest: list[str] = []
    may_be_value = False
    for i, arg in enumerate(args):
        if may_be_value and not _arg_is_flag(spec, arg):
            may_be_value = False
            flags.append(arg)
        elif arg == "--":
            rest = ["--", *rest, *args[i + 1:]]
            break
        elif _arg_is_flag(spec, arg):
            flags.append(arg)
            may_be_value = "=" not in arg
        else:
            rest.append(arg)
    return flags + rest


# runc's libcontainer validateID: `^[\w+-\.]+$` (ASCII word characters, and the range `+` to `.`),
# and the id must be a clean path element (not "." or "..").
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+,-.")


def _parse_ordered(subcommand: str, args: list[str]) -> _Parsed:
    """The command's flags parsed as Go does, checked as runc and snapguard need."""
    where = f"{subcommand}: "
    parsed = _Parsed()
    index = _go_parse(args, _SUBCOMMAND_SPECS[subcommand], where, parsed)
    _normalize(_SUBCOMMAND_FLAGS[subcommand], parsed.seen, where)
    parsed.rest = args[index:]
    if parsed.bools.get("help"):
        raise ArgvError(f"{where}--help given: runc would print help, not {subcommand}")
    if len(parsed.rest) != 1:
        raise ArgvError(f"{where}expected exactly one container id, got {len(parsed.rest)}")
    container_id = parsed.rest[0]
    if not container_id:
        raise ArgvError(f"{where}container id cannot be empty")
    if container_id in (".", "..") or not set(container_id) <= _ID_CHARS:
        raise ArgvError(f"{where}invalid container ID format: {one_line(container_id)}")
    for namespace in parsed.multi.get("empty-ns", []):
        # runc's setEmptyNsMask knows only "network" (urfave/cli v1.22.2+ would drop an empty value).
        if namespace != "network":
            raise ArgvError(f'{where}namespace "{one_line(namespace)}" is not supported')
    return parsed


def parse_subcommand(subcommand: str, args: list[str]) -> SubcommandArgs:
    """Parse the arguments after `checkpoint` or `restore` as runc would; the container id is
    required. Flags may follow the container id, as urfave/cli moves them in front; a command
    line that the urfave/cli versions runc is built with read differently is refused."""
    if subcommand not in _SUBCOMMAND_SPECS:
        raise ArgvError(f"{one_line(subcommand)}: not a guarded command")
    for i, arg in enumerate(args):
        if "\0" in arg:
            raise ArgvError(f"{subcommand}: argument {i + 1} after the command contains a NUL byte")
    spec = _SUBCOMMAND_SPECS[subcommand]
    readings: list[_Parsed | ArgvError] = []
    for ordered in (_reorder_v1_22_1(args), _reorder_v1_22_2(args, spec)):
        try:
            readings.append(_parse_ordered(subcommand, ordered))
        except ArgvError as e:
            readings.append(e)
    for reading in readings:
        if isinstance(reading, ArgvError):
            raise reading
    old, new = readings
    assert isinstance(old, _Parsed) and isinstance(new, _Parsed)
    if old.key() != new.key():
        raise ArgvError(f"{subcommand}: runc builds read this command line differently (urfave/cli "
                        "v1.22.1 or later); write the flags before the container id")
    parsed = SubcommandArgs(subcommand)
    parsed.values = dict(new.values)
    parsed.multi = {name: list(values) for name, values in new.multi.items()}
    parsed.bools = {name for name, on in new.bools.items() if on}
    parsed.container_id = new.rest[0]
    for name in dict.fromkeys(n for n in new.seen if n in DEPRECATED_RESTORE_FLAGS and subcommand == "restore"):
        os.write(2, f"snapguard-runc: --{name} is deprecated, use --{DEPRECATED_RESTORE_FLAGS[name]}\n".encode())
    return parsed
