/* expert_read.h: one expert's bytes read from its checkpoint file and checked, as a job (msw_job) that both
 * the background reader threads (experts/native_reads.c) and the native decode step's in-call loads
 * (decode_step.c) run: one definition of the job's layout and of the read and check. experts/reads.py builds
 * msw_job's ctypes mirror from MSW_JOB_FIELDS and checks it field by field against the reader library.
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

/* msw_job's fields, FIELD(type, name, array dimension or nothing) in struct order; experts/reads.py builds its
 * ctypes mirror from this list (ops/kernel_abi.py) and checks it against the reader library's msw_job_field. */
#define MSW_JOB_FIELDS(FIELD)                                                                                  \
    FIELD(int64_t, fd, )                                                                                       \
    FIELD(int64_t, offset, )                                                                                   \
    FIELD(int64_t, nbytes, )                                                                                   \
    FIELD(uint8_t *, dst, )                                                                                    \
    FIELD(int32_t, drop, )      /* after reading, drop these pages from the OS page cache (cold reads) */     \
    FIELD(int32_t, state, )     /* MSW_JOB_STATES */                                                          \
    FIELD(int32_t, error, )     /* 0, an errno, or -1: the file ended before nbytes */                        \
    FIELD(int32_t, nchecks, )   /* ranges of dst to check after a good read (0..MSW_CHECKS) */                \
    FIELD(int64_t, check_off, [MSW_CHECKS])                                                                    \
    FIELD(int64_t, check_len, [MSW_CHECKS])                                                                    \
    FIELD(int32_t, check_max, ) /* every byte of those ranges must be <= this */                              \
    FIELD(int32_t, bad, )       /* set by the reader: 1 when some byte is above check_max */                  \
    FIELD(struct msw_job *, next, )

/* A job's states, in order from 0 (MSW_QUEUED, ...). */
#define MSW_JOB_STATES(STATE) STATE(QUEUED) STATE(RUNNING) STATE(DONE) STATE(CANCELLED)

#define MSW_DECLARE_FIELD(type, name, dims) type name dims;
typedef struct msw_job { MSW_JOB_FIELDS(MSW_DECLARE_FIELD) } msw_job;
#undef MSW_DECLARE_FIELD

#define MSW_STATE(name) MSW_##name,
enum { MSW_JOB_STATES(MSW_STATE) };
#undef MSW_STATE

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
