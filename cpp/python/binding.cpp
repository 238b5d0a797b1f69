// pybind11 module cutlass_moe._C: the only C++ file that knows about Python. It takes raw pointers,
// sizes and a stream handle (torch stays on the Python side), so one build serves every PyTorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cutlass_moe/cutlass_moe.h"

namespace py = pybind11;
using namespace cutlass_moe;

namespace {

MoeGemmProblem make_problem(int dtype, int weight_layout, int count_type, int64_t num_tokens,
                            int64_t num_experts, int64_t n, int64_t k, uintptr_t x, int64_t ldx,
                            uintptr_t weights, int64_t ldw, int64_t expert_stride, uintptr_t out,
                            int64_t ldout, uintptr_t tokens_per_expert) {
  MoeGemmProblem p;
  p.dtype = static_cast<DType>(dtype);
  p.weight_layout = static_cast<WeightLayout>(weight_layout);
  p.count_type = static_cast<IndexType>(count_type);
  p.num_tokens = num_tokens;
  p.num_experts = num_experts;
  p.n = n;
  p.k = k;
  p.x = reinterpret_cast<const void*>(x);
  p.ldx = ldx;
  p.weights = reinterpret_cast<const void*>(weights);
  p.ldw = ldw;
  p.expert_stride = expert_stride;
  p.out = reinterpret_cast<void*>(out);
  p.ldout = ldout;
  p.tokens_per_expert = reinterpret_cast<const void*>(tokens_per_expert);
  return p;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cutlass_moe compiled core (torch-free): pointers, sizes and a CUDA stream";

  // Bad arguments reach Python as ValueError, a missing kernel as NotImplementedError, the rest
  // (CUDA and CUTLASS failures) as RuntimeError. Each message carries the C++ file and line.
  py::register_exception_translator([](std::exception_ptr ptr) {
    try {
      if (ptr) std::rethrow_exception(ptr);
    } catch (const Error& e) {
      switch (e.status()) {
        case Status::kInvalidArgument: py::set_error(PyExc_ValueError, e.what()); break;
        case Status::kNotSupported: py::set_error(PyExc_NotImplementedError, e.what()); break;
        default: py::set_error(PyExc_RuntimeError, e.what()); break;
      }
    }
  });

  m.def("moe_gemm",
        [](int dtype, int weight_layout, int count_type, int64_t num_tokens, int64_t num_experts,
           int64_t n, int64_t k, uintptr_t x, int64_t ldx, uintptr_t weights, int64_t ldw,
           int64_t expert_stride, uintptr_t out, int64_t ldout, uintptr_t tokens_per_expert,
           int backend, int config, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
          MoeGemmProblem p = make_problem(dtype, weight_layout, count_type, num_tokens, num_experts, n, k, x,
                                          ldx, weights, ldw, expert_stride, out, ldout, tokens_per_expert);
          moe_gemm(p, static_cast<Backend>(backend), static_cast<KernelConfig>(config),
                   reinterpret_cast<void*>(workspace), workspace_bytes, reinterpret_cast<cudaStream_t>(stream));
        });

  m.def("workspace_size",
        [](int dtype, int weight_layout, int64_t num_tokens, int64_t num_experts, int64_t n, int64_t k,
           int backend, int config, int device) {
          // Only the sizes matter for the workspace; stand-in pointers and strides that pass check_problem.
          const uintptr_t stand_in = 256;
          const int64_t ldw = static_cast<WeightLayout>(weight_layout) == WeightLayout::kKN ? n : k;
          MoeGemmProblem p = make_problem(dtype, weight_layout, /*count_type=*/0, num_tokens, num_experts, n, k,
                                          stand_in, k, stand_in, ldw, 0, stand_in, n, stand_in);
          return workspace_size(p, static_cast<Backend>(backend), static_cast<KernelConfig>(config), device);
        });

  // The heuristics' picks for these sizes: (backend, config), with backend kAuto resolved first.
  m.def("select", [](int64_t num_tokens, int64_t num_experts, int64_t n, int64_t k, int backend, int device) {
    MoeGemmProblem p;
    p.num_tokens = num_tokens;
    p.num_experts = num_experts;
    p.n = n;
    p.k = k;
    Backend b = static_cast<Backend>(backend);
    if (b == Backend::kAuto) b = select_backend(p, device);
    return std::make_pair(static_cast<int>(b), static_cast<int>(select_config(p, b, device)));
  });
  m.def("backend_names", [] {
    py::dict names;  // name -> Backend value
    for (int b = 0; b < kNumBackends; ++b) names[backend_name(static_cast<Backend>(b))] = b;
    return names;
  });

  m.def("config_names", [] {
    py::dict names;  // name -> KernelConfig value, "auto" included
    for (int c = -1; c < kNumKernelConfigs; ++c) names[config_name(static_cast<KernelConfig>(c))] = c;
    return names;
  });
  m.def("built_instances", &built_instances);
  m.def("build_info", &build_info);
}
