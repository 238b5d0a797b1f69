// Host-side entry points: argument checks, family and config resolution, and dispatch to the
// kernel instances this build holds. No CUTLASS here; the instance table comes from the generated
// <arch>_<family>_instances.inc files (one line per instance, see CMakeLists.txt).
#include <algorithm>
#include <array>
#include <iterator>
#include <sstream>

#include "check.h"
#include "cutlass_moe/cutlass_moe.h"
#include "expert_rows.hpp"
#include "kernel_families.h"
#include "launch_facts.h"
#include "split_gate.hpp"
#include "workspace.h"
#include "zero_rows.h"

namespace cutlass_moe {
namespace {

struct Instance {
  const char* arch;  // "sm90" or "sm80"
  Backend backend;
  DType dtype;
  WeightLayout layout;
  KernelConfig config;
  size_t (*workspace_size)(int64_t num_experts, int sm_count);
  void (*run)(const MoeGemmProblem&, void*, size_t, int, cudaStream_t);
};

#define CUTLASS_MOE_INSTANCE(ARCH, FAMILY, BACKEND, DTYPE, LAYOUT, CONFIG)                        \
  Instance{#ARCH, Backend::BACKEND, DType::DTYPE, WeightLayout::LAYOUT, KernelConfig::CONFIG,      \
           &ARCH::FAMILY<DType::DTYPE, WeightLayout::LAYOUT, KernelConfig::CONFIG>::workspace_size, \
           &ARCH::FAMILY<DType::DTYPE, WeightLayout::LAYOUT, KernelConfig::CONFIG>::run},
#define CUTLASS_MOE_SM90_GROUPED_INSTANCE(DTYPE, LAYOUT, CONFIG) \
  CUTLASS_MOE_INSTANCE(sm90, GroupedGemmInstance, kGrouped, DTYPE, LAYOUT, CONFIG)
#define CUTLASS_MOE_SM90_MOE_INSTANCE(DTYPE, LAYOUT, CONFIG) \
  CUTLASS_MOE_INSTANCE(sm90, MoeGemmInstance, kMoe, DTYPE, LAYOUT, CONFIG)
#define CUTLASS_MOE_SM80_GROUPED_INSTANCE(DTYPE, LAYOUT, CONFIG) \
  CUTLASS_MOE_INSTANCE(sm80, GroupedGemmInstance, kSm80Grouped, DTYPE, LAYOUT, CONFIG)
#define CUTLASS_MOE_SM80_MOE_INSTANCE(DTYPE, LAYOUT, CONFIG) \
  CUTLASS_MOE_INSTANCE(sm80, MoeGemmInstance, kSm80Moe, DTYPE, LAYOUT, CONFIG)

const std::vector<Instance>& instances() {
  static const std::vector<Instance> table = {
#include "sm90_grouped_instances.inc"
#include "sm90_moe_instances.inc"
#include "sm80_grouped_instances.inc"
#include "sm80_moe_instances.inc"
  };
  return table;
}

#undef CUTLASS_MOE_SM80_MOE_INSTANCE
#undef CUTLASS_MOE_SM80_GROUPED_INSTANCE
#undef CUTLASS_MOE_SM90_MOE_INSTANCE
#undef CUTLASS_MOE_SM90_GROUPED_INSTANCE
#undef CUTLASS_MOE_INSTANCE

// The weight-gradient families: one instance per (arch, input dtype, output dtype, config).
struct WgradInstance {
  const char* arch;  // "sm90" or "sm80"
  Backend backend;   // kMoe, kGrouped (sm90) or kSm80Grouped
  DType dtype;
  DType out_dtype;
  KernelConfig config;
  size_t (*workspace_size)(int64_t num_experts, int sm_count);
  void (*run)(const MoeWgradProblem&, void*, size_t, int, cudaStream_t);
};

#define CUTLASS_MOE_WGRAD_INSTANCE(ARCH, BACKEND, FAMILY, DTYPE, OUT_DTYPE, CONFIG)                        \
  WgradInstance{#ARCH, Backend::BACKEND, DType::DTYPE, DType::OUT_DTYPE, KernelConfig::CONFIG,           \
                &ARCH::FAMILY<DType::DTYPE, DType::OUT_DTYPE, KernelConfig::CONFIG>::workspace_size,      \
                &ARCH::FAMILY<DType::DTYPE, DType::OUT_DTYPE, KernelConfig::CONFIG>::run},
#define CUTLASS_MOE_SM90_WGRAD_MOE_INSTANCE(DTYPE, OUT_DTYPE, CONFIG) \
  CUTLASS_MOE_WGRAD_INSTANCE(sm90, kMoe, WgradMoeInstance, DTYPE, OUT_DTYPE, CONFIG)
#define CUTLASS_MOE_SM90_WGRAD_INSTANCE(DTYPE, OUT_DTYPE, CONFIG) \
  CUTLASS_MOE_WGRAD_INSTANCE(sm90, kGrouped, WgradGroupedInstance, DTYPE, OUT_DTYPE, CONFIG)
#define CUTLASS_MOE_SM80_WGRAD_INSTANCE(DTYPE, OUT_DTYPE, CONFIG) \
  CUTLASS_MOE_WGRAD_INSTANCE(sm80, kSm80Grouped, WgradGroupedInstance, DTYPE, OUT_DTYPE, CONFIG)

// In order of preference for backend kAuto.
const std::vector<WgradInstance>& wgrad_instances() {
  static const std::vector<WgradInstance> table = {
#include "sm90_wgrad_moe_instances.inc"
#include "sm90_wgrad_instances.inc"
#include "sm80_wgrad_instances.inc"
  };
  return table;
}

#undef CUTLASS_MOE_SM80_WGRAD_INSTANCE
#undef CUTLASS_MOE_SM90_WGRAD_INSTANCE
#undef CUTLASS_MOE_SM90_WGRAD_MOE_INSTANCE
#undef CUTLASS_MOE_WGRAD_INSTANCE

// Compute capabilities the sm80 families carry machine code for (CMake's CUTLASS_MOE_ARCHS).
constexpr int kSm80FamilyCcs[] = {0, CUTLASS_MOE_SM80_FAMILY_CCS};  // 0: never a device

bool is_sm80_backend(Backend backend) {
  return backend == Backend::kSm80Grouped || backend == Backend::kSm80Moe;
}

// Whether this build has machine code of `backend` for a device of compute capability `cc`.
bool runs_on(Backend backend, int cc) {
  if (!is_sm80_backend(backend)) return cc == 90;  // sm90a code runs on sm90 only
  return std::find(std::begin(kSm80FamilyCcs), std::end(kSm80FamilyCcs), cc) != std::end(kSm80FamilyCcs);
}

bool is_empty(const MoeGemmProblem& p) {
  return p.num_tokens == 0 || p.num_experts == 0 || p.n == 0;
}

bool is_built(Backend backend, const MoeGemmProblem& p) {
  return std::any_of(instances().begin(), instances().end(), [&](const Instance& inst) {
    return inst.backend == backend && inst.dtype == p.dtype && inst.layout == p.weight_layout;
  });
}

// Resolves kAuto (family, then config) and finds the instance; throws kNotSupported if this build
// lacks it or has no machine code for the device.
const Instance& find_instance(const MoeGemmProblem& p, Backend backend, KernelConfig config, int device) {
  const int cc = device_facts(device).cc;
  if (backend == Backend::kAuto) {
    backend = select_backend(p, device);
    // The heuristic's family may be missing from a custom build: take the first family, in order
    // of preference, that is built and runs here.
    if (!is_built(backend, p) || !runs_on(backend, cc)) {
      for (Backend b : {Backend::kMoe, Backend::kGrouped, Backend::kSm80Moe, Backend::kSm80Grouped}) {
        if (is_built(b, p) && runs_on(b, cc)) {
          backend = b;
          break;
        }
      }
    }
  }
  CUTLASS_MOE_CHECK(runs_on(backend, cc), Status::kNotSupported,
                    "this build has no " << backend_name(backend) << " kernels for device " << device << " (sm"
                                         << cc << "); build with CUTLASS_MOE_ARCHS including it");
  const bool automatic = config == KernelConfig::kAuto;
  if (automatic) config = select_config(p, backend, device);
  const Instance* fallback = nullptr;
  for (const Instance& inst : instances()) {
    if (inst.backend != backend || inst.dtype != p.dtype || inst.layout != p.weight_layout) continue;
    if (inst.config == config) return inst;
    if (!fallback) fallback = &inst;
  }
  // A custom build (CUTLASS_MOE_*CONFIGS) may lack the heuristic's pick: take what is built.
  if (automatic && fallback) return *fallback;
  CUTLASS_MOE_CHECK(false, Status::kNotSupported,
                    "no " << backend_name(backend) << " kernel built for " << dtype_name(p.dtype) << ", weights "
                          << layout_name(p.weight_layout) << ", config " << config_name(config));
}

// The wgrad instance of `backend` for the problem's dtypes on `device`. kAuto: the first built one
// that runs there, in the table's order (sm90 MoE, sm90 grouped, sm80 grouped), except that the sm90
// grouped family comes first where select_wgrad_backend takes it (heuristics.cpp).
const WgradInstance& find_wgrad_instance(const MoeWgradProblem& p, Backend backend, KernelConfig config,
                                         int device) {
  CUTLASS_MOE_CHECK_ARG(backend == Backend::kAuto || backend == Backend::kMoe || backend == Backend::kGrouped ||
                            backend == Backend::kSm80Grouped,
                        "backend: the wgrad families are 'auto', 'moe' and 'grouped' (sm90) and 'sm80_grouped', got '"
                            << backend_name(backend) << "'");
  const int cc = device_facts(device).cc;
  const bool grouped_first = backend == Backend::kAuto && select_wgrad_backend(p) == Backend::kGrouped;
  const WgradInstance* found = nullptr;
  for (const WgradInstance& inst : wgrad_instances()) {
    if (inst.dtype != p.dtype || inst.out_dtype != p.out_dtype) continue;
    if (!runs_on(inst.backend, cc)) continue;
    if (backend != Backend::kAuto && inst.backend != backend) continue;
    if (config != KernelConfig::kAuto && inst.config != config) continue;
    const bool preferred = !grouped_first || inst.backend == Backend::kGrouped;
    if (!found || preferred) found = &inst;
    if (preferred) break;
  }
  CUTLASS_MOE_CHECK(found != nullptr, Status::kNotSupported,
                    "this build has no " << backend_name(backend) << " wgrad kernel, config " << config_name(config)
                                         << ", for " << dtype_name(p.dtype) << " with a " << dtype_name(p.out_dtype)
                                         << " output on device " << device << " (sm" << cc << ")");
  return *found;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// A pointer as the error messages print it.
std::string address(const void* ptr) {
  std::ostringstream os;
  os << "0x" << std::hex << reinterpret_cast<uintptr_t>(ptr);
  return os.str();
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat32: return "fp32";
  }
  return "unknown";
}

const char* layout_name(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kKN: return "kn";
    case WeightLayout::kNK: return "nk";
  }
  return "unknown";
}

const char* index_type_name(IndexType type) {
  switch (type) {
    case IndexType::kInt32: return "int32";
    case IndexType::kInt64: return "int64";
  }
  return "unknown";
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kGrouped: return "grouped";
    case Backend::kMoe: return "moe";
    case Backend::kSm80Grouped: return "sm80_grouped";
    case Backend::kSm80Moe: return "sm80_moe";
  }
  return "unknown";
}

