// Our enums as CUTLASS types, and CUTLASS's checked host sequence, for every kernel family.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/layout/matrix.h>
#include <cutlass/numeric_types.h>

#include "check.h"
#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

template <DType kDType> struct ElementOf;
template <> struct ElementOf<DType::kFloat16>  { using type = cutlass::half_t; };
template <> struct ElementOf<DType::kBFloat16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<DType::kFloat32>  { using type = float; };

// WeightLayout -> CUTLASS layout tag of B, which is logically K x N.
template <WeightLayout kLayout> struct LayoutBOf;
template <> struct LayoutBOf<WeightLayout::kKN> { using type = cutlass::layout::RowMajor; };     // N contiguous
template <> struct LayoutBOf<WeightLayout::kNK> { using type = cutlass::layout::ColumnMajor; };  // K contiguous

// CUTLASS's device-level host sequence, each step checked: can_implement -> initialize -> run.
// `workspace` is the caller's, after our own arrays.
template <class Gemm>
void run_device_gemm(typename Gemm::Arguments const& args, void* workspace, cudaStream_t stream) {
  Gemm gemm;
  cutlass::Status status = Gemm::can_implement(args);
  CUTLASS_MOE_CHECK(status == cutlass::Status::kSuccess, Status::kCutlassError,
                    "CUTLASS can_implement: " << cutlassGetStatusString(status));
  status = gemm.initialize(args, workspace, stream);
  CUTLASS_MOE_CHECK(status == cutlass::Status::kSuccess, Status::kCutlassError,
                    "CUTLASS initialize: " << cutlassGetStatusString(status));
  status = gemm.run(stream);
  CUTLASS_MOE_CHECK(status == cutlass::Status::kSuccess, Status::kCutlassError,
                    "CUTLASS run: " << cutlassGetStatusString(status));
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe
