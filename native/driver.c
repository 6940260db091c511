/* The one place that opens libcuda: the driver's entry points are looked up at run time, so the
 * library builds and imports on machines without a GPU driver. */
#define _GNU_SOURCE
#include "driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

static pthread_once_t open_once = PTHREAD_ONCE_INIT;
static void *handle;
static char open_error[256];

static void open_driver(void) {
  handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!handle) snprintf(open_error, sizeof open_error, "cannot open libcuda.so.1: %s", dlerror());
}

int foundry_cuda_resolve(const foundry_cuda_symbol *symbols, size_t n, char *err, size_t errlen) {
  pthread_once(&open_once, open_driver);
  if (!handle) {
    snprintf(err, errlen, "%s", open_error);
    return -1;
  }
  for (size_t i = 0; i < n; i++) {
    *symbols[i].slot = dlsym(handle, symbols[i].name);
    if (!*symbols[i].slot) {
      snprintf(err, errlen, "libcuda.so.1 has no %s", symbols[i].name);
      return -1;
    }
  }
  return 0;
}
