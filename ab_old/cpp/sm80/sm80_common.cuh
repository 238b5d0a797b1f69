// Pieces both sm80 families share: tile configs, the epilogue op, CUTLASS's grouped kernel.
// The sm80 families are CUTLASS 2.x kernels (cp.async multistage mainloop, mma.sync). They run on
// sm80, sm86, sm89 and, built for it, sm90 (where they serve as a fallback and for testing).
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/gemm.h>
#include <cutlass/layout/matrix.h>
#include <cutlass/numeric_types.h>

#include <cutlass/gemm/kernel/default_gemm_grouped.h>

#include "cutlass_moe/cutlass_moe.h"
#include "cutlass_types.cuh"

namespace cutlass_moe::sm80 {

template <KernelConfig kConfig> struct ConfigTraits;

#define CUTLASS_MOE_SM80_CONFIG(NAME, TM, TN, TK, WM, WN, WK, STAGES)          \
  template <> struct ConfigTraits<KernelConfig::NAME> {                        \
    using ThreadblockShape = cutlass::gemm::GemmShape<TM, TN, TK>;             \
    using WarpShape        = cutlass::gemm::GemmShape<WM, WN, WK>;             \
    static constexpr int kStages = STAGES;                                     \
  };

//                      name                        CTA tile M  N    K   warp tile   stages
CUTLASS_MOE_SM80_CONFIG(kSm80_64x128x32_32x64_s4,   64,  128, 32,   32, 64, 32,  4)
CUTLASS_MOE_SM80_CONFIG(kSm80_128x128x32_64x64_s4,  128, 128, 32,   64, 64, 32,  4)

#undef CUTLASS_MOE_SM80_CONFIG

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct KernelTypes {
  using Element            = typename ElementOf<kDType>::type;
  using ElementAccumulator = float;                                              // fp32 accumulation
  using LayoutA            = cutlass::layout::RowMajor;                          // x: T x K
  using LayoutB            = typename LayoutBOf<kLayout>::type;                  // weights[e]: K x N
  using LayoutC            = cutlass::layout::RowMajor;                          // out: T x N
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte cp.async
  using ThreadblockShape   = typename ConfigTraits<kConfig>::ThreadblockShape;
  using WarpShape          = typename ConfigTraits<kConfig>::WarpShape;
  using InstructionShape   = cutlass::gemm::GemmShape<16, 8, 16>;                // mma.sync bf16/fp16
  static constexpr int kStages = ConfigTraits<kConfig>::kStages;
  // out = accumulators, converted: alpha scaling only, so C is never read.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<
      Element, kAlignment, ElementAccumulator, ElementAccumulator,
      cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;
  // CUTLASS 2.x GemmGrouped for this config: the grouped family runs it; the MoE family takes its
  // kernel-level Mma and Epilogue.
  using GroupedKernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      Element, LayoutA, cutlass::ComplexTransform::kNone, kAlignment,
      Element, LayoutB, cutlass::ComplexTransform::kNone, kAlignment,
      Element, LayoutC,
      ElementAccumulator,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      ThreadblockShape, WarpShape, InstructionShape,
      EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>,
      kStages,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly
    >::GemmKernel;
};

}  // namespace cutlass_moe::sm80