const char* config_name(KernelConfig config) {
  switch (config) {
    case KernelConfig::kAuto: return "auto";
    case KernelConfig::kSm90Pingpong_64x128x64_1x1x1: return "sm90_pingpong_64x128x64_1x1x1";
    case KernelConfig::kSm90Cooperative_128x256x64_1x2x1: return "sm90_cooperative_128x256x64_1x2x1";
    case KernelConfig::kSm90Cooperative_128x128x64_1x1x1: return "sm90_cooperative_128x128x64_1x1x1";
    case KernelConfig::kSm90Pingpong_64x256x64_1x1x1: return "sm90_pingpong_64x256x64_1x1x1";
    case KernelConfig::kSm90Cooperative_256x128x64_2x1x1: return "sm90_cooperative_256x128x64_2x1x1";
    case KernelConfig::kSm90Pingpong_128x128x64_1x2x1: return "sm90_pingpong_128x128x64_1x2x1";
    case KernelConfig::kSm80_64x128x32_32x64_s4: return "sm80_64x128x32_32x64_s4";
    case KernelConfig::kSm80_128x128x32_64x64_s4: return "sm80_128x128x32_64x64_s4";
    case KernelConfig::kSm90Cooperative_128x256x64_1x1x1: return "sm90_cooperative_128x256x64_1x1x1";
    case KernelConfig::kSm90CooperativeWide_64x512x32_1x1x1: return "sm90_cooperative_wide_64x512x32_1x1x1";
  }
  return "unknown";
}

