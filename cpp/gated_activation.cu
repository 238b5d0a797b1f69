// The gated activation on its own, over a (rows x 2 cols) tensor y holding (gate, up) pairs
// interleaved column by column: out[r][j] = act(y[r][2j]) * y[r][2j + 1] and its backward. These
// are the composite path of moe_gemm_gated (where a gradient is recorded, the GEMM's output y is
// kept and the activation runs here) and of GroupedMLP. One pass each: torch's operations on the
// interleaved halves cost several, and the stack of the two halves' gradients alone 4x the
// bandwidth time of a copy (benchmarks/NOTES.md).
//
// Each thread takes 4 pairs: 16 bytes of y, 8 bytes of out / grad, 16 bytes of dy. The math is fp32,
// with activations.hpp's functions, the same as the fused GEMM epilogue's.
#include <algorithm>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "activations.hpp"
#include "check.h"
#include "cutlass_types.cuh"

namespace cutlass_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kPairs = 4;  // per thread

struct GatedShape {
  int64_t rows, cols;  // cols: pairs per row (out's columns)
  int64_t ldy, ldout, ldgrad_y;
  float alpha, limit;
};

template <Activation kActivation>
CUTLASS_DEVICE float gated(float gate, float up, GatedShape const& s) {
  if constexpr (kActivation == Activation::kSwigluOai) {
    return swiglu_oai(gate, up, s.alpha, s.limit);
  } else {
    return activate<kActivation>(gate) * up;
  }
}

// Calls body(row, pair) for each thread's groups of kPairs pairs (pair: the group's first), grid-stride.
template <class Body>
CUTLASS_DEVICE void for_each_group(GatedShape const& s, Body&& body) {
  const int64_t groups_per_row = s.cols / kPairs;
  const int64_t groups = s.rows * groups_per_row;
  for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < groups; v += int64_t(gridDim.x) * kThreads) {
    body(v / groups_per_row, (v % groups_per_row) * kPairs);
  }
}

template <class Element, Activation kActivation>
__global__ void __launch_bounds__(kThreads)
gated_forward_kernel(const Element* __restrict__ y, Element* __restrict__ out, GatedShape s) {
  for_each_group(s, [&](int64_t row, int64_t pair) {
    const auto in = *reinterpret_cast<cutlass::Array<Element, 2 * kPairs> const*>(y + row * s.ldy + 2 * pair);
    cutlass::Array<Element, kPairs> result;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPairs; ++i) result[i] = Element(gated<kActivation>(float(in[2 * i]), float(in[2 * i + 1]), s));
    *reinterpret_cast<cutlass::Array<Element, kPairs>*>(out + row * s.ldout + pair) = result;
  });
}

template <class Element, Activation kActivation>
__global__ void __launch_bounds__(kThreads)
gated_backward_kernel(const Element* __restrict__ y, const Element* __restrict__ grad_out,
                      Element* __restrict__ grad_y, GatedShape s) {
  for_each_group(s, [&](int64_t row, int64_t pair) {
    const auto in = *reinterpret_cast<cutlass::Array<Element, 2 * kPairs> const*>(y + row * s.ldy + 2 * pair);
    const auto grad = *reinterpret_cast<cutlass::Array<Element, kPairs> const*>(grad_out + row * s.ldout + pair);
    cutlass::Array<Element, 2 * kPairs> result;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPairs; ++i) {
      const float gate = float(in[2 * i]), up = float(in[2 * i + 1]), g = float(grad[i]);
      float d_gate, d_up;
      if constexpr (kActivation == Activation::kSwigluOai) {
        swiglu_oai_grad(gate, up, s.alpha, s.limit, g, d_gate, d_up);
      } else {
        d_gate = g * up * activate_grad<kActivation>(gate);
        d_up = g * activate<kActivation>(gate);
      }
      result[2 * i] = Element(d_gate);
      result[2 * i + 1] = Element(d_up);
    }
    *reinterpret_cast<cutlass::Array<Element, 2 * kPairs>*>(grad_y + row * s.ldgrad_y + 2 * pair) = result;
  });
}

