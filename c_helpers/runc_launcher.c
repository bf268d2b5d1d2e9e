/*
 * snapguard-runc's launcher: what containerd's runc shim runs in place of runc, so that the verbs
 * of every container's life (create, start, state, kill, delete, exec, ps, events) do not start
 * Python.
 *
 * It reads runc's argv as snapguard/shim/_argv.py does (runc's urfave/cli global flags over Go's
 * flag package; the verbs and flags come from runc_argv_table.h, generated from that module) and
 * execs, argv unchanged but argv[0]:
 *
 * - the real runc, where snapguard's Python entry would pass the command line through as it is:
 *   runc would run a verb other than checkpoint, restore and resume, or the verb is unclear and
 *   the command line names neither checkpoint nor restore;
 * - snapguard's Python entry (the snapguard-runc console script) for everything else: checkpoint,
 *   restore, resume (which the entry passes to runc once it has put back a pause that a killed
 *   executor lifted), command lines it must refuse with a typed reason, and the app's help
 *   (`--help` among runc's global flags: snapguard's part first, then runc's).
 *
 * Both paths come from the pinned file SG_PIN_PATH, which `snapguard install` writes and the
 * config loader keeps in sync with the config's `runc`:
 *
 *     snapguard-runc-launcher 1
 *     config /etc/snapguard/config.toml
 *     stamp DEV INO SIZE MTIME_NS CTIME_NS     (the config file the runc line was read from)
 *     runc /usr/sbin/runc
 *     entry /opt/snapguard/venv/bin/snapguard-runc
 *
 * The pinned file, runc and the entry are opened by a walk from "/" that follows no link, with
 * every directory on the way and the file itself root's and writable by root alone (a root-owned
 * sticky directory such as /tmp may be passed), checked with fstat on the descriptors opened.
 * runc is exec'd only when the config file is still the one the pinned runc was read from and
 * no environment variable (SNAPGUARD_RUNC, or a SNAPGUARD_CONFIG naming another file) chooses
 * another runc; otherwise the Python entry decides, reads the config and refreshes the pinned
 * file. A pinned file that is missing, unsafe or malformed, or an exec that fails, is one line
 * `snapguard-runc: <reason>` on stderr and exit 2 (the exit contract's "the install cannot be
 * used and nothing was tried"; 1 is a refusal, which only the Python entry makes); nothing is
 * looked up in PATH.
 *
 * Built with -DSG_ROUTE_TEST, main() prints the route ("runc" or "snapguard") for its argv and
 * execs nothing; with -DSG_HELP_TEST as well, "help" where the app's help is asked, else "-": the
 * tests that hold this parser to the Python one run those builds.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runc_argv_table.h"

#ifndef SG_CONFIG_PATH
#define SG_CONFIG_PATH SG_DEFAULT_CONFIG_PATH
#endif
#ifndef SG_PIN_PATH
#define SG_PIN_PATH SG_DEFAULT_PIN_PATH
#endif

#define N_TABLE(t) (sizeof(t) / sizeof((t)[0]))

/* the exit contract (docs/operations.md): 2, the command line or install cannot be used and nothing was tried */
#define SG_EXIT_UNUSABLE 2

enum route { ROUTE_SNAPGUARD = 0, ROUTE_RUNC = 1 };

/* --- argv, as _argv.split_global and entry.decide read it ------------------------------------ */

/* Go's strconv.ParseBool: 1 true, 0 false, -1 where it fails */
static int go_parse_bool(const char *s)
{
	static const char *const ok[] = {"1", "t", "T", "TRUE", "true", "True",
					 "0", "f", "F", "FALSE", "false", "False"};
	for (size_t i = 0; i < N_TABLE(ok); i++)
		if (strcmp(s, ok[i]) == 0)
			return i < 6;
	return -1;
}

static const struct sg_flag *global_flag(const char *name, size_t len)
{
	for (size_t i = 0; i < N_TABLE(sg_global_flags); i++)
		if (strlen(sg_global_flags[i].name) == len && memcmp(sg_global_flags[i].name, name, len) == 0)
			return &sg_global_flags[i];
	return NULL;
}

