// Shared by the C++ examples: the command line, deterministic inputs, tokens_per_expert for each
// routing distribution, a plain float32 reference GEMM, the check against it and CUDA-event timing.
// Only the CUDA runtime and the public cutlass_moe API are used.
//
// Exit codes: 0 pass, 1 failure or error, 77 (kExitSkipped, ctest's SKIP_RETURN_CODE) when there is
// no CUDA device or the library has no kernel for it (cutlass_moe::Status::kNotSupported).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cutlass_moe/cutlass_moe.h"

// Throws std::runtime_error naming the call, the CUDA error, the file and the line.
#define EXAMPLE_CHECK_CUDA(expr)                                                                   \
  do {                                                                                             \
    cudaError_t example_err_ = (expr);                                                             \
    if (example_err_ != cudaSuccess) {                                                             \
      throw std::runtime_error(std::string(#expr) + " failed: " + cudaGetErrorString(example_err_) + \
                               " (" + __FILE__ + ":" + std::to_string(__LINE__) + ")");            \
    }                                                                                              \
  } while (0)

namespace example {

using cutlass_moe::Backend;
using cutlass_moe::DType;
using cutlass_moe::KernelConfig;
using cutlass_moe::MoeGemmProblem;
using cutlass_moe::WeightLayout;

constexpr int kExitSkipped = 77;
constexpr double kTolerance = 1e-2;  // bound on both errors of compare_with_reference (bf16/fp16)
constexpr int64_t kElementBytes = 2;  // bf16 and fp16

// ---- command line ----------------------------------------------------------------------------------

enum class Distribution { kUniform, kRandom, kHot, kDecode };
constexpr const char* kDistributionNames[] = {"uniform", "random", "hot", "decode"};

inline const char* distribution_name(Distribution d) { return kDistributionNames[static_cast<int>(d)]; }

struct Options {
  int64_t experts = 8;
  int64_t tokens = 4096;
  int64_t n = 1024;
  int64_t k = 1024;
  Distribution dist = Distribution::kRandom;
  DType dtype = DType::kBFloat16;
  Backend backend = Backend::kAuto;
  KernelConfig config = KernelConfig::kAuto;
  bool trans_b = false;  // weights (E, N, K) instead of (E, K, N)
  int iterations = 20;
  uint64_t seed = 1;
  bool takes_tokens = true;  // false: the example sets T itself and refuses --tokens
  bool help = false;
};

inline void print_usage(const char* program, const char* about, const Options& d) {
  std::printf("%s\n\nUsage: %s [options]\n\n", about, program);
  std::printf("  --experts=E       number of experts (default %lld)\n", static_cast<long long>(d.experts));
  if (d.takes_tokens) {
    std::printf("  --tokens=T        rows of x and out, sorted by expert (default %lld)\n",
                static_cast<long long>(d.tokens));
  }
  std::printf("  --n=N             output columns (default %lld)\n", static_cast<long long>(d.n));
  std::printf("  --k=K             reduction length (default %lld)\n", static_cast<long long>(d.k));
  std::printf("  --dist=D          tokens_per_expert (default %s):\n", distribution_name(d.dist));
  std::printf("                      uniform: T/E each; random: random counts, some experts get none;\n");
  std::printf("                      hot: one expert takes half of T;\n");
  std::printf("                      decode: each row picks a random expert\n");
  std::printf("  --dtype=bf16|fp16 element type of x, weights and out (default %s)\n",
              cutlass_moe::dtype_name(d.dtype));
  std::printf("  --backend=B       kernel family (default auto):");
  for (int b = 0; b < cutlass_moe::kNumBackends; ++b) {
    std::printf(" %s", cutlass_moe::backend_name(Backend(b)));
  }
  std::printf("\n  --config=C        kernel config (default auto):");
  for (int c = -1; c < cutlass_moe::kNumKernelConfigs; ++c) {
    std::printf("\n                      %s", cutlass_moe::config_name(KernelConfig(c)));
  }
  std::printf("\n  --trans-b         weights (E, N, K), K contiguous (nn.Linear); default (E, K, N)\n");
  std::printf("  --iterations=I    timed calls after one warm-up call (default %d)\n", d.iterations);
  std::printf("  --seed=S          seed of the inputs and the counts (default %llu)\n",
              static_cast<unsigned long long>(d.seed));
  std::printf("  --help            this text\n\n");
  std::printf("Exit status: 0 pass, 1 fail or error, %d skipped.\n", kExitSkipped);
}

inline int64_t parse_int(const std::string& name, const std::string& value, int64_t min_value) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || v < min_value) {
    throw std::invalid_argument("--" + name + ": expected an integer >= " + std::to_string(min_value) +
                                ", got '" + value + "'");
  }
  return v;
}

