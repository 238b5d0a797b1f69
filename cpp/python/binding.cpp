// pybind11 module cutlass_moe._C: the only C++ file that knows about Python. It takes raw pointers,
// sizes and a stream handle (torch stays on the Python side), so one build serves every PyTorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cutlass_moe/cutlass_moe.h"

namespace py = pybind11;
using namespace cutlass_moe;

namespace {

// A problem from sizes and strides; pointers are filled in by the caller where it has them.
MoeGemmProblem make_problem(int dtype, int weight_layout, int count_type, int64_t num_tokens, int64_t num_experts,
                            int64_t n, int64_t k, int64_t ldx, int64_t ldw, int64_t expert_stride, int64_t ldout) {
  MoeGemmProblem p;
  p.dtype = static_cast<DType>(dtype);
  p.weight_layout = static_cast<WeightLayout>(weight_layout);
  p.count_type = static_cast<IndexType>(count_type);
  p.num_tokens = num_tokens;
  p.num_experts = num_experts;
  p.n = n;
  p.k = k;
  p.ldx = ldx;
  p.ldw = ldw;
  p.expert_stride = expert_stride;
  p.ldout = ldout;
  return p;
}

template <class Enum, class NameOf>
py::dict enum_values(int first, int count, NameOf name_of) {
  py::dict names;  // name -> value
  for (int v = first; v < count; ++v) names[name_of(static_cast<Enum>(v))] = v;
  return names;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cutlass_moe compiled core (torch-free): pointers, sizes and a CUDA stream";

  // Bad arguments reach Python as ValueError, a missing kernel as NotImplementedError, the rest
  // (CUDA and CUTLASS failures) as RuntimeError. Each message names the argument first and ends
  // with the C++ file and line.
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

  // The enums of cutlass_moe.h, name -> value.
  m.def("dtypes", [] { return enum_values<DType>(0, kNumDTypes, dtype_name); });
  m.def("layouts", [] { return enum_values<WeightLayout>(0, kNumWeightLayouts, layout_name); });
  m.def("index_types", [] { return enum_values<IndexType>(0, kNumIndexTypes, index_type_name); });
  m.def("backend_names", [] { return enum_values<Backend>(0, kNumBackends, backend_name); });
  m.def("config_names", [] { return enum_values<KernelConfig>(-1, kNumKernelConfigs, config_name); });
  m.attr("MAX_TOKENS") = kMaxTokens;

  // check_layout: sizes, strides, dtype and layout, no pointers (torch fake tensors can be checked).
  m.def("check_layout", [](int dtype, int weight_layout, int count_type, int64_t num_tokens, int64_t num_experts,
                           int64_t n, int64_t k, int64_t ldx, int64_t ldw, int64_t expert_stride, int64_t ldout,
                           bool gated) {
    MoeGemmProblem p = make_problem(dtype, weight_layout, count_type, num_tokens, num_experts, n, k, ldx, ldw,
                                    expert_stride, ldout);
    p.gated = gated;
    check_layout(p);
  }, py::arg("dtype"), py::arg("weight_layout"), py::arg("count_type"), py::arg("num_tokens"), py::arg("num_experts"),
     py::arg("n"), py::arg("k"), py::arg("ldx"), py::arg("ldw"), py::arg("expert_stride"), py::arg("ldout"),
     py::arg("gated") = false);

  py::class_<MoeGemmPlan>(m, "Plan", "A problem shape resolved to a kernel instance (plan_moe_gemm)")
      .def_property_readonly("backend", [](const MoeGemmPlan& p) { return backend_name(p.backend); })
      .def_property_readonly("config", [](const MoeGemmPlan& p) { return config_name(p.config); })
      // The config that runs instead on splits of whole 128-row tiles (SplitGate, read on the device), or None.
      .def_property_readonly("aligned_config",
                             [](const MoeGemmPlan& p) -> py::object {
                               if (p.aligned_instance == nullptr) return py::none();
                               return py::str(config_name(p.aligned_config));
                             })
      .def_readonly("workspace_bytes", &MoeGemmPlan::workspace_bytes)
      .def_readonly("device", &MoeGemmPlan::device);

  m.def("plan",
        [](int dtype, int weight_layout, int64_t num_tokens, int64_t num_experts, int64_t n, int64_t k,
           int backend, int config, int device, bool fused) {
          // The natural strides: the plan does not depend on them (run checks the real ones).
          const int64_t ldw = static_cast<WeightLayout>(weight_layout) == WeightLayout::kKN ? n : k;
          MoeGemmProblem p = make_problem(dtype, weight_layout, 0, num_tokens, num_experts, n, k, k, ldw,
                                          ldw * (ldw == n ? k : n), n);
          Backend b = static_cast<Backend>(backend);
          // fused: a call with a fused epilogue (bias, activation, row_scale, gated), which only the
          // MoE families run: auto picks among them.
          if (fused && b == Backend::kAuto) b = select_fused_backend(p, device);
          return plan_moe_gemm(p, b, static_cast<KernelConfig>(config), device);
        });

  // run_moe_gemm; zero_unowned: a new output, fully defined (MoeGemmProblem::zero_unowned).
  auto run = [](const MoeGemmPlan& plan, int count_type, uintptr_t x, int64_t ldx, uintptr_t weights, int64_t ldw,
                int64_t expert_stride, uintptr_t out, int64_t ldout, uintptr_t tokens_per_expert, uintptr_t workspace,
                size_t workspace_bytes, bool zero_unowned, uintptr_t stream, uintptr_t bias, int64_t bias_stride,
                uintptr_t row_scale, int activation, bool gated, float alpha, float limit) {
    MoeGemmProblem p = make_problem(static_cast<int>(plan.dtype), static_cast<int>(plan.weight_layout), count_type,
                                    plan.num_tokens, plan.num_experts, plan.n, plan.k, ldx, ldw, expert_stride, ldout);
    p.x = reinterpret_cast<const void*>(x);
    p.weights = reinterpret_cast<const void*>(weights);
    p.out = reinterpret_cast<void*>(out);
    p.tokens_per_expert = reinterpret_cast<const void*>(tokens_per_expert);
    p.bias = reinterpret_cast<const void*>(bias);
    p.bias_stride = bias_stride;
    p.row_scale = reinterpret_cast<const float*>(row_scale);
    p.activation = static_cast<Activation>(activation);
    p.gated = gated;
    p.alpha = alpha;
    p.limit = limit;
    p.zero_unowned = zero_unowned;
    run_moe_gemm(plan, p, reinterpret_cast<void*>(workspace), workspace_bytes, reinterpret_cast<cudaStream_t>(stream));
  };
  m.def("run", [run](const MoeGemmPlan& plan, int count_type, uintptr_t x, int64_t ldx, uintptr_t weights, int64_t ldw,
                     int64_t expert_stride, uintptr_t out, int64_t ldout, uintptr_t tokens_per_expert,
                     uintptr_t workspace, size_t workspace_bytes, bool zero_unowned, uintptr_t stream) {
    run(plan, count_type, x, ldx, weights, ldw, expert_stride, out, ldout, tokens_per_expert, workspace,
        workspace_bytes, zero_unowned, stream, 0, 0, 0, 0, false, 0.0f, 0.0f);
  });
  // run with the fused epilogue: bias (E x N, x's dtype, row stride bias_stride), row_scale (T fp32),
  // activation (activations()), gated (out is T x N/2; alpha and limit for swiglu_oai).
  m.def("run_fused", run);
  // Interleaved groups (MoeGemmProblem::group_rows): expert e's rows are x[b * ldx + e * x_group_stride]
  // and out[b * ldout + e * out_group_stride], b < group_rows (the plan's T is E * group_rows); no
  // counts, no row_scale.
  m.def("run_interleaved", [](const MoeGemmPlan& plan, uintptr_t x, int64_t ldx, int64_t x_group_stride,
                              uintptr_t weights, int64_t ldw, int64_t expert_stride, uintptr_t out, int64_t ldout,
                              int64_t out_group_stride, int64_t group_rows, uintptr_t workspace,
                              size_t workspace_bytes, uintptr_t stream, uintptr_t bias, int64_t bias_stride,
                              int activation, bool gated, float alpha, float limit) {
    MoeGemmProblem p = make_problem(static_cast<int>(plan.dtype), static_cast<int>(plan.weight_layout), 0,
                                    plan.num_tokens, plan.num_experts, plan.n, plan.k, ldx, ldw, expert_stride, ldout);
    p.x = reinterpret_cast<const void*>(x);
    p.weights = reinterpret_cast<const void*>(weights);
    p.out = reinterpret_cast<void*>(out);
    p.group_rows = group_rows;
    p.x_group_stride = x_group_stride;
    p.out_group_stride = out_group_stride;
    p.bias = reinterpret_cast<const void*>(bias);
    p.bias_stride = bias_stride;
    p.activation = static_cast<Activation>(activation);
    p.gated = gated;
    p.alpha = alpha;
    p.limit = limit;
    run_moe_gemm(plan, p, reinterpret_cast<void*>(workspace), workspace_bytes, reinterpret_cast<cudaStream_t>(stream));
  });
  m.def("activations", [] {
    auto v = [](Activation a) { return static_cast<int>(a); };
    return std::vector<std::pair<std::string, int>>{{"none", v(Activation::kNone)},
                                                    {"relu", v(Activation::kRelu)},
                                                    {"gelu_tanh", v(Activation::kGeluTanh)},
                                                    {"gelu", v(Activation::kGelu)},
                                                    {"silu", v(Activation::kSilu)},
                                                    {"swiglu_oai", v(Activation::kSwigluOai)}};
  });

  // The gated activation and its backward (pointers and row strides in elements).
  m.def("gated_activation", [](int dtype, int activation, float alpha, float limit, int64_t rows, int64_t cols,
                               uintptr_t y, int64_t ldy, uintptr_t out, int64_t ldout, uintptr_t stream) {
    gated_activation(static_cast<DType>(dtype), static_cast<Activation>(activation), alpha, limit, rows, cols,
                     reinterpret_cast<const void*>(y), ldy, reinterpret_cast<void*>(out), ldout,
                     reinterpret_cast<cudaStream_t>(stream));
  });
  m.def("gated_activation_backward",
        [](int dtype, int activation, float alpha, float limit, int64_t rows, int64_t cols, uintptr_t y, int64_t ldy,
           uintptr_t grad_out, int64_t ld_grad_out, uintptr_t grad_y, int64_t ld_grad_y, uintptr_t stream) {
          gated_activation_backward(static_cast<DType>(dtype), static_cast<Activation>(activation), alpha, limit,
                                    rows, cols, reinterpret_cast<const void*>(y), ldy,
                                    reinterpret_cast<const void*>(grad_out), ld_grad_out,
                                    reinterpret_cast<void*>(grad_y), ld_grad_y, reinterpret_cast<cudaStream_t>(stream));
        });

  // The weight gradient (MoeWgradProblem): its checks without pointers, its workspace, the call.
  auto wgrad_problem = [](int dtype, int out_dtype, int weight_layout, int count_type, bool accumulate,
                          int64_t num_tokens, int64_t num_experts, int64_t n, int64_t k, int64_t ldx,
                          int64_t ld_grad_out, int64_t ldw, int64_t expert_stride) {
    MoeWgradProblem p;
    p.dtype = static_cast<DType>(dtype);
    p.out_dtype = static_cast<DType>(out_dtype);
    p.weight_layout = static_cast<WeightLayout>(weight_layout);
    p.count_type = static_cast<IndexType>(count_type);
    p.accumulate = accumulate;
    p.num_tokens = num_tokens;
    p.num_experts = num_experts;
    p.n = n;
    p.k = k;
    p.ldx = ldx;
    p.ld_grad_out = ld_grad_out;
    p.ldw = ldw;
    p.expert_stride = expert_stride;
    return p;
  };
  m.def("check_wgrad_layout", [=](int dtype, int out_dtype, int weight_layout, int count_type, bool accumulate,
                                  int64_t num_tokens, int64_t num_experts, int64_t n, int64_t k, int64_t ldx,
                                  int64_t ld_grad_out, int64_t ldw, int64_t expert_stride) {
    check_wgrad_layout(wgrad_problem(dtype, out_dtype, weight_layout, count_type, accumulate, num_tokens,
                                     num_experts, n, k, ldx, ld_grad_out, ldw, expert_stride));
  });
  m.def("wgrad_workspace_size", [=](int dtype, int out_dtype, int weight_layout, bool accumulate, int64_t num_tokens,
                                    int64_t num_experts, int64_t n, int64_t k, int backend, int config,
                                    int device) {
    const int64_t ldw = static_cast<WeightLayout>(weight_layout) == WeightLayout::kKN ? n : k;
    return wgrad_workspace_size(wgrad_problem(dtype, out_dtype, weight_layout, 0, accumulate, num_tokens, num_experts,
                                              n, k, k, n, ldw, ldw * (ldw == n ? k : n)),
                                static_cast<Backend>(backend), static_cast<KernelConfig>(config), device);
  });
  m.def("wgrad", [=](int backend, int config, int dtype, int out_dtype, int weight_layout, int count_type, bool accumulate,
                     int64_t num_tokens, int64_t num_experts, int64_t n, int64_t k, uintptr_t x, int64_t ldx,
                     uintptr_t grad_out, int64_t ld_grad_out, uintptr_t out, int64_t ldw, int64_t expert_stride,
                     uintptr_t tokens_per_expert, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
    MoeWgradProblem p = wgrad_problem(dtype, out_dtype, weight_layout, count_type, accumulate, num_tokens,
                                      num_experts, n, k, ldx, ld_grad_out, ldw, expert_stride);
    p.x = reinterpret_cast<const void*>(x);
    p.grad_out = reinterpret_cast<const void*>(grad_out);
    p.out = reinterpret_cast<void*>(out);
    p.tokens_per_expert = reinterpret_cast<const void*>(tokens_per_expert);
    moe_gemm_wgrad(p, static_cast<Backend>(backend), static_cast<KernelConfig>(config),
                   reinterpret_cast<void*>(workspace), workspace_bytes, reinterpret_cast<cudaStream_t>(stream));
  });

  // The heuristics' picks for these sizes: (backend, config, aligned config), with backend kAuto
  // resolved first; the aligned config (select_aligned_config) is kAuto where there is none.
  m.def("select", [](int64_t num_tokens, int64_t num_experts, int64_t n, int64_t k, int backend, int device,
                     int dtype, int weight_layout) {
    MoeGemmProblem p;
    p.dtype = static_cast<DType>(dtype);
    p.weight_layout = static_cast<WeightLayout>(weight_layout);
    p.num_tokens = num_tokens;
    p.num_experts = num_experts;
    p.n = n;
    p.k = k;
    Backend b = static_cast<Backend>(backend);
    if (b == Backend::kAuto) b = select_backend(p, device);
    const KernelConfig config = select_config(p, b, device);
    const KernelConfig aligned = b == Backend::kMoe ? select_aligned_config(p, config, device) : KernelConfig::kAuto;
    return std::make_tuple(static_cast<int>(b), static_cast<int>(config), static_cast<int>(aligned));
  });

  // The sm90 wgrad family backend="auto" takes (select_wgrad_backend).
  m.def("select_wgrad", [](int64_t num_tokens, int64_t num_experts, bool accumulate) {
    MoeWgradProblem p;
    p.num_tokens = num_tokens;
    p.num_experts = num_experts;
    p.accumulate = accumulate;
    return static_cast<int>(select_wgrad_backend(p));
  });

  m.def("expert_row_ranges", [](const std::vector<int64_t>& counts, int64_t num_tokens) {
    std::vector<std::pair<int64_t, int64_t>> ranges;  // (start, stop), as the Python reference gives them
    for (auto [start, rows] : expert_row_ranges(counts, num_tokens)) ranges.emplace_back(start, start + rows);
    return ranges;
  });
  m.def("split_of_whole_tiles", &split_of_whole_tiles);
  m.def("built_instances", &built_instances);
  m.def("target_archs", &target_archs);
  m.def("sm80_family_ccs", &sm80_family_ccs);
  m.def("build_info", &build_info);
}
