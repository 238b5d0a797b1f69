// cutlass_moe public C++ API.
//
// Mixture-of-Experts grouped GEMM: tokens are sorted by expert, and expert e multiplies its
// tokens_per_expert[e] rows of x (T x K) by its own weight matrix (K x N), writing the same rows of
// out (T x N). Everything here takes raw device pointers, sizes and a cudaStream_t: no torch, no
// CUTLASS types. The caller provides the workspace (query its size first), so every call can be
// captured in a CUDA graph.
//
// Count semantics (device side, never read by the host):
//   count'[e] = clamp(tokens_per_expert[e], 0, T)
//   start[e]  = min(count'[0] + ... + count'[e-1], T)
//   rows[e]   = min(count'[e], T - start[e])
// Expert e reads x rows [start[e], start[e] + rows[e]) and writes the same rows of out. Rows of out
// past start[E-1] + rows[E-1] are left unwritten. No count vector can make a kernel touch memory
// outside x, weights or out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace cutlass_moe {

enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
};

enum class IndexType : int {
  kInt32 = 0,
  kInt64 = 1,
};

// Memory layout of one expert's weight matrix, which is logically K x N.
enum class WeightLayout : int {
  kKN = 0,  // (E, K, N): N is contiguous (row-major K x N).
  kNK = 1,  // (E, N, K): K is contiguous, the nn.Linear layout (x @ W.T).
};

// Kernel families.
enum class Backend : int {
  kAuto = 0,         // the faster family for the device and problem (select_backend)
  kGrouped = 1,      // sm90: CUTLASS's ptr-array grouped GEMM; a small kernel first writes per-expert arrays
  kMoe = 2,          // sm90: our MoE kernel: base pointers + counts, one launch, no per-expert arrays
  kSm80Grouped = 3,  // sm80+: CUTLASS 2.x GemmGrouped (device-only scheduling) after the same array kernel
  kSm80Moe = 4,      // sm80+: CUTLASS 2.x mainloop under our problem visitor: base pointers + counts
};
constexpr int kNumBackends = 5;

// Kernel configurations. The numbers are CTA tile M x N x K and the cluster shape.
enum class KernelConfig : int {
  kAuto = -1,                             // pick by heuristic (select_config)
  kSm90Pingpong_64x128x64_1x1x1 = 0,
  kSm90Cooperative_128x256x64_1x2x1 = 1,  // default build: thousands of rows per expert
  // (kSm90Pingpong_64x256x64_1x1x1 below is the default build's small-M config)
  kSm90Cooperative_128x128x64_1x1x1 = 2,
  kSm90Pingpong_64x256x64_1x1x1 = 3,
  kSm90Cooperative_256x128x64_2x1x1 = 4,
  kSm90Pingpong_128x128x64_1x2x1 = 5,
  // sm80 families: CTA tile M x N x K, warp tile, pipeline stages.
  kSm80_64x128x32_32x64_s4 = 6,   // small M per expert (decode)
  kSm80_128x128x32_64x64_s4 = 7,  // large M per expert (prefill)
  kSm90Cooperative_128x256x64_1x1x1 = 8,
  kSm90Pingpong_64x256x64_2x1x1 = 9,  // MoE family: 2-CTA clusters share each weight tile
};
constexpr int kNumKernelConfigs = 10;  // configs 0 .. kNumKernelConfigs - 1

enum class Status : int {
  kSuccess = 0,
  kInvalidArgument = 1,  // a size, pointer or stride the kernels cannot take
  kNotSupported = 2,     // a config or architecture this build does not have
  kWorkspaceTooSmall = 3,
  kCudaError = 4,
  kCutlassError = 5,
};

// Every failure throws this, with the file, line and what was expected.
class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& what) : std::runtime_error(what), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

// One MoE GEMM call. Leading dimensions and strides are in elements.
struct MoeGemmProblem {
  DType dtype = DType::kBFloat16;
  WeightLayout weight_layout = WeightLayout::kKN;
  IndexType count_type = IndexType::kInt32;

  int64_t num_tokens = 0;   // T: rows of x and out
  int64_t num_experts = 0;  // E
  int64_t n = 0;
  int64_t k = 0;

  const void* x = nullptr;  // T x K, row-major, leading dimension ldx
  int64_t ldx = 0;

  const void* weights = nullptr;  // E matrices, layout above
  int64_t ldw = 0;                // stride between rows (kKN) or columns (kNK) of one expert
  int64_t expert_stride = 0;      // stride between experts

  void* out = nullptr;  // T x N, row-major, leading dimension ldout
  int64_t ldout = 0;

  const void* tokens_per_expert = nullptr;  // E counts on the device, count_type
};

// Checks the sizes, pointers and strides the kernels need (16-byte alignment for TMA and so on).
// Throws Error(kInvalidArgument) naming the field.
void check_problem(const MoeGemmProblem& problem);

// The family and configuration the heuristics pick from what the host knows: the device's
// architecture, T/E, N and K (never the counts). select_config answers for a given (resolved)
// family. A negative device means "an sm90 device".
Backend select_backend(const MoeGemmProblem& problem, int device);
KernelConfig select_config(const MoeGemmProblem& problem, Backend backend, int device);

// Workspace bytes for `problem` with `backend` and `config` (kAuto resolves through the
// heuristics) on `device`. The kMoe family needs none.
size_t workspace_size(const MoeGemmProblem& problem, Backend backend, KernelConfig config, int device);

// Runs out = x @ weights per expert on `stream`. workspace must hold workspace_size() bytes and be
// 256-byte aligned; its contents need not be initialized. Never synchronizes, never allocates.
void moe_gemm(const MoeGemmProblem& problem, Backend backend, KernelConfig config, void* workspace,
              size_t workspace_bytes, cudaStream_t stream);

// What this build holds.
const char* backend_name(Backend backend);
const char* config_name(KernelConfig config);
std::vector<std::string> built_instances();  // "sm90:<family>:<dtype>:<layout>:<config>" entries
std::string build_info();                    // CUDA, CUTLASS and arch versions, one line

}  // namespace cutlass_moe
