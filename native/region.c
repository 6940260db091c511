/* Deterministic device memory: a fixed-address virtual region with a monotonic cursor.
 *
 * torch's caching allocator asks for segments through foundry_alloc/foundry_free (a
 * torch.cuda.MemPool built on CUDAPluggableAllocator). Every segment is placed at the region's
 * cursor, which only moves forward, so the same sequence of segment requests in two processes
 * yields the same addresses. Virtual addresses are never reused, so a segment freed during a
 * warmup leaves a hole instead of shifting what comes after it.
 *
 * Every segment is logged (address, size, live, label). A LOAD compares its own log with the
 * SAVE's to prove placement, and maps the segments the graphs own at their recorded addresses.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "cuda_min.h"
#include "driver.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 64

typedef struct {
  CUdeviceptr addr;
  size_t size;
  CUmemGenericAllocationHandle handle;
  int live;
  int label;
  int kind; /* 0: eager pool, 1: graph pool, 2: mapped by a LOAD */
} segment;

typedef struct {
  int reserved;
  CUdeviceptr base;
  size_t size;
  size_t cursor; /* offset of the next segment */
  size_t granularity;
  segment *log;
  size_t log_len, log_cap;
} region;

static region regions[MAX_DEVICES];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int current_label;
static char last_error[256];

static struct {
  CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*granularity)(size_t *, const CUmemAllocationProp *, int);
  CUresult (*error_name)(CUresult, const char **);
} cu;

static void set_error(const char *what, CUresult rc) {
  const char *name = NULL;
  if (cu.error_name) cu.error_name(rc, &name);
  snprintf(last_error, sizeof last_error, "%s failed: %s (%d)", what, name ? name : "unknown", rc);
}

static int load_driver(void) {
  if (cu.reserve) return 0;
  const foundry_cuda_symbol symbols[] = {
      {(void **)&cu.error_name, "cuGetErrorName"},
      {(void **)&cu.address_free, "cuMemAddressFree"},
      {(void **)&cu.create, "cuMemCreate"},
      {(void **)&cu.release, "cuMemRelease"},
      {(void **)&cu.map, "cuMemMap"},
      {(void **)&cu.unmap, "cuMemUnmap"},
      {(void **)&cu.set_access, "cuMemSetAccess"},
      {(void **)&cu.granularity, "cuMemGetAllocationGranularity"},
      {(void **)&cu.reserve, "cuMemAddressReserve"}, /* last: it doubles as the "loaded" flag */
  };
  if (foundry_cuda_resolve(symbols, sizeof symbols / sizeof *symbols, last_error, sizeof last_error)) {
    cu.reserve = NULL; /* a partial table is not "loaded" */
    return -1;
  }
  return 0;
}

static CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

static int log_append(region *r, CUdeviceptr addr, size_t size, CUmemGenericAllocationHandle handle,
                      int kind) {
  if (r->log_len == r->log_cap) {
    size_t cap = r->log_cap ? 2 * r->log_cap : 256;
    segment *grown = realloc(r->log, cap * sizeof *grown);
    if (!grown) return -1;
    r->log = grown;
    r->log_cap = cap;
  }
  segment s = {addr, size, handle, 1, current_label, kind};
  r->log[r->log_len++] = s;
  return 0;
}

/* Physical memory for [addr, addr + size), readable and writable from `device`. */
static int map_physical(int device, CUdeviceptr addr, size_t size, CUmemGenericAllocationHandle *out) {
  CUmemAllocationProp prop = device_prop(device);
  CUmemGenericAllocationHandle handle;
  CUresult rc = cu.create(&handle, size, &prop, 0);
  if (rc != CUDA_SUCCESS) {
    set_error("cuMemCreate", rc);
    return -1;
  }
  rc = cu.map(addr, size, 0, handle, 0);
  if (rc != CUDA_SUCCESS) {
    set_error("cuMemMap", rc);
    cu.release(handle);
    return -1;
  }
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  rc = cu.set_access(addr, size, &access, 1);
  if (rc != CUDA_SUCCESS) {
    set_error("cuMemSetAccess", rc);
    cu.unmap(addr, size);
    cu.release(handle);
    return -1;
  }
  *out = handle;
  return 0;
}

/* Reserve [base, base + size) on `device`. Returns 0, or -1 with foundry_region_error() set;
 * -2 when the driver placed the reservation elsewhere (the region is then released again). */
