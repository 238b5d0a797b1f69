// TMA descriptors of the sm90 MoE kernel, and the cache that spares most calls from encoding any.
//
// x (A) and, in the cooperative configs, out (D) are read and written through "ragged" views: for
// a tile of kRows rows, element (i, c, j) of the view is x[j + i - kRows, c], with i < kRows and
// j <= T (rows stride both i and j). A tile holding r rows of its expert from row s uses the box at
// (kRows - r, c, s + r): x[s, s + r) is the box's first r rows, and the rest of the box has
// i >= kRows, outside the view, so a load zero-fills it without reading and a store skips it.
// No row of another expert is touched, no count vector reaches outside x or out, and one
// descriptor serves every expert. The view's base address, kRows rows before x, is never
// dereferenced. Weights (B) are one descriptor with the expert as the batch mode.
//
// Encoding a descriptor costs microseconds, and weights rarely change between calls while x and
// out often live in fixed buffers (CUDA graphs, serving), so descriptors are kept per (pointer,
// sizes, strides). A failed encode throws (sm90_tma_encode.hpp) before anything is cached.
#pragma once

#include "sm90/sm90_tma_encode.hpp"  // first: routes every TMA encode through a checked call

#include <array>
#include <cstdint>
#include <mutex>

#include <cute/tensor.hpp>

#include "sm90/sm90_common.cuh"

namespace cutlass_moe::sm90 {

// Sizes of one MoE GEMM as the kernel sees them.
struct MoeProblemShape {
  int num_tokens;   // T
  int n;
  int k;
  int num_experts;  // E
};

// Where the experts' rows lie in x and out. Sorted by expert (group_rows 0): one ragged view over
// the T rows. Interleaved groups (MoeGemmProblem::group_rows): expert e's rows are row 0 onwards
// of one view of group_rows rows whose columns hold every group, e's starting at e * stride.
struct MoeGroupLayout {
  int group_rows = 0;
  int64_t x_group_stride = 0;
  int64_t out_group_stride = 0;

  CUTLASS_HOST_DEVICE bool interleaved() const { return group_rows > 0; }
  // The views' rows (their end rows run to rows + 1) and columns, given one group's columns.
  CUTLASS_HOST_DEVICE int view_rows(int num_tokens) const { return interleaved() ? group_rows : num_tokens; }
  CUTLASS_HOST_DEVICE int x_view_cols(int k, int num_experts) const {
    return static_cast<int>(k + (num_experts - 1) * x_group_stride);
  }
  CUTLASS_HOST_DEVICE int out_view_cols(int cols, int num_experts) const {
    return static_cast<int>(cols + (num_experts - 1) * out_group_stride);
  }
};

// The last kEntries distinct keys and their values. make() runs under the lock; if it throws,
// nothing is stored.
template <class Value, int kEntries = 8>
class DescriptorCache {
 public:
  using Key = std::array<int64_t, 6>;

  template <class Make>
  Value get(Key const& key, Make&& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < used_; ++i) {
      if (keys_[i] == key) return values_[i];
    }
    Value value = make();
    const int slot = next_;
    next_ = (next_ + 1) % kEntries;
    used_ = used_ < kEntries ? used_ + 1 : kEntries;
    keys_[slot] = key;
    values_[slot] = value;
    return value;
  }

 private:
  std::mutex mutex_;
  std::array<Key, kEntries> keys_{};
  std::array<Value, kEntries> values_{};
  int used_ = 0;
  int next_ = 0;
};

// The collective mainloop's Params for x through the ragged view of kTileM rows and the weights
// with the expert as batch, built by the collective's own to_underlying_arguments. It takes one
// batch extent L for both operands, while the views need T + 1 (x) and E (weights), so x's
// descriptor comes from one call and the weights' from another; each is cached on its own key.
// x's view has x_rows + 1 end rows and x_cols columns (T and K, unless groups are interleaved).
template <class Mainloop, int kTileM>
typename Mainloop::Params make_mainloop_params(MoeProblemShape const& problem, void const* x, int64_t ldx,
                                               int x_rows, int x_cols, void const* weights, int64_t ldw,
                                               int64_t expert_stride, int device) {
  using namespace cute;
  using Params = typename Mainloop::Params;
  using ElementA = typename Mainloop::InternalElementA;
  static DescriptorCache<decltype(Params::tma_load_a)> x_cache;
  static DescriptorCache<Params> weight_cache;

  const int n = problem.n, k = problem.k, e = problem.num_experts;
  // A batch stride of 0 is no valid tensor map stride; any 16-byte multiple serves a batch of 1.
  const int64_t batch_stride = e > 1 ? expert_stride : ldw * (is_static_v<tuple_element_t<0, typename Mainloop::StrideB>> ? k : n);
  const auto ragged_x = reinterpret_cast<uintptr_t>(x) - uintptr_t(kTileM) * ldx * sizeof(ElementA);
  typename Mainloop::Arguments args{reinterpret_cast<typename Mainloop::ElementA const*>(ragged_x),
                                    leading_stride<typename Mainloop::StrideA>(ldx, ldx),
                                    static_cast<typename Mainloop::ElementB const*>(weights),
                                    leading_stride<typename Mainloop::StrideB>(ldw, batch_stride)};
  Params params = weight_cache.get(
      {reinterpret_cast<int64_t>(weights), e, int64_t(n) << 32 | k, ldw, batch_stride, device},
      [&] { return Mainloop::to_underlying_arguments(make_shape(kTileM, n, k, e), args, nullptr); });
  params.tma_load_a = x_cache.get({reinterpret_cast<int64_t>(x), x_rows, x_cols, ldx, device, kTileM}, [&] {
    return Mainloop::to_underlying_arguments(make_shape(kTileM, n, x_cols, x_rows + 1), args, nullptr).tma_load_a;
  });
  return params;
}

// TMA store of out through the ragged view (kRows, cols, rows + 1), in boxes of SmemLayout (cols and
// rows: out's, or the interleaved groups' view).
template <class Element, int kRows, class SmemLayout>
struct RaggedStore {
  using Tma = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr<Element>(nullptr),
                        cute::make_layout(cute::make_shape(0, 0, 0), cute::make_stride(int64_t(0), cute::_1{}, int64_t(0)))),
      SmemLayout{}));

  static Tma make(int rows, int cols, void* out, int64_t ldout, int device) {
    using namespace cute;
    static DescriptorCache<Tma> cache;
    return cache.get({reinterpret_cast<int64_t>(out), rows, cols, ldout, device, kRows}, [&] {
      const auto base = reinterpret_cast<uintptr_t>(out) - uintptr_t(kRows) * ldout * sizeof(Element);
      auto view = make_tensor(make_gmem_ptr(reinterpret_cast<Element*>(base)),
                              make_layout(make_shape(int{kRows}, cols, rows + 1), make_stride(ldout, _1{}, ldout)));
      return make_tma_copy(SM90_TMA_STORE{}, view, SmemLayout{});
    });
  }
};

}  // namespace cutlass_moe::sm90
