// The linear kernel: the gated delta rule's C++ forms, built as one extension.
//
//   delta_chunks_forward / _backward   a prompt or a training step, in chunks (delta_chunks.h,
//                                      delta_chunks_backward.h)
//   delta_step                         one decoding token, the state read and written in place
//                                      (delta_step.h)
//
// Every product and sum is float32; attnkit/linear/kernel.py and step.py convert the inputs.
// Built with -ffast-math but -fno-finite-math-only: a NaN in one sequence stays NaN there, and
// sums may be reassociated (the tests bound the error against the float64 loop).

// ATen and torch's pybind11 glue, not <torch/extension.h>, whose headers triple the build's time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "delta_chunks.h"
#include "delta_chunks_backward.h"
#include "delta_step.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("delta_chunks_forward", &delta_chunks_forward,
        "The gated delta rule over whole sequences, in chunks");
  m.def("delta_chunks_backward", &delta_chunks_backward,
        "The gradients of delta_chunks_forward, recomputing each chunk");
  m.def("delta_step", &delta_step, "One token's step of the gated delta rule, the state in place");
}
