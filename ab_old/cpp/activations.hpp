// The fused epilogue's activations (Activation in cutlass_moe.h) on one fp32 value, shared by the
// kernels' epilogues and the gated_activation kernels. Accuracy: the results are rounded to
// bf16/fp16 next, so the fast hardware forms (tanh.approx, ex2.approx; errors ~1e-4 .. 1e-3 of the
// values' scale) are enough; the reference (python/cutlass_moe/reference.py) uses the exact formulas.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

// 1 / (1 + exp(-v)) as 0.5 + 0.5 tanh(v / 2): one MUFU operation (tanh.approx) where exp and a
// reciprocal take two. The MUFU unit's throughput bounds the fused gated epilogue's pre-pass
// (2 operations per (gate, up) pair took 2-4% of a prefill GEMM, benchmarks/NOTES.md). Absolute
// error about 2.5e-4.
CUTLASS_DEVICE float sigmoid(float v) { return fmaf(0.5f, cutlass::fast_tanh(0.5f * v), 0.5f); }

CUTLASS_DEVICE float sigmoid_times(float v, float scale) { return v * sigmoid(scale * v); }

template <Activation kActivation>
CUTLASS_DEVICE float activate(float v) {
  if constexpr (kActivation == Activation::kRelu) {
    return fmaxf(v, 0.0f);
  } else if constexpr (kActivation == Activation::kGeluTanh) {
    return 0.5f * v * (1.0f + cutlass::fast_tanh(0.7978845608f * (v + 0.044715f * v * v * v)));
  } else if constexpr (kActivation == Activation::kGelu) {
    return 0.5f * v * (1.0f + erff(v * 0.7071067812f));
  } else if constexpr (kActivation == Activation::kSilu) {
    return sigmoid_times(v, 1.0f);
  } else {
    return v;
  }
}

// act'(v), as torch's autograd takes it (relu: 0 at v = 0).
template <Activation kActivation>
CUTLASS_DEVICE float activate_grad(float v) {
  if constexpr (kActivation == Activation::kRelu) {
    return v > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (kActivation == Activation::kGeluTanh) {
    constexpr float kBeta = 0.7978845608f, kKappa = 0.044715f;
    const float t = cutlass::fast_tanh(kBeta * (v + kKappa * v * v * v));
    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kBeta * (1.0f + 3.0f * kKappa * v * v);
  } else if constexpr (kActivation == Activation::kGelu) {
    return 0.5f * (1.0f + erff(v * 0.7071067812f)) + v * 0.3989422804f * __expf(-0.5f * v * v);
  } else if constexpr (kActivation == Activation::kSilu) {
    const float s = sigmoid(v);
    return s * (1.0f + v * (1.0f - s));
  } else {
    return 1.0f;
  }
}

// gpt-oss's gated activation of a (gate, up) pair (Activation::kSwigluOai).
CUTLASS_DEVICE float swiglu_oai(float gate, float up, float alpha, float limit) {
  const float g = fminf(gate, limit);
  const float u = fminf(fmaxf(up, -limit), limit);
  return (u + 1.0f) * sigmoid_times(g, alpha);
}

// Its gradients: d_gate, d_up of swiglu_oai(gate, up) times `grad` (torch's clamp passes the
// gradient where the value lies inside the closed range).
CUTLASS_DEVICE void swiglu_oai_grad(float gate, float up, float alpha, float limit, float grad, float& d_gate,
                                    float& d_up) {
  const float g = fminf(gate, limit);
  const float u = fminf(fmaxf(up, -limit), limit);
  const float s = sigmoid(alpha * g);
  d_gate = gate <= limit ? grad * (u + 1.0f) * s * (1.0f + alpha * g * (1.0f - s)) : 0.0f;
  d_up = up >= -limit && up <= limit ? grad * g * s : 0.0f;
}

}  // namespace cutlass_moe
