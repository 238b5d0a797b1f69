// Per-tile records handed from the producer warp to the consumer warps of an sm90 MoE kernel.
//
// The producer warp walks the tile scheduler anyway, to issue each tile's loads. If every consumer
// warp walked it as well, each tile boundary would wait for the walk (a chain of dependent shuffles
// and a ballot: about 870 cycles in the forward, about 600 in the wgrad, with the tensor cores
// idle; benchmarks/NOTES.md). Instead, the producer writes each tile's record into a ring in shared
// memory as soon as it has found it, right after the previous tile's last loads, and a consumer's
// step between two tiles is a wait that completed long before and a read of shared memory.
//
// The ring: kRecords records behind a cutlass::PipelineAsync. Lane 0 of the producer warp fills a
// record; one lane of each of the kConsumerWarps consumer warps frees it. The producer runs at most
// a stage count of K blocks ahead of the consumers, so with more records than stages the ring holds
// it back only where tiles without K blocks pile up (the wgrad's experts with no rows).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace cutlass_moe::sm90 {

template <class Record, int kRecords, int kConsumerWarps>
class TileRecords {
 public:
  static constexpr int kCapacity = kRecords;
  using Pipeline = cutlass::PipelineAsync<kRecords>;
  struct SharedStorage {
    alignas(16) typename Pipeline::SharedStorage pipeline;
    Record record[kRecords];
  };

  // Every thread of the block constructs it (before the block's __syncthreads that publishes the
  // barriers' initialization); is_producer: the producer warp, is_consumer: the consumer warps.
  CUTLASS_DEVICE TileRecords(SharedStorage& storage, bool is_producer, bool is_consumer)
      : pipeline_(storage.pipeline, pipeline_params(is_producer, is_consumer)),
        records_(storage.record),
        state_(is_producer ? cutlass::make_producer_start_state<Pipeline>() : typename Pipeline::PipelineState{}) {}

  // The producer warp, every lane: the next record.
  CUTLASS_DEVICE void put(Record const& record) {
    pipeline_.producer_acquire(state_);
    if (cute::elect_one_sync()) {
      records_[state_.index()] = record;
      pipeline_.producer_commit(state_);
    }
    __syncwarp();
    ++state_;
  }

  // A consumer warp, every lane: the next record.
  CUTLASS_DEVICE Record take() {
    pipeline_.consumer_wait(state_);
    const Record record = records_[state_.index()];
    __syncwarp();  // every lane has read the record before it is freed
    if (cute::elect_one_sync()) pipeline_.consumer_release(state_);
    ++state_;
    return record;
  }

 private:
  CUTLASS_DEVICE static typename Pipeline::Params pipeline_params(bool is_producer, bool is_consumer) {
    typename Pipeline::Params params;
    params.role = is_producer   ? Pipeline::ThreadCategory::Producer
                  : is_consumer ? Pipeline::ThreadCategory::Consumer
                                : Pipeline::ThreadCategory::NonParticipant;
    params.producer_arv_count = 1;
    params.consumer_arv_count = kConsumerWarps;
    return params;
  }

  Pipeline pipeline_;
  Record* records_;
  typename Pipeline::PipelineState state_;
};

}  // namespace cutlass_moe::sm90
