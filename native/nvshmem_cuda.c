/* The driver NVSHMEM sees, placing its symmetric heap at a recorded address.
 *
 * NVSHMEM (3.4.5, the nvidia-nvshmem wheel) reserves its symmetric heap's virtual range with
 * cuMemAddressReserve and no address hint (mem_heap.cpp, reserve_heap), so a fresh process gets
 * another base, and a captured kernel that addresses the heap (DeepEP's low-latency buffers are
 * nvshmem_align'ed in it) would point elsewhere after a LOAD. NVSHMEM reaches the driver through a
 * table of its own, filled with cuGetProcAddress from the libcuda.so.1 it dlopens, and it takes that
 * file from $NVSHMEM_CUDA_PATH where set (cudawrap.cpp). This library is that libcuda.so.1: Python
 * points NVSHMEM_CUDA_PATH at a folder whose libcuda.so.1 links here (nvshmem.py). It forwards
 * cuInit and every cuGetProcAddress to the real driver, except that cuMemAddressReserve resolves to
 * foundry_nvshmem_reserve: once Python armed a base, the first hint-less request of at least the
 * armed size (the heap: NVSHMEM_MAX_MEMORY_PER_GPU, 128 GiB by default, per peer) is asked for at
 * that base. Where the driver chooses another address the request still succeeds, so NVSHMEM goes on
 * working, and the placement records what it got, which Python refuses (fail closed). Nothing else
 * changes. It is a library of its own, never in the process's global scope: its cuInit must not
 * stand in for the driver's anywhere but in NVSHMEM's table.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "cuda_min.h"

#define EXPORT __attribute__((visibility("default")))
#define CUDA_ERROR_NOT_INITIALIZED 3

typedef uint64_t cuuint64_t;
typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*proc_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*proc_v2_fn)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char real_path[4096] = "libcuda.so.1";
static void *real;
static init_fn real_init;
static proc_fn real_proc;
static proc_v2_fn real_proc_v2;
static reserve_fn real_reserve;
static uint64_t armed_base, armed_min, placed_addr, placed_size, asked_addr;
static int taken;    /* the placing request has been made (one only, whichever thread makes it) */
static int resolved; /* NVSHMEM asked for cuMemAddressReserve through this library */

static int load_real(void) {
  pthread_mutex_lock(&lock);
  if (!real) {
    real = dlopen(real_path, RTLD_NOW | RTLD_LOCAL);
    if (real) {
      *(void **)&real_init = dlsym(real, "cuInit");
      *(void **)&real_proc = dlsym(real, "cuGetProcAddress");
      *(void **)&real_proc_v2 = dlsym(real, "cuGetProcAddress_v2");
    }
  }
  int ok = real && real_init && real_proc;
  pthread_mutex_unlock(&lock);
  return ok;
}

static CUresult foundry_nvshmem_reserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags) {
  pthread_mutex_lock(&lock);
  int take = armed_base && !addr && size >= armed_min && !taken;
  if (take) taken = 1;
  reserve_fn next = real_reserve;
  pthread_mutex_unlock(&lock);
  CUresult rc = next(ptr, size, alignment, take ? (CUdeviceptr)armed_base : addr, flags);
  if (take && rc == CUDA_SUCCESS) {
    pthread_mutex_lock(&lock);
    asked_addr = armed_base;
    placed_addr = *ptr;
    placed_size = size;
    pthread_mutex_unlock(&lock);
  }
  return rc;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status);

/* cuMemAddressReserve resolves to the placing entry, the real one kept for it; cuGetProcAddress
 * itself (a caller may look up its versioned form) to this library's, so later lookups come here. */
static void substitute(const char *symbol, void **pfn) {
  if (!*pfn) return;
  if (strcmp(symbol, "cuGetProcAddress") == 0) {
    if (*pfn == (void *)real_proc)
      *pfn = (void *)cuGetProcAddress;
    else if (*pfn == (void *)real_proc_v2)
      *pfn = (void *)cuGetProcAddress_v2;
    return;
  }
  if (strcmp(symbol, "cuMemAddressReserve") != 0) return;
  pthread_mutex_lock(&lock);
  if (!real_reserve) real_reserve = (reserve_fn)*pfn;
  resolved = 1;
  pthread_mutex_unlock(&lock);
  *pfn = (void *)foundry_nvshmem_reserve;
}

EXPORT CUresult cuInit(unsigned int flags) {
  return load_real() ? real_init(flags) : CUDA_ERROR_NOT_INITIALIZED;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
  if (!load_real()) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult rc = real_proc(symbol, pfn, version, flags);
  if (rc == CUDA_SUCCESS) substitute(symbol, pfn);
  return rc;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    int *status) {
  if (!load_real() || !real_proc_v2) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult rc = real_proc_v2(symbol, pfn, version, flags, status);
  if (rc == CUDA_SUCCESS) substitute(symbol, pfn);
  return rc;
}

/* The driver library to forward to (the folder NVSHMEM_CUDA_PATH named before Foundry took it over);
 * only before the first forwarded call. */
EXPORT int foundry_nvshmem_real_driver(const char *path) {
  pthread_mutex_lock(&lock);
  int result = -1;
  if (!real && path && strlen(path) < sizeof real_path) {
    snprintf(real_path, sizeof real_path, "%s", path);
    result = 0;
  }
  pthread_mutex_unlock(&lock);
  return result;
}

/* The heap goes to `base`: the first hint-less request of at least `min_size` bytes from now on. */
EXPORT void foundry_nvshmem_arm(uint64_t base, uint64_t min_size) {
  pthread_mutex_lock(&lock);
  armed_base = base;
  armed_min = min_size;
  pthread_mutex_unlock(&lock);
}

/* What the placing request asked for and got (all 0 before it), and whether NVSHMEM resolved
 * cuMemAddressReserve through this library at all. */
EXPORT void foundry_nvshmem_placement(uint64_t *asked, uint64_t *addr, uint64_t *size, int *through_us) {
  pthread_mutex_lock(&lock);
  *asked = asked_addr;
  *addr = placed_addr;
  *size = placed_size;
  *through_us = resolved;
  pthread_mutex_unlock(&lock);
}
