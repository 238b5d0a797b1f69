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
// outside x, weights or out. expert_row_ranges() below applies the same rule on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cutlass_moe {

// The most rows x and out may have: every kernel's 32-bit row and tile arithmetic (T + 1,
// rows + tile - 1, TMA coordinates) stays below 2^31 with room to spare.
constexpr int64_t kMaxTokens = (int64_t{1} << 31) - 1024;

enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,  // only as the weight gradient's output type (MoeWgradProblem::out_dtype)
};
constexpr int kNumDTypes = 3;

enum class IndexType : int {
  kInt32 = 0,
  kInt64 = 1,
};
constexpr int kNumIndexTypes = 2;

// The activation of the fused epilogue (MoeGemmProblem::activation).
enum class Activation : int {
  kNone = 0,
  kRelu = 1,
  kGeluTanh = 2,  // 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3)))
  kGelu = 3,      // 0.5 v (1 + erf(v / sqrt(2)))
  kSilu = 4,      // v / (1 + exp(-v))
  // gpt-oss's gated form (MoeGemmProblem::gated only): g = min(gate, limit), u = clamp(up, -limit,
  // limit), out = (u + 1) * g / (1 + exp(-alpha g)).
  kSwigluOai = 5,
};
constexpr int kNumActivations = 6;

// Memory layout of one expert's weight matrix, which is logically K x N.
enum class WeightLayout : int {
  kKN = 0,  // (E, K, N): N is contiguous (row-major K x N).
  kNK = 1,  // (E, N, K): K is contiguous, the nn.Linear layout (x @ W.T).
};
constexpr int kNumWeightLayouts = 2;

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
  // MoE family, (E, K, N) weights: both consumers on the same 64 rows, each on 256 of 512 columns.
  kSm90CooperativeWide_64x512x32_1x1x1 = 9,
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

// Where a plan holds a second config for splits of whole kAlignedSplitRows tiles
// (MoeGemmPlan::aligned_instance), run_moe_gemm launches both, and each launch reads the counts on
// the device and returns at once unless the split is its kind. Callers leave it at kAlways.
// A split of whole tiles: every count a multiple of kAlignedSplitRows, and some expert holding two
// tiles or more. An even split of exactly one tile per expert is not one: there the 64-row tiles
// that such plans pick stay 1-3% faster (select_aligned_config).
enum class SplitGate : int {
  kAlways = 0,
  kAlignedOnly = 1,    // a split of whole tiles
  kUnalignedOnly = 2,  // any other
};
constexpr int64_t kAlignedSplitRows = 128;  // the cooperative tile's rows

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

  void* out = nullptr;  // T x out_columns (N, or N/2 when gated), row-major, leading dimension ldout
  int64_t ldout = 0;

  const void* tokens_per_expert = nullptr;  // E counts on the device, count_type

  // Fused epilogue, out[row] = row_scale[row] * activation(x[row] . W_e + bias[e]), each part off by
  // default. The MoE families (kMoe, kSm80Moe) run it (run_moe_gemm rejects it elsewhere).
  const void* bias = nullptr;         // E x N of dtype, row stride bias_stride; null: no bias
  int64_t bias_stride = 0;
  const float* row_scale = nullptr;   // T fp32 factors; null: none
  Activation activation = Activation::kNone;

  // Gated (a fused gate/up projection): the weights hold gate and up interleaved column by column,
  // gate_j at column 2j and up_j at 2j + 1 (the bias likewise), and out is T x N/2:
  //   out[row][j] = row_scale[row] * act(gate_j + bias[e][2j]) * (up_j + bias[e][2j + 1]),
  // with kSwigluOai's clamp, alpha and +1 (alpha, limit). N must be a multiple of 16.
  bool gated = false;
  float alpha = 1.702f;
  float limit = 7.0f;

  // Interleaved groups: grouped_linear's (B, G, K) input read in place, with no token sort. When
  // group_rows > 0, every expert owns group_rows rows and tokens_per_expert is not read: expert
  // e's row b is x[b * ldx + e * x_group_stride] and out[b * ldout + e * out_group_stride], and
  // T must be E * group_rows. Only the sm90 MoE family ('moe') runs it, with K and out's columns
  // multiples of 64 (a K block or a stored slice never reaches the next group's columns) and no
  // row_scale.
  int64_t group_rows = 0;
  int64_t x_group_stride = 0;
  int64_t out_group_stride = 0;

  // A new output: also write zeros to the rows no expert owns, [min(sum of clamped counts, T), T),
  // so that out is fully defined at the cost of its tail alone. The MoE families do it inside the
  // GEMM's launch; the grouped families (and K == 0) launch zero_unowned_rows after the GEMM.
  bool zero_unowned = false;

  // Set by run_moe_gemm for a plan's two launches (SplitGate); callers leave it at kAlways.
  SplitGate split_gate = SplitGate::kAlways;
};

// Whether `problem` asks for any part of the fused epilogue.
inline bool has_fused_epilogue(const MoeGemmProblem& p) {
  return p.bias != nullptr || p.row_scale != nullptr || p.activation != Activation::kNone || p.gated;
}

