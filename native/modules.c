/* Code capture: keep a copy of every module image the CUDA driver loads in this process.
 *
 * CUPTI's resource callback hands over the image of each module as it is loaded (PyTorch's own
 * kernels, cuBLAS/cuBLASLt, flash attention, Triton, ...), with no LD_PRELOAD. When a load goes
 * through the public driver API (cuModuleLoadData and friends, which Triton uses), the driver-API
 * callback also tells us the CUmodule handle it produced, which resolves kernels whose names
 * appear in more than one image.
 *
 * The same subscription counts stream-capture starts, so a LOAD can prove it captured nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_min.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct {
  char *data;
  size_t size;
  uint64_t handle; /* CUmodule when known, else 0 */
} image;

static image *images;
static size_t n_images, cap_images;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int started;
static char last_error[256];
/* Kept from foundry_modules_start for foundry_modules_stop. */
static CUpti_SubscriberHandle subscriber;
static CUptiResult (*cupti_unsubscribe)(CUpti_SubscriberHandle);
static CUptiResult (*cupti_finalize)(void);
static uint64_t captures_driver, captures_runtime;
static int dropped; /* images lost to host out-of-memory: SAVE must refuse */

/* Index of the image most recently loaded on this thread, to pair with the driver call that loaded
 * it: the resource callback fires inside cuModuleLoad*, before its exit callback. */
static __thread long last_loaded = -1;

/* Off in processes that only count stream captures (a LOAD): copying every image there would cost
 * time and host memory for nothing. */
static int keep_images = 1;

static void on_module_loaded(const CUpti_ResourceData *rd) {
  const CUpti_ModuleResourceData *md = rd->resourceDescriptor;
  if (!__atomic_load_n(&keep_images, __ATOMIC_RELAXED)) {
    last_loaded = -1;
    return;
  }
  if (!md || !md->pCubin || !md->cubinSize) return;
  char *copy = malloc(md->cubinSize);
  pthread_mutex_lock(&lock);
  if (!copy) goto fail;
  if (n_images == cap_images) {
    size_t cap = cap_images ? 2 * cap_images : 64;
    image *grown = realloc(images, cap * sizeof *grown);
    if (!grown) goto fail;
    images = grown;
    cap_images = cap;
  }
  memcpy(copy, md->pCubin, md->cubinSize);
  images[n_images].data = copy;
  images[n_images].size = md->cubinSize;
  images[n_images].handle = 0;
  last_loaded = (long)n_images;
  n_images++;
  pthread_mutex_unlock(&lock);
  return;
fail:
  dropped++;
  pthread_mutex_unlock(&lock);
  free(copy);
}

static void on_driver_call(CUpti_CallbackId cbid, const CUpti_CallbackData *cd) {
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph_ptsz:
      if (cd->callbackSite == CUPTI_API_ENTER) __atomic_add_fetch(&captures_driver, 1, __ATOMIC_RELAXED);
      return;
    default:
      break;
  }
  /* a cuModuleLoad* call */
  if (cd->callbackSite == CUPTI_API_ENTER) {
    last_loaded = -1;
    return;
  }
  const CUresult *rc = cd->functionReturnValue;
  const foundry_module_load_params *p = cd->functionParams;
  if (!rc || *rc != CUDA_SUCCESS || !p || !p->module || last_loaded < 0) return;
  pthread_mutex_lock(&lock);
  if ((size_t)last_loaded < n_images) images[last_loaded].handle = (uint64_t)(uintptr_t)*p->module;
  pthread_mutex_unlock(&lock);
  last_loaded = -1;
}

static void callback(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void *data) {
  (void)userdata;
  if (domain == CUPTI_CB_DOMAIN_RESOURCE && cbid == CUPTI_CBID_RESOURCE_MODULE_LOADED)
    on_module_loaded(data);
  else if (domain == CUPTI_CB_DOMAIN_DRIVER_API)
    on_driver_call(cbid, data);
  else if (domain == CUPTI_CB_DOMAIN_RUNTIME_API &&
           ((const CUpti_CallbackData *)data)->callbackSite == CUPTI_API_ENTER)
    __atomic_add_fetch(&captures_runtime, 1, __ATOMIC_RELAXED);
}

/* Whether module images loaded from now on are kept (1, the default) or only counted captures are. */
EXPORT void foundry_modules_keep_images(int keep) {
  __atomic_store_n(&keep_images, keep ? 1 : 0, __ATOMIC_RELAXED);
}

/* Subscribe once per process. `cupti_path` is the libcupti to open (NULL: the loader's search).
 * Returns 0, or -1 with foundry_modules_error() set. */
