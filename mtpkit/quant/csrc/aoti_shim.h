// C entry points for programs compiled ahead of time (AOTInductor). A program compiled with
// these declared (kernels.aoti_c_shims) calls a kernel as a plain C function; without them it
// calls through torch's proxy executor, which boxes every argument and output into IValues
// and goes through the dispatcher for each of the ~150 kernel calls of a step, on the main
// thread while the other one waits (session 20 measured the difference: docs/benchmarks.md).
// The name is AOTInductor's convention, aoti_torch_<device>_<op name>.
#pragma once

#include <torch/csrc/inductor/aoti_torch/utils.h>

namespace mtpkit_shim {

inline const at::Tensor& arg(AtenTensorHandle h) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

// An argument the op writes (Tensor(a!) in its schema).
inline at::Tensor& mut(AtenTensorHandle h) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

}  // namespace mtpkit_shim

// Stores the tensor `expr` evaluates to in *ret0; a c10::Error (a failed TORCH_CHECK) becomes
// AOTInductor's error code, with its message logged by torch, as for torch's own shims.
#define MTPKIT_AOTI_SHIM(name, params, expr)                                               \
  extern "C" __attribute__((visibility("default"))) AOTITorchError                         \
      aoti_torch_cpu_##name params {                                                       \
    using mtpkit_shim::arg;                                                                \
    using mtpkit_shim::mut;                                                                \
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(                                            \
        { *ret0 = torch::aot_inductor::new_tensor_handle(expr); });                        \
  }