// Fills `opts` (holding the example's defaults) from argv. Returns false when the program should
// stop: after --help (opts.help set, exit 0) or on a bad option (message printed, exit 1).
inline bool parse_options(int argc, char** argv, const char* about, Options& opts) {
  const Options defaults = opts;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        print_usage(argv[0], about, defaults);
        opts.help = true;
        return false;
      }
      if (arg == "--trans-b") {
        opts.trans_b = true;
        continue;
      }
      const size_t eq = arg.find('=');
      if (arg.compare(0, 2, "--") != 0 || eq == std::string::npos) {
        throw std::invalid_argument("unknown option '" + arg + "'");
      }
      const std::string name = arg.substr(2, eq - 2);
      const std::string value = arg.substr(eq + 1);
      if (name == "experts") {
        opts.experts = parse_int(name, value, 1);
      } else if (name == "tokens" && opts.takes_tokens) {
        opts.tokens = parse_int(name, value, 1);
      } else if (name == "n") {
        opts.n = parse_int(name, value, 1);
      } else if (name == "k") {
        opts.k = parse_int(name, value, 1);
      } else if (name == "iterations") {
        opts.iterations = static_cast<int>(parse_int(name, value, 1));
      } else if (name == "seed") {
        opts.seed = static_cast<uint64_t>(parse_int(name, value, 0));
      } else if (name == "dist") {
        const auto* names = std::begin(kDistributionNames);
        const auto* it = std::find(names, std::end(kDistributionNames), value);
        if (it == std::end(kDistributionNames)) {
          throw std::invalid_argument("--dist: unknown '" + value + "'");
        }
        opts.dist = static_cast<Distribution>(it - names);
      } else if (name == "dtype") {
        if (value != "bf16" && value != "fp16") {
          throw std::invalid_argument("--dtype: expected bf16 or fp16, got '" + value + "'");
        }
        opts.dtype = value == "fp16" ? DType::kFloat16 : DType::kBFloat16;
      } else if (name == "backend") {
        int b = 0;
        while (b < cutlass_moe::kNumBackends && value != cutlass_moe::backend_name(Backend(b))) ++b;
        if (b == cutlass_moe::kNumBackends) {
          throw std::invalid_argument("--backend: unknown '" + value + "'");
        }
        opts.backend = Backend(b);
      } else if (name == "config") {
        int c = -1;
        while (c < cutlass_moe::kNumKernelConfigs && value != cutlass_moe::config_name(KernelConfig(c))) ++c;
        if (c == cutlass_moe::kNumKernelConfigs) {
          throw std::invalid_argument("--config: unknown '" + value + "'");
        }
        opts.config = KernelConfig(c);
      } else {
        throw std::invalid_argument("unknown option '" + arg + "'");
      }
    }
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "error: %s (see %s --help)\n", e.what(), argv[0]);
    return false;
  }
  return true;
}

// ---- routing ---------------------------------------------------------------------------------------

// tokens_per_expert for `dist`: E non-negative counts summing to T (so the library clamps nothing).
inline std::vector<int32_t> make_tokens_per_expert(int64_t experts, int64_t tokens, Distribution dist,
                                                   uint64_t seed) {
  std::vector<int32_t> counts(experts, 0);
  std::mt19937_64 rng(seed);
  auto spread_evenly = [&](int64_t rows, int64_t skip) {  // over every expert but `skip`
    const int64_t owners = skip < 0 ? experts : experts - 1;
    for (int64_t e = 0, i = 0; e < experts; ++e) {
      if (e == skip) continue;
      counts[e] += static_cast<int32_t>(rows / owners + (i++ < rows % owners ? 1 : 0));
    }
  };
  switch (dist) {
    case Distribution::kUniform:
      spread_evenly(tokens, -1);
      break;
    case Distribution::kRandom: {
      // Random weights; about a quarter of the experts (at least one where E > 1, never all) get none.
      std::uniform_real_distribution<double> unit(0.0, 1.0);
      std::vector<double> weight(experts);
      for (double& w : weight) w = unit(rng) < 0.25 ? 0.0 : unit(rng);
      const int64_t empty = static_cast<int64_t>(rng() % experts);
      if (experts > 1) weight[empty] = 0.0;
      if (std::all_of(weight.begin(), weight.end(), [](double w) { return w == 0.0; })) {
        weight[(empty + 1) % experts] = 1.0;
      }
      std::discrete_distribution<int64_t> pick(weight.begin(), weight.end());
      for (int64_t t = 0; t < tokens; ++t) ++counts[pick(rng)];
      break;
    }
    case Distribution::kHot: {
      const int64_t hot = static_cast<int64_t>(rng() % experts);
      const int64_t hot_rows = experts == 1 ? tokens : tokens / 2;
      counts[hot] = static_cast<int32_t>(hot_rows);
      if (experts > 1) spread_evenly(tokens - hot_rows, hot);
      break;
    }
    case Distribution::kDecode: {
      std::uniform_int_distribution<int64_t> pick(0, experts - 1);
      for (int64_t t = 0; t < tokens; ++t) ++counts[pick(rng)];
      break;
    }
  }
  return counts;
}

