/*
 * Version and feature queries.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "gpu/gpu.h"
#include "tp/tp.h"
#include "kvi_build_config.h"

KVI_API unsigned kvi_version_number(void) { return KVI_VERSION_NUMBER; }

KVI_API const char *kvi_version_string(void) { return KVI_VERSION_STRING; }

KVI_API unsigned kvi_features(void) {
  unsigned f = 0;
  if (KVI_BUILT_CUDA) f |= KVI_FEATURE_CUDA;
  if (KVI_BUILT_CUBLASLT && kvi__lt_usable()) f |= KVI_FEATURE_CUBLASLT; /* opens the library once */
  if (KVI_BUILT_NCCL && kvi__nccl_usable()) f |= KVI_FEATURE_NCCL;
  return f;
}

KVI_API kvi_status kvi_cuda_device_count(int *out_count) {
  if (!out_count) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, __func__, "out_count is NULL");
  *out_count = 0;
  if (!KVI_BUILT_CUDA)
    return kvi__fail(KVI_ERR_NOT_BUILT, __func__, "libkvinject was built without CUDA");
  *out_count = kvi__cuda_count();
  return KVI_OK;
}