// Calls fn(Element{}, std::integral_constant<Activation, kActivation>{}) for the runtime dtype and
// activation.
template <class Fn>
void dispatch(DType dtype, Activation activation, Fn&& fn) {
  auto with_element = [&](auto element) {
    using A = Activation;
    switch (activation) {
      case A::kNone: fn(element, std::integral_constant<A, A::kNone>{}); break;
      case A::kRelu: fn(element, std::integral_constant<A, A::kRelu>{}); break;
      case A::kGeluTanh: fn(element, std::integral_constant<A, A::kGeluTanh>{}); break;
      case A::kGelu: fn(element, std::integral_constant<A, A::kGelu>{}); break;
      case A::kSilu: fn(element, std::integral_constant<A, A::kSilu>{}); break;
      case A::kSwigluOai: fn(element, std::integral_constant<A, A::kSwigluOai>{}); break;
    }
  };
  if (dtype == DType::kFloat16) {
    with_element(cutlass::half_t{});
  } else {
    with_element(cutlass::bfloat16_t{});
  }
}

void check_gated(DType dtype, Activation activation, int64_t rows, int64_t cols,
                 std::initializer_list<std::pair<const char*, const void*>> pointers,
                 std::initializer_list<std::pair<const char*, int64_t>> strides) {
  CUTLASS_MOE_CHECK_ARG(dtype == DType::kFloat16 || dtype == DType::kBFloat16,
                        "y: expected fp16 or bf16, got dtype value " << static_cast<int>(dtype));
  CUTLASS_MOE_CHECK_ARG(static_cast<int>(activation) >= 0 && static_cast<int>(activation) < kNumActivations,
                        "activation: unknown value " << static_cast<int>(activation));
  CUTLASS_MOE_CHECK_ARG(rows >= 0 && cols >= 0 && cols % kPairs == 0,
                        "y: expected rows >= 0 and a multiple of " << 2 * kPairs << " columns, got " << rows << " x "
                                                                   << 2 * cols);
  for (auto [name, ptr] : pointers) {
    CUTLASS_MOE_CHECK_ARG(rows * cols == 0 || (ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 8 == 0),
                          name << ": data pointer must be 8-byte aligned");
  }
  for (auto [name, stride] : strides) {
    CUTLASS_MOE_CHECK_ARG(stride % kPairs == 0,
                          name << ": row stride " << stride << " must be a multiple of " << kPairs);
  }
}

int blocks_for(int64_t rows, int64_t cols) {
  return static_cast<int>(std::clamp<int64_t>((rows * (cols / kPairs) + kThreads - 1) / kThreads, 1, 8192));
}

}  // namespace

void gated_activation(DType dtype, Activation activation, float alpha, float limit, int64_t rows, int64_t cols,
                      const void* y, int64_t ldy, void* out, int64_t ldout, cudaStream_t stream) {
  check_gated(dtype, activation, rows, cols, {{"y", y}, {"out", out}}, {{"y", ldy}, {"out", ldout}});
  CUTLASS_MOE_CHECK_ARG(ldy >= 2 * cols && ldout >= cols, "y, out: row strides " << ldy << ", " << ldout
                                                                                 << " below their widths");
  if (rows * cols == 0) return;
  const GatedShape s{rows, cols, ldy, ldout, 0, alpha, limit};
  dispatch(dtype, activation, [&](auto element, auto activation_tag) {
    using Element = decltype(element);
    gated_forward_kernel<Element, decltype(activation_tag)::value><<<blocks_for(rows, cols), kThreads, 0, stream>>>(
        static_cast<const Element*>(y), static_cast<Element*>(out), s);
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

void gated_activation_backward(DType dtype, Activation activation, float alpha, float limit, int64_t rows,
                               int64_t cols, const void* y, int64_t ldy, const void* grad_out, int64_t ld_grad_out,
                               void* grad_y, int64_t ld_grad_y, cudaStream_t stream) {
  check_gated(dtype, activation, rows, cols, {{"y", y}, {"grad_out", grad_out}, {"grad_y", grad_y}},
              {{"y", ldy}, {"grad_out", ld_grad_out}, {"grad_y", ld_grad_y}});
  CUTLASS_MOE_CHECK_ARG(ldy >= 2 * cols && ld_grad_out >= cols && ld_grad_y >= 2 * cols,
                        "y, grad_out, grad_y: row strides below their widths");
  if (rows * cols == 0) return;
  const GatedShape s{rows, cols, ldy, ld_grad_out, ld_grad_y, alpha, limit};
  dispatch(dtype, activation, [&](auto element, auto activation_tag) {
    using Element = decltype(element);
    gated_backward_kernel<Element, decltype(activation_tag)::value><<<blocks_for(rows, cols), kThreads, 0, stream>>>(
        static_cast<const Element*>(y), static_cast<const Element*>(grad_out), static_cast<Element*>(grad_y), s);
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe
