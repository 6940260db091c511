/* The native graph builder: one call turns an FGB1 graph encoding (graphbuild.h) into a CUgraph,
 * instantiated and uploaded.
 *
 * The whole encoding is validated before the first driver call (sizes, counts, indices, attribute
 * ids, child-graph references), so a damaged or hostile encoding is refused with a message and no
 * read ever leaves the buffer. The build then mirrors the Python builder (graphs._build) call for
 * call: nodes are added in order without dependencies, then every edge on its own with its edge
 * data (one cuGraphAddDependencies_v2 call per edge, never a batch: some drivers apply the first
 * edge's data to a whole batch), then cuGraphInstantiateWithFlags (torch's flags) and cuGraphUpload.
 *
 * Ahead of the memory (foundry_graph_build_ahead), memset and memcpy nodes are built against a stand-in
 * allocation, because the driver resolves their addresses when they are added, and
 * foundry_graph_retarget points them at their own addresses once those are mapped.
 *
 * Driver entry points are resolved once (driver.c). Every function here is reentrant:
 * errors go to the caller's buffer. One file (over 600 lines) because validating, building and
 * re-pointing read the same encoding with the same reader and must agree on every byte of it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "driver.h"
#include "graphbuild.h"

#define EXPORT __attribute__((visibility("default")))

#define HEADER_BYTES 24
#define KERNEL_ENTRY_BYTES 16
#define LAYOUT_ENTRY_BYTES 8
#define NODE_HEADER_BYTES 4
#define KERNEL_FIXED_BYTES 32
#define ATTR_BYTES 16
#define MEMSET_BYTES 40
#define MEMCPY_BYTES 128
#define EDGE_BYTES 12
#define MAX_GRAPHS 4096u
#define MAX_DEPTH 64u
#define MAX_ATTRS 16u
#define MAX_PARAM_BYTES 65536u

/* ---- driver entry points ---- */

static struct {
  CUresult (*error_name)(CUresult, const char **);
  CUresult (*ctx_current)(CUcontext *);
  CUresult (*graph_create)(CUgraph *, unsigned int);
  CUresult (*graph_destroy)(CUgraph);
  CUresult (*add_kernel)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                         const foundry_kernel_node_params *);
  CUresult (*set_attr)(CUgraphNode, int, const foundry_launch_attr_value *);
  CUresult (*get_attr)(CUgraphNode, int, foundry_launch_attr_value *);
  CUresult (*add_memset)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                         const foundry_memset_node_params *, CUcontext);
  CUresult (*add_memcpy)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const foundry_memcpy3d *,
                         CUcontext);
  CUresult (*add_event_record)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUevent);
  CUresult (*add_event_wait)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUevent);
  CUresult (*add_empty)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t);
  CUresult (*add_child)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraph);
  CUresult (*add_deps)(CUgraph, const CUgraphNode *, const CUgraphNode *, const foundry_edge_data *, size_t);
  CUresult (*instantiate)(CUgraphExec *, CUgraph, unsigned long long);
  CUresult (*upload)(CUgraphExec, CUstream);
  CUresult (*exec_destroy)(CUgraphExec);
  CUresult (*set_memset)(CUgraphNode, const foundry_memset_node_params *);
  CUresult (*set_memcpy)(CUgraphNode, const foundry_memcpy3d *);
  CUresult (*exec_set_memset)(CUgraphExec, CUgraphNode, const foundry_memset_node_params *, CUcontext);
  CUresult (*exec_set_memcpy)(CUgraphExec, CUgraphNode, const foundry_memcpy3d *, CUcontext);
} cu;

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static char driver_error[256];
static int driver_ok;

static void load_driver(void) {
  const foundry_cuda_symbol symbols[] = {
      {(void **)&cu.error_name, "cuGetErrorName"},
      {(void **)&cu.ctx_current, "cuCtxGetCurrent"},
      {(void **)&cu.graph_create, "cuGraphCreate"},
      {(void **)&cu.graph_destroy, "cuGraphDestroy"},
      {(void **)&cu.add_kernel, "cuGraphAddKernelNode_v2"},
      {(void **)&cu.set_attr, "cuGraphKernelNodeSetAttribute"},
      {(void **)&cu.get_attr, "cuGraphKernelNodeGetAttribute"},
      {(void **)&cu.add_memset, "cuGraphAddMemsetNode"},
      {(void **)&cu.add_memcpy, "cuGraphAddMemcpyNode"},
      {(void **)&cu.add_event_record, "cuGraphAddEventRecordNode"},
      {(void **)&cu.add_event_wait, "cuGraphAddEventWaitNode"},
      {(void **)&cu.add_empty, "cuGraphAddEmptyNode"},
      {(void **)&cu.add_child, "cuGraphAddChildGraphNode"},
      {(void **)&cu.add_deps, "cuGraphAddDependencies_v2"},
      {(void **)&cu.instantiate, "cuGraphInstantiateWithFlags"},
      {(void **)&cu.upload, "cuGraphUpload"},
      {(void **)&cu.exec_destroy, "cuGraphExecDestroy"},
      {(void **)&cu.set_memset, "cuGraphMemsetNodeSetParams"},
      {(void **)&cu.set_memcpy, "cuGraphMemcpyNodeSetParams"},
      {(void **)&cu.exec_set_memset, "cuGraphExecMemsetNodeSetParams"},
      {(void **)&cu.exec_set_memcpy, "cuGraphExecMemcpyNodeSetParams"},
  };
  driver_ok =
      foundry_cuda_resolve(symbols, sizeof symbols / sizeof *symbols, driver_error, sizeof driver_error) == 0;
}

/* ---- little-endian loads (the encoding is little-endian; so is every host CUDA runs on) ---- */