namespace {

// Interleaved groups (MoeGemmProblem::group_rows): every K block and stored slice of 64 columns
// stays inside its own group's columns, and the views' columns fit in 32 bits.
void check_interleaved_groups(const MoeGemmProblem& p) {
  constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;
  const int64_t cols = out_columns(p);
  const int64_t groups = p.num_experts;
  CUTLASS_MOE_CHECK_ARG(p.num_tokens == p.group_rows * groups,
                        "x: T = " << p.num_tokens << " rows; interleaved groups need T = E * group_rows = " << groups
                                  << " * " << p.group_rows);
  CUTLASS_MOE_CHECK_ARG(p.k > 0 && p.k % 64 == 0,
                        "x: K = " << p.k << " must be a positive multiple of 64 for interleaved groups (whole K "
                                  "blocks: none reaches the next group's columns)");
  CUTLASS_MOE_CHECK_ARG(cols % 64 == 0, "out: " << cols << " columns must be a multiple of 64 for interleaved groups "
                                                           "(whole stored slices)");
  CUTLASS_MOE_CHECK_ARG(p.x_group_stride >= p.k && p.x_group_stride % 8 == 0,
                        "x: group stride of " << p.x_group_stride << " elements must be a multiple of 8 and >= K = "
                                              << p.k);
  CUTLASS_MOE_CHECK_ARG(p.out_group_stride >= cols && p.out_group_stride % 8 == 0,
                        "out: group stride of " << p.out_group_stride << " elements must be a multiple of 8 and >= "
                                                << cols << " (its columns)");
  const int64_t x_cols = (groups - 1) * p.x_group_stride + p.k;
  const int64_t out_cols = (groups - 1) * p.out_group_stride + cols;
  CUTLASS_MOE_CHECK_ARG(p.ldx >= x_cols && x_cols <= kMaxDim,
                        "x: row stride of " << p.ldx << " elements must cover every group, >= (E - 1) * group stride "
                                               "+ K = " << x_cols << " (< 2^31)");
  CUTLASS_MOE_CHECK_ARG(p.ldout >= out_cols && out_cols <= kMaxDim,
                        "out: row stride of " << p.ldout << " elements must cover every group, >= (E - 1) * group "
                                                 "stride + columns = " << out_cols << " (< 2^31)");
}

}  // namespace