EXPORT int foundry_region_reserve(int device, uint64_t base, uint64_t size) {
  if (device < 0 || device >= MAX_DEVICES) {
    snprintf(last_error, sizeof last_error, "device %d out of range", device);
    return -1;
  }
  if (load_driver()) return -1;
  pthread_mutex_lock(&lock);
  region *r = &regions[device];
  int result = 0;
  if (r->reserved) {
    if (r->base != base || r->size != size) {
      snprintf(last_error, sizeof last_error,
               "device %d already has a region at 0x%llx (+%zu bytes); cannot reserve another at 0x%llx",
               device, (unsigned long long)r->base, r->size, (unsigned long long)base);
      result = -1;
    }
    goto out;
  }
  CUmemAllocationProp prop = device_prop(device);
  size_t gran = 0;
  CUresult rc = cu.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (rc != CUDA_SUCCESS) {
    set_error("cuMemGetAllocationGranularity", rc);
    result = -1;
    goto out;
  }
  CUdeviceptr got = 0;
  rc = cu.reserve(&got, size, gran, base, 0);
  if (rc != CUDA_SUCCESS) {
    set_error("cuMemAddressReserve", rc);
    result = -1;
    goto out;
  }
  if (got != base) {
    cu.address_free(got, size);
    snprintf(last_error, sizeof last_error,
             "the driver placed the region at 0x%llx instead of the requested 0x%llx (address range in use?)",
             (unsigned long long)got, (unsigned long long)base);
    result = -2;
    goto out;
  }
  r->reserved = 1;
  r->base = base;
  r->size = size;
  r->cursor = 0;
  r->granularity = gran;
out:
  pthread_mutex_unlock(&lock);
  return result;
}

static void *region_alloc(ssize_t size, int device, int kind) {
  if (device < 0 || device >= MAX_DEVICES || size <= 0) return NULL;
  pthread_mutex_lock(&lock);
  region *r = &regions[device];
  void *result = NULL;
  if (!r->reserved) {
    snprintf(last_error, sizeof last_error, "no region reserved on device %d", device);
    goto out;
  }
  size_t rounded = ((size_t)size + r->granularity - 1) / r->granularity * r->granularity;
  if (r->cursor + rounded > r->size) {
    snprintf(last_error, sizeof last_error,
             "region on device %d is exhausted: %zu bytes requested at offset %zu of %zu (raise region.size)",
             device, rounded, r->cursor, r->size);
    goto out;
  }
  CUdeviceptr addr = r->base + r->cursor;
  CUmemGenericAllocationHandle handle;
  if (map_physical(device, addr, rounded, &handle)) goto out;
  if (log_append(r, addr, rounded, handle, kind)) {
    cu.unmap(addr, rounded);
    cu.release(handle);
    snprintf(last_error, sizeof last_error, "out of host memory for the segment log");
    goto out;
  }
  r->cursor += rounded;
  result = (void *)(uintptr_t)addr;
out:
  pthread_mutex_unlock(&lock);
  return result;
}

/* torch CUDAPluggableAllocator entry points: one per pool, so the log knows which pool asked. */
EXPORT void *foundry_alloc(ssize_t size, int device, void *stream) {
  (void)stream;
  return region_alloc(size, device, 0);
}

EXPORT void *foundry_alloc_graph(ssize_t size, int device, void *stream) {
  (void)stream;
  return region_alloc(size, device, 1);
}

static segment *find_live(region *r, CUdeviceptr addr) {
  /* Addresses in the log increase with the index (the cursor is monotonic): binary search. */
  size_t lo = 0, hi = r->log_len;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (r->log[mid].addr < addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo < r->log_len && r->log[lo].addr == addr && r->log[lo].live) return &r->log[lo];
  return NULL;
}

static void release_segment(segment *s) {
  cu.unmap(s->addr, s->size);
  cu.release(s->handle);
  s->live = 0;
}

EXPORT void foundry_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)size;
  (void)stream;
  if (device < 0 || device >= MAX_DEVICES) return;
  pthread_mutex_lock(&lock);
  segment *s = find_live(&regions[device], (CUdeviceptr)(uintptr_t)ptr);
  if (s) release_segment(s);
  pthread_mutex_unlock(&lock);
}

/* LOAD: map physical memory at a recorded segment address at or past the cursor; the cursor moves
 * to the segment's end, exactly as if the allocator had produced it. */