static uint32_t ld32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t ld64(const uint8_t *p) {
  return (uint64_t)ld32(p) | (uint64_t)ld32(p + 4) << 32;
}

typedef struct {
  const uint8_t *data;
  size_t len, pos;
} reader;

/* The next n bytes, or NULL when fewer are left. */
static const uint8_t *take(reader *r, size_t n) {
  if (n > r->len - r->pos) return NULL;
  const uint8_t *p = r->data + r->pos;
  r->pos += n;
  return p;
}

typedef struct {
  uint32_t n_graphs, n_events, n_kernels, n_layout;
  const uint8_t *kernels; /* n_kernels x KERNEL_ENTRY_BYTES */
  const uint8_t *layout;  /* n_layout x LAYOUT_ENTRY_BYTES */
  size_t *graph_off;      /* start of each graph section */
  uint64_t nodes, edges;
  uint32_t max_params, max_param_bytes;
} parsed;

#define FAIL(...)                       \
  do {                                  \
    snprintf(err, errlen, __VA_ARGS__); \
    goto fail;                          \
  } while (0)

static int attr_known(uint32_t id) {
  switch (id) {
    case FOUNDRY_ATTR_COOPERATIVE:
    case FOUNDRY_ATTR_CLUSTER_DIMENSION:
    case FOUNDRY_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
    case FOUNDRY_ATTR_PRIORITY:
    case FOUNDRY_ATTR_MEM_SYNC_DOMAIN_MAP:
    case FOUNDRY_ATTR_MEM_SYNC_DOMAIN:
    case FOUNDRY_ATTR_PREFERRED_CLUSTER_DIMENSION:
    case FOUNDRY_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT:
      return 1;
    default:
      return 0;
  }
}

