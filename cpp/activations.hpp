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

// gpt-oss's gated activation of a (gate, up) pair (Activation::kSwigluOai).
CUTLASS_DEVICE float swiglu_oai(float gate, float up, float alpha, float limit) {
  const float g = fminf(gate, limit);
  const float u = fminf(fmaxf(up, -limit), limit);
  return (u + 1.0f) * sigmoid_times(g, alpha);
}

}  // namespace cutlass_moe
