#include "bucket_layout.h"

#include <algorithm>
#include <limits>

namespace shardadam {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// Written without a + b - 1 so that sizes near 2^63 cannot overflow.
int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }
int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

}  // namespace

BucketLayout::BucketLayout(const std::vector<int64_t>& numels, const std::vector<int>& keys,
                           int64_t world_size, int64_t bucket_cap_bytes,
                           const std::map<int, int64_t>& elem_sizes, int64_t alignment)
    : num_params_(int64_t(numels.size())), world_size_(world_size), alignment_(alignment) {
  SHARDADAM_CHECK(world_size >= 1, "world_size must be at least 1, got " + std::to_string(world_size));
  SHARDADAM_CHECK(bucket_cap_bytes > 0,
                  "bucket_cap_bytes must be positive, got " + std::to_string(bucket_cap_bytes));
  SHARDADAM_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0,
                  "alignment must be a power of two (bytes), got " + std::to_string(alignment));
  SHARDADAM_CHECK(keys.size() == numels.size(),
                  "keys has " + std::to_string(keys.size()) + " entries but numels has " +
                      std::to_string(numels.size()) + ": give one key per parameter");

  // Elements each key needs with every parameter aligned: a model smaller
  // than one bucket gets one bucket of its own size, not bucket_cap_bytes.
  // Saturates at kMax: the overflow check below then reports it.
  std::map<int, int64_t> need;
  for (size_t i = 0; i < numels.size() && i < keys.size(); ++i) {
    auto it = elem_sizes.find(keys[i]);
    if (it == elem_sizes.end() || it->second <= 0 || numels[i] <= 0) continue;
    const int64_t align = std::max<int64_t>(alignment / it->second, 1);
    int64_t& n = need[keys[i]];
    n = numels[i] > kMax - align - n ? kMax : n + round_up(numels[i], align);
  }
  for (const auto& [key, es] : elem_sizes) {
    const std::string name = "elem_sizes[" + std::to_string(key) + "]";
    SHARDADAM_CHECK(es > 0, name + " must be positive, got " + std::to_string(es));
    SHARDADAM_CHECK(alignment % es == 0, "alignment (" + std::to_string(alignment) +
                                             " bytes) must be a multiple of " + name + " = " +
                                             std::to_string(es) + ": use a larger alignment");
    KeyInfo k;
    k.elem_size = es;
    k.align_elems = alignment / es;
    // Round the capacity up rather than down (apex rounds down): a tiny
    // capacity still gives one aligned unit per rank, never an empty shard.
    const int64_t cap_elems = std::max<int64_t>(std::min(ceil_div(bucket_cap_bytes, es), need[key]), 1);
    const int64_t per_rank = ceil_div(cap_elems, world_size);
    SHARDADAM_CHECK(per_rank <= kMax - k.align_elems && round_up(per_rank, k.align_elems) <= kMax / world_size,
                    "bucket_cap_bytes is too large: the bucket size of key " + std::to_string(key) +
                        " overflows 64 bits");
    k.shard_size = round_up(per_rank, k.align_elems);
    keys_.emplace(key, k);
  }

  for (int64_t i = 0; i < num_params_; ++i) {
    const int64_t n = numels[size_t(i)];
    SHARDADAM_CHECK(n >= 0, "numels[" + std::to_string(i) + "] is negative (" + std::to_string(n) +
                                "): sizes must be >= 0");
    auto it = keys_.find(keys[size_t(i)]);
    SHARDADAM_CHECK(it != keys_.end(), "keys[" + std::to_string(i) + "] = " + std::to_string(keys[size_t(i)]) +
                                           " has no entry in elem_sizes: give its element size");
    total_numel_ += n;
    KeyInfo& k = it->second;
    const int64_t bucket_size = k.shard_size * world_size_;
    // Each parameter starts aligned, after the last one of its key; what does
    // not fit continues at offset 0 of fresh buckets, so a split parameter is
    // contiguous across consecutive buckets of its key.
    for (int64_t done = 0; done < n;) {
      int64_t start = k.last_bucket < 0 ? bucket_size : round_up(buckets_[size_t(k.last_bucket)].used, k.align_elems);
      if (start >= bucket_size) {  // bucket_size is a multiple of align_elems: never past it
        k.last_bucket = int64_t(buckets_.size());
        buckets_.push_back(LayoutBucket{it->first, k.num_buckets++, 0});
        start = 0;
      }
      const int64_t len = std::min(n - done, bucket_size - start);
      fragments_.push_back(LayoutFragment{i, done, done + len, k.last_bucket, start});
      buckets_[size_t(k.last_bucket)].used = start + len;
      done += len;
    }
  }
}

const BucketLayout::KeyInfo& BucketLayout::key_info(int key) const {
  auto it = keys_.find(key);
  SHARDADAM_CHECK(it != keys_.end(), "key " + std::to_string(key) + " has no entry in elem_sizes");
  return it->second;
}

std::vector<LayoutShardFragment> BucketLayout::shard_fragments(int64_t rank) const {
  SHARDADAM_CHECK(rank >= 0 && rank < world_size_, "rank " + std::to_string(rank) +
                                                       " is outside [0, world_size=" +
                                                       std::to_string(world_size_) + ")");
  // Shard sizes by bucket, so the loop below does no map lookup per fragment.
  std::vector<int64_t> shard(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) shard[b] = keys_.at(buckets_[b].key).shard_size;
  std::vector<LayoutShardFragment> out;
  for (const LayoutFragment& f : fragments_) {
    const int64_t s = shard[size_t(f.bucket)];
    const int64_t lo = rank * s, hi = lo + s;
    const int64_t b_end = f.bucket_start + (f.param_end - f.param_start);
    const int64_t b0 = std::max(f.bucket_start, lo), b1 = std::min(b_end, hi);
    if (b0 >= b1) continue;  // empty pieces never reach a launcher
    out.push_back(LayoutShardFragment{f.param, f.param_start + (b0 - f.bucket_start),
                                      f.param_start + (b1 - f.bucket_start), f.bucket, b0 - lo});
  }
  return out;
}

}  // namespace shardadam
