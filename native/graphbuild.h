/* The CUDA driver graph-API declarations the native graph builder (graphbuild.c) uses, and the
 * binary graph encoding it reads (FGB1, docs/archive-format.md section "Graph encoding").
 *
 * Layouts match cuda.h of CUDA 12.3+ and 13 (CUDA_KERNEL_NODE_PARAMS_v2, CUDA_MEMSET_NODE_PARAMS_v1,
 * CUDA_MEMCPY3D_v2, CUgraphEdgeData, CUlaunchAttributeValue); tests/test_graph_encoding_abi.py
 * checks them against a real cuda.h wherever a toolkit is installed.
 */
#ifndef FOUNDRY_GRAPHBUILD_H
#define FOUNDRY_GRAPHBUILD_H

#include "cuda_min.h"

typedef struct CUfunc_st *CUfunction;
typedef struct CUkern_st *CUkernel;
typedef struct CUarray_st *CUarray;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;

/* CUDA_KERNEL_NODE_PARAMS_v2 */
typedef struct {
  CUfunction func;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void **kernelParams;
  void **extra;
  CUkernel kern;
  CUcontext ctx;
} foundry_kernel_node_params;

/* CUDA_MEMSET_NODE_PARAMS_v1 */
typedef struct {
  CUdeviceptr dst;
  size_t pitch;
  unsigned int value;
  unsigned int elementSize;
  size_t width;
  size_t height;
} foundry_memset_node_params;

/* CUDA_MEMCPY3D_v2 */
typedef struct {
  size_t srcXInBytes, srcY, srcZ, srcLOD;
  int srcMemoryType; /* CUmemorytype */
  const void *srcHost;
  CUdeviceptr srcDevice;
  CUarray srcArray;
  void *reserved0;
  size_t srcPitch, srcHeight;
  size_t dstXInBytes, dstY, dstZ, dstLOD;
  int dstMemoryType; /* CUmemorytype */
  void *dstHost;
  CUdeviceptr dstDevice;
  CUarray dstArray;
  void *reserved1;
  size_t dstPitch, dstHeight;
  size_t WidthInBytes, Height, Depth;
} foundry_memcpy3d;

/* CUgraphEdgeData */
typedef struct {
  unsigned char from_port;
  unsigned char to_port;
  unsigned char type;
  unsigned char reserved[5];
} foundry_edge_data;

/* CUlaunchAttributeValue (CUkernelNodeAttrValue): every member starts at offset 0. */
typedef union {
  char pad[64];
  int i;
  unsigned int u;
  struct {
    unsigned int x, y, z;
  } dim;
  struct {
    unsigned char default_;
    unsigned char remote;
  } map;
} foundry_launch_attr_value;

/* CUlaunchAttributeID values a saved kernel node may carry (graphs.NODE_ATTRIBUTES). */
#define FOUNDRY_ATTR_COOPERATIVE 2
#define FOUNDRY_ATTR_CLUSTER_DIMENSION 4
#define FOUNDRY_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE 5
#define FOUNDRY_ATTR_PRIORITY 8
#define FOUNDRY_ATTR_MEM_SYNC_DOMAIN_MAP 9
#define FOUNDRY_ATTR_MEM_SYNC_DOMAIN 10
#define FOUNDRY_ATTR_PREFERRED_CLUSTER_DIMENSION 11
#define FOUNDRY_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT 14

/* ---- FGB1: the binary graph encoding (all integers little-endian, no alignment) ----
 *
 * header    "FGB1", u32 version (1), u32 n_graphs, u32 n_events, u32 n_kernels, u32 n_layout
 * kernels   n_kernels x {u32 function index, u32 first layout entry, u32 n_params, u32 param_bytes}
 * layout    n_layout x {u32 offset, u32 size}
 * graphs    n_graphs sections (0 is the top graph; child graphs follow, each referenced once by a
 *           node of a graph with a smaller index): u32 n_nodes, u32 n_edges, nodes, edges
 * node      u8 type, u8 n_attrs, u16 0, then by type:
 *   kernel       u32 kernel, u32 grid[3], u32 block[3], u32 smem, n_attrs x {u32 id, u32 v[3]},
 *                param_bytes bytes of parameters
 *   memset       u64 dst, u64 pitch, u32 value, u32 element_size, u64 width, u64 height
 *   memcpy       u32 src_type, u32 dst_type, u64 src, u64 dst, u64 src_xyz[3], u64 dst_xyz[3],
 *                u64 src_pitch, u64 src_height, u64 dst_pitch, u64 dst_height, u64 extent[3]
 *   event_*      u32 event slot
 *   empty        nothing
 *   graph        u32 child graph index
 * edge      u32 from, u32 to, u8 from_port, u8 to_port, u8 type, u8 0
 */
#define FGB_MAGIC "FGB1"
#define FGB_VERSION 1
#define FGB_NODE_KERNEL 1
#define FGB_NODE_MEMSET 2
#define FGB_NODE_MEMCPY 3
#define FGB_NODE_EVENT_RECORD 4
#define FGB_NODE_EVENT_WAIT 5
#define FGB_NODE_EMPTY 6
#define FGB_NODE_GRAPH 7

#endif