// The columns of out: N, or N/2 when gated.
inline int64_t out_columns(const MoeGemmProblem& p) { return p.gated ? p.n / 2 : p.n; }

// Whether `problem` reads its experts' rows as interleaved groups (MoeGemmProblem::group_rows).
inline bool has_interleaved_groups(const MoeGemmProblem& p) { return p.group_rows > 0; }

// Checks the enums, sizes and strides the kernels need (16-byte multiples for TMA and so on), not
// the pointers: what a shape-only caller (a workspace query, a torch fake tensor) can be checked
// for. Throws Error(kInvalidArgument) whose message starts with the argument's name in the Python
// API ("x: ...", "weights: ...", "out: ...", "tokens_per_expert: ...").
void check_layout(const MoeGemmProblem& problem);

// check_layout, then the pointers (non-null, 16-byte aligned).
void check_problem(const MoeGemmProblem& problem);

// The rows [start, start + rows) each expert owns, by the count rule above, computed on the host
// with the function the kernels use on the device.
std::vector<std::pair<int64_t, int64_t>> expert_row_ranges(const std::vector<int64_t>& tokens_per_expert,
                                                           int64_t num_tokens);

// Whether these counts are a split of whole kAlignedSplitRows tiles (SplitGate), computed on the host
// with the per-count tests the kernel uses on the device: where a plan holds an aligned instance,
// whether the device runs it.
bool split_of_whole_tiles(const std::vector<int64_t>& tokens_per_expert);

// The family and configuration the heuristics pick from what the host knows: the device's
// architecture, T/E, N and K (never the counts). select_config answers for a given (resolved)
// family. A negative device means "an sm90 device" (with an H200's DRAM, where the pick depends on
// the memory's speed).
Backend select_backend(const MoeGemmProblem& problem, int device);
// The family select_backend picks for a call with a fused epilogue (has_fused_epilogue): one of the
// MoE families, the only ones that run it.
Backend select_fused_backend(const MoeGemmProblem& problem, int device);
KernelConfig select_config(const MoeGemmProblem& problem, Backend backend, int device);
// The config to run instead of select_config's `picked` where the counts turn out to be a split of
// whole kAlignedSplitRows tiles (SplitGate: an even split of 256, 384, ... rows, or a layout that pads
// each expert to such tiles), read on the device; kAuto where the pick stays for every split.
KernelConfig select_aligned_config(const MoeGemmProblem& problem, KernelConfig picked, int device);

// A problem shape resolved once: the family, the config and the kernel instance (kAuto resolved
// through the heuristics), and the workspace it needs. Make one per shape with plan_moe_gemm (which
// reads no pointer) and run it with run_moe_gemm on any tensors of that shape: repeated calls then
// skip the resolution.
struct MoeGemmPlan {
  Backend backend = Backend::kAuto;           // resolved family
  KernelConfig config = KernelConfig::kAuto;  // resolved config
  size_t workspace_bytes = 0;                 // 256-byte aligned workspace run_moe_gemm needs
  int device = -1;
  int sm_count = 0;

  // The shape it was made for (run_moe_gemm checks the problem against it).
  DType dtype = DType::kBFloat16;
  WeightLayout weight_layout = WeightLayout::kKN;
  int64_t num_tokens = 0, num_experts = 0, n = 0, k = 0;
  const void* instance = nullptr;  // the dispatcher's kernel instance; null when nothing is multiplied
  // config = kAuto's second instance, or null: it runs instead of `instance` on splits of whole
  // kAlignedSplitRows tiles (SplitGate, select_aligned_config). run_moe_gemm then launches both, and each
  // launch reads the counts on the device (SplitGate): no host synchronization, and a CUDA graph
  // replays either with new counts.
  const void* aligned_instance = nullptr;
  KernelConfig aligned_config = KernelConfig::kAuto;
};

// Resolves `backend` and `config` for the shape, dtype and layout of `problem` on `device`
// (check_layout: pointers are not read). Throws kNotSupported if this build has no such kernel for
// the device.
MoeGemmPlan plan_moe_gemm(const MoeGemmProblem& problem, Backend backend, KernelConfig config, int device);

// Runs out = x @ weights per expert on `stream`, on the current device, which must be the plan's.
// workspace must hold plan.workspace_bytes and be 256-byte aligned; its contents need not be
// initialized. Never synchronizes, never allocates.
void run_moe_gemm(const MoeGemmPlan& plan, const MoeGemmProblem& problem, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream);

// The weight gradient of moe_gemm: dW[e] = x_e^T . grad_out_e (K x N), a GEMM per expert whose
// reduction runs over the expert's rows (by the count rule above). An expert with no rows gets
// zeros, or is left untouched when accumulating. Deterministic: no atomics, no split reduction.
struct MoeWgradProblem {
  DType dtype = DType::kBFloat16;      // x and grad_out: fp16 or bf16
  DType out_dtype = DType::kBFloat16;  // dW: dtype, or kFloat32
  WeightLayout weight_layout = WeightLayout::kKN;  // dW's layout, as the weights': (E, K, N) or (E, N, K)
  IndexType count_type = IndexType::kInt32;
  bool accumulate = false;  // dW += ..., into a kFloat32 out (Megatron's main_grad)