void check_layout(const MoeGemmProblem& p) {
  constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;  // CUTLASS problem shapes are int
  CUTLASS_MOE_CHECK_ARG(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16,
                        "x: unknown dtype value " << static_cast<int>(p.dtype));
  CUTLASS_MOE_CHECK_ARG(p.weight_layout == WeightLayout::kKN || p.weight_layout == WeightLayout::kNK,
                        "weights: unknown layout value " << static_cast<int>(p.weight_layout));
  CUTLASS_MOE_CHECK_ARG(p.count_type == IndexType::kInt32 || p.count_type == IndexType::kInt64,
                        "tokens_per_expert: unknown index type value " << static_cast<int>(p.count_type));
  CUTLASS_MOE_CHECK_ARG(p.num_tokens >= 0 && p.num_tokens <= kMaxTokens,
                        "x: T = " << p.num_tokens << " rows; expected 0 <= T <= " << kMaxTokens
                                  << " (2^31 - 1024: 32-bit row and tile arithmetic)");
  CUTLASS_MOE_CHECK_ARG(p.num_experts >= 0 && p.num_experts <= kMaxDim,
                        "weights: E = " << p.num_experts << " experts; expected 0 <= E < 2^31");
  CUTLASS_MOE_CHECK_ARG(p.n >= 0 && p.n <= kMaxDim, "weights: N = " << p.n << "; expected 0 <= N < 2^31");
  CUTLASS_MOE_CHECK_ARG(p.k >= 0 && p.k <= kMaxDim, "x: K = " << p.k << "; expected 0 <= K < 2^31");
  CUTLASS_MOE_CHECK_ARG(p.group_rows >= 0, "x: group_rows = " << p.group_rows << "; expected >= 0 (0: sorted rows)");
  CUTLASS_MOE_CHECK_ARG(p.split_gate == SplitGate::kAlways,
                        "split_gate: run_moe_gemm sets it for a plan's two launches; expected kAlways, got "
                            << static_cast<int>(p.split_gate));
  if (is_empty(p)) return;
  if (has_interleaved_groups(p)) check_interleaved_groups(p);
  // TMA: 16-byte aligned base addresses and strides; CUTLASS also wants the contiguous extents in
  // whole 16-byte vectors.
  CUTLASS_MOE_CHECK_ARG(p.k % 8 == 0, "x: K = " << p.k << " must be a multiple of 8 (16 bytes, for TMA)");
  CUTLASS_MOE_CHECK_ARG(p.n % 8 == 0, "weights: N = " << p.n << " must be a multiple of 8 (16 bytes, for TMA)");
  CUTLASS_MOE_CHECK_ARG(!p.gated || p.n % 16 == 0,
                        "weights: N = " << p.n << " must be a multiple of 16 for a gated projection (N/2 output "
                                        "columns in 16-byte vectors)");
  CUTLASS_MOE_CHECK_ARG(p.ldout >= out_columns(p) && p.ldout % 8 == 0,
                        "out: row stride of " << p.ldout << " elements must be a multiple of 8 (16 bytes) and >= "
                                              << out_columns(p) << " (its columns)");
  if (p.k == 0) return;
  CUTLASS_MOE_CHECK_ARG(p.ldx >= p.k && p.ldx % 8 == 0,
                        "x: row stride of " << p.ldx << " elements must be a multiple of 8 (16 bytes) and >= K = "
                                            << p.k);
  const int64_t inner = p.weight_layout == WeightLayout::kKN ? p.n : p.k;
  CUTLASS_MOE_CHECK_ARG(p.ldw >= inner && p.ldw % 8 == 0,
                        "weights: leading stride of " << p.ldw
                                                      << " elements must be a multiple of 8 (16 bytes) and >= "
                                                      << inner);
  CUTLASS_MOE_CHECK_ARG(p.expert_stride >= 0 && p.expert_stride % 8 == 0,
                        "weights: expert stride of " << p.expert_stride
                                                     << " elements must be a non-negative multiple of 8 (16 bytes)");
}