EXPORT int foundry_region_map(int device, uint64_t addr, uint64_t size, int label) {
  if (device < 0 || device >= MAX_DEVICES) return -1;
  pthread_mutex_lock(&lock);
  region *r = &regions[device];
  int result = -1;
  if (!r->reserved) {
    snprintf(last_error, sizeof last_error, "no region reserved on device %d", device);
    goto out;
  }
  if (addr < r->base + r->cursor || addr + size > r->base + r->size || size % r->granularity) {
    snprintf(last_error, sizeof last_error,
             "segment 0x%llx (+%llu bytes) cannot be mapped: region cursor is at 0x%llx, end 0x%llx",
             (unsigned long long)addr, (unsigned long long)size, (unsigned long long)(r->base + r->cursor),
             (unsigned long long)(r->base + r->size));
    goto out;
  }
  CUmemGenericAllocationHandle handle;
  if (map_physical(device, addr, size, &handle)) goto out;
  int saved = current_label;
  current_label = label;
  int failed = log_append(r, addr, size, handle, 2);
  current_label = saved;
  if (failed) {
    cu.unmap(addr, size);
    cu.release(handle);
    goto out;
  }
  r->cursor = addr + size - r->base;
  result = 0;
out:
  pthread_mutex_unlock(&lock);
  return result;
}

/* LOAD: release a segment that foundry_region_map produced (unloading restored graphs). */
EXPORT int foundry_region_unmap(int device, uint64_t addr) {
  if (device < 0 || device >= MAX_DEVICES) return -1;
  pthread_mutex_lock(&lock);
  segment *s = find_live(&regions[device], addr);
  if (s) release_segment(s);
  pthread_mutex_unlock(&lock);
  return s ? 0 : -1;
}

/* Skip the cursor forward (never back), e.g. past the end a SAVE reached. */
EXPORT int foundry_region_advance(int device, uint64_t offset) {
  if (device < 0 || device >= MAX_DEVICES) return -1;
  pthread_mutex_lock(&lock);
  region *r = &regions[device];
  int ok = r->reserved && offset >= r->cursor && offset <= r->size;
  if (ok) r->cursor = offset;
  pthread_mutex_unlock(&lock);
  return ok ? 0 : -1;
}

/* LOAD undone: forget the log entries from `log_len` on and move the cursor back to `cursor`, so the
 * same archive can be restored again into this process. Refused (-1) while any of those entries is
 * still live, or when `cursor` would fall inside a kept segment. */
EXPORT int foundry_region_rewind(int device, size_t log_len, uint64_t cursor) {
  if (device < 0 || device >= MAX_DEVICES) return -1;
  pthread_mutex_lock(&lock);
  region *r = &regions[device];
  int result = -1;
  if (!r->reserved || log_len > r->log_len || cursor > r->cursor) {
    snprintf(last_error, sizeof last_error, "cannot rewind region on device %d to entry %zu, offset %llu",
             device, log_len, (unsigned long long)cursor);
    goto out;
  }
  if (log_len > 0 && r->log[log_len - 1].addr + r->log[log_len - 1].size > r->base + cursor) {
    snprintf(last_error, sizeof last_error, "cannot rewind region: offset %llu lies inside segment #%zu",
             (unsigned long long)cursor, log_len - 1);
    goto out;
  }
  for (size_t i = log_len; i < r->log_len; i++) {
    if (r->log[i].live) {
      snprintf(last_error, sizeof last_error,
               "cannot rewind region: segment #%zu (%zu bytes at 0x%llx) is still allocated", i,
               r->log[i].size, (unsigned long long)r->log[i].addr);
      goto out;
    }
  }
  r->log_len = log_len;
  r->cursor = cursor;
  result = 0;
out:
  pthread_mutex_unlock(&lock);
  return result;
}

EXPORT uint64_t foundry_region_cursor(int device) {
  if (device < 0 || device >= MAX_DEVICES) return 0;
  return regions[device].cursor;
}

EXPORT size_t foundry_region_log_len(int device) {
  if (device < 0 || device >= MAX_DEVICES) return 0;
  return regions[device].log_len;
}

/* Copy up to `n` log entries from index `start` into parallel arrays; returns the count copied. */
EXPORT size_t foundry_region_log_read(int device, size_t start, size_t n, uint64_t *addr, uint64_t *size,
                                      int32_t *live, int32_t *label, int32_t *kind) {
  if (device < 0 || device >= MAX_DEVICES) return 0;
  pthread_mutex_lock(&lock);
  region *r = &regions[device];
  size_t count = 0;
  for (size_t i = start; i < r->log_len && count < n; i++, count++) {
    addr[count] = r->log[i].addr;
    size[count] = r->log[i].size;
    live[count] = r->log[i].live;
    label[count] = r->log[i].label;
    kind[count] = r->log[i].kind;
  }
  pthread_mutex_unlock(&lock);
  return count;
}

/* Segments allocated from now on carry this label (an index into names kept by Python). */
EXPORT void foundry_region_set_label(int label) {
  current_label = label;
}

EXPORT const char *foundry_region_error(void) {
  return last_error;
}