// offsets[e] = first row of expert e, offsets[E] = rows owned (T here).
inline std::vector<int64_t> expert_offsets(const std::vector<int32_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

// Experts with tokens: the ones whose weights a call must read.
inline int64_t busy_experts(const std::vector<int32_t>& counts) {
  return std::count_if(counts.begin(), counts.end(), [](int32_t c) { return c > 0; });
}

inline std::string describe_counts(const std::vector<int32_t>& counts) {
  const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end());
  return std::to_string(busy_experts(counts)) + " of " + std::to_string(counts.size()) +
         " experts with tokens, " + std::to_string(*lo) + ".." + std::to_string(*hi) + " rows each";
}

// "E=8 N=1024 K=1024 bf16, weights (E,K,N), backend auto, config auto"
inline std::string describe_options(const Options& o) {
  return "E=" + std::to_string(o.experts) + " N=" + std::to_string(o.n) + " K=" + std::to_string(o.k) + " " +
         cutlass_moe::dtype_name(o.dtype) + ", weights " + (o.trans_b ? "(E,N,K)" : "(E,K,N)") + ", backend " +
         cutlass_moe::backend_name(o.backend) + ", config " + cutlass_moe::config_name(o.config);
}

// ---- device memory and kernels ---------------------------------------------------------------------

// Owns one cudaMalloc allocation (256-byte aligned, as the library's workspace must be).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes = 0) : bytes_(bytes) {
    if (bytes > 0) EXAMPLE_CHECK_CUDA(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Calls f(T{}) with T the element type of `dtype`.
template <class F>
void dispatch_dtype(DType dtype, F&& f) {
  if (dtype == DType::kBFloat16) {
    f(__nv_bfloat16{});
  } else {
    f(__half{});
  }
}

// A value in [-1, 1) from a hash of (index, seed): the splitmix64 finalizer.
__host__ __device__ inline float hash_uniform(uint64_t index, uint64_t seed) {
  uint64_t z = index * 0x9E3779B97F4A7C15ull + (seed + 1) * 0xD1B54A32D192ED03ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // top 24 bits
}

template <class T>
__global__ void fill_uniform_kernel(T* data, int64_t count, uint64_t seed) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += stride) {
    data[i] = T(hash_uniform(static_cast<uint64_t>(i), seed));
  }
}

inline void fill_uniform(void* data, int64_t count, DType dtype, uint64_t seed, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 4096));
  if (blocks == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    fill_uniform_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<T*>(data), count, seed);
  });
  EXAMPLE_CHECK_CUDA(cudaGetLastError());
}

// ref[r, j] = sum_k x[r, k] * W_e[k, j] in float32 for every row r < offsets[E], where e owns r.
// One thread per output element; the problem's strides and layout are honoured as the library's.
template <class T>
__global__ void reference_moe_gemm_kernel(MoeGemmProblem p, const int64_t* offsets, float* ref) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= p.n) return;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weights);
  const bool kn = p.weight_layout == WeightLayout::kKN;
  for (int64_t r = blockIdx.y; r < offsets[p.num_experts]; r += gridDim.y) {
    // The owner of row r is the last expert starting at or before it (empty experts start there too).
    int64_t lo = 0, hi = p.num_experts - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
    }
    const T* w_e = w + lo * p.expert_stride;
    float acc = 0.0f;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      const T b = kn ? w_e[kk * p.ldw + j] : w_e[j * p.ldw + kk];
      acc += static_cast<float>(x[r * p.ldx + kk]) * static_cast<float>(b);
    }
    ref[r * p.n + j] = acc;
  }
}