void check_problem(const MoeGemmProblem& p) {
  check_layout(p);
  CUTLASS_MOE_CHECK_ARG(static_cast<int>(p.activation) >= 0 && static_cast<int>(p.activation) < kNumActivations,
                        "activation: unknown value " << static_cast<int>(p.activation));
  CUTLASS_MOE_CHECK_ARG(p.gated || p.activation != Activation::kSwigluOai,
                        "activation: swiglu_oai is a gated activation (moe_gemm_gated)");
  CUTLASS_MOE_CHECK_ARG(!p.gated || (p.limit > 0.0f && p.alpha == p.alpha),
                        "limit: expected a positive clamp limit, got " << p.limit);
  CUTLASS_MOE_CHECK_ARG(p.bias == nullptr || (p.bias_stride >= p.n && p.bias_stride % 2 == 0),
                        "bias: row stride of " << p.bias_stride << " elements must be even and >= N = " << p.n);
  CUTLASS_MOE_CHECK_ARG(reinterpret_cast<uintptr_t>(p.bias) % 4 == 0,
                        "bias: data pointer must be 4-byte aligned (pairs of columns are read together), got "
                            << address(p.bias));
  CUTLASS_MOE_CHECK_ARG(!has_interleaved_groups(p) || p.row_scale == nullptr,
                        "row_scale: not taken with interleaved groups (its rows are rows sorted by expert)");
  if (is_empty(p)) return;
  CUTLASS_MOE_CHECK_ARG(p.tokens_per_expert != nullptr || has_interleaved_groups(p),
                        "tokens_per_expert: null data pointer");
  CUTLASS_MOE_CHECK_ARG(p.out != nullptr && aligned16(p.out),
                        "out: data pointer must be 16-byte aligned, got " << address(p.out));
  if (p.k == 0) return;
  CUTLASS_MOE_CHECK_ARG(p.x != nullptr && aligned16(p.x), "x: data pointer must be 16-byte aligned, got " << address(p.x));
  CUTLASS_MOE_CHECK_ARG(p.weights != nullptr && aligned16(p.weights),
                        "weights: data pointer must be 16-byte aligned, got " << address(p.weights));
}

std::vector<std::pair<int64_t, int64_t>> expert_row_ranges(const std::vector<int64_t>& tokens_per_expert,
                                                           int64_t num_tokens) {
  CUTLASS_MOE_CHECK_ARG(num_tokens >= 0, "num_tokens: expected >= 0, got " << num_tokens);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  ranges.reserve(tokens_per_expert.size());
  int64_t rows_before = 0;  // the running end, capped at T like the kernels' windows
  for (int64_t count : tokens_per_expert) {
    const ExpertRows r = expert_rows(rows_before, clamp_count(count, num_tokens), num_tokens);
    ranges.emplace_back(r.start, r.rows);
    rows_before = r.start + r.rows;
  }
  return ranges;
}

bool split_of_whole_tiles(const std::vector<int64_t>& tokens_per_expert) {
  bool aligned = true, multi_tile = false;
  for (int64_t count : tokens_per_expert) {
    aligned = aligned && count_in_whole_tiles(count);
    multi_tile = multi_tile || count_spans_two_tiles(count);
  }
  return aligned && multi_tile;
}

