/* expert_read.h: one expert's bytes read from its checkpoint file and checked, as a job (msw_job) that both
 * the background reader threads (experts/native_reads.c) and the native decode step's in-call loads
 * (decode_step.c) run: one definition of the job's layout and of the read and check. experts/reads.py mirrors
 * msw_job in ctypes and checks its size and the offset of `bad` against the reader library.
 * The file names no function the kernels library exports: everything here is static. */
#ifndef MOESWAP_EXPERT_READ_H
#define MOESWAP_EXPERT_READ_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>

#define MSW_CHECKS 4

typedef struct msw_job {
    int64_t fd, offset, nbytes;
    unsigned char *dst;
    int32_t drop;  /* after reading, drop these pages from the OS page cache (benchmarks' cold reads) */
    int32_t state;
    int32_t error; /* 0, an errno, or -1: the file ended before nbytes */
    int32_t nchecks; /* ranges of dst to check after a good read (0..MSW_CHECKS) */
    int64_t check_off[MSW_CHECKS], check_len[MSW_CHECKS];
    int32_t check_max; /* every byte of those ranges must be <= this */
    int32_t bad;       /* set by the reader: 1 when some byte is above check_max */
    struct msw_job *next;
} msw_job;

static inline int msw_read_all(msw_job *j) {
    int64_t done = 0;
    while (done < j->nbytes) {
        ssize_t n = pread((int)j->fd, j->dst + done, (size_t)(j->nbytes - done), (off_t)(j->offset + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) return -1;
        done += n;
    }
#ifdef POSIX_FADV_DONTNEED
    if (j->drop) posix_fadvise((int)j->fd, (off_t)j->offset, (off_t)j->nbytes, POSIX_FADV_DONTNEED);
#endif
    return 0;
}

static inline void msw_check(msw_job *j) {
    int bad = 0;
    for (int c = 0; c < j->nchecks && c < MSW_CHECKS && !bad; c++) {
        const unsigned char *p = j->dst + j->check_off[c];
        unsigned char top = 0;
        for (int64_t i = 0; i < j->check_len[c]; i++) top = p[i] > top ? p[i] : top;
        bad = top > j->check_max;
    }
    j->bad = bad;
}

/* The read, then (when it is whole) its checks; returns the error (0, an errno, -1 the file ended early). */
static inline int msw_read_and_check(msw_job *j) {
    int error = msw_read_all(j);
    if (!error) msw_check(j);
    return error;
}

#endif
