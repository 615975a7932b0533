// The name Python imports one build of the kernels by: setup.py compiles this file once per
// instruction-set level (-DLLMACCEL_MODULE=_kernels_avx2 -DLLMACCEL_KERNEL_LEVEL=avx2
// -DLLMACCEL_BUILD_ID=<the sources' digest>) beside that level's kernels and the one bindings.cpp object;
// the JIT build (llmaccel/ops/cpu_kernels.py) compiles it with torch's TORCH_EXTENSION_NAME.
#include <Python.h>

#ifndef LLMACCEL_MODULE
#define LLMACCEL_MODULE TORCH_EXTENSION_NAME
#endif
#ifndef LLMACCEL_KERNEL_LEVEL
#define LLMACCEL_KERNEL_LEVEL native
#endif
#ifndef LLMACCEL_BUILD_ID
#define LLMACCEL_BUILD_ID jit
#endif

#define LLMACCEL_STR2(x) #x
#define LLMACCEL_STR(x) LLMACCEL_STR2(x)
#define LLMACCEL_CAT2(a, b) a##b
#define LLMACCEL_CAT(a, b) LLMACCEL_CAT2(a, b)

extern const char* const llmaccel_kernel_level = LLMACCEL_STR(LLMACCEL_KERNEL_LEVEL);
extern const char* const llmaccel_build_id = LLMACCEL_STR(LLMACCEL_BUILD_ID);

extern "C" PyObject* PyInit__kernels();  // bindings.cpp

extern "C" __attribute__((visibility("default"))) PyObject* LLMACCEL_CAT(PyInit_, LLMACCEL_MODULE)() {
  return PyInit__kernels();
}
