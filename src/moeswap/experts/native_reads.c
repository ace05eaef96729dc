/* native_reads.c: a pool of POSIX threads that read byte ranges of files into caller buffers, and check
 * what they read.
 *
 * Why C: a Python reader thread must take the GIL back after every read, which on a small machine slows
 * the model's own thread (which drops and retakes the GIL around every torch call) more than the same
 * reads from another process do (docs/benchmarks.md). These threads never touch Python:
 * the model's thread submits jobs and later polls or waits for them (experts/reads.py).
 *
 * A job is caller memory (a ctypes struct) that stays alive until it is done or cancelled. Jobs run
 * urgent queue first, each queue in order. A job may name up to MSW_CHECKS byte ranges of its buffer
 * whose bytes must not exceed check_max (MXFP4's scale bytes): the thread that read it checks them, so
 * the model's thread only looks at `bad`. Entry points: msw_reads_new / submit / submit_many / cancel /
 * done / wait / free, and msw_read_now (the same read and check on the caller's thread). */
#define _GNU_SOURCE
#include <stddef.h>
#include <pthread.h>
#include <stdlib.h>

#include "../ops/csrc/expert_read.h"

typedef struct {
    msw_job *head, *tail;
} queue;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work, finished;
    queue urgent, normal;
    int stop, nthreads;
    pthread_t *threads;
} msw_reads;

static void push(queue *q, msw_job *j) {
    j->next = NULL;
    if (q->tail) q->tail->next = j; else q->head = j;
    q->tail = j;
}

static msw_job *pop(queue *q) {
    msw_job *j = q->head;
    if (j) {
        q->head = j->next;
        if (!q->head) q->tail = NULL;
    }
    return j;
}

static int unlink_job(queue *q, msw_job *j) {
    msw_job *prev = NULL;
    for (msw_job *it = q->head; it; prev = it, it = it->next) {
        if (it != j) continue;
        if (prev) prev->next = it->next; else q->head = it->next;
        if (q->tail == it) q->tail = prev;
        return 1;
    }
    return 0;
}

static void *worker(void *arg) {
    msw_reads *r = arg;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        while (!r->stop && !r->urgent.head && !r->normal.head) pthread_cond_wait(&r->work, &r->lock);
        if (r->stop) break;
        msw_job *j = pop(&r->urgent);
        if (!j) j = pop(&r->normal);
        j->state = MSW_RUNNING;
        pthread_mutex_unlock(&r->lock);
        int error = msw_read_and_check(j);
        pthread_mutex_lock(&r->lock);
        j->error = error;
        __atomic_store_n(&j->state, MSW_DONE, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&r->finished);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

void *msw_reads_new(int nthreads) {
    msw_reads *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!r->threads) { free(r); return NULL; }
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->finished, NULL);
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&r->threads[i], NULL, worker, r)) break;
        r->nthreads++;
    }
    return r;
}

void msw_reads_submit(void *handle, msw_job *j, int urgent) {
    msw_reads *r = handle;
    pthread_mutex_lock(&r->lock);
    j->state = MSW_QUEUED;
    j->error = 0;
    push(urgent ? &r->urgent : &r->normal, j);
    pthread_cond_signal(&r->work);
    pthread_mutex_unlock(&r->lock);
}

/* The job's layout and states as compiled, which experts/reads.py checks its ctypes mirror against before using
 * the library: field i's name, offset, size and type as MSW_JOB_FIELDS spells it (dimensions expanded), or
 * state i's name; 0, or 1 past the last one. */
