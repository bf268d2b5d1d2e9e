/*
 * Fast scan of /proc/<pid>/maps and /proc/<pid>/fd for device handles.
 *
 * Mechanism only: the caller (snapguard/preflight/scan.py) decides which path prefixes and
 * device majors matter and what a match means. Processes or fds that vanish mid-scan, or that
 * cannot be read, are skipped: that is the normal state of a live /proc. The only error reported
 * is a full output buffer (-1, errno = ENOSPC), so the caller can retry with a larger one.
 *
 * Output: one record per match, "pid kind major:minor path\n", kind 'm' (mapping) or 'f' (fd
 * number after it: "pid f<N> major:minor path"). The kernel's cost of generating maps dominates,
 * and it is paid per CPU: the pids are split among `nthreads` threads, records kept in pid order.
 */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "procscan.h"

struct out_buf {
	char *p;
	size_t len, used;
	int full; /* out of memory: the scan fails with ENOMEM */
};

static void emit(struct out_buf *o, int pid, const char *kind, unsigned maj, unsigned min, const char *path,
		 size_t pathlen)
{
	char head[64];
	int n = snprintf(head, sizeof(head), "%d %s %u:%u ", pid, kind, maj, min);
	if (o->full || n < 0)
		return;
	size_t need = o->used + (size_t)n + pathlen + 1;
	if (need > o->len) {
		size_t len = o->len ? o->len : 65536;
		while (len < need)
			len *= 2;
		char *p = realloc(o->p, len);
		if (!p) {
			o->full = 1;
			return;
		}
		o->p = p;
		o->len = len;
	}
	memcpy(o->p + o->used, head, (size_t)n);
	o->used += (size_t)n;
	memcpy(o->p + o->used, path, pathlen);
	o->used += pathlen;
	o->p[o->used++] = '\n';
}

static int prefix_match(const char *path, size_t len, const char *const *prefixes, int nprefixes)
{
	for (int i = 0; i < nprefixes; i++) {
		size_t pl = strlen(prefixes[i]);
		if (pl <= len && memcmp(path, prefixes[i], pl) == 0)
			return 1;
	}
	return 0;
}

static int major_match(unsigned maj, const unsigned *majors, int nmajors)
{
	for (int i = 0; i < nmajors; i++)
		if (majors[i] == maj)
			return 1;
	return 0;
}

/* A mapped path under /dev/ is a device node: its rdev, not the maps dev column, names it. */
static int dev_rdev(const char *path, size_t len, unsigned *maj, unsigned *min)
{
	char buf[4096];
	struct stat st;
	if (len >= sizeof(buf) || len < 5 || memcmp(path, "/dev/", 5) != 0)
		return 0;
	memcpy(buf, path, len);
	buf[len] = '\0';
	if (stat(buf, &st) != 0 || !(S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)))
		return 0;
	*maj = major(st.st_rdev);
	*min = minor(st.st_rdev);
	return 1;
}

static void scan_line(struct out_buf *o, int pid, char *line, size_t len, const char *const *prefixes,
		      int nprefixes, const unsigned *majors, int nmajors)
{
	/* addr perms offset dev inode [path]: the path starts after the fifth field's spaces. */
	size_t i = 0;
	for (int field = 0; field < 5; field++) {
		while (i < len && line[i] != ' ')
			i++;
		while (i < len && line[i] == ' ')
			i++;
	}
	if (i >= len)
		return;
	const char *path = line + i;
	size_t plen = len - i;
	unsigned maj = 0, min = 0;
	int is_dev = dev_rdev(path, plen, &maj, &min);
	if (prefix_match(path, plen, prefixes, nprefixes) || (is_dev && major_match(maj, majors, nmajors)))
		emit(o, pid, "m", maj, min, path, plen);
}

