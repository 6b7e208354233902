// C entry points for programs compiled ahead of time (AOTInductor). A program compiled with
// these declared (kernels.aoti_c_shims) calls a kernel as a plain C function; without them it
// calls through torch's proxy executor, which boxes every argument and output into IValues
// and goes through the dispatcher for each of the ~150 kernel calls of a step, on the main
// thread while the other one waits.
// The name is AOTInductor's convention, aoti_torch_<device>_<op name>.
#pragma once

#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <cstdint>
#include <initializer_list>

namespace mtpkit_shim {

inline const at::Tensor& arg(AtenTensorHandle h) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

// An argument the op writes (Tensor(a!) in its schema).
inline at::Tensor& mut(AtenTensorHandle h) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

// Reads the metadata of a call's tensor arguments ahead of its checks: the at::Tensor each
// handle points to, its TensorImpl and its StorageImpl, level by level for all of them at
// once. A step reads them once, and its weight stream (SmolLM2 W8A8: ~135 MB) evicts them
// from every cache level before the next: read argument by argument, as a kernel's checks
// read them, each costs a chain of three dependent misses. Read together, the misses
// overlap, which halves the time a call spends before its first GEMM. Loads, not
// prefetches: w8a8_trunk's ~480 tensors asked for by prefetches in one burst (~2,900 lines)
// mostly were not there when its checks read them (probably dropped: a burst beyond the
// misses a core can track), while loads make planning a decode step several times faster.
inline void warm(const AtenTensorHandle* handles, int64_t n) {
  uintptr_t sink = 0;
  for (int64_t i = 0; i < n; i++) sink += *reinterpret_cast<const volatile uintptr_t*>(handles[i]);
  for (int64_t i = 0; i < n; i++) {
    const char* impl = reinterpret_cast<const char*>(arg(handles[i]).unsafeGetTensorImpl());
    for (size_t b = 0; b < sizeof(c10::TensorImpl); b += 64)
      sink += *reinterpret_cast<const volatile char*>(impl + b);
  }
  for (int64_t i = 0; i < n; i++) {
    const char* storage = reinterpret_cast<const char*>(
        arg(handles[i]).unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
    if (storage)  // an undefined tensor has none
      sink += *reinterpret_cast<const volatile char*>(storage) +
              *reinterpret_cast<const volatile char*>(storage + 64);
  }
  asm volatile("" ::"r"(sink));
}
inline void warm(std::initializer_list<AtenTensorHandle> handles) {
  warm(handles.begin(), int64_t(handles.size()));
}

}  // namespace mtpkit_shim

// Stores the tensor `expr` evaluates to in *ret0, after warming the metadata of `tensors`
// (the parenthesized tensor parameters); a c10::Error (a failed TORCH_CHECK) becomes
// AOTInductor's error code, with its message logged by torch, as for torch's own shims.
#define MTPKIT_UNPAREN(...) __VA_ARGS__
#define MTPKIT_AOTI_SHIM(name, params, tensors, expr)                                      \
  extern "C" __attribute__((visibility("default"))) AOTITorchError                         \
      aoti_torch_cpu_##name params {                                                       \
    using mtpkit_shim::arg;                                                                \
    using mtpkit_shim::mut;                                                                \
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({                                           \
      mtpkit_shim::warm({MTPKIT_UNPAREN tensors});                                         \
      *ret0 = torch::aot_inductor::new_tensor_handle(expr);                                \
    });                                                                                    \
  }