#define MSW_TEXT(x) MSW_TEXT_(x)
#define MSW_TEXT_(x) #x
#define FIELD_ROW(type, name, dims) \
    {#name, (int64_t)offsetof(msw_job, name), (int64_t)sizeof(((msw_job *)0)->name), MSW_TEXT(type) MSW_TEXT(dims)},
static const struct { const char *name; int64_t offset, size; const char *type; } job_fields[] = {
    MSW_JOB_FIELDS(FIELD_ROW)
};
#undef FIELD_ROW
#define STATE_NAME(name) #name,
static const char *const job_states[] = {MSW_JOB_STATES(STATE_NAME)};
#undef STATE_NAME

int64_t msw_job_size(void) { return (int64_t)sizeof(msw_job); }

int msw_job_field(int64_t i, const char **name, int64_t *offset, int64_t *size, const char **type) {
    if (i < 0 || i >= (int64_t)(sizeof(job_fields) / sizeof(job_fields[0]))) return 1;
    *name = job_fields[i].name, *offset = job_fields[i].offset, *size = job_fields[i].size;
    *type = job_fields[i].type;
    return 0;
}

int msw_job_state(int64_t i, const char **name) {
    if (i < 0 || i >= (int64_t)(sizeof(job_states) / sizeof(job_states[0]))) return 1;
    *name = job_states[i];
    return 0;
}

/* n jobs under one lock acquisition, in order (a layer step's reads). */
void msw_reads_submit_many(void *handle, msw_job **jobs, int n, int urgent) {
    msw_reads *r = handle;
    pthread_mutex_lock(&r->lock);
    for (int i = 0; i < n; i++) {
        jobs[i]->state = MSW_QUEUED;
        jobs[i]->error = 0;
        push(urgent ? &r->urgent : &r->normal, jobs[i]);
    }
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->lock);
}

/* The read and its checks on the calling thread (a demand miss); returns and sets the job's error. */
int msw_read_now(msw_job *j) {
    j->error = msw_read_and_check(j);
    j->state = MSW_DONE;
    return j->error;
}

/* 1: removed before it started (the caller may free it); 0: running or finished. */
int msw_reads_cancel(void *handle, msw_job *j) {
    msw_reads *r = handle;
    pthread_mutex_lock(&r->lock);
    int removed = j->state == MSW_QUEUED && (unlink_job(&r->urgent, j) || unlink_job(&r->normal, j));
    if (removed) __atomic_store_n(&j->state, MSW_CANCELLED, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&r->lock);
    return removed;
}

int msw_reads_done(const msw_job *j) { return __atomic_load_n(&j->state, __ATOMIC_ACQUIRE) >= MSW_DONE; }

/* Blocks until j is done; a queued job moves to the front of the urgent queue first. */
void msw_reads_wait(void *handle, msw_job *j) {
    msw_reads *r = handle;
    pthread_mutex_lock(&r->lock);
    if (j->state == MSW_QUEUED && (unlink_job(&r->normal, j) || unlink_job(&r->urgent, j))) {
        j->next = r->urgent.head;
        r->urgent.head = j;
        if (!r->urgent.tail) r->urgent.tail = j;
        pthread_cond_signal(&r->work);
    }
    while (j->state < MSW_DONE) pthread_cond_wait(&r->finished, &r->lock);
    pthread_mutex_unlock(&r->lock);
}

/* Stops the threads after the reads in progress; queued jobs end CANCELLED. */
void msw_reads_free(void *handle) {
    msw_reads *r = handle;
    if (!r) return;
    pthread_mutex_lock(&r->lock);
    r->stop = 1;
    msw_job *j;
    while ((j = pop(&r->urgent))) __atomic_store_n(&j->state, MSW_CANCELLED, __ATOMIC_RELEASE);
    while ((j = pop(&r->normal))) __atomic_store_n(&j->state, MSW_CANCELLED, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&r->work);
    pthread_cond_broadcast(&r->finished);
    pthread_mutex_unlock(&r->lock);
    for (int i = 0; i < r->nthreads; i++) pthread_join(r->threads[i], NULL);
    pthread_cond_destroy(&r->finished);
    pthread_cond_destroy(&r->work);
    pthread_mutex_destroy(&r->lock);
    free(r->threads);
    free(r);
}