/* Checks the whole encoding; fills *out (out->graph_off is malloc'd: free it). */
static int validate(const uint8_t *data, size_t len, size_t n_funcs, size_t n_events, parsed *out, char *err,
                    size_t errlen) {
  uint8_t *referenced = NULL;
  uint32_t *depth = NULL;
  memset(out, 0, sizeof *out);
  if (!data) FAIL("no graph encoding given");
  reader r = {data, len, 0};
  const uint8_t *p = take(&r, HEADER_BYTES);
  if (!p) FAIL("graph encoding of %zu bytes is shorter than its %d-byte header", len, HEADER_BYTES);
  if (memcmp(p, FGB_MAGIC, 4) != 0) FAIL("not a Foundry graph encoding (no FGB1 magic)");
  if (ld32(p + 4) != FGB_VERSION)
    FAIL("graph encoding version %u is not supported (this Foundry reads 1)", ld32(p + 4));
  out->n_graphs = ld32(p + 8);
  out->n_events = ld32(p + 12);
  out->n_kernels = ld32(p + 16);
  out->n_layout = ld32(p + 20);
  if (out->n_graphs < 1 || out->n_graphs > MAX_GRAPHS)
    FAIL("graph encoding declares %u graphs (1 to %u allowed)", out->n_graphs, MAX_GRAPHS);
  if (out->n_events > n_events)
    FAIL("graph encoding uses %u events, %zu were given", out->n_events, n_events);
  if ((uint64_t)out->n_kernels * KERNEL_ENTRY_BYTES + (uint64_t)out->n_layout * LAYOUT_ENTRY_BYTES >
      (uint64_t)(len - r.pos))
    FAIL("graph encoding truncated: %u kernel entries and %u layout entries do not fit", out->n_kernels,
         out->n_layout);
  out->kernels = take(&r, (size_t)out->n_kernels * KERNEL_ENTRY_BYTES);
  out->layout = take(&r, (size_t)out->n_layout * LAYOUT_ENTRY_BYTES);
  for (uint32_t k = 0; k < out->n_kernels; k++) {
    const uint8_t *e = out->kernels + (size_t)k * KERNEL_ENTRY_BYTES;
    uint32_t func = ld32(e), first = ld32(e + 4), n = ld32(e + 8), bytes = ld32(e + 12);
    if (func >= n_funcs) FAIL("kernel entry %u names function %u, only %zu are known", k, func, n_funcs);
    if ((uint64_t)first + n > out->n_layout)
      FAIL("kernel entry %u: parameter layout [%u, +%u) is outside the %u layout entries", k, first, n,
           out->n_layout);
    if (bytes > MAX_PARAM_BYTES)
      FAIL("kernel entry %u: %u parameter bytes (at most %u)", k, bytes, MAX_PARAM_BYTES);
    uint64_t end = 0;
    for (uint32_t j = 0; j < n; j++) {
      const uint8_t *l = out->layout + (size_t)(first + j) * LAYOUT_ENTRY_BYTES;
      uint64_t e_end = (uint64_t)ld32(l) + ld32(l + 4);
      if (e_end > bytes)
        FAIL("kernel entry %u: parameter %u ends at byte %llu, past %u", k, j, (unsigned long long)e_end,
             bytes);
      if (e_end > end) end = e_end;
    }
    if (end != bytes)
      FAIL("kernel entry %u: parameters end at byte %llu, entry says %u", k, (unsigned long long)end, bytes);
    if (n > out->max_params) out->max_params = n;
    if (bytes > out->max_param_bytes) out->max_param_bytes = bytes;
  }
  out->graph_off = calloc(out->n_graphs, sizeof *out->graph_off);
  referenced = calloc(out->n_graphs, 1);
  depth = calloc(out->n_graphs, sizeof *depth);
  if (!out->graph_off || !referenced || !depth) FAIL("out of host memory");
  for (uint32_t g = 0; g < out->n_graphs; g++) {
    if (g > 0 && !referenced[g]) FAIL("graph %u is not referenced by any child-graph node before it", g);
    out->graph_off[g] = r.pos;
    p = take(&r, 8);
    if (!p) FAIL("graph %u: truncated section header", g);
    uint32_t n_nodes = ld32(p), n_edges = ld32(p + 4);
    if ((uint64_t)n_nodes * NODE_HEADER_BYTES > (uint64_t)(len - r.pos))
      FAIL("graph %u: %u nodes cannot fit in the %zu bytes left", g, n_nodes, len - r.pos);
    for (uint32_t i = 0; i < n_nodes; i++) {
      p = take(&r, NODE_HEADER_BYTES);
      if (!p) FAIL("graph %u node %u: truncated", g, i);
      uint8_t type = p[0], n_attrs = p[1];
      if (p[2] || p[3]) FAIL("graph %u node %u: reserved header bytes are not zero", g, i);
      if (type != FGB_NODE_KERNEL && n_attrs)
        FAIL("graph %u node %u: only kernel nodes carry attributes", g, i);
      const uint8_t *q;
      switch (type) {
        case FGB_NODE_KERNEL: {
          q = take(&r, KERNEL_FIXED_BYTES);
          if (!q) FAIL("graph %u node %u (kernel): truncated", g, i);
          uint32_t k = ld32(q);
          if (k >= out->n_kernels) FAIL("graph %u node %u: kernel entry %u of %u", g, i, k, out->n_kernels);
          if (n_attrs > MAX_ATTRS)
            FAIL("graph %u node %u: %u attributes (at most %u)", g, i, n_attrs, MAX_ATTRS);
          q = take(&r, (size_t)n_attrs * ATTR_BYTES);
          if (!q) FAIL("graph %u node %u (kernel): truncated attributes", g, i);
          for (uint32_t a = 0; a < n_attrs; a++)
            if (!attr_known(ld32(q + (size_t)a * ATTR_BYTES)))
              FAIL("graph %u node %u: unknown launch attribute id %u", g, i,
                   ld32(q + (size_t)a * ATTR_BYTES));
          uint32_t bytes = ld32(out->kernels + (size_t)k * KERNEL_ENTRY_BYTES + 12);
          if (!take(&r, bytes)) FAIL("graph %u node %u (kernel): truncated parameters", g, i);
          break;
        }
        case FGB_NODE_MEMSET:
          if (!take(&r, MEMSET_BYTES)) FAIL("graph %u node %u (memset): truncated", g, i);
          break;
        case FGB_NODE_MEMCPY:
          q = take(&r, MEMCPY_BYTES);
          if (!q) FAIL("graph %u node %u (memcpy): truncated", g, i);
          for (int s = 0; s < 2; s++)
            if (ld32(q + 4 * s) != 2 && ld32(q + 4 * s) != 4)
              FAIL("graph %u node %u: memcpy memory type %u (only device and unified)", g, i,
                   ld32(q + 4 * s));
          break;
        case FGB_NODE_EVENT_RECORD:
        case FGB_NODE_EVENT_WAIT:
          q = take(&r, 4);
          if (!q) FAIL("graph %u node %u (event): truncated", g, i);
          if (ld32(q) >= out->n_events)
            FAIL("graph %u node %u: event slot %u of %u", g, i, ld32(q), out->n_events);
          break;
        case FGB_NODE_EMPTY:
          break;
        case FGB_NODE_GRAPH: {
          q = take(&r, 4);
          if (!q) FAIL("graph %u node %u (child graph): truncated", g, i);
          uint32_t c = ld32(q);
          if (c <= g || c >= out->n_graphs) FAIL("graph %u node %u: child graph %u is not after it", g, i, c);
          if (referenced[c]) FAIL("graph %u node %u: child graph %u is referenced twice", g, i, c);
          if (depth[g] + 1 > MAX_DEPTH)
            FAIL("graph %u node %u: child graphs nested over %u deep", g, i, MAX_DEPTH);
          referenced[c] = 1;
          depth[c] = depth[g] + 1;
          break;
        }
        default:
          FAIL("graph %u node %u: unknown node type %u", g, i, type);
      }
    }
    if ((uint64_t)n_edges * EDGE_BYTES > (uint64_t)(len - r.pos))
      FAIL("graph %u: %u edges cannot fit in the %zu bytes left", g, n_edges, len - r.pos);
    const uint8_t *edges = take(&r, (size_t)n_edges * EDGE_BYTES);
    for (uint32_t e = 0; e < n_edges; e++) {
      const uint8_t *q = edges + (size_t)e * EDGE_BYTES;
      if (ld32(q) >= n_nodes || ld32(q + 4) >= n_nodes)
        FAIL("graph %u edge %u: %u -> %u, the graph has %u nodes", g, e, ld32(q), ld32(q + 4), n_nodes);
      if (q[11]) FAIL("graph %u edge %u: reserved byte is not zero", g, e);
    }
    out->nodes += n_nodes;
    out->edges += n_edges;
  }
  if (r.pos != len) FAIL("graph encoding has %zu bytes after its last graph", len - r.pos);
  free(referenced);
  free(depth);
  return 0;
fail:
  free(referenced);
  free(depth);
  free(out->graph_off);
  out->graph_off = NULL;
  return -1;
}

/* counts: [graphs, nodes, edges, kernel entries, events] */
EXPORT int foundry_graph_validate(const uint8_t *data, size_t len, size_t n_funcs, size_t n_events,
                                  uint64_t *counts, char *err, size_t errlen) {
  parsed ps;
  if (validate(data, len, n_funcs, n_events, &ps, err, errlen) != 0) return -1;
  if (counts) {
    counts[0] = ps.n_graphs;
    counts[1] = ps.nodes;
    counts[2] = ps.edges;
    counts[3] = ps.n_kernels;
    counts[4] = ps.n_events;
  }
  free(ps.graph_off);
  return 0;
}