EXPORT int foundry_modules_start(const char *cupti_path) {
  pthread_mutex_lock(&lock);
  int result = 0;
  if (started) goto out;
  void *h = dlopen(cupti_path ? cupti_path : "libcupti.so", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    snprintf(last_error, sizeof last_error, "cannot open CUPTI (%s): %s",
             cupti_path ? cupti_path : "libcupti.so", dlerror());
    result = -1;
    goto out;
  }
  CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *) = dlsym(h, "cuptiSubscribe");
  CUptiResult (*enable)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId) =
      dlsym(h, "cuptiEnableCallback");
  if (!subscribe || !enable) {
    snprintf(last_error, sizeof last_error, "CUPTI lacks cuptiSubscribe/cuptiEnableCallback");
    result = -1;
    goto out;
  }
  CUpti_SubscriberHandle sub;
  CUptiResult rc = subscribe(&sub, callback, NULL);
  if (rc) {
    /* Most often CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED: a profiler is attached. */
    snprintf(last_error, sizeof last_error,
             "cuptiSubscribe failed with CUPTI error %d (is a profiler attached?)", rc);
    result = -1;
    goto out;
  }
  static const CUpti_CallbackId driver_ids[] = {
      CUPTI_DRIVER_TRACE_CBID_cuModuleLoad,
      CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData,
      CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx,
      CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary,
      CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture,
      CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz,
      CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2,
      CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz,
      CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph,
      CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph_ptsz,
  };
  static const CUpti_CallbackId runtime_ids[] = {
      CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000,
      CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_ptsz_v10000,
      CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCaptureToGraph_v12030,
      CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCaptureToGraph_ptsz_v12030,
  };
  rc = enable(1, sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_MODULE_LOADED);
  for (size_t i = 0; !rc && i < sizeof driver_ids / sizeof *driver_ids; i++)
    rc = enable(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, driver_ids[i]);
  for (size_t i = 0; !rc && i < sizeof runtime_ids / sizeof *runtime_ids; i++)
    rc = enable(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, runtime_ids[i]);
  CUptiResult (*unsubscribe)(CUpti_SubscriberHandle) = dlsym(h, "cuptiUnsubscribe");
  if (rc) {
    /* Leave no half-enabled subscriber behind: it would hold CUPTI's only subscriber slot (a
     * profiler could not attach) and call back into a recorder that reports itself stopped. */
    if (unsubscribe) unsubscribe(sub);
    snprintf(last_error, sizeof last_error, "cuptiEnableCallback failed with CUPTI error %d", rc);
    result = -1;
    goto out;
  }
  subscriber = sub;
  cupti_unsubscribe = unsubscribe;
  cupti_finalize = dlsym(h, "cuptiFinalize");
  started = 1;
out:
  pthread_mutex_unlock(&lock);
  return result;
}

/* Unsubscribe and detach CUPTI from the process, so that a server's serving loop runs with no
 * profiler interface attached (PyTorch has seen a CUPTI left attached slow training by 10-20 %;
 * on the H200 stack, benchmarks/cupti_overhead.py measured 0-4 % on small eager launches). Images
 * already kept and the capture counts stay readable. Returns 0 (also when not started), or -1 with
 * foundry_modules_error() set. */
EXPORT int foundry_modules_stop(void) {
  pthread_mutex_lock(&lock);
  int result = 0;
  if (!started) goto out;
  CUptiResult rc = cupti_unsubscribe ? cupti_unsubscribe(subscriber) : 0;
  if (!rc && cupti_finalize) rc = cupti_finalize();
  if (rc) {
    snprintf(last_error, sizeof last_error, "cuptiUnsubscribe/cuptiFinalize failed with CUPTI error %d", rc);
    result = -1;
    goto out;
  }
  subscriber = NULL;
  started = 0;
out:
  pthread_mutex_unlock(&lock);
  return result;
}

EXPORT size_t foundry_modules_count(void) {
  pthread_mutex_lock(&lock);
  size_t n = n_images;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Image `i`: its bytes stay valid for the life of the process (images are never freed). */
EXPORT int foundry_modules_get(size_t i, const char **data, size_t *size, uint64_t *handle) {
  pthread_mutex_lock(&lock);
  int ok = i < n_images;
  if (ok) {
    *data = images[i].data;
    *size = images[i].size;
    *handle = images[i].handle;
  }
  pthread_mutex_unlock(&lock);
  return ok ? 0 : -1;
}

EXPORT int foundry_modules_dropped(void) {
  return dropped;
}
EXPORT int foundry_modules_started(void) {
  return started;
}
EXPORT uint64_t foundry_captures_driver(void) {
  return __atomic_load_n(&captures_driver, __ATOMIC_RELAXED);
}
EXPORT uint64_t foundry_captures_runtime(void) {
  return __atomic_load_n(&captures_runtime, __ATOMIC_RELAXED);
}
EXPORT const char *foundry_modules_error(void) {
  return last_error;
}