static void scan_maps(struct out_buf *o, const char *proc, int pid, const char *const *prefixes,
		      int nprefixes, const unsigned *majors, int nmajors)
{
	char path[256], buf[65536];
	size_t have = 0;
	snprintf(path, sizeof(path), "%s/%d/maps", proc, pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return;
	for (;;) {
		ssize_t n = read(fd, buf + have, sizeof(buf) - have);
		if (n <= 0)
			break;
		have += (size_t)n;
		size_t start = 0;
		for (size_t j = 0; j < have; j++) {
			if (buf[j] != '\n')
				continue;
			scan_line(o, pid, buf + start, j - start, prefixes, nprefixes, majors, nmajors);
			start = j + 1;
		}
		memmove(buf, buf + start, have - start);
		have -= start;
		if (have == sizeof(buf))
			have = 0; /* a line longer than the buffer: drop it */
	}
	if (have)
		scan_line(o, pid, buf, have, prefixes, nprefixes, majors, nmajors);
	close(fd);
}

static void scan_fds(struct out_buf *o, const char *proc, int pid, const char *const *prefixes, int nprefixes,
		     const unsigned *majors, int nmajors)
{
	char dir[256], link[512], target[4096];
	snprintf(dir, sizeof(dir), "%s/%d/fd", proc, pid);
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] < '0' || e->d_name[0] > '9')
			continue;
		snprintf(link, sizeof(link), "%s/%s", dir, e->d_name);
		ssize_t n = readlink(link, target, sizeof(target) - 1);
		if (n <= 0)
			continue;
		target[n] = '\0';
		unsigned maj = 0, min = 0;
		int matched = prefix_match(target, (size_t)n, prefixes, nprefixes);
		struct stat st;
		/* stat through the fd link: the device as the process sees it, in its own mount namespace */
		if (target[0] == '/' && (matched || nmajors) && stat(link, &st) == 0 &&
		    (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))) {
			maj = major(st.st_rdev);
			min = minor(st.st_rdev);
			matched = matched || major_match(maj, majors, nmajors);
		}
		if (matched) {
			char kind[24];
			snprintf(kind, sizeof(kind), "f%s", e->d_name);
			emit(o, pid, kind, maj, min, target, (size_t)n);
		}
	}
	closedir(d);
}

struct slice {
	const char *proc;
	const int *pids;
	int npids;
	const char *const *prefixes;
	int nprefixes;
	const unsigned *majors;
	int nmajors;
	struct out_buf out;
};

static void *scan_slice(void *arg)
{
	struct slice *s = arg;
	for (int i = 0; i < s->npids && !s->out.full; i++) {
		scan_maps(&s->out, s->proc, s->pids[i], s->prefixes, s->nprefixes, s->majors, s->nmajors);
		scan_fds(&s->out, s->proc, s->pids[i], s->prefixes, s->nprefixes, s->majors, s->nmajors);
	}
	return NULL;
}

long sg_scan(const char *proc, const int *pids, int npids, const char *const *prefixes, int nprefixes,
	     const unsigned *majors, int nmajors, int nthreads, char *out, size_t outlen)
{
	if (nthreads < 1)
		nthreads = 1;
	if (nthreads > npids)
		nthreads = npids > 0 ? npids : 1;
	struct slice *slices = calloc((size_t)nthreads, sizeof(*slices));
	pthread_t *threads = calloc((size_t)nthreads, sizeof(*threads));
	char *started = calloc((size_t)nthreads, 1);
	if (!slices || !threads || !started) {
		free(slices);
		free(threads);
		free(started);
		errno = ENOMEM;
		return -1;
	}
	int per = npids / nthreads, extra = npids % nthreads, at = 0;
	for (int t = 0; t < nthreads; t++) {
		int n = per + (t < extra);
		slices[t] = (struct slice){ proc, pids + at, n, prefixes, nprefixes, majors, nmajors, { 0 } };
		at += n;
		/* slice 0 runs on this thread; a thread that cannot start runs here too */
		started[t] = t > 0 && pthread_create(&threads[t], NULL, scan_slice, &slices[t]) == 0;
	}
	for (int t = 0; t < nthreads; t++)
		if (!started[t])
			scan_slice(&slices[t]);
	long used = 0;
	int err = 0;
	for (int t = 0; t < nthreads; t++) {
		if (started[t])
			pthread_join(threads[t], NULL);
		struct out_buf *o = &slices[t].out;
		if (o->full)
			err = ENOMEM;
		else if (!err && (size_t)used + o->used > outlen)
			err = ENOSPC;
		else if (!err) {
			memcpy(out + used, o->p, o->used);
			used += (long)o->used;
		}
		free(o->p);
	}
	free(slices);
	free(threads);
	free(started);
	if (err) {
		errno = err;
		return -1;
	}
	return used;
}
