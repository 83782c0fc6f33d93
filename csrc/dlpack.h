/* dlpack.h: the DLPack ABI (v1.0), declared from the published specification.
 *
 * Only what rlhfz exchanges: devices, dtypes, the tensor descriptor and the
 * two managed-tensor forms (legacy and versioned). Layouts must match the
 * spec byte for byte, since other libraries read these structs directly.
 */
#ifndef RLHFZ_DLPACK_H
#define RLHFZ_DLPACK_H

#include <stdint.h>

#define RLHFZ_DLPACK_MAJOR_VERSION 1
#define RLHFZ_DLPACK_MINOR_VERSION 0

#define RLHFZ_DLPACK_FLAG_READ_ONLY ((uint64_t)1 << 0)
#define RLHFZ_DLPACK_FLAG_IS_COPIED ((uint64_t)1 << 1)

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13,
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;      /* NULL: compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#endif /* RLHFZ_DLPACK_H */
