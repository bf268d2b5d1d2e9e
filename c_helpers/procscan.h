/* See procscan.c. Returns bytes written to out, or -1 with errno ENOSPC (out too small) or ENOMEM. */
long sg_scan(const char *proc, const int *pids, int npids, const char *const *prefixes, int nprefixes,
	     const unsigned *majors, int nmajors, int nthreads, char *out, size_t outlen);