/* Where runc's global flags end (Go's FlagSet.Parse, then urfave/cli's normalizeFlags): the index
 * of the verb (argc when none follows), or -1 where runc's parsing would fail. `*help` is set to
 * whether the app's help flag (--help, -h) ends up true. */
static int split_global(int argc, char *const args[], int *help)
{
	const struct sg_flag *seen[SG_FLAG_GROUPS] = {NULL};
	int i = 0;

	*help = 0;

	while (i < argc) {
		const char *s = args[i];
		if (s[0] != '-' || s[1] == '\0')
			return i; /* a lone "-", "" or a token without a dash: the flags end, it is kept */
		if (strcmp(s, "--") == 0)
			return i + 1;
		const char *name = s + (s[1] == '-' ? 2 : 1);
		if (name[0] == '-' || name[0] == '=')
			return -1; /* bad flag syntax */
		i++;
		const char *eq = strchr(name + 1, '=');
		const struct sg_flag *f = global_flag(name, eq ? (size_t)(eq - name) : strlen(name));
		if (!f)
			return -1; /* flag provided but not defined */
		if (!f->takes_value) {
			int on = eq ? go_parse_bool(eq + 1) : 1;
			if (on < 0)
				return -1;
			if (strcmp(f->name, "help") == 0 || strcmp(f->name, "h") == 0)
				*help = on; /* the last one given counts, as in Go's FlagSet */
		} else {
			const char *value = eq ? eq + 1 : NULL;
			if (!value) {
				if (i == argc)
					return -1; /* flag needs an argument */
				value = args[i++];
			}
			if (strlen(value) > SG_MAX_VALUE_BYTES)
				return -1;
		}
		if (seen[f->group] && strcmp(seen[f->group]->name, f->name) != 0)
			return -1; /* two forms of the same flag */
		seen[f->group] = f;
	}
	return i;
}

/* ROUTE_RUNC exactly where entry.decide(args) is ("pass", None) and the verb is not one the Python
 * entry passes on after a step of its own (SG_VERB_ENTRY: resume). */
static enum route decide(int argc, char *const args[])
{
	int help;
	int verb = split_global(argc, args, &help);
	if (verb >= 0 && verb < argc) {
		for (size_t i = 0; i < N_TABLE(sg_verbs); i++)
			if (strcmp(args[verb], sg_verbs[i].name) == 0)
				return sg_verbs[i].route == SG_VERB_RUNC ? ROUTE_RUNC : ROUTE_SNAPGUARD;
	}
	/* runc would fail, or run no command or an unknown one: refused where a guarded verb is named */
	for (int j = 0; j < argc; j++)
		for (size_t i = 0; i < N_TABLE(sg_verbs); i++)
			if (sg_verbs[i].route == SG_VERB_GUARD && strcmp(args[j], sg_verbs[i].name) == 0)
				return ROUTE_SNAPGUARD;
	return ROUTE_RUNC;
}

/* 1 exactly where entry._help_asked(args) is None: the app's help is asked (`--help` among runc's
 * global flags, which parse), so snapguard's part is shown before runc's. */
static int app_help_asked(int argc, char *const args[])
{
	int help;
	return split_global(argc, args, &help) >= 0 && help;
}

#ifdef SG_ROUTE_TEST

/* the route decide() picks; built with -DSG_HELP_TEST too, whether the app's help is asked */
int main(int argc, char *argv[])
{
#ifdef SG_HELP_TEST
	(void)decide;
	puts(app_help_asked(argc - 1, argv + 1) ? "help" : "-");
#else
	(void)app_help_asked;
	puts(decide(argc - 1, argv + 1) == ROUTE_RUNC ? "runc" : "snapguard");
#endif
	return 0;
}

#else

/* --- trusted paths (snapguard/trust.py's rules) ----------------------------------------------- */

