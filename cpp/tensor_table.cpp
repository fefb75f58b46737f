#include "tensor_table.h"

#include <algorithm>
#include <cstring>

namespace shardadam {
namespace {

std::string where(const ListSpec& l, int64_t t) { return l.name + "[" + std::to_string(t) + "]"; }

struct Range {
  uint64_t begin, end;
  int list;
  int64_t tensor;
  bool written;
};

template <class T>
size_t append(std::vector<uint8_t>& blob, const std::vector<T>& v) {
  // Every array starts 16-byte aligned so engines can read records directly.
  const size_t off = (blob.size() + 15) & ~size_t(15);
  blob.resize(off + v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(blob.data() + off, v.data(), v.size() * sizeof(T));
  return off;
}

}  // namespace

TensorTable::TensorTable(std::vector<ListSpec> lists, std::vector<uint32_t> groups,
                         int64_t num_groups, int64_t chunk_size, int alias_list)
    : lists_(std::move(lists)), groups_(std::move(groups)), num_groups_(num_groups),
      chunk_size_(chunk_size), alias_list_(alias_list) {
  // An empty first list is a table of no tensors (a rank whose shard holds
  // nothing, say): valid, and every operation on it launches nothing.
  SHARDADAM_CHECK(!lists_.empty(), "a table needs at least one list");
  SHARDADAM_CHECK(chunk_size_ > 0 && chunk_size_ % kVecElems == 0 && chunk_size_ <= (int64_t(1) << 30),
                  "chunk_size must be a positive multiple of 4, at most 2^30");
  const ListSpec& first = lists_[0];
  num_tensors_ = int64_t(first.ptrs.size());
  SHARDADAM_CHECK(num_tensors_ < (int64_t(1) << 32), "too many tensors for one table (2^32)");
  SHARDADAM_CHECK(num_lists() <= kMaxLists, "a table has at most " + std::to_string(kMaxLists) + " lists");
  for (const ListSpec& l : lists_) {
    if (l.ptrs.empty() || l.blocks_of >= 0) continue;  // block lists: validate_blocks
    SHARDADAM_CHECK(int64_t(l.ptrs.size()) == num_tensors_ && l.numels.size() == l.ptrs.size() &&
                        l.dtypes.size() == l.ptrs.size(),
                    l.name + " has " + std::to_string(l.ptrs.size()) + " tensors but " + first.name +
                        " has " + std::to_string(num_tensors_) + ": pass lists of equal length");
    for (int64_t t = 0; t < num_tensors_; ++t) {
      SHARDADAM_CHECK(l.numels[t] == first.numels[t],
                      where(l, t) + " has " + std::to_string(l.numels[t]) + " elements but " +
                          where(first, t) + " has " + std::to_string(first.numels[t]) +
                          ": corresponding tensors must have the same number of elements");
      SHARDADAM_CHECK(is_storage_dtype(l.dtypes[t]),
                      where(l, t) + " has an unsupported dtype code " + std::to_string(l.dtypes[t]));
      SHARDADAM_CHECK(l.numels[t] >= 0, where(l, t) + " has a negative size");
      SHARDADAM_CHECK(l.numels[t] == 0 || l.ptrs[t] != 0, where(l, t) + " has a null data pointer");
    }
  }
  if (groups_.empty()) groups_.assign(size_t(num_tensors_), 0u);
  SHARDADAM_CHECK(int64_t(groups_.size()) == num_tensors_, "groups must give one group index per tensor");
  for (int64_t t = 1; t < num_tensors_; ++t)
    SHARDADAM_CHECK(groups_[t] >= groups_[t - 1], "tensors must be ordered by group index");
  SHARDADAM_CHECK(num_groups_ >= 1 && (num_tensors_ == 0 || int64_t(groups_.back()) < num_groups_),
                  "num_groups must be at least 1 and exceed every group index");

  validate_blocks();
  validate_overlap();

  // Zero-size tensors keep their index (per-tensor outputs stay aligned with
  // the caller's list) but produce no chunk, so no launch ever sees them.
  tensor_chunks_.assign(size_t(num_tensors_) + 1, 0);
  group_chunk_begin_.assign(size_t(num_groups_) + 1, 0);
  int64_t g_next = 0;
  for (int64_t t = 0; t < num_tensors_; ++t) {
    while (g_next <= int64_t(groups_[t])) group_chunk_begin_[g_next++] = int64_t(chunks_.size());
    tensor_chunks_[t] = int64_t(chunks_.size());
    const int64_t n = first.numels[t];
    total_numel_ += n;
    for (int64_t s = 0; s < n; s += chunk_size_)
      chunks_.push_back(Chunk{s, uint32_t(t), uint32_t(std::min(chunk_size_, n - s))});
  }
  tensor_chunks_[num_tensors_] = int64_t(chunks_.size());
  while (g_next <= num_groups_) group_chunk_begin_[g_next++] = int64_t(chunks_.size());
  build_blob();
}

void TensorTable::validate_blocks() const {
  const ListSpec& first = lists_[0];
  std::vector<int> block_list(size_t(num_lists()), -1);
  for (int l = 0; l < num_lists(); ++l) {
    const ListSpec& b = lists_[l];
    if (b.blocks_of < 0) continue;
    SHARDADAM_CHECK(b.blocks_of < num_lists() && b.blocks_of != l && lists_[b.blocks_of].blocks_of < 0,
                    b.name + " holds the block maxima of no valid list");
    const ListSpec& of = lists_[b.blocks_of];
    SHARDADAM_CHECK(block_list[b.blocks_of] < 0, of.name + " has two lists of block maxima");
    if (b.ptrs.empty()) continue;
    block_list[b.blocks_of] = l;
    SHARDADAM_CHECK(!of.ptrs.empty(), b.name + " holds block maxima of " + of.name + ", which is not given");
    SHARDADAM_CHECK(int64_t(b.ptrs.size()) == num_tensors_ && b.numels.size() == b.ptrs.size() &&
                        b.dtypes.size() == b.ptrs.size(),
                    b.name + " has " + std::to_string(b.ptrs.size()) + " tensors but " + first.name + " has " +
                        std::to_string(num_tensors_) + ": pass lists of equal length");
    for (int64_t t = 0; t < num_tensors_; ++t) {
      const int64_t blocks = (first.numels[t] + kQuantBlock - 1) / kQuantBlock;
      SHARDADAM_CHECK(b.numels[t] == blocks, where(b, t) + " has " + std::to_string(b.numels[t]) +
                                                 " elements; it holds one float32 per " +
                                                 std::to_string(kQuantBlock) + " elements of " + where(of, t) +
                                                 ": " + std::to_string(blocks));
      SHARDADAM_CHECK(DType(b.dtypes[t]) == DType::F32, where(b, t) + " must be float32 (block maxima)");
      SHARDADAM_CHECK(b.numels[t] == 0 || b.ptrs[t] != 0, where(b, t) + " has a null data pointer");
      SHARDADAM_CHECK(is_blockwise(DType(of.dtypes[t])),
                      where(b, t) + " holds block maxima, but " + where(of, t) + " is " +
                          dtype_name(DType(of.dtypes[t])) + ", not blockwise 8-bit");
    }
  }
  for (int l = 0; l < num_lists(); ++l) {
    const ListSpec& spec = lists_[l];
    if (spec.ptrs.empty() || block_list[l] >= 0) continue;
    for (int64_t t = 0; t < num_tensors_; ++t)
      SHARDADAM_CHECK(!is_blockwise(DType(spec.dtypes[t])),
                      where(spec, t) + " is blockwise 8-bit but the table has no list of its block maxima");
  }
}

void TensorTable::validate_overlap(uint32_t also_written) const {
  // Sweep the address ranges in order: a range overlaps an earlier one iff it
  // starts before the furthest end seen so far. Written ranges may not overlap
  // anything; read-only ranges may share memory with each other.
  auto bytes_of = [](const ListSpec& spec, int64_t t) {
    return uint64_t(spec.numels[t]) * uint64_t(dtype_size(DType(spec.dtypes[t])));
  };
  // A written tensor that is exactly its own input (in-place) counts once, as
  // a written range: it may not overlap anything else, itself given twice included.
  std::vector<int> in_place_of(size_t(num_tensors_), -1);  // written list aliasing the input
  if (alias_list_ >= 0 && has_list(alias_list_)) {
    const ListSpec& a = lists_[alias_list_];
    for (int l = 0; l < num_lists(); ++l) {
      const ListSpec& spec = lists_[l];
      if (l == alias_list_ || !spec.written || spec.ptrs.empty()) continue;
      for (int64_t t = 0; t < num_tensors_; ++t)
        if (a.ptrs[t] == spec.ptrs[t] && bytes_of(a, t) == bytes_of(spec, t)) in_place_of[t] = l;
    }
  }
  std::vector<Range> ranges;
  for (int l = 0; l < num_lists(); ++l) {
    const ListSpec& spec = lists_[l];
    if (spec.ptrs.empty()) continue;
    for (int64_t t = 0; t < num_tensors_; ++t) {
      const uint64_t bytes = bytes_of(spec, t);
      if (bytes == 0 || in_place_of[t] == l) continue;
      const bool written =
          spec.written || ((also_written >> l) & 1u) || (l == alias_list_ && in_place_of[t] >= 0);
      ranges.push_back(Range{spec.ptrs[t], spec.ptrs[t] + bytes, l, t, written});
    }
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  const Range* furthest = nullptr;
  const Range* furthest_written = nullptr;
  for (const Range& r : ranges) {
    const Range* hit = nullptr;
    if (furthest_written && r.begin < furthest_written->end) hit = furthest_written;
    else if (r.written && furthest && r.begin < furthest->end) hit = furthest;
    if (hit) {
      throw std::invalid_argument(
          where(lists_[r.list], r.tensor) + " overlaps " + where(lists_[hit->list], hit->tensor) +
          " in memory, and at least one of them is written: pass separate tensors");
    }
    if (!furthest || r.end > furthest->end) furthest = &r;
    if (r.written && (!furthest_written || r.end > furthest_written->end)) furthest_written = &r;
  }
}

void TensorTable::build_blob() {
  const int L = num_lists();
  uniform_dtype_.assign(size_t(L), uint8_t(DType::None));
  blockwise_ = false;
  for (int l = 0; l < L; ++l) {
    const ListSpec& spec = lists_[l];
    if (spec.ptrs.empty()) continue;
    uint8_t d = spec.dtypes.empty() ? uint8_t(DType::None) : spec.dtypes[0];
    for (uint8_t x : spec.dtypes) {
      if (x != d) d = kMixedDtypes;
      blockwise_ |= is_blockwise(DType(x));
    }
    uniform_dtype_[l] = d;
  }
  SHARDADAM_CHECK(!blockwise_ || chunk_size_ % kQuantBlock == 0,
                  "chunk_size must be a multiple of " + std::to_string(kQuantBlock) + " with blockwise lists");
  std::vector<uint64_t> ptrs(size_t(L) * size_t(num_tensors_), 0);
  std::vector<uint8_t> dtypes(size_t(L) * size_t(num_tensors_), uint8_t(DType::None));
  std::vector<uint8_t> aligned(size_t(num_tensors_), 1);
  for (int l = 0; l < L; ++l) {
    const ListSpec& spec = lists_[l];
    if (spec.ptrs.empty()) continue;
    for (int64_t t = 0; t < num_tensors_; ++t) {
      ptrs[size_t(l) * num_tensors_ + t] = spec.ptrs[t];
      dtypes[size_t(l) * num_tensors_ + t] = spec.dtypes[t];
      const uint64_t vec_bytes = uint64_t(kVecElems * dtype_size(DType(spec.dtypes[t])));
      if (spec.blocks_of < 0 && spec.ptrs[t] % vec_bytes != 0) aligned[t] = 0;  // maxima: read one by one
    }
  }
  blob_.clear();
  off_ptrs_ = append(blob_, ptrs);
  off_dtypes_ = append(blob_, dtypes);
  off_numels_ = append(blob_, lists_[0].numels);
  off_groups_ = append(blob_, groups_);
  off_aligned_ = append(blob_, aligned);
  off_tensor_chunks_ = append(blob_, tensor_chunks_);
  off_chunks_ = append(blob_, chunks_);
  if (blockwise_) {
    std::vector<Q8Maps> maps{q8_maps()};
    off_q8_ = append(blob_, maps);
  }
  blob_.resize((blob_.size() + 15) & ~size_t(15));
}

TableView TensorTable::view(const void* base) const {
  const uint8_t* b = static_cast<const uint8_t*>(base);
  TableView v;
  v.ptrs = reinterpret_cast<const uint64_t*>(b + off_ptrs_);
  v.dtypes = b + off_dtypes_;
  v.numels = reinterpret_cast<const int64_t*>(b + off_numels_);
  v.groups = reinterpret_cast<const uint32_t*>(b + off_groups_);
  v.aligned = b + off_aligned_;
  v.tensor_chunks = reinterpret_cast<const int64_t*>(b + off_tensor_chunks_);
  v.chunks = reinterpret_cast<const Chunk*>(b + off_chunks_);
  v.blockwise = blockwise_;
  if (blockwise_) v.q8 = reinterpret_cast<const Q8Maps*>(b + off_q8_);
  for (int l = 0; l < num_lists(); ++l)
    if (lists_[l].blocks_of >= 0 && has_list(l)) v.block_list[lists_[l].blocks_of] = int8_t(l);
  v.num_lists = num_lists();
  v.num_tensors = num_tensors_;
  v.num_chunks = int64_t(chunks_.size());
  return v;
}


}  // namespace shardadam

namespace shardadam {

void TensorTable::check_writable(int l) const {
  SHARDADAM_CHECK(l >= 0 && l < num_lists() && has_list(l), "check_writable: no such list in the table");
  if (lists_[l].written || ((checked_writable_ >> l) & 1u)) return;
  validate_overlap(uint32_t(1) << l);
  checked_writable_ |= uint32_t(1) << l;
}

bool TensorTable::refresh_read_list(int l, const std::vector<uint64_t>& ptrs) {
  SHARDADAM_CHECK(l >= 0 && l < num_lists() && has_list(l), "refresh_read_list: no such list in the table");
  ListSpec& spec = lists_[l];
  SHARDADAM_CHECK(!spec.written, "refresh_read_list: " + spec.name + " is written; its addresses are fixed when the table is built");
  SHARDADAM_CHECK(int64_t(ptrs.size()) == num_tensors_,
                  "refresh_read_list: " + spec.name + " needs " + std::to_string(num_tensors_) + " addresses");
  for (int64_t t = 0; t < num_tensors_; ++t)
    SHARDADAM_CHECK(spec.numels[t] == 0 || ptrs[t] != 0,
                    spec.name + "[" + std::to_string(t) + "] has a null data pointer");
  checked_writable_ &= ~(uint32_t(1) << l);
  uint64_t* column = reinterpret_cast<uint64_t*>(blob_.data() + ptrs_offset(l));
  uint8_t* aligned = blob_.data() + off_aligned_;
  bool alignment_changed = false;
  for (int64_t t = 0; t < num_tensors_; ++t) {
    spec.ptrs[t] = ptrs[t];
    column[t] = ptrs[t];
    const uint64_t vec_bytes = uint64_t(kVecElems * dtype_size(DType(spec.dtypes[t])));
    if (spec.blocks_of < 0 && ptrs[t] % vec_bytes != 0 && aligned[t]) {  // never re-enabled: other lists may need it off
      aligned[t] = 0;
      alignment_changed = true;
    }
  }
  return alignment_changed;
}

}  // namespace shardadam
