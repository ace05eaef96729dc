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
#include <time.h>
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
    FIELD(int64_t, direct_fd1, ) /* an O_DIRECT descriptor of the same file plus one (0: none, read buffered) */ \
    FIELD(int64_t, align, )     /* O_DIRECT: the alignment of offsets, lengths and addresses */               \
    FIELD(int64_t, head, )      /* O_DIRECT: bytes of the caller's buffer before dst the read may overwrite */ \
    FIELD(int64_t, tail, )      /* ... and after dst + nbytes */                                              \
    FIELD(int32_t, direct, )    /* set by the reader: 1 read by O_DIRECT, -1 O_DIRECT refused (read buffered) */ \
    FIELD(int32_t, spare, )     /* unused: the next field at 8 bytes, as C lays it out anyway */              \
    FIELD(int64_t, t0_ns, )     /* set by the reader: CLOCK_MONOTONIC when the read began and ended */         \
    FIELD(int64_t, t1_ns, )                                                                                    \
    FIELD(struct msw_job *, next, )

/* A job's states, in order from 0 (MSW_QUEUED, ...). */
#define MSW_JOB_STATES(STATE) STATE(QUEUED) STATE(RUNNING) STATE(DONE) STATE(CANCELLED)

#define MSW_DECLARE_FIELD(type, name, dims) type name dims;
typedef struct msw_job { MSW_JOB_FIELDS(MSW_DECLARE_FIELD) } msw_job;
#undef MSW_DECLARE_FIELD

#define MSW_STATE(name) MSW_##name,
enum { MSW_JOB_STATES(MSW_STATE) };
#undef MSW_STATE

static inline int msw_pread_all(int fd, uint8_t *dst, int64_t nbytes, int64_t offset) {
    int64_t done = 0;
    while (done < nbytes) {
        ssize_t n = pread(fd, dst + done, (size_t)(nbytes - done), (off_t)(offset + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) return -1;
        done += n;
    }
    return 0;
}

/* The aligned superset of [offset, offset + nbytes) read by O_DIRECT straight into the caller's buffer, so that
 * the expert's bytes land at dst (the caller laid the buffer out for it: head and tail bytes of room, dst - the
 * offset's misalignment aligned). Returns 0, an errno, -1 (the file ended early), or -2: not possible here
 * (the buffer is not laid out for it, or the file system refuses O_DIRECT: EINVAL), read buffered instead. */
static inline int msw_read_direct(msw_job *j) {
    const int64_t a = j->align, pad = j->offset % a, base = j->offset - pad, want = pad + j->nbytes;
    const int64_t total = (want + a - 1) / a * a;
    uint8_t *at = j->dst - pad;
    if (a <= 0 || pad > j->head || total - want > j->tail || (uintptr_t)at % (uintptr_t)a) return -2;
    int64_t done = 0;
    while (done < want) {
        if (done % a) /* a short read not at the file's end (rare): the rest buffered */
            return msw_pread_all((int)j->fd, at + done, want - done, base + done);
        ssize_t n = pread((int)(j->direct_fd1 - 1), at + done, (size_t)(total - done), (off_t)(base + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno == EINVAL && done == 0 ? -2 : errno;
        }
        if (n == 0) return -1;
        done += n;
    }
    return 0;
}

static inline int64_t msw_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline int msw_read_all(msw_job *j) {
    j->t0_ns = msw_now_ns();
    int error = -2;
    j->direct = 0;
    if (j->direct_fd1 > 0) {
        error = msw_read_direct(j);
        j->direct = error == -2 ? -1 : 1;
    }
    if (error == -2) {
        error = msw_pread_all((int)j->fd, j->dst, j->nbytes, j->offset);
#ifdef POSIX_FADV_DONTNEED
        if (!error && (j->drop || j->direct == -1)) /* refused: leave the cache as O_DIRECT would */
            posix_fadvise((int)j->fd, (off_t)j->offset, (off_t)j->nbytes, POSIX_FADV_DONTNEED);
#endif
    }
    j->t1_ns = msw_now_ns();
    return error;
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
