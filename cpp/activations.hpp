// The fused epilogue's activations (Activation in cutlass_moe.h) on one fp32 value, shared by the
// kernels' epilogues. Accuracy: the results are rounded to bf16/fp16 next, so the fast hardware
// forms (ex2.approx, rcp.approx, tanh.approx, relative error ~1e-6 .. 1e-3) are enough; the
// reference (python/cutlass_moe/reference.py) uses the exact formulas.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

CUTLASS_DEVICE float sigmoid_times(float v, float scale) {
  // v / (1 + exp(-scale v)); for very negative scale v the denominator is inf and the result 0.
  return __fdividef(v, 1.0f + __expf(-scale * v));
}

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
    const float s = __fdividef(1.0f, 1.0f + __expf(-v));
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
  const float s = __fdividef(1.0f, 1.0f + __expf(-alpha * g));
  d_gate = gate <= limit ? grad * (u + 1.0f) * s * (1.0f + alpha * g * (1.0f - s)) : 0.0f;
  d_up = up >= -limit && up <= limit ? grad * g * s : 0.0f;
}

}  // namespace cutlass_moe