/* ---- memory nodes ---- */

static void read_memset(const uint8_t *q, foundry_memset_node_params *mp) {
  memset(mp, 0, sizeof *mp);
  mp->dst = ld64(q);
  mp->pitch = (size_t)ld64(q + 8);
  mp->value = ld32(q + 16);
  mp->elementSize = ld32(q + 20);
  mp->width = (size_t)ld64(q + 24);
  mp->height = (size_t)ld64(q + 32);
}

static void read_memcpy(const uint8_t *q, foundry_memcpy3d *c) {
  memset(c, 0, sizeof *c);
  c->srcMemoryType = (int)ld32(q);
  c->dstMemoryType = (int)ld32(q + 4);
  c->srcDevice = ld64(q + 8);
  c->dstDevice = ld64(q + 16);
  c->srcXInBytes = (size_t)ld64(q + 24);
  c->srcY = (size_t)ld64(q + 32);
  c->srcZ = (size_t)ld64(q + 40);
  c->dstXInBytes = (size_t)ld64(q + 48);
  c->dstY = (size_t)ld64(q + 56);
  c->dstZ = (size_t)ld64(q + 64);
  c->srcPitch = (size_t)ld64(q + 72);
  c->srcHeight = (size_t)ld64(q + 80);
  c->dstPitch = (size_t)ld64(q + 88);
  c->dstHeight = (size_t)ld64(q + 96);
  c->WidthInBytes = (size_t)ld64(q + 104);
  c->Height = (size_t)ld64(q + 112);
  c->Depth = (size_t)ld64(q + 120);
}

/* Bytes a memset writes from its destination on; SIZE_MAX where that overflows. */
static size_t memset_span(const foundry_memset_node_params *mp) {
  size_t row, rows, span;
  if (!mp->height || !mp->width) return 0;
  if (__builtin_mul_overflow(mp->width, (size_t)mp->elementSize, &row) ||
      __builtin_mul_overflow(mp->height - 1, mp->pitch, &rows) || __builtin_add_overflow(rows, row, &span))
    return SIZE_MAX;
  return span;
}

/* A copy the driver lets an executable graph re-point: one row, no array, no y/z offsets. */
static int memcpy_is_1d(const foundry_memcpy3d *c) {
  return c->Height <= 1 && c->Depth <= 1 && !c->srcY && !c->srcZ && !c->dstY && !c->dstZ;
}

/* Stand-in bytes a 1-D copy needs: its source in the lower half, its destination in the upper. */
static size_t memcpy_span(const foundry_memcpy3d *c) {
  size_t src, dst, half;
  if (__builtin_add_overflow(c->srcXInBytes, c->WidthInBytes, &src) ||
      __builtin_add_overflow(c->dstXInBytes, c->WidthInBytes, &dst))
    return SIZE_MAX;
  half = src > dst ? src : dst;
  return half > SIZE_MAX / 2 ? SIZE_MAX : 2 * half;
}

/* Steps over one node of a validated encoding; returns where its fixed part starts and its type. */
static const uint8_t *step_node(reader *r, const parsed *ps, uint8_t *type) {
  const uint8_t *p = take(r, NODE_HEADER_BYTES), *q = r->data + r->pos;
  uint8_t n_attrs = p[1];
  *type = p[0];
  switch (*type) {
    case FGB_NODE_KERNEL: {
      const uint8_t *k = take(r, KERNEL_FIXED_BYTES);
      take(r, (size_t)n_attrs * ATTR_BYTES);
      take(r, ld32(ps->kernels + (size_t)ld32(k) * KERNEL_ENTRY_BYTES + 12));
      break;
    }
    case FGB_NODE_MEMSET:
      take(r, MEMSET_BYTES);
      break;
    case FGB_NODE_MEMCPY:
      take(r, MEMCPY_BYTES);
      break;
    case FGB_NODE_EVENT_RECORD:
    case FGB_NODE_EVENT_WAIT:
    case FGB_NODE_GRAPH:
      take(r, 4);
      break;
    default: /* empty: nothing follows the header */
      break;
  }
  return q;
}

/* counts: [memory nodes in the top graph, memory nodes in child graphs, 2-D or 3-D copies in the top
 * graph, stand-in bytes the top graph's memory nodes need] (foundry_graph_build_ahead). */
EXPORT int foundry_graph_memory_nodes(const uint8_t *data, size_t len, uint64_t *counts, char *err,
                                      size_t errlen) {
  parsed ps;
  if (validate(data, len, SIZE_MAX, SIZE_MAX, &ps, err, errlen) != 0) return -1;
  memset(counts, 0, 4 * sizeof *counts);
  for (uint32_t g = 0; g < ps.n_graphs; g++) {
    reader r = {data, len, ps.graph_off[g]};
    uint32_t n_nodes = ld32(take(&r, 8));
    for (uint32_t i = 0; i < n_nodes; i++) {
      uint8_t type;
      const uint8_t *q = step_node(&r, &ps, &type);
      if (type != FGB_NODE_MEMSET && type != FGB_NODE_MEMCPY) continue;
      if (g) {
        counts[1]++;
        continue;
      }
      counts[0]++;
      size_t need;
      if (type == FGB_NODE_MEMSET) {
        foundry_memset_node_params mp;
        read_memset(q, &mp);
        need = memset_span(&mp);
      } else {
        foundry_memcpy3d c;
        read_memcpy(q, &c);
        if (!memcpy_is_1d(&c)) counts[2]++;
        need = memcpy_span(&c);
      }
      if (need > counts[3]) counts[3] = need;
    }
  }
  free(ps.graph_off);
  return 0;
}

/* ---- building ---- */