MoeGemmPlan plan_moe_gemm(const MoeGemmProblem& p, Backend backend, KernelConfig config, int device) {
  check_layout(p);
  CUTLASS_MOE_CHECK_ARG(static_cast<int>(backend) >= 0 && static_cast<int>(backend) < kNumBackends,
                        "backend: unknown value " << static_cast<int>(backend));
  CUTLASS_MOE_CHECK_ARG(static_cast<int>(config) >= -1 && static_cast<int>(config) < kNumKernelConfigs,
                        "config: unknown value " << static_cast<int>(config));
  if (has_interleaved_groups(p)) {
    CUTLASS_MOE_CHECK_ARG(backend == Backend::kAuto || backend == Backend::kMoe,
                          "backend: interleaved groups run in the sm90 MoE family ('moe'), got '"
                              << backend_name(backend) << "'");
    backend = Backend::kMoe;
  }
  MoeGemmPlan plan;
  plan.backend = backend;
  plan.config = config;
  plan.device = device;
  plan.dtype = p.dtype;
  plan.weight_layout = p.weight_layout;
  plan.num_tokens = p.num_tokens;
  plan.num_experts = p.num_experts;
  plan.n = p.n;
  plan.k = p.k;
  if (is_empty(p) || p.k == 0) return plan;  // nothing to multiply: no kernel instance
  const Instance& inst = find_instance(p, backend, config, device);
  plan.backend = inst.backend;
  plan.config = inst.config;
  plan.sm_count = device_facts(device).sm_count;
  plan.workspace_bytes = inst.workspace_size(p.num_experts, plan.sm_count);
  plan.instance = &inst;
  // config = kAuto: a second config for splits of whole 128-row tiles, where the heuristic has one
  // and this build holds it.
  if (config == KernelConfig::kAuto && inst.backend == Backend::kMoe) {
    const KernelConfig aligned = select_aligned_config(p, inst.config, device);
    const auto it = aligned == KernelConfig::kAuto
                        ? instances().end()
                        : std::find_if(instances().begin(), instances().end(), [&](const Instance& other) {
                            return other.backend == inst.backend && other.dtype == p.dtype &&
                                   other.layout == p.weight_layout && other.config == aligned;
                          });
    if (it != instances().end()) {
      plan.aligned_instance = &*it;
      plan.aligned_config = aligned;
      plan.workspace_bytes = std::max(plan.workspace_bytes, it->workspace_size(p.num_experts, plan.sm_count));
    }
  }
  return plan;
}

void run_moe_gemm(const MoeGemmPlan& plan, const MoeGemmProblem& p, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  check_problem(p);
  CUTLASS_MOE_CHECK_ARG(plan.dtype == p.dtype && plan.weight_layout == p.weight_layout &&
                            plan.num_tokens == p.num_tokens && plan.num_experts == p.num_experts && plan.n == p.n &&
                            plan.k == p.k,
                        "plan: made for " << dtype_name(plan.dtype) << ", weights " << layout_name(plan.weight_layout)
                                          << ", (T, E, N, K) = (" << plan.num_tokens << ", " << plan.num_experts << ", "
                                          << plan.n << ", " << plan.k << "), not for this problem");
  if (is_empty(p)) {
    if (p.zero_unowned) launch_zero_unowned_rows(p, stream);  // E == 0: every row is unowned
    return;
  }
  CUTLASS_MOE_CHECK_ARG(!has_fused_epilogue(p) || ((plan.backend == Backend::kMoe || plan.backend == Backend::kSm80Moe) &&
                                                     p.k > 0),
                        "bias, activation, row_scale, gated: the fused epilogue runs in the MoE families ('moe', "
                        "'sm80_moe') with K > 0; "
                        "this call resolved to '"
                            << backend_name(plan.backend) << "' with K = " << p.k);
  CUTLASS_MOE_CHECK_ARG(!has_interleaved_groups(p) || plan.backend == Backend::kMoe,
                        "plan: interleaved groups run in the sm90 MoE family ('moe'); this plan resolved to '"
                            << backend_name(plan.backend) << "'");
  // The MoE families zero a new output's unowned rows in the GEMM's own launch; the others, and
  // K == 0 (no GEMM), in a second launch.
  const bool folds_zero_fill = plan.backend == Backend::kMoe || plan.backend == Backend::kSm80Moe;
  if (p.k == 0) {
    launch_zero_computed_rows(p, stream);
    if (p.zero_unowned) launch_zero_unowned_rows(p, stream);
    return;
  }
  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  CUTLASS_MOE_CHECK_ARG(device == plan.device,
                        "plan: made for device " << plan.device << ", but the current device is " << device);
  CUTLASS_MOE_CHECK(workspace_bytes >= plan.workspace_bytes, Status::kWorkspaceTooSmall,
                    "workspace: expected at least " << plan.workspace_bytes << " bytes, got " << workspace_bytes);
  CUTLASS_MOE_CHECK_ARG(
      plan.workspace_bytes == 0 || reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlignment == 0,
      "workspace: data pointer must be " << kWorkspaceAlignment << "-byte aligned, got " << address(workspace));
  if (plan.aligned_instance != nullptr && !has_interleaved_groups(p)) {
    // Both configs, each run only for its kind of split, read from the counts on the device.
    // (Interleaved groups read no counts: the plan's own instance alone.)
    MoeGemmProblem gated = p;
    gated.split_gate = SplitGate::kAlignedOnly;
    static_cast<const Instance*>(plan.aligned_instance)->run(gated, workspace, workspace_bytes, plan.sm_count, stream);
    gated.split_gate = SplitGate::kUnalignedOnly;
    static_cast<const Instance*>(plan.instance)->run(gated, workspace, workspace_bytes, plan.sm_count, stream);
  } else {
    static_cast<const Instance*>(plan.instance)->run(p, workspace, workspace_bytes, plan.sm_count, stream);
  }
  if (p.zero_unowned && !folds_zero_fill) launch_zero_unowned_rows(p, stream);
}