static int owner_ok(const struct stat *st)
{
	return st->st_uid == 0 || st->st_uid == geteuid();
}

static int dir_ok(int fd)
{
	struct stat st;
	if (fstat(fd, &st) < 0)
		return -1;
	if (!S_ISDIR(st.st_mode)) {
		errno = ENOTDIR;
		return -1;
	}
	/* a root-owned sticky directory (/tmp) may be passed: every entry taken from it is root's */
	if (!owner_ok(&st) || ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX))) {
		errno = EPERM;
		return -1;
	}
	return 0;
}

/* The file at the absolute `path`, opened with `flags` by a walk from "/" that follows no link
 * (a link anywhere is ELOOP or ENOTDIR); every directory on the way root's alone (else EPERM), the
 * file regular (EINVAL), root's and writable by root alone (EPERM), executable when `exec` (EACCES).
 * The descriptor, or -1 with errno set. */
static int open_trusted(const char *path, int flags, int exec)
{
	char buf[PATH_MAX];
	size_t len = strlen(path);
	if (path[0] != '/' || len >= sizeof(buf)) {
		errno = path[0] != '/' ? EINVAL : ENAMETOOLONG;
		return -1;
	}
	memcpy(buf, path, len + 1);
	int dir = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (dir < 0 || dir_ok(dir) < 0)
		goto fail;
	char *p = buf;
	for (;;) {
		while (*p == '/')
			p++;
		char *end = strchr(p, '/');
		if (end)
			*end = '\0';
		int last = !end || !end[1 + strspn(end + 1, "/")];
		if (*p == '\0' || strcmp(p, ".") == 0 || strcmp(p, "..") == 0) {
			errno = EINVAL; /* pinned paths are canonical */
			goto fail;
		}
		if (last) {
			int fd = openat(dir, p, flags | O_NOFOLLOW | O_CLOEXEC);
			int saved = errno;
			close(dir);
			if (fd < 0) {
				errno = saved;
				return -1;
			}
			struct stat st;
			if (fstat(fd, &st) < 0)
				saved = errno;
			else if (S_ISLNK(st.st_mode))
				saved = ELOOP;
			else if (!S_ISREG(st.st_mode))
				saved = EINVAL;
			else if (!owner_ok(&st) || (st.st_mode & (S_IWGRP | S_IWOTH)))
				saved = EPERM;
			else if (exec && !(st.st_mode & (S_IXUSR | S_IXGRP | S_IXOTH)))
				saved = EACCES;
			else
				return fd;
			close(fd);
			errno = saved;
			return -1;
		}
		int next = openat(dir, p, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		int saved = errno;
		close(dir);
		dir = next;
		if (dir < 0) {
			errno = saved;
			return -1;
		}
		if (dir_ok(dir) < 0)
			goto fail;
		p = end + 1;
	}
fail:
	if (dir >= 0) {
		int saved = errno;
		close(dir);
		errno = saved;
	}
	return -1;
}

/* --- the pinned file -------------------------------------------------------------------------- */

struct pin {
	char text[8192];
	const char *config, *stamp, *runc, *entry;
};

/* Reads and splits SG_PIN_PATH into `pin`; -1 with errno (EINVAL: malformed, EFBIG: too large). */
static int read_pin(struct pin *pin)
{
	int fd = open_trusted(SG_PIN_PATH, O_RDONLY | O_NONBLOCK, 0);
	if (fd < 0)
		return -1;
	size_t used = 0;
	for (;;) {
		ssize_t n = read(fd, pin->text + used, sizeof(pin->text) - 1 - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int saved = errno;
			close(fd);
			errno = saved;
			return -1;
		}
		if (n == 0)
			break;
		used += (size_t)n;
		if (used == sizeof(pin->text) - 1) {
			close(fd);
			errno = EFBIG;
			return -1;
		}
	}
	close(fd);
	pin->text[used] = '\0';
	pin->config = pin->stamp = pin->runc = pin->entry = NULL;
	char *line = pin->text;
	int first = 1;
	while (*line) {
		char *nl = strchr(line, '\n');
		if (!nl)
			break; /* a last line without its newline: a torn write, not a pinned file */
		*nl = '\0';
		char *value = strchr(line, ' ');
		if (first) {
			if (strcmp(line, SG_PIN_HEADER) != 0)
				break;
			first = 0;
		} else if (value) {
			*value++ = '\0';
			const char **slot = strcmp(line, "config") == 0 ? &pin->config
					  : strcmp(line, "stamp") == 0	 ? &pin->stamp
					  : strcmp(line, "runc") == 0	 ? &pin->runc
					  : strcmp(line, "entry") == 0	 ? &pin->entry
									 : NULL;
			if (slot)
				*slot = value;
		}
		line = nl + 1;
	}
	if (first || *line || !pin->config || !pin->stamp || !pin->runc || !pin->entry || pin->runc[0] != '/' ||
	    pin->entry[0] != '/') {
		errno = EINVAL;
		return -1;
	}
	return 0;
}

/* 1 when the config file is still the one the pinned runc was read from (same stamp as
 * snapguard.config writes it), 0 when not or when it cannot be opened as a trusted file. */
static int config_unchanged(const char *stamp)
{
	int fd = open_trusted(SG_CONFIG_PATH, O_PATH, 0);
	if (fd < 0)
		return 0;
	struct stat st;
	int ok = fstat(fd, &st) == 0;
	close(fd);
	if (!ok)
		return 0;
	char now[160];
	snprintf(now, sizeof(now), "%llu %llu %lld %lld %lld", (unsigned long long)st.st_dev,
		 (unsigned long long)st.st_ino, (long long)st.st_size,
		 (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
		 (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec);
	return strcmp(now, stamp) == 0;
}

/* Where snapguard.config.pinned_runc would look elsewhere than the pinned file's config. */
static int env_overrides(void)
{
	const char *runc = getenv("SNAPGUARD_RUNC");
	const char *config = getenv("SNAPGUARD_CONFIG");
	if (runc && *runc)
		return 1;
	return strcmp(config && *config ? config : SG_DEFAULT_CONFIG_PATH, SG_CONFIG_PATH) != 0;
}

static int die(const char *what, const char *path)
{
	fprintf(stderr, "snapguard-runc: %s %s: %s\n", what, path, strerror(errno));
	return SG_EXIT_UNUSABLE;
}

/* argv unchanged but argv[0], the path exec'd (argv is this process's own, NULL-terminated) */
static void run(const char *path, char *argv[])
{
	argv[0] = (char *)path;
	execv(path, argv);
}

int main(int argc, char *argv[])
{
	static struct pin pin;
	if (argc < 1)
		return SG_EXIT_UNUSABLE;
	/* the app's help: snapguard's part, then runc's (the Python entry prints both) */
	enum route route = app_help_asked(argc - 1, argv + 1) ? ROUTE_SNAPGUARD : decide(argc - 1, argv + 1);
	if (read_pin(&pin) < 0)
		return die("pinned file", SG_PIN_PATH);
	if (strcmp(pin.config, SG_CONFIG_PATH) != 0) {
		errno = EINVAL; /* written for another config than this launcher was built for */
		return die("pinned file", SG_PIN_PATH);
	}
	if (route == ROUTE_RUNC && !env_overrides() && config_unchanged(pin.stamp)) {
		int fd = open_trusted(pin.runc, O_PATH, 1);
		if (fd >= 0) {
			close(fd);
			run(pin.runc, argv);
			return die("exec runc", pin.runc);
		}
		/* runc missing or not root's alone: the Python entry reports it with a typed reason */
	}
	int fd = open_trusted(pin.entry, O_PATH, 1);
	if (fd < 0)
		return die("snapguard's Python entry", pin.entry);
	close(fd);
	run(pin.entry, argv);
	return die("exec snapguard's Python entry", pin.entry);
}

#endif