typedef struct {
  const uint8_t *data;
  size_t len;
  parsed ps;
  void *const *funcs;
  void *const *events;
  CUcontext ctx;
  uint8_t *scratch; /* parameter bytes, 16-byte aligned */
  void **argv;
  /* Ahead of the memory (foundry_graph_build_ahead): memset and memcpy nodes point into the stand-in
   * [standin, standin + standin_bytes) instead of their own addresses, and are listed in moved[]. */
  CUdeviceptr standin;
  size_t standin_bytes;
  CUgraphNode *moved;
  size_t n_moved, cap_moved;
} builder;

static const char *err_name(CUresult rc) {
  const char *name = NULL;
  if (cu.error_name) cu.error_name(rc, &name);
  return name ? name : "unknown error";
}

static const char *type_name(uint8_t type) {
  static const char *names[] = {"?",          "kernel", "memset", "memcpy", "event_record",
                                "event_wait", "empty",  "graph"};
  return type <= FGB_NODE_GRAPH ? names[type] : "?";
}

/* Ahead of the memory: point a memset into the stand-in (foundry_graph_build_ahead). */
static int stand_in_memset(builder *b, uint32_t g, uint32_t i, foundry_memset_node_params *mp, char *err,
                           size_t errlen) {
  size_t span = memset_span(mp);
  if (g) {
    snprintf(err, errlen, "graph %u node %u (memset): in a child graph, not built ahead", g, i);
    return -1;
  }
  if (span > b->standin_bytes) {
    snprintf(err, errlen, "graph 0 node %u (memset): %zu bytes, the stand-in has %zu", i, span,
             b->standin_bytes);
    return -1;
  }
  mp->dst = b->standin;
  return 0;
}

/* Ahead of the memory: point a 1-D copy into the stand-in, source below its middle, destination above. */
static int stand_in_memcpy(builder *b, uint32_t g, uint32_t i, foundry_memcpy3d *c, char *err,
                           size_t errlen) {
  size_t span = memcpy_span(c);
  if (g || !memcpy_is_1d(c)) {
    snprintf(err, errlen, "graph %u node %u (memcpy): %s, not built ahead", g, i,
             g ? "in a child graph" : "not one-dimensional");
    return -1;
  }
  if (span > b->standin_bytes) {
    snprintf(err, errlen, "graph 0 node %u (memcpy): needs %zu bytes, the stand-in has %zu", i, span,
             b->standin_bytes);
    return -1;
  }
  c->srcDevice = b->standin;
  c->dstDevice = b->standin + b->standin_bytes / 2;
  return 0;
}

