// The Python module of the CUDA extension (zero_engine_cuda_ops): the CPU module's op names and
// arguments, so engine/ops/ calls whichever module matches the tensors' device the same way.
//
// The bindings live in this .cpp, compiled by the host compiler, rather than in ops.cu: nvcc then never
// parses <torch/extension.h> and pybind11, which would dominate its compile time.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  namespace gpu = zero_engine::gpu;
  // As the CPU module: the GIL is released while an op runs (sum_squares_and_overflow waits for the GPU).
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.doc() = "zero-engine CUDA ops: fused flatten/cast/scale copies, overflow check + sum of squares, fused Adam, "
            "accumulate (dst += src * scale)";
  m.def("copy_into", &gpu::copy_into, "dst[offsets[i]:][:srcs[i].numel()] = cast(float(srcs[i]) * scale)",
        py::arg("dst"), py::arg("srcs"), py::arg("offsets"), py::arg("scale") = 1.0, release);
  m.def("copy_out", &gpu::copy_out, "dsts[i] = cast(float(src[offsets[i]:][:dsts[i].numel()]) * scale)",
        py::arg("src"), py::arg("dsts"), py::arg("offsets"), py::arg("scale") = 1.0, release);
  m.def("sum_squares_and_overflow", &gpu::sum_squares_and_overflow,
        "(sum of (float(x) * scale)^2 in double, whether any element is inf/nan), deterministic",
        py::arg("tensors"), py::arg("scale") = 1.0, release);
  m.def("adam_step", &gpu::adam_step, "fused Adam/AdamW step with grad unscale and low-precision copy-out",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("lp_params"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw_mode"), py::arg("step"), py::arg("bias_correction"), py::arg("grad_scale"), release);
  m.def("accumulate", &gpu::accumulate, "dst += float(src) * scale in place (float32 math, one rounding into dst)",
        py::arg("dst"), py::arg("src"), py::arg("scale") = 1.0, release);
}
