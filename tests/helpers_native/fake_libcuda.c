/* A stand-in libcuda.so.1 for the native graph builder's CPU tests (tests/test_build_ahead.py): the
 * graph calls graphbuild.c resolves, with handles that are counters, an address space in which only
 * ranges given to fake_map() are mapped (memset and memcpy nodes on anything else are refused with
 * CUDA_ERROR_INVALID_VALUE, as the driver does), and a log of every memory-node call for the test to
 * read (fake_log). Not part of Foundry. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "graphbuild.h"

#define EXPORT __attribute__((visibility("default")))
#define INVALID_VALUE 1

static char log_text[1 << 16];
static size_t log_len;
static unsigned long long next_handle = 0x1000;
static struct {
  unsigned long long base, size;
} mapped[16];
static int n_mapped;

static void say(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(log_text + log_len, sizeof log_text - log_len, fmt, ap);
  va_end(ap);
  if (n > 0 && log_len + (size_t)n < sizeof log_text) log_len += (size_t)n;
}

static int is_mapped(unsigned long long addr) {
  for (int i = 0; i < n_mapped; i++)
    if (addr >= mapped[i].base && addr < mapped[i].base + mapped[i].size) return 1;
  return 0;
}

static void *handle(void) {
  return (void *)(next_handle++);
}

EXPORT void fake_map(unsigned long long base, unsigned long long size) {
  mapped[n_mapped].base = base;
  mapped[n_mapped].size = size;
  n_mapped++;
}

EXPORT const char *fake_log(void) {
  return log_text;
}

EXPORT CUresult cuGetErrorName(CUresult rc, const char **name) {
  *name = rc == INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN";
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
  *ctx = (CUcontext)0x42;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphCreate(CUgraph *g, unsigned int flags) {
  (void)flags;
  *g = handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphDestroy(CUgraph g) {
  say("destroy graph %p\n", (void *)g);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                        const foundry_kernel_node_params *p) {
  (void)g, (void)d, (void)nd;
  /* Every function's dynamic shared memory limit is the default 48 KiB here: a node asking more is
   * refused, as the driver refuses one above its function's limit. */
  if (p->sharedMemBytes > 48 * 1024) return INVALID_VALUE;
  *n = handle();
  return CUDA_SUCCESS;
}

/* Launch attributes set on kernel nodes, answered back by cuGraphKernelNodeGetAttribute; an
 * attribute never set is refused (as the driver refuses the ones it does not know). */
static struct {
  CUgraphNode node;
  int id;
  foundry_launch_attr_value v;
} attrs[256];
static int n_attrs;

EXPORT CUresult cuGraphKernelNodeSetAttribute(CUgraphNode n, int id, const foundry_launch_attr_value *v) {
  if (n_attrs < 256) {
    attrs[n_attrs].node = n;
    attrs[n_attrs].id = id;
    attrs[n_attrs].v = *v;
    n_attrs++;
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphKernelNodeGetAttribute(CUgraphNode n, int id, foundry_launch_attr_value *v) {
  for (int i = n_attrs - 1; i >= 0; i--)
    if (attrs[i].node == n && attrs[i].id == id) {
      *v = attrs[i].v;
      return CUDA_SUCCESS;
    }
  return INVALID_VALUE;
}

/* The handle the builder got for its k-th kernel node with attributes (for the tests to read). */
EXPORT void *fake_attr_node(int k) {
  CUgraphNode seen[256];
  int n_seen = 0;
  for (int i = 0; i < n_attrs; i++) {
    int known = 0;
    for (int j = 0; j < n_seen; j++)
      known |= seen[j] == attrs[i].node;
    if (!known) seen[n_seen++] = attrs[i].node;
  }
  return k < n_seen ? (void *)seen[k] : NULL;
}

EXPORT CUresult cuGraphAddMemsetNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                     const foundry_memset_node_params *p, CUcontext ctx) {
  (void)g, (void)d, (void)nd, (void)ctx;
  if (!is_mapped(p->dst)) return INVALID_VALUE;
  *n = handle();
  say("add memset %p dst=%llx width=%zu\n", (void *)*n, p->dst, p->width);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                     const foundry_memcpy3d *c, CUcontext ctx) {
  (void)g, (void)d, (void)nd, (void)ctx;
  if (!is_mapped(c->srcDevice) || !is_mapped(c->dstDevice)) return INVALID_VALUE;
  *n = handle();
  say("add memcpy %p src=%llx dst=%llx width=%zu\n", (void *)*n, c->srcDevice, c->dstDevice, c->WidthInBytes);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddEventRecordNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                          CUevent e) {
  (void)g, (void)d, (void)nd, (void)e;
  *n = handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddEventWaitNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                        CUevent e) {
  (void)g, (void)d, (void)nd, (void)e;
  *n = handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd) {
  (void)g, (void)d, (void)nd;
  *n = handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                         CUgraph c) {
  (void)g, (void)d, (void)nd, (void)c;
  *n = handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddDependencies_v2(CUgraph g, const CUgraphNode *from, const CUgraphNode *to,
                                          const foundry_edge_data *e, size_t n) {
  (void)g, (void)from, (void)to, (void)e, (void)n;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *x, CUgraph g, unsigned long long flags) {
  *x = handle();
  say("instantiate %p from %p flags=%llu\n", (void *)*x, (void *)g, flags);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphUpload(CUgraphExec x, CUstream s) {
  (void)x, (void)s;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphExecDestroy(CUgraphExec x) {
  say("destroy exec %p\n", (void *)x);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphMemsetNodeSetParams(CUgraphNode n, const foundry_memset_node_params *p) {
  if (!is_mapped(p->dst)) return INVALID_VALUE;
  say("set memset %p dst=%llx width=%zu\n", (void *)n, p->dst, p->width);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphMemcpyNodeSetParams(CUgraphNode n, const foundry_memcpy3d *c) {
  if (!is_mapped(c->srcDevice) || !is_mapped(c->dstDevice)) return INVALID_VALUE;
  say("set memcpy %p src=%llx dst=%llx\n", (void *)n, c->srcDevice, c->dstDevice);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphExecMemsetNodeSetParams(CUgraphExec x, CUgraphNode n,
                                               const foundry_memset_node_params *p, CUcontext ctx) {
  (void)ctx;
  if (!is_mapped(p->dst)) return INVALID_VALUE;
  say("exec %p set memset %p dst=%llx width=%zu\n", (void *)x, (void *)n, p->dst, p->width);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphExecMemcpyNodeSetParams(CUgraphExec x, CUgraphNode n, const foundry_memcpy3d *c,
                                               CUcontext ctx) {
  (void)ctx;
  if (!is_mapped(c->srcDevice) || !is_mapped(c->dstDevice)) return INVALID_VALUE;
  say("exec %p set memcpy %p src=%llx dst=%llx\n", (void *)x, (void *)n, c->srcDevice, c->dstDevice);
  return CUDA_SUCCESS;
}
