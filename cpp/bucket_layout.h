// ZeRO-2 bucket layout: where each parameter's elements live in the flat
// gradient/state buckets, and which of them each rank owns. Pure integer math
// (no tensors, no CUDA) so that every rank, and every test, computes the same
// layout from the same ordered list of sizes.
//
// Parameters are packed per dtype-group key, in the order given: a bucket only
// ever holds parameters of one key, because a bucket is one flat buffer of one
// element type and one reduce-scatter. All buckets of a key have the same size,
// shard_size * world_size, so rank r owns [r * shard_size, (r+1) * shard_size)
// of every bucket and collectives need no per-bucket size exchange.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "common.h"

namespace shardadam {

struct LayoutBucket {
  int key;        // dtype-group key of every parameter in the bucket
  int64_t index;  // position among the buckets of this key
  int64_t used;   // high-water mark: every fragment lies in [0, used), padding included
};

// The part of one parameter that lies in one bucket.
struct LayoutFragment {
  int64_t param;         // index into the parameter list
  int64_t param_start;   // [param_start, param_end) of the flattened parameter
  int64_t param_end;
  int64_t bucket;        // global bucket index
  int64_t bucket_start;  // where param_start lands in the bucket
};

// The part of a fragment that lies in one rank's shard of its bucket.
struct LayoutShardFragment {
  int64_t param;
  int64_t param_start;
  int64_t param_end;
  int64_t bucket;
  int64_t shard_start;  // offset within the rank's shard, in [0, shard_size)
};

class BucketLayout {
 public:
  // numels[i], keys[i]: size and dtype-group key of parameter i, in packing
  // order. elem_sizes: bytes per element for each key. bucket_cap_bytes: the
  // target bucket size; the real one is rounded up so that each shard is a
  // whole number of alignment units. alignment: bytes, a power of two and a
  // multiple of every element size; every parameter and every shard starts on it.
  BucketLayout(const std::vector<int64_t>& numels, const std::vector<int>& keys,
               int64_t world_size, int64_t bucket_cap_bytes,
               const std::map<int, int64_t>& elem_sizes, int64_t alignment = 128);

  int64_t num_params() const { return num_params_; }
  int64_t world_size() const { return world_size_; }
  int64_t alignment() const { return alignment_; }
  int64_t total_numel() const { return total_numel_; }
  // Per key, in elements. Throws for a key not in elem_sizes.
  int64_t shard_size(int key) const { return key_info(key).shard_size; }
  int64_t bucket_size(int key) const { return key_info(key).shard_size * world_size_; }
  int64_t align_elems(int key) const { return key_info(key).align_elems; }

  // Buckets in creation order (the order parameters first reach them), which
  // interleaves keys; fragments in parameter order, and for a split parameter
  // in increasing bucket order. Zero-size parameters have no fragment.
  const std::vector<LayoutBucket>& buckets() const { return buckets_; }
  const std::vector<LayoutFragment>& fragments() const { return fragments_; }

  // The non-empty pieces of every fragment that rank `rank` owns, in fragment order.
  std::vector<LayoutShardFragment> shard_fragments(int64_t rank) const;

 private:
  struct KeyInfo {
    int64_t elem_size = 0;
    int64_t align_elems = 0;
    int64_t shard_size = 0;
    int64_t last_bucket = -1;  // the bucket of this key being filled
    int64_t num_buckets = 0;
  };
  const KeyInfo& key_info(int key) const;

  std::map<int, KeyInfo> keys_;
  std::vector<LayoutBucket> buckets_;
  std::vector<LayoutFragment> fragments_;
  int64_t num_params_ = 0;
  int64_t world_size_ = 0;
  int64_t alignment_ = 0;
  int64_t total_numel_ = 0;
};

}  // namespace shardadam
