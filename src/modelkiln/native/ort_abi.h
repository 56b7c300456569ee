/* The few pieces of onnxruntime's C ABI a custom-op library needs, declared here so that the
 * library builds with gcc alone (the onnxruntime wheel ships no headers).
 *
 * onnxruntime hands a library one table of function pointers (OrtApi) that only ever grows at its
 * end, so a function's place in it never changes between releases. The slots below are those
 * places; KILN_ORT_API_VERSION is the oldest table that has every one of them (ParallelFor came
 * with 17), and the package admits onnxruntime >= 1.20. Every call returns NULL on success or a
 * status to release. */
#ifndef KILN_ORT_ABI_H
#define KILN_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

#define KILN_ORT_API_VERSION 17

typedef struct OrtApi OrtApi;  /* opaque: read through kiln_ort_fn */
typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { KILN_TENSOR_FLOAT = 1, KILN_TENSOR_UINT8 = 2, KILN_TENSOR_FLOAT16 = 10 };  /* ONNXTensorElementDataType */
enum { KILN_ORT_FAIL = 1, KILN_ORT_INVALID_ARGUMENT = 2 };  /* OrtErrorCode */

/* Version 13 of the custom-op description: onnxruntime reads fields past these only from ops
 * that declare a later version. */
typedef struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const struct OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
    int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
    int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    int (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
} OrtCustomOp;

/* Slots of OrtApi. */
enum {
    SLOT_CreateStatus = 0,
    SLOT_GetErrorMessage = 2,
    SLOT_CreateCustomOpDomain = 26,
    SLOT_CustomOpDomain_Add = 27,
    SLOT_AddCustomOpDomain = 28,
    SLOT_GetTensorMutableData = 51,
    SLOT_GetDimensionsCount = 61,
    SLOT_GetDimensions = 62,
    SLOT_GetTensorTypeAndShape = 65,
    SLOT_KernelInfoGetAttribute_float = 85,
    SLOT_KernelInfoGetAttribute_int64 = 86,
    SLOT_KernelContext_GetInput = 90,
    SLOT_KernelContext_GetOutput = 91,
    SLOT_ReleaseStatus = 93,
    SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    SLOT_KernelContext_ParallelFor = 274,
};

#define kiln_ort_fn(api, slot) (((void *const *)(api))[slot])

typedef OrtStatus *(*CreateStatusFn)(int code, const char *message);
typedef OrtStatus *(*CreateCustomOpDomainFn)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*CustomOpDomainAddFn)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
typedef OrtStatus *(*AddCustomOpDomainFn)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*GetTensorMutableDataFn)(OrtValue *value, void **out);
typedef OrtStatus *(*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
typedef OrtStatus *(*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t count);
typedef OrtStatus *(*GetTensorTypeAndShapeFn)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);
typedef OrtStatus *(*KernelInfoGetAttributeInt64Fn)(const OrtKernelInfo *info, const char *name, int64_t *out);
typedef OrtStatus *(*KernelInfoGetAttributeFloatFn)(const OrtKernelInfo *info, const char *name, float *out);
typedef OrtStatus *(*KernelContextGetInputFn)(const OrtKernelContext *context, size_t index, const OrtValue **out);
typedef OrtStatus *(*KernelContextGetOutputFn)(OrtKernelContext *context, size_t index, const int64_t *dims,
                                               size_t count, OrtValue **out);
typedef void (*ReleaseStatusFn)(OrtStatus *status);
typedef void (*ReleaseTensorTypeAndShapeInfoFn)(OrtTensorTypeAndShapeInfo *info);
typedef OrtStatus *(*KernelContextParallelForFn)(const OrtKernelContext *context, void (*fn)(void *, size_t),
                                                 size_t total, size_t num_batch, void *user_data);

/* What both operator files need of a kernel's compute: a failed call releases its status and returns
   (a custom op's compute of this interface version cannot report it), and a tensor's shape. */
#define CHECK(call)                                                                   \
    do {                                                                              \
        OrtStatus *status_ = (call);                                                  \
        if (status_) {                                                                \
            ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status_);         \
            return;                                                                   \
        }                                                                             \
    } while (0)

static inline int shape_of(const OrtApi *api, const OrtValue *value, int64_t dims[8], size_t *rank) {
    OrtTensorTypeAndShapeInfo *info;
    if (((GetTensorTypeAndShapeFn)kiln_ort_fn(api, SLOT_GetTensorTypeAndShape))(value, &info)) return 0;
    int ok = !((GetDimensionsCountFn)kiln_ort_fn(api, SLOT_GetDimensionsCount))(info, rank) && *rank <= 8 &&
             !((GetDimensionsFn)kiln_ort_fn(api, SLOT_GetDimensions))(info, dims, *rank);
    ((ReleaseTensorTypeAndShapeInfoFn)kiln_ort_fn(api, SLOT_ReleaseTensorTypeAndShapeInfo))(info);
    return ok;
}

#endif
