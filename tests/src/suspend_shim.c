/* LD_PRELOAD shim for tests/src/suspend.rs: holds CLOCK_MONOTONIC (and its _RAW and _COARSE
 * variants) back by the nanoseconds stored in the file named by SUSPEND_SHIM_FILE, which the
 * test raises while the process is stopped. CLOCK_BOOTTIME and CLOCK_REALTIME are left alone:
 * across a SIGSTOP the process then sees its clocks as after a host suspend (monotonic time
 * did not pass, boot time and wall time did). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static volatile const int64_t *held_back;

__attribute__((constructor)) static void init(void) {
    real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    const char *path = getenv("SUSPEND_SHIM_FILE");
    if (path == NULL) return;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    void *map = mmap(NULL, sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map != MAP_FAILED) held_back = map;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    if (real_clock_gettime == NULL) real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    int result = real_clock_gettime(clock, ts);
    if (result != 0 || held_back == NULL) return result;
    if (clock == CLOCK_MONOTONIC || clock == CLOCK_MONOTONIC_RAW || clock == CLOCK_MONOTONIC_COARSE) {
        int64_t ns = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec - *held_back;
        ts->tv_sec = ns / 1000000000;
        ts->tv_nsec = ns % 1000000000;
    }
    return result;
}