void check_wgrad_layout(const MoeWgradProblem& p) {
  constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;
  CUTLASS_MOE_CHECK_ARG(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16,
                        "x: unknown dtype value " << static_cast<int>(p.dtype));
  CUTLASS_MOE_CHECK_ARG(p.out_dtype == p.dtype || p.out_dtype == DType::kFloat32,
                        "out: dtype " << dtype_name(p.out_dtype) << "; expected x's (" << dtype_name(p.dtype)
                                      << ") or fp32");
  CUTLASS_MOE_CHECK_ARG(!p.accumulate || p.out_dtype == DType::kFloat32,
                        "out: accumulate=True adds into an fp32 buffer, got " << dtype_name(p.out_dtype));
  CUTLASS_MOE_CHECK_ARG(p.weight_layout == WeightLayout::kKN || p.weight_layout == WeightLayout::kNK,
                        "out: unknown layout value " << static_cast<int>(p.weight_layout));
  CUTLASS_MOE_CHECK_ARG(p.count_type == IndexType::kInt32 || p.count_type == IndexType::kInt64,
                        "tokens_per_expert: unknown index type value " << static_cast<int>(p.count_type));
  CUTLASS_MOE_CHECK_ARG(p.num_tokens >= 0 && p.num_tokens <= kMaxTokens,
                        "x: T = " << p.num_tokens << " rows; expected 0 <= T <= " << kMaxTokens
                                  << " (2^31 - 1024: 32-bit row and tile arithmetic)");
  CUTLASS_MOE_CHECK_ARG(p.num_experts >= 0 && p.num_experts <= kMaxDim,
                        "tokens_per_expert: E = " << p.num_experts << " experts; expected 0 <= E < 2^31");
  CUTLASS_MOE_CHECK_ARG(p.n >= 0 && p.n <= kMaxDim, "grad_out: N = " << p.n << "; expected 0 <= N < 2^31");
  CUTLASS_MOE_CHECK_ARG(p.k >= 0 && p.k <= kMaxDim, "x: K = " << p.k << "; expected 0 <= K < 2^31");
  if (p.num_experts == 0 || p.n == 0 || p.k == 0) return;
  CUTLASS_MOE_CHECK_ARG(p.k % 8 == 0, "x: K = " << p.k << " must be a multiple of 8 (16 bytes, for TMA)");
  CUTLASS_MOE_CHECK_ARG(p.n % 8 == 0, "grad_out: N = " << p.n << " must be a multiple of 8 (16 bytes, for TMA)");
  const int64_t inner = p.weight_layout == WeightLayout::kKN ? p.n : p.k;
  CUTLASS_MOE_CHECK_ARG(p.ldw >= inner && p.ldw % 8 == 0,
                        "out: leading stride of " << p.ldw << " elements must be a multiple of 8 and >= " << inner);
  CUTLASS_MOE_CHECK_ARG(p.expert_stride >= 0 && p.expert_stride % 8 == 0,
                        "out: expert stride of " << p.expert_stride
                                                 << " elements must be a non-negative multiple of 8");
  if (p.num_tokens == 0) return;
  CUTLASS_MOE_CHECK_ARG(p.ldx >= p.k && p.ldx % 8 == 0,
                        "x: row stride of " << p.ldx << " elements must be a multiple of 8 (16 bytes) and >= K = "
                                            << p.k);
  CUTLASS_MOE_CHECK_ARG(p.ld_grad_out >= p.n && p.ld_grad_out % 8 == 0,
                        "grad_out: row stride of " << p.ld_grad_out
                                                   << " elements must be a multiple of 8 (16 bytes) and >= N = " << p.n);
}

