/* The few CUDA driver and CUPTI declarations Foundry's native library uses.
 *
 * Declared here rather than included from a toolkit so that `pip install` builds on a machine with
 * no CUDA toolkit; libcuda and libcupti are opened at run time. The layouts match cuda.h and
 * cupti_callbacks.h of CUDA 12/13; tests/test_native_abi.py checks them against real headers
 * wherever a toolkit is installed.
 */
#ifndef FOUNDRY_CUDA_MIN_H
#define FOUNDRY_CUDA_MIN_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUstream_st *CUstream;

#define CUDA_SUCCESS 0

typedef struct {
  int type; /* CUmemLocationType */
  int id;
} CUmemLocation;

typedef struct {
  int type;                 /* CUmemAllocationType */
  int requestedHandleTypes; /* CUmemAllocationHandleType */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0

/* ---- CUPTI callback API ---- */
typedef int CUptiResult;
typedef struct CUpti_Subscriber_st *CUpti_SubscriberHandle;
typedef uint32_t CUpti_CallbackId;
typedef int CUpti_CallbackDomain;
typedef void (*CUpti_CallbackFunc)(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                                   const void *cbdata);

#define CUPTI_CB_DOMAIN_DRIVER_API 1
#define CUPTI_CB_DOMAIN_RUNTIME_API 2
#define CUPTI_CB_DOMAIN_RESOURCE 3
#define CUPTI_API_ENTER 0
#define CUPTI_API_EXIT 1
#define CUPTI_CBID_RESOURCE_MODULE_LOADED 6

/* Driver API callback ids (cupti_driver_cbid.h): loads whose CUmodule handle we learn. */
#define CUPTI_DRIVER_TRACE_CBID_cuModuleLoad 18
#define CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData 19
#define CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx 20
#define CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary 21
/* ... and stream-capture starts, counted so a LOAD can prove it captured nothing. */
#define CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture 495
#define CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz 496
#define CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2 539
#define CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz 540
#define CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph 720
#define CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph_ptsz 721
#define CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000 315
#define CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_ptsz_v10000 316
#define CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCaptureToGraph_v12030 452
#define CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCaptureToGraph_ptsz_v12030 453

typedef struct {
  CUcontext context;
  union {
    CUstream stream;
  } resourceHandle;
  void *resourceDescriptor;
} CUpti_ResourceData;

typedef struct {
  uint32_t moduleId;
  size_t cubinSize;
  const char *pCubin;
} CUpti_ModuleResourceData;

typedef struct {
  int callbackSite; /* CUpti_ApiCallbackSite */
  const char *functionName;
  const void *functionParams;
  void *functionReturnValue;
  const char *symbolName;
  CUcontext context;
  uint32_t contextUid;
  uint64_t *correlationData;
  uint32_t correlationId;
} CUpti_CallbackData;

/* Every cuModuleLoad* parameter struct starts with the CUmodule* output. */
typedef struct {
  CUmodule *module;
} foundry_module_load_params;

#endif
