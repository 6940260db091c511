/* libcuda's entry points, resolved for region.c and graphbuild.c by one loader (driver.c). */
#ifndef FOUNDRY_DRIVER_H
#define FOUNDRY_DRIVER_H

#include <stddef.h>

typedef struct {
  void **slot; /* where the function pointer goes */
  const char *name;
} foundry_cuda_symbol;

/* Opens libcuda.so.1 once per process and fills every slot. Returns 0, or -1 with the reason
 * (library missing, or the first symbol it lacks) in err. Thread-safe; callers resolve their own
 * table once and keep the result. */
int foundry_cuda_resolve(const foundry_cuda_symbol *symbols, size_t n, char *err, size_t errlen);

#endif