inline void reference_moe_gemm(const MoeGemmProblem& p, const int64_t* offsets, float* ref,
                               cudaStream_t stream) {
  const dim3 block(256);
  const dim3 grid(static_cast<unsigned>((p.n + 255) / 256),
                  static_cast<unsigned>(std::min<int64_t>(p.num_tokens, 65535)));
  dispatch_dtype(p.dtype, [&](auto tag) {
    reference_moe_gemm_kernel<decltype(tag)><<<grid, block, 0, stream>>>(p, offsets, ref);
  });
  EXAMPLE_CHECK_CUDA(cudaGetLastError());
}

// Errors of out against the reference over the rows each expert owns, the worst expert kept, so
// that one wrong expert fails however few rows it has:
//   rel: ||out_e - ref_e|| / ||ref_e|| (Frobenius norms), the usual GEMM check;
//   max: max |out_e - ref_e| / max |ref_e|, which also catches a few wrong elements in a large
//        expert (rounding a correct result to bf16 alone gives up to 2^-8, about 3.9e-3).
// Both NaN if out has a NaN or inf (out starts as NaN, so also if a row was never written).
struct Errors {
  double rel = 0.0;
  double max = 0.0;
};

inline Errors compare_with_reference(const MoeGemmProblem& p, const std::vector<int64_t>& offsets,
                                     const float* ref_d) {
  const int64_t rows = offsets.back();
  std::vector<float> out(rows * p.n), ref(rows * p.n);
  EXAMPLE_CHECK_CUDA(cudaMemcpy(ref.data(), ref_d, ref.size() * sizeof(float), cudaMemcpyDeviceToHost));
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> raw(rows * p.ldout);
    EXAMPLE_CHECK_CUDA(cudaMemcpy(raw.data(), p.out, raw.size() * sizeof(T), cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < p.n; ++j) out[r * p.n + j] = static_cast<float>(raw[r * p.ldout + j]);
    }
  });
  Errors worst;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    double diff2 = 0.0, ref2 = 0.0, diff_max = 0.0, ref_max = 0.0;
    for (int64_t i = offsets[e] * p.n; i < offsets[e + 1] * p.n; ++i) {
      const double d = std::abs(static_cast<double>(out[i]) - ref[i]);
      if (!std::isfinite(d)) return {NAN, NAN};
      diff2 += d * d;
      ref2 += static_cast<double>(ref[i]) * ref[i];
      diff_max = std::max(diff_max, d);
      ref_max = std::max(ref_max, static_cast<double>(std::abs(ref[i])));
    }
    worst.rel = std::max(worst.rel, ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2));
    worst.max = std::max(worst.max, ref_max > 0.0 ? diff_max / ref_max : diff_max);
  }
  return worst;
}

// ---- one workload: inputs, counts, check, timing ---------------------------------------------------

struct Result {
  double ms = 0.0;  // per call, mean over the timed calls
  double tflops = 0.0;
  double gbps = 0.0;
  Errors errors;
  bool passed = false;  // both errors below kTolerance
};

// Device inputs for up to `max_tokens` rows, the counts of one routing at a time, and a run that
// checks one call against the reference and then times `iterations` calls.
class Workload {
 public:
  Workload(const Options& opts, int64_t max_tokens, cudaStream_t stream)
      : opts_(opts),
        stream_(stream),
        x_(max_tokens * opts.k * kElementBytes),
        weights_(opts.experts * opts.k * opts.n * kElementBytes),
        out_(max_tokens * opts.n * kElementBytes),
        ref_(max_tokens * opts.n * sizeof(float)),
        counts_(opts.experts * sizeof(int32_t)),
        offsets_((opts.experts + 1) * sizeof(int64_t)) {
    p_.dtype = opts.dtype;
    p_.weight_layout = opts.trans_b ? WeightLayout::kNK : WeightLayout::kKN;
    p_.count_type = cutlass_moe::IndexType::kInt32;
    p_.num_experts = opts.experts;
    p_.n = opts.n;
    p_.k = opts.k;
    p_.x = x_.get();
    p_.ldx = opts.k;
    p_.weights = weights_.get();
    p_.ldw = opts.trans_b ? opts.k : opts.n;
    p_.expert_stride = opts.k * opts.n;
    p_.out = out_.get();
    p_.ldout = opts.n;
    p_.tokens_per_expert = counts_.get();
  }

  // Writes x and the weights. Separate from the constructor so that a caller can ask the library
  // (workspace_size) first: a GPU it has no kernels for then skips before any kernel launches here.
  void fill_inputs() {
    auto elements = [](const DeviceBuffer& b) { return static_cast<int64_t>(b.bytes() / kElementBytes); };
    fill_uniform(x_.get(), elements(x_), opts_.dtype, opts_.seed, stream_);
    fill_uniform(weights_.get(), elements(weights_), opts_.dtype, opts_.seed + 1, stream_);
  }

