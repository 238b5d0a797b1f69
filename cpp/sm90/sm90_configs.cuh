// Maps each sm90 KernelConfig to its CUTLASS tile, cluster and schedule types.
// Adding a config: a line in KernelConfig (include/cutlass_moe/cutlass_moe.h), a specialization
// here, and its name in CUTLASS_MOE_SM90_CONFIGS (CMakeLists.txt).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe::sm90 {

using cute::_1;
using cute::_2;
using cute::_64;
using cute::_128;
using cute::_256;

// KernelSchedule / EpilogueSchedule: the ptr-array grouped family.
// MoeMainloopSchedule: the collective mainloop the MoE family's own kernel runs.
struct Pingpong {
  using KernelSchedule      = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule    = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using MoeMainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  static constexpr bool kPingpong = true;
  static constexpr bool kWide = false;
};

struct Cooperative {
  using KernelSchedule      = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule    = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using MoeMainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  static constexpr bool kPingpong = false;
  static constexpr bool kWide = false;
};

// The MoE family's wide tile (MoeGemmKernel::wide_tiles): both consumers on the same kTileM rows,
// each on its own half of the columns.
struct CooperativeWide : Cooperative {
  static constexpr bool kWide = true;
};

template <KernelConfig kConfig>
struct ConfigTraits;

#define CUTLASS_MOE_SM90_CONFIG(NAME, SCHEDULE, TM, TN, TK, CM, CN)      \
  template <>                                                            \
  struct ConfigTraits<KernelConfig::NAME> : SCHEDULE {                   \
    using TileShape    = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>; \
    using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, _1>;  \
  };

//                      name                                 schedule     tile M  N    K   cluster
CUTLASS_MOE_SM90_CONFIG(kSm90Pingpong_64x128x64_1x1x1,      Pingpong,    64,  128, 64,  1, 1)
CUTLASS_MOE_SM90_CONFIG(kSm90Cooperative_128x256x64_1x2x1,  Cooperative, 128, 256, 64,  1, 2)
CUTLASS_MOE_SM90_CONFIG(kSm90Cooperative_128x128x64_1x1x1,  Cooperative, 128, 128, 64,  1, 1)
CUTLASS_MOE_SM90_CONFIG(kSm90Pingpong_64x256x64_1x1x1,      Pingpong,    64,  256, 64,  1, 1)
CUTLASS_MOE_SM90_CONFIG(kSm90Cooperative_256x128x64_2x1x1,  Cooperative, 256, 128, 64,  2, 1)
CUTLASS_MOE_SM90_CONFIG(kSm90Pingpong_128x128x64_1x2x1,     Pingpong,    128, 128, 64,  1, 2)
CUTLASS_MOE_SM90_CONFIG(kSm90Cooperative_128x256x64_1x1x1,  Cooperative, 128, 256, 64,  1, 1)
// The wide tile: the MoE forward only, and (E, K, N) weights only: with K-contiguous weights its
// 512 rows of a weights box exceed TMA's 256 per box dimension (CMakeLists.txt skips that instance).
CUTLASS_MOE_SM90_CONFIG(kSm90CooperativeWide_64x512x32_1x1x1, CooperativeWide, 64, 512, 32, 1, 1)

#undef CUTLASS_MOE_SM90_CONFIG

}  // namespace cutlass_moe::sm90
