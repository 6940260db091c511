/* Fixed addresses for torch's symmetric memory.
 *
 * torch (2.11) maps every symmetric-memory block (the local buffer, each peer's buffer, the
 * multicast object) into a virtual range it reserves with cuMemAddressReserve and no address hint,
 * so the driver chooses, and a fresh process gets another base. A captured all-reduce holds those
 * addresses. torch calls the driver through its own table of entry points (c10::cuda::DriverAPI),
 * not through libcuda's exported symbol, so the one place to steer the choice is that table's
 * cuMemAddressReserve slot. Python finds and checks the slot (symmetric.py); this file swaps it for
 * foundry_symm_reserve and back.
 *
 * The replacement forwards every call unchanged except a hint-less request made by a thread that
 * Python armed: that one gets the next aligned sub-range of a window Foundry reserved for the device
 * beforehand (symmetric.py), and the driver is not asked at all. A hint would not do: the driver
 * placed torch's 2-8 MiB reservations where it chose at every hint tried, and honours a hint only
 * for large ones such as the window (one H200, 2026-12-03). Mapping into part of a reservation is
 * what the VMM calls allow, and torch never frees these reservations (it unmaps and releases the
 * memory only), so a sub-range is never handed back to the driver. The same sequence of requests in
 * two processes then gets the same addresses. A request the window has no room for goes to the
 * driver unchanged, so torch goes on working, and the window is marked misplaced with the reason,
 * which Python turns into an error (fail closed). Each placed request is recorded (placements()).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "cuda_min.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 64
#define MAX_PLACED 256

typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);

typedef struct {
  uint64_t base, size, align;
  uint64_t cursor; /* offset of the first free byte */
  uint64_t placed_addr[MAX_PLACED], placed_size[MAX_PLACED];
  size_t placed;
  int misplaced;
} window;

static window windows[MAX_DEVICES];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int armed_device = -1;
static void **hooked_slot;
static reserve_fn original;
static char last_error[256];

static CUresult foundry_symm_reserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags) {
  int device = armed_device;
  reserve_fn next = original;
  if (device < 0 || addr != 0) return next(ptr, size, alignment, addr, flags);
  pthread_mutex_lock(&lock);
  window *w = &windows[device];
  uint64_t align = alignment > w->align ? alignment : w->align;
  uint64_t at = (w->base + w->cursor + align - 1) / align * align;
  CUresult rc;
  if (!w->size || w->placed == MAX_PLACED || at + size > w->base + w->size) {
    rc = next(ptr, size, alignment, 0, flags);
    w->misplaced = 1;
    snprintf(last_error, sizeof last_error,
             "symmetric-memory window on device %d is full: %zu bytes requested at 0x%llx, window ends at "
             "0x%llx (%zu placed)",
             device, size, (unsigned long long)at, (unsigned long long)(w->base + w->size), w->placed);
  } else {
    *ptr = at;
    rc = CUDA_SUCCESS;
    w->placed_addr[w->placed] = at;
    w->placed_size[w->placed++] = size;
    w->cursor = at + size - w->base;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

/* The window symmetric memory of `device` is placed in from now on: [base, base + size), reserved by
 * the caller, each request aligned to `align`. Setting the same window again keeps its cursor;
 * another one is refused. */
EXPORT int foundry_symm_window(int device, uint64_t base, uint64_t size, uint64_t align) {
  if (device < 0 || device >= MAX_DEVICES || !size || !align || (align & (align - 1))) {
    snprintf(last_error, sizeof last_error, "bad symmetric-memory window for device %d", device);
    return -1;
  }
  pthread_mutex_lock(&lock);
  window *w = &windows[device];
  int result = 0;
  if (w->size && (w->base != base || w->size != size || w->align != align)) {
    snprintf(last_error, sizeof last_error,
             "device %d already has a symmetric-memory window at 0x%llx (+%llu bytes)", device,
             (unsigned long long)w->base, (unsigned long long)w->size);
    result = -1;
  } else if (!w->size) {
    w->base = base;
    w->size = size;
    w->align = align;
  }
  pthread_mutex_unlock(&lock);
  return result;
}

/* Swap the cuMemAddressReserve entry at `slot` (Python checked that it is one) for the placing one.
 * Installing over the same slot again is a no-op; a second slot is refused. */
EXPORT int foundry_symm_hook_install(void **slot) {
  pthread_mutex_lock(&lock);
  int result = 0;
  if (hooked_slot && hooked_slot != slot) {
    snprintf(last_error, sizeof last_error, "the symmetric-memory hook is already installed elsewhere");
    result = -1;
  } else if (!hooked_slot) {
    original = (reserve_fn)*slot;
    hooked_slot = slot;
    __atomic_store_n(slot, (void *)foundry_symm_reserve, __ATOMIC_SEQ_CST);
  }
  pthread_mutex_unlock(&lock);
  return result;
}

/* Put the original entry back. Refused when the slot no longer holds ours (someone else swapped it
 * since: writing over theirs would break them). */
EXPORT int foundry_symm_hook_remove(void) {
  pthread_mutex_lock(&lock);
  int result = 0;
  if (hooked_slot) {
    if (__atomic_load_n(hooked_slot, __ATOMIC_SEQ_CST) != (void *)foundry_symm_reserve) {
      snprintf(last_error, sizeof last_error,
               "torch's cuMemAddressReserve entry was replaced by another hook");
      result = -1;
    } else {
      __atomic_store_n(hooked_slot, (void *)original, __ATOMIC_SEQ_CST);
      hooked_slot = NULL;
    }
  }
  pthread_mutex_unlock(&lock);
  return result;
}

/* Requests made by this thread from now on are placed in `device`'s window; -1 disarms. */
EXPORT void foundry_symm_arm(int device) {
  armed_device = device >= 0 && device < MAX_DEVICES ? device : -1;
}

/* 1 when a request of `device` could not be placed (foundry_symm_error says why), else 0. */
EXPORT int foundry_symm_misplaced(int device) {
  if (device < 0 || device >= MAX_DEVICES) return 0;
  pthread_mutex_lock(&lock);
  int misplaced = windows[device].misplaced;
  pthread_mutex_unlock(&lock);
  return misplaced;
}

/* Copy up to `n` placed requests (address, size) of `device`; returns the count copied. */
EXPORT size_t foundry_symm_placed(int device, size_t n, uint64_t *addr, uint64_t *size) {
  if (device < 0 || device >= MAX_DEVICES) return 0;
  pthread_mutex_lock(&lock);
  window *w = &windows[device];
  size_t count = w->placed < n ? w->placed : n;
  memcpy(addr, w->placed_addr, count * sizeof *addr);
  memcpy(size, w->placed_size, count * sizeof *size);
  pthread_mutex_unlock(&lock);
  return count;
}

EXPORT const char *foundry_symm_error(void) {
  return last_error;
}