  // Routes sum(counts) <= max_tokens rows: T = sum(counts), counts and offsets to the device.
  void route(const std::vector<int32_t>& counts) {
    offsets_host_ = expert_offsets(counts);
    p_.num_tokens = offsets_host_.back();
    busy_experts_ = busy_experts(counts);
    EXAMPLE_CHECK_CUDA(cudaMemcpyAsync(counts_.get(), counts.data(), counts.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream_));
    EXAMPLE_CHECK_CUDA(cudaMemcpyAsync(offsets_.get(), offsets_host_.data(), offsets_.bytes(),
                                       cudaMemcpyHostToDevice, stream_));
    EXAMPLE_CHECK_CUDA(cudaStreamSynchronize(stream_));  // the host vectors may go away
  }

  const MoeGemmProblem& problem() const { return p_; }

  size_t workspace_size(int device) const {
    return cutlass_moe::workspace_size(p_, opts_.backend, opts_.config, device);
  }

  Result run(const DeviceBuffer& workspace) {
    auto call = [&] {
      cutlass_moe::moe_gemm(p_, opts_.backend, opts_.config, workspace.get(), workspace.bytes(), stream_);
    };
    Result result;
    // Check: out starts as NaN (0xFFFF in bf16 and fp16), so a row the kernel misses fails.
    EXAMPLE_CHECK_CUDA(cudaMemsetAsync(out_.get(), 0xFF, p_.num_tokens * p_.ldout * kElementBytes, stream_));
    call();  // also the warm-up
    reference_moe_gemm(p_, offsets_.as<int64_t>(), ref_.as<float>(), stream_);
    EXAMPLE_CHECK_CUDA(cudaStreamSynchronize(stream_));
    result.errors = compare_with_reference(p_, offsets_host_, ref_.as<float>());
    result.passed = result.errors.rel < kTolerance && result.errors.max < kTolerance;  // false for NaN

    cudaEvent_t start, stop;
    EXAMPLE_CHECK_CUDA(cudaEventCreate(&start));
    EXAMPLE_CHECK_CUDA(cudaEventCreate(&stop));
    EXAMPLE_CHECK_CUDA(cudaEventRecord(start, stream_));
    for (int i = 0; i < opts_.iterations; ++i) call();
    EXAMPLE_CHECK_CUDA(cudaEventRecord(stop, stream_));
    EXAMPLE_CHECK_CUDA(cudaEventSynchronize(stop));
    float total_ms = 0.0f;
    EXAMPLE_CHECK_CUDA(cudaEventElapsedTime(&total_ms, start, stop));
    EXAMPLE_CHECK_CUDA(cudaEventDestroy(start));
    EXAMPLE_CHECK_CUDA(cudaEventDestroy(stop));

    const double t = static_cast<double>(p_.num_tokens);
    const double n = static_cast<double>(p_.n);
    const double k = static_cast<double>(p_.k);
    const double bytes = kElementBytes * (t * k + static_cast<double>(busy_experts_) * k * n + t * n);
    result.ms = total_ms / opts_.iterations;
    result.tflops = 2.0 * t * n * k / (result.ms * 1e-3) / 1e12;
    result.gbps = bytes / (result.ms * 1e-3) / 1e9;
    return result;
  }

 private:
  Options opts_;
  cudaStream_t stream_;
  DeviceBuffer x_, weights_, out_, ref_, counts_, offsets_;
  MoeGemmProblem p_;
  std::vector<int64_t> offsets_host_;
  int64_t busy_experts_ = 0;
};

// ---- main ------------------------------------------------------------------------------------------

// Prints the device and the library build; returns the device.
inline int print_device() {
  int device = 0;
  cudaDeviceProp prop{};
  EXAMPLE_CHECK_CUDA(cudaGetDevice(&device));
  EXAMPLE_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %d: %s (sm%d%d, %d SMs); %s\n", device, prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, cutlass_moe::build_info().c_str());
  return device;
}

// Runs body() (which returns the exit status) with the exit codes above: skipped without a CUDA
// device or on Status::kNotSupported, 1 on any other error.
template <class Body>
int run_example(Body&& body) {
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::printf("skipped: no CUDA device\n");
      return kExitSkipped;
    }
    return body();
  } catch (const cutlass_moe::Error& e) {
    if (e.status() == cutlass_moe::Status::kNotSupported) {
      std::printf("skipped: %s\n", e.what());
      return kExitSkipped;
    }
    std::fprintf(stderr, "error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}

}  // namespace example