static int build_graph(builder *b, uint32_t g, CUgraph *out, char *err, size_t errlen) {
  reader r = {b->data, b->len, b->ps.graph_off[g]};
  const uint8_t *p = take(&r, 8); /* validated: every take below succeeds */
  uint32_t n_nodes = ld32(p), n_edges = ld32(p + 4);
  CUgraph graph = NULL;
  CUgraphNode *nodes = malloc(((size_t)n_nodes + 1) * sizeof *nodes);
  CUresult rc;
  if (!nodes) {
    snprintf(err, errlen, "out of host memory");
    return -1;
  }
  rc = cu.graph_create(&graph, 0);
  if (rc != CUDA_SUCCESS) {
    snprintf(err, errlen, "graph %u: cuGraphCreate failed: %s", g, err_name(rc));
    free(nodes);
    return -1;
  }
  for (uint32_t i = 0; i < n_nodes; i++) {
    p = take(&r, NODE_HEADER_BYTES);
    uint8_t type = p[0], n_attrs = p[1];
    const uint8_t *q;
    const char *what = "";
    char detail[160] = ""; /* a refused kernel launch's configuration, for the error */
    rc = CUDA_SUCCESS;
    switch (type) {
      case FGB_NODE_KERNEL: {
        q = take(&r, KERNEL_FIXED_BYTES);
        uint32_t k = ld32(q);
        const uint8_t *e = b->ps.kernels + (size_t)k * KERNEL_ENTRY_BYTES;
        uint32_t func = ld32(e), first = ld32(e + 4), n_params = ld32(e + 8), bytes = ld32(e + 12);
        const uint8_t *attrs = take(&r, (size_t)n_attrs * ATTR_BYTES);
        const uint8_t *params = take(&r, bytes);
        if (bytes) memcpy(b->scratch, params, bytes);
        for (uint32_t j = 0; j < n_params; j++)
          b->argv[j] = b->scratch + ld32(b->ps.layout + (size_t)(first + j) * LAYOUT_ENTRY_BYTES);
        foundry_kernel_node_params kp;
        memset(&kp, 0, sizeof kp);
        kp.func = (CUfunction)b->funcs[func];
        kp.gridDimX = ld32(q + 4);
        kp.gridDimY = ld32(q + 8);
        kp.gridDimZ = ld32(q + 12);
        kp.blockDimX = ld32(q + 16);
        kp.blockDimY = ld32(q + 20);
        kp.blockDimZ = ld32(q + 24);
        kp.sharedMemBytes = ld32(q + 28);
        kp.kernelParams = n_params ? b->argv : NULL;
        what = "cuGraphAddKernelNode";
        rc = cu.add_kernel(&nodes[i], graph, NULL, 0, &kp);
        if (rc != CUDA_SUCCESS)
          snprintf(detail, sizeof detail,
                   " (function %u, grid %u x %u x %u, block %u x %u x %u, dynamic shared memory %u bytes)",
                   func, kp.gridDimX, kp.gridDimY, kp.gridDimZ, kp.blockDimX, kp.blockDimY, kp.blockDimZ,
                   kp.sharedMemBytes);
        for (uint32_t a = 0; rc == CUDA_SUCCESS && a < n_attrs; a++) {
          const uint8_t *at = attrs + (size_t)a * ATTR_BYTES;
          uint32_t id = ld32(at), v0 = ld32(at + 4), v1 = ld32(at + 8), v2 = ld32(at + 12);
          foundry_launch_attr_value v;
          memset(&v, 0, sizeof v);
          if (id == FOUNDRY_ATTR_CLUSTER_DIMENSION || id == FOUNDRY_ATTR_PREFERRED_CLUSTER_DIMENSION) {
            v.dim.x = v0;
            v.dim.y = v1;
            v.dim.z = v2;
          } else if (id == FOUNDRY_ATTR_MEM_SYNC_DOMAIN_MAP) {
            v.map.default_ = (unsigned char)v0;
            v.map.remote = (unsigned char)v1;
          } else {
            v.u = v0; /* int and unsigned members share these four bytes */
          }
          what = "cuGraphKernelNodeSetAttribute";
          rc = cu.set_attr(nodes[i], (int)id, &v);
        }
        break;
      }
      case FGB_NODE_MEMSET: {
        foundry_memset_node_params mp;
        read_memset(take(&r, MEMSET_BYTES), &mp);
        if (b->standin_bytes && stand_in_memset(b, g, i, &mp, err, errlen) != 0) goto fail_quiet;
        what = "cuGraphAddMemsetNode";
        rc = cu.add_memset(&nodes[i], graph, NULL, 0, &mp, b->ctx);
        break;
      }
      case FGB_NODE_MEMCPY: {
        foundry_memcpy3d c;
        read_memcpy(take(&r, MEMCPY_BYTES), &c);
        if (b->standin_bytes && stand_in_memcpy(b, g, i, &c, err, errlen) != 0) goto fail_quiet;
        what = "cuGraphAddMemcpyNode";
        rc = cu.add_memcpy(&nodes[i], graph, NULL, 0, &c, b->ctx);
        break;
      }
      case FGB_NODE_EVENT_RECORD:
        q = take(&r, 4);
        what = "cuGraphAddEventRecordNode";
        rc = cu.add_event_record(&nodes[i], graph, NULL, 0, (CUevent)b->events[ld32(q)]);
        break;
      case FGB_NODE_EVENT_WAIT:
        q = take(&r, 4);
        what = "cuGraphAddEventWaitNode";
        rc = cu.add_event_wait(&nodes[i], graph, NULL, 0, (CUevent)b->events[ld32(q)]);
        break;
      case FGB_NODE_EMPTY:
        what = "cuGraphAddEmptyNode";
        rc = cu.add_empty(&nodes[i], graph, NULL, 0);
        break;
      case FGB_NODE_GRAPH: {
        q = take(&r, 4);
        CUgraph child = NULL;
        if (build_graph(b, ld32(q), &child, err, errlen) != 0) goto fail_quiet;
        what = "cuGraphAddChildGraphNode";
        rc = cu.add_child(&nodes[i], graph, NULL, 0, child);
        cu.graph_destroy(child); /* the node holds its own clone */
        break;
      }
      default: /* unreachable after validation */
        snprintf(err, errlen, "graph %u node %u: unknown node type %u", g, i, type);
        goto fail_quiet;
    }
    if (rc != CUDA_SUCCESS) {
      snprintf(err, errlen, "graph %u node %u (%s): %s failed: %s%s", g, i, type_name(type), what,
               err_name(rc), detail);
      goto fail_quiet;
    }
    if (b->standin_bytes && (type == FGB_NODE_MEMSET || type == FGB_NODE_MEMCPY)) {
      if (b->n_moved == b->cap_moved) {
        snprintf(err, errlen, "graph %u node %u: more memory nodes than the %zu expected", g, i,
                 b->cap_moved);
        goto fail_quiet;
      }
      b->moved[b->n_moved++] = nodes[i];
    }
  }
  const uint8_t *edges = take(&r, (size_t)n_edges * EDGE_BYTES);
  for (uint32_t e = 0; e < n_edges; e++) {
    const uint8_t *q = edges + (size_t)e * EDGE_BYTES;
    foundry_edge_data d;
    memset(&d, 0, sizeof d);
    d.from_port = q[8];
    d.to_port = q[9];
    d.type = q[10];
    rc = cu.add_deps(graph, &nodes[ld32(q)], &nodes[ld32(q + 4)], &d, 1);
    if (rc != CUDA_SUCCESS) {
      snprintf(err, errlen, "graph %u edge %u (%u -> %u): cuGraphAddDependencies failed: %s", g, e, ld32(q),
               ld32(q + 4), err_name(rc));
      goto fail_quiet;
    }
  }
  free(nodes);
  *out = graph;
  return 0;
fail_quiet:
  cu.graph_destroy(graph);
  free(nodes);
  return -1;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define BUILD_INSTANTIATE 1
#define BUILD_UPLOAD 2
/* The flags torch instantiates its captured graphs with (CUDAGraph::instantiate): auto-free on launch
 * and per-node priority. With flags 0 a restored graph's kernels would run at the launch stream's
 * priority instead of the priority they were captured with. Keep equal to graphs.INSTANTIATE_FLAGS. */
#define FOUNDRY_INSTANTIATE_FLAGS (1ULL | 8ULL)

/* Builds (and with BUILD_INSTANTIATE instantiates, with BUILD_UPLOAD uploads) the graph b describes;
 * b->data, b->len, b->funcs, b->events and the stand-in fields are set by the caller. */
static int build(builder *b, size_t n_funcs, size_t n_events, void *stream, int flags, void **out_graph,
                 void **out_exec, double *times, char *err, size_t errlen) {
  double t0 = now(), t1, t2, t3;
  if (times) times[0] = times[1] = times[2] = 0.0;
  *out_graph = NULL;
  if (out_exec) *out_exec = NULL;
  if ((flags & BUILD_INSTANTIATE) && !out_exec) {
    snprintf(err, errlen, "instantiating needs somewhere to return the executable graph");
    return -1;
  }
  pthread_once(&driver_once, load_driver);
  if (!driver_ok) {
    snprintf(err, errlen, "%s", driver_error);
    return -1;
  }
  if (validate(b->data, b->len, n_funcs, n_events, &b->ps, err, errlen) != 0) return -1;
  for (size_t i = 0; i < n_funcs; i++) {
    if (!b->funcs[i]) {
      snprintf(err, errlen, "function %zu has no CUfunction handle", i);
      free(b->ps.graph_off);
      return -1;
    }
  }
  for (uint32_t i = 0; i < b->ps.n_events; i++) {
    if (!b->events[i]) {
      snprintf(err, errlen, "event slot %u has no CUevent handle", i);
      free(b->ps.graph_off);
      return -1;
    }
  }
  b->scratch = aligned_alloc(16, ((size_t)b->ps.max_param_bytes + 16) & ~(size_t)15);
  b->argv = malloc(((size_t)b->ps.max_params + 1) * sizeof *b->argv);
  CUgraph graph = NULL;
  CUgraphExec exec = NULL;
  CUresult rc;
  int status = -1;
  if (!b->scratch || !b->argv) {
    snprintf(err, errlen, "out of host memory");
    goto done;
  }
  rc = cu.ctx_current(&b->ctx);
  if (rc != CUDA_SUCCESS || !b->ctx) {
    snprintf(err, errlen, "no current CUDA context (cuCtxGetCurrent: %s)", err_name(rc));
    goto done;
  }
  if (build_graph(b, 0, &graph, err, errlen) != 0) goto done;
  t1 = now();
  if (times) times[0] = t1 - t0;
  if (flags & BUILD_INSTANTIATE) {
    rc = cu.instantiate(&exec, graph, FOUNDRY_INSTANTIATE_FLAGS);
    if (rc != CUDA_SUCCESS) {
      snprintf(err, errlen, "cuGraphInstantiateWithFlags failed: %s", err_name(rc));
      cu.graph_destroy(graph);
      goto done;
    }
    t2 = now();
    if (times) times[1] = t2 - t1;
    if (flags & BUILD_UPLOAD) {
      rc = cu.upload(exec, (CUstream)stream);
      if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "cuGraphUpload failed: %s", err_name(rc));
        cu.exec_destroy(exec);
        cu.graph_destroy(graph);
        goto done;
      }
      t3 = now();
      if (times) times[2] = t3 - t2;
    }
  }
  *out_graph = graph;
  if (out_exec) *out_exec = exec;
  status = 0;