  int64_t num_tokens = 0;   // T: rows of x and grad_out
  int64_t num_experts = 0;  // E
  int64_t n = 0;
  int64_t k = 0;

  const void* x = nullptr;  // T x K, row-major, leading dimension ldx
  int64_t ldx = 0;
  const void* grad_out = nullptr;  // T x N, row-major, leading dimension ld_grad_out
  int64_t ld_grad_out = 0;
  void* out = nullptr;  // E matrices in weight_layout, out_dtype
  int64_t ldw = 0;            // stride between rows (kKN) or columns (kNK) of one expert's K x N
  int64_t expert_stride = 0;  // stride between experts

  const void* tokens_per_expert = nullptr;  // E counts on the device, count_type
};

// Sizes, strides, dtypes, layout; no pointers. Messages start with the Python argument's name.
void check_wgrad_layout(const MoeWgradProblem& problem);

// The wgrad families: backend kMoe (sm90, our MoE kernel: one launch, counts read by the tile
// scheduler), kGrouped (sm90, CUTLASS's ptr-array grouped GEMM) or kSm80Grouped (CUTLASS 2.x
// GemmGrouped); kAuto takes the first of them built with machine code for the device, except that
// an accumulating call prefers kGrouped (faster at adding into fp32). config kAuto takes the
// family's first built config (CUTLASS_MOE_*_WGRAD*_CONFIGS).

// The gated activation on its own (moe_gemm_gated's composite path, where a gradient is recorded):
// y is rows x 2 cols of (gate, up) pairs interleaved column by column (MoeGemmProblem::gated's
// layout), out is rows x cols, out[r][j] = act(y[r][2j]) * y[r][2j + 1] (kSwigluOai: alpha and
// limit), in fp32, rounded once. The backward writes grad_y (rows x 2 cols, interleaved) from
// grad_out (rows x cols). fp16/bf16; cols and the row strides (elements) multiples of 4, pointers
// 8-byte aligned. On the current device, never synchronizes.
void gated_activation(DType dtype, Activation activation, float alpha, float limit, int64_t rows, int64_t cols,
                      const void* y, int64_t ldy, void* out, int64_t ldout, cudaStream_t stream);
void gated_activation_backward(DType dtype, Activation activation, float alpha, float limit, int64_t rows,
                               int64_t cols, const void* y, int64_t ldy, const void* grad_out, int64_t ld_grad_out,
                               void* grad_y, int64_t ld_grad_y, cudaStream_t stream);

// The sm90 wgrad family backend=kAuto takes, from what the host knows of the problem (never the
// counts): kMoe, or kGrouped when accumulating (heuristics.cpp says why). moe_gemm_wgrad falls back
// to the next built family that runs on the device where that one is not built or does not run there.
Backend select_wgrad_backend(const MoeWgradProblem& problem);

// Workspace bytes moe_gemm_wgrad needs for `problem` on `device` (check_wgrad_layout only).
size_t wgrad_workspace_size(const MoeWgradProblem& problem, Backend backend, KernelConfig config, int device);

// Runs the weight gradient on `stream`, on the current device. workspace: wgrad_workspace_size()
// bytes, 256-byte aligned. Never synchronizes, never allocates.
void moe_gemm_wgrad(const MoeWgradProblem& problem, Backend backend, KernelConfig config, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

// Writes zeros to the rows of out that no expert owns, [start[E-1] + rows[E-1], T) (reads the
// counts on the device): makes a new output fully defined at the cost of its tail alone.
void zero_unowned_rows(const MoeGemmProblem& problem, cudaStream_t stream);

// plan_moe_gemm(...).workspace_bytes.
size_t workspace_size(const MoeGemmProblem& problem, Backend backend, KernelConfig config, int device);

// plan_moe_gemm on the current device, then run_moe_gemm.
void moe_gemm(const MoeGemmProblem& problem, Backend backend, KernelConfig config, void* workspace,
              size_t workspace_bytes, cudaStream_t stream);

// Names of the enum values, as the Python API spells them.
const char* backend_name(Backend backend);
const char* config_name(KernelConfig config);
const char* dtype_name(DType dtype);              // "fp16", "bf16"
const char* layout_name(WeightLayout layout);     // "kn", "nk"
const char* index_type_name(IndexType type);      // "int32", "int64"

// What this build holds.
std::vector<std::string> built_instances();  // "sm90:<family>:<dtype>:<layout>:<config>" entries;
                                             // wgrad: "sm90:wgrad_<family>:<dtype>:<out dtype>:<config>"
std::vector<std::string> target_archs();     // CUTLASS_MOE_ARCHS as built: "80", "86", "89", "90a"
std::vector<int> sm80_family_ccs();          // compute capabilities the sm80 families have code for
std::string build_info();                    // CUDA, CUTLASS and arch versions, one line

}  // namespace cutlass_moe
