// One source for AMD (hipcc) and NVIDIA (nvcc): the few runtime names the kernels need, spelled once.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
typedef hipStream_t cascade_stream_t;
typedef hipError_t cascade_error_t;
#define cascade_get_last_error hipGetLastError
#define cascade_success hipSuccess
#define cascade_error_string hipGetErrorString
#else
#include <cuda_runtime.h>
typedef cudaStream_t cascade_stream_t;
typedef cudaError_t cascade_error_t;
#define cascade_get_last_error cudaGetLastError
#define cascade_success cudaSuccess
#define cascade_error_string cudaGetErrorString
#endif
