/* An LD_PRELOAD shim that moves this process's wall clock only.
 *
 * CLOCK_REALTIME (and its coarse variant), gettimeofday() and time() read
 * RALLYPOINT_CLOCK_SHIFT seconds (signed) ahead of the real wall clock; every other
 * clock, CLOCK_MONOTONIC above all, is left alone, and so are the kernel's timed
 * waits. (libfaketime moves the monotonic clock too and breaks Python's waits.)
 * Children inherit LD_PRELOAD and the variable, so a node's workers share its clock.
 *
 * Build: gcc -shared -fPIC -O2 -o shift_clock.so shift_clock.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);
typedef int (*gettimeofday_fn)(struct timeval *, void *);

static long long shift_seconds(void) {
    static int known;
    static long long shift;
    if (!known) {
        const char *text = getenv("RALLYPOINT_CLOCK_SHIFT");
        shift = text ? atoll(text) : 0;
        known = 1;
    }
    return shift;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    static clock_gettime_fn real;
    if (!real) real = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clock, ts);
    if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE))
        ts->tv_sec += shift_seconds();
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    static gettimeofday_fn real;
    if (!real) real = (gettimeofday_fn)dlsym(RTLD_NEXT, "gettimeofday");
    int rc = real(tv, tz);
    if (rc == 0) tv->tv_sec += shift_seconds();
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return (time_t)-1;
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