done:
  free(b->scratch);
  free(b->argv);
  free(b->ps.graph_off);
  return status;
}

/* Builds the graph an FGB1 encoding describes in the current context. funcs[i] is the CUfunction of
 * function index i, events[i] the CUevent of slot i. With BUILD_INSTANTIATE, also instantiates it
 * (FOUNDRY_INSTANTIATE_FLAGS) into *out_exec, and with BUILD_UPLOAD uploads that to `stream`. times receives
 * the seconds spent building, instantiating and uploading. Returns 0, or -1 with a message in err and nothing
 * left allocated. */
EXPORT int foundry_graph_build(const uint8_t *data, size_t len, void *const *funcs, size_t n_funcs,
                               void *const *events, size_t n_events, void *stream, int flags,
                               void **out_graph, void **out_exec, double *times, char *err, size_t errlen) {
  builder b;
  memset(&b, 0, sizeof b);
  b.data = data;
  b.len = len;
  b.funcs = funcs;
  b.events = events;
  return build(&b, n_funcs, n_events, stream, flags, out_graph, out_exec, times, err, errlen);
}

/* Builds and instantiates the graph before the memory its memset and memcpy nodes name is mapped: the
 * driver refuses such a node whose addresses it cannot resolve yet (cuGraphAddMemsetNode:
 * CUDA_ERROR_INVALID_VALUE), while kernel nodes hold their pointers as opaque bytes. Each memory node of
 * the top graph is built against the stand-in [standin, standin + standin_bytes), device memory of the
 * same kind as the region's (foundry_graph_memory_nodes says how much it needs), and listed in moved[]
 * (room for cap_moved, *n_moved used); foundry_graph_retarget points them at their own addresses once
 * those are mapped. A memory node in a child graph, a copy of more than one row, or one larger than the
 * stand-in fails the build with a message (the caller builds that graph after the mapping instead). */
EXPORT int foundry_graph_build_ahead(const uint8_t *data, size_t len, void *const *funcs, size_t n_funcs,
                                     void *const *events, size_t n_events, uint64_t standin,
                                     uint64_t standin_bytes, void **moved, size_t cap_moved, size_t *n_moved,
                                     void **out_graph, void **out_exec, double *times, char *err,
                                     size_t errlen) {
  builder b;
  memset(&b, 0, sizeof b);
  b.data = data;
  b.len = len;
  b.funcs = funcs;
  b.events = events;
  b.standin = (CUdeviceptr)standin;
  b.standin_bytes = (size_t)standin_bytes; /* non-zero: memory nodes are moved */
  b.moved = (CUgraphNode *)moved;
  b.cap_moved = cap_moved;
  *n_moved = 0;
  *out_graph = NULL;
  *out_exec = NULL;
  if (!standin || !standin_bytes) {
    snprintf(err, errlen, "building ahead needs a stand-in allocation");
    return -1;
  }
  int rc = build(&b, n_funcs, n_events, NULL, BUILD_INSTANTIATE, out_graph, out_exec, times, err, errlen);
  *n_moved = rc == 0 ? b.n_moved : 0;
  return rc;
}