size_t wgrad_workspace_size(const MoeWgradProblem& p, Backend backend, KernelConfig config, int device) {
  check_wgrad_layout(p);
  if (p.num_experts == 0 || p.n == 0 || p.k == 0) return 0;
  return find_wgrad_instance(p, backend, config, device).workspace_size(p.num_experts,
                                                                        device_facts(device).sm_count);
}

void moe_gemm_wgrad(const MoeWgradProblem& p, Backend backend, KernelConfig config, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  check_wgrad_layout(p);
  if (p.num_experts == 0 || p.n == 0 || p.k == 0) return;
  CUTLASS_MOE_CHECK_ARG(p.tokens_per_expert != nullptr, "tokens_per_expert: null data pointer");
  CUTLASS_MOE_CHECK_ARG(p.out != nullptr && aligned16(p.out),
                        "out: data pointer must be 16-byte aligned, got " << address(p.out));
  if (p.num_tokens > 0) {
    CUTLASS_MOE_CHECK_ARG(p.x != nullptr && aligned16(p.x),
                          "x: data pointer must be 16-byte aligned, got " << address(p.x));
    CUTLASS_MOE_CHECK_ARG(p.grad_out != nullptr && aligned16(p.grad_out),
                          "grad_out: data pointer must be 16-byte aligned, got " << address(p.grad_out));
  }
  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  const WgradInstance& inst = find_wgrad_instance(p, backend, config, device);
  const int sm_count = device_facts(device).sm_count;
  const size_t needed = inst.workspace_size(p.num_experts, sm_count);
  CUTLASS_MOE_CHECK(workspace_bytes >= needed, Status::kWorkspaceTooSmall,
                    "workspace: expected at least " << needed << " bytes, got " << workspace_bytes);
  CUTLASS_MOE_CHECK_ARG(reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlignment == 0,
                        "workspace: data pointer must be " << kWorkspaceAlignment << "-byte aligned, got "
                                                           << address(workspace));
  inst.run(p, workspace, workspace_bytes, sm_count, stream);
}

size_t workspace_size(const MoeGemmProblem& p, Backend backend, KernelConfig config, int device) {
  return plan_moe_gemm(p, backend, config, device).workspace_bytes;
}

void moe_gemm(const MoeGemmProblem& p, Backend backend, KernelConfig config, void* workspace,
              size_t workspace_bytes, cudaStream_t stream) {
  int device = 0;
  if (!is_empty(p) && p.k > 0) CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  run_moe_gemm(plan_moe_gemm(p, backend, config, device), p, workspace, workspace_bytes, stream);
}

std::vector<std::string> built_instances() {
  std::vector<std::string> names;
  for (const Instance& inst : instances()) {
    std::ostringstream os;
    os << inst.arch << ":" << backend_name(inst.backend) << ":" << dtype_name(inst.dtype) << ":" << layout_name(inst.layout) << ":"
       << config_name(inst.config);
    names.push_back(os.str());
  }
  for (const WgradInstance& inst : wgrad_instances()) {
    names.push_back(std::string(inst.arch) + ":wgrad_" + backend_name(inst.backend) + ":" + dtype_name(inst.dtype) + ":" + dtype_name(inst.out_dtype) +
                    ":" + config_name(inst.config));
  }
  return names;
}

std::vector<std::string> target_archs() {
  std::vector<std::string> archs;
  std::istringstream list(CUTLASS_MOE_ARCHS);
  for (std::string arch; std::getline(list, arch, ',');) archs.push_back(arch);
  return archs;
}

std::vector<int> sm80_family_ccs() { return {std::begin(kSm80FamilyCcs) + 1, std::end(kSm80FamilyCcs)}; }

std::string build_info() {
  std::ostringstream os;
  os << "cutlass_moe " << CUTLASS_MOE_VERSION << "; CUDA " << CUDART_VERSION / 1000 << "."
     << (CUDART_VERSION % 1000) / 10 << "; CUTLASS " << CUTLASS_MOE_CUTLASS_VERSION << "; archs "
     << CUTLASS_MOE_ARCHS << "; sm80 families for ";
  for (size_t i = 1; i < std::size(kSm80FamilyCcs); ++i) os << (i > 1 ? "," : "") << "sm_" << kSm80FamilyCcs[i];
  return os.str();
}

}  // namespace cutlass_moe