/* Points the memory nodes foundry_graph_build_ahead moved (moved[0..n_moved), in the order it listed
 * them) at their own addresses, now mapped: in the executable graph (what replays) and in the graph
 * it was instantiated from (what a read-back or a later instantiation sees). Returns 0, or -1 with a
 * message naming the node; the executable graph is then not to be replayed (the caller rebuilds it). */
EXPORT int foundry_graph_retarget(const uint8_t *data, size_t len, void *exec, void *const *moved,
                                  size_t n_moved, char *err, size_t errlen) {
  parsed ps;
  CUcontext ctx = NULL;
  CUresult rc;
  size_t k = 0;
  pthread_once(&driver_once, load_driver);
  if (!driver_ok) {
    snprintf(err, errlen, "%s", driver_error);
    return -1;
  }
  if (validate(data, len, SIZE_MAX, SIZE_MAX, &ps, err, errlen) != 0) return -1;
  rc = cu.ctx_current(&ctx);
  if (rc != CUDA_SUCCESS || !ctx) {
    snprintf(err, errlen, "no current CUDA context (cuCtxGetCurrent: %s)", err_name(rc));
    free(ps.graph_off);
    return -1;
  }
  reader r = {data, len, ps.graph_off[0]};
  uint32_t n_nodes = ld32(take(&r, 8));
  for (uint32_t i = 0; i < n_nodes; i++) {
    uint8_t type;
    const uint8_t *q = step_node(&r, &ps, &type);
    if (type != FGB_NODE_MEMSET && type != FGB_NODE_MEMCPY) continue;
    if (k == n_moved) {
      snprintf(err, errlen, "node %u: more memory nodes than the %zu moved", i, n_moved);
      goto fail;
    }
    CUgraphNode node = (CUgraphNode)moved[k++];
    const char *what;
    if (type == FGB_NODE_MEMSET) {
      foundry_memset_node_params mp;
      read_memset(q, &mp);
      what = "cuGraphExecMemsetNodeSetParams";
      rc = cu.exec_set_memset((CUgraphExec)exec, node, &mp, ctx);
      if (rc == CUDA_SUCCESS) {
        what = "cuGraphMemsetNodeSetParams";
        rc = cu.set_memset(node, &mp);
      }
    } else {
      foundry_memcpy3d c;
      read_memcpy(q, &c);
      what = "cuGraphExecMemcpyNodeSetParams";
      rc = cu.exec_set_memcpy((CUgraphExec)exec, node, &c, ctx);
      if (rc == CUDA_SUCCESS) {
        what = "cuGraphMemcpyNodeSetParams";
        rc = cu.set_memcpy(node, &c);
      }
    }
    if (rc != CUDA_SUCCESS) {
      snprintf(err, errlen, "node %u (%s): %s failed: %s", i, type_name(type), what, err_name(rc));
      goto fail;
    }
  }
  if (k != n_moved) {
    snprintf(err, errlen, "%zu memory nodes were moved, the encoding has %zu", n_moved, k);
    goto fail;
  }
  free(ps.graph_off);
  return 0;
fail:
  free(ps.graph_off);
  return -1;
}

/* ---- reading a captured graph (SAVE) ---- */

/* The launch attributes of kernel node `node`, ids[0..n) (n <= 32), for the SAVE's walk: one call per
 * node instead of one Python driver call (and value object) per attribute. values receives three words
 * per attribute in the order the builder writes them back: a dimension's x, y, z; a domain map's
 * default and remote; otherwise the 32-bit value (its C type's bits, signed or not). Returns the mask
 * of the attributes the driver answered for, or -1 with the reason in err (no driver). */
EXPORT int64_t foundry_graph_node_attrs(void *node, const int32_t *ids, size_t n, uint32_t *values, char *err,
                                        size_t errlen) {
  int64_t mask = 0;
  pthread_once(&driver_once, load_driver);
  if (!driver_ok) {
    snprintf(err, errlen, "%s", driver_error);
    return -1;
  }
  if (n > 32) {
    snprintf(err, errlen, "%zu attributes asked for, at most 32", n);
    return -1;
  }
  for (size_t a = 0; a < n; a++) {
    foundry_launch_attr_value v;
    uint32_t *out = values + 3 * a;
    memset(&v, 0, sizeof v);
    out[0] = out[1] = out[2] = 0;
    if (cu.get_attr((CUgraphNode)node, (int)ids[a], &v) != CUDA_SUCCESS) continue;
    mask |= (int64_t)1 << a;
    if (ids[a] == FOUNDRY_ATTR_CLUSTER_DIMENSION || ids[a] == FOUNDRY_ATTR_PREFERRED_CLUSTER_DIMENSION) {
      out[0] = v.dim.x;
      out[1] = v.dim.y;
      out[2] = v.dim.z;
    } else if (ids[a] == FOUNDRY_ATTR_MEM_SYNC_DOMAIN_MAP) {
      out[0] = v.map.default_;
      out[1] = v.map.remote;
    } else {
      out[0] = v.u; /* int and unsigned members share these four bytes */
    }
  }
  return mask;
}

/* A kernel node's parameter block, as the SAVE stores it: parameter i copied from where
 * kernel_params[i] points (cuGraphKernelNodeGetParams' kernelParams) to its offset in out, layout
 * being n x {offset, size} (cuFuncGetParamInfo). One call per node instead of two per parameter. */
EXPORT void foundry_graph_pack_params(void *const *kernel_params, const uint32_t *layout, size_t n,
                                      uint8_t *out) {
  for (size_t i = 0; i < n; i++)
    memcpy(out + layout[2 * i], kernel_params[i], layout[2 * i + 1]);
}
