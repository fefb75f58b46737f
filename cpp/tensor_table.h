// A table of tensors for one multi-tensor operation: several lists (params,
// grads, ...) of equally sized tensors, validated once and cut into chunks.
// It holds raw addresses only; the Python side keeps the tensors alive.
//
// The table is serialised into one blob (structure of arrays) that engines read
// through TableView. The CPU engine reads the host blob; for CUDA, Python copies
// the blob to the device once and passes its address with each launch, so a
// launch costs the same whatever the number of tensors.
#pragma once

#include <string>
#include <vector>

#include "dtype.h"

namespace shardadam {

// Elements handled per vector access on the GPU; tables flag tensors whose
// every list is aligned to this many elements so the engine can vectorise.
constexpr int kVecElems = 4;
// The most lists a table may have.
constexpr int kMaxLists = 12;
// TensorTable::list_dtype_is: a list whose tensors differ in dtype.
constexpr uint8_t kMixedDtypes = 0xff;

// A tensor's chunks split its elements into equal shares of work. The CPU
// engine walks each chunk's contiguous range; the CUDA engine keeps the count
// but interleaves the shares (cuda/multi_tensor_apply.cuh). Per-chunk results
// are only ever combined per tensor, so both are exact.
struct Chunk {
  int64_t start;    // first element, within the tensor
  uint32_t tensor;  // index into the table
  uint32_t len;     // elements, > 0
};
static_assert(sizeof(Chunk) == 16, "Chunk is read as a 16-byte record");

// What an engine sees. All pointers point into one blob.
struct TableView {
  const uint64_t* ptrs = nullptr;      // [num_lists][num_tensors]; 0 = list absent
  const uint8_t* dtypes = nullptr;     // [num_lists][num_tensors]
  const int64_t* numels = nullptr;     // [num_tensors]
  const uint32_t* groups = nullptr;    // [num_tensors]
  const uint8_t* aligned = nullptr;    // [num_tensors]: every list vector-aligned
  const int64_t* tensor_chunks = nullptr;  // [num_tensors + 1]: chunk range per tensor
  const Chunk* chunks = nullptr;       // [num_chunks]
  const Q8Maps* q8 = nullptr;          // the dynamic maps, in tables with blockwise lists
  // Per list: the list holding its blocks' maxima (blockwise lists), else -1.
  int8_t block_list[kMaxLists] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
  bool blockwise = false;              // some list is blockwise 8-bit
  int32_t num_lists = 0;
  int64_t num_tensors = 0;
  int64_t num_chunks = 0;
};

struct ListSpec {
  std::string name;
  std::vector<uint64_t> ptrs;    // empty: the list is absent
  std::vector<int64_t> numels;
  std::vector<uint8_t> dtypes;
  bool written = false;
  // >= 0: this list holds the per-block maxima (float32, one per 256
  // elements, rounded up) of list `blocks_of`, whose dtype is blockwise.
  int blocks_of = -1;
};

class TensorTable {
 public:
  // `alias_ok`: a written list may be exactly the same memory as the list
  // at index `alias_ok` for the same tensor (in-place scale). -1: never.
  // `groups`: a non-decreasing group index per tensor (empty: all in group 0);
  // `num_groups`: how many groups there are, trailing empty ones included.
  TensorTable(std::vector<ListSpec> lists, std::vector<uint32_t> groups, int64_t num_groups,
              int64_t chunk_size, int alias_list);

  int num_lists() const { return int(lists_.size()); }
  int64_t num_tensors() const { return num_tensors_; }
  int64_t num_chunks() const { return int64_t(chunks_.size()); }
  int64_t num_groups() const { return num_groups_; }
  int64_t total_numel() const { return total_numel_; }
  int64_t chunk_size() const { return chunk_size_; }
  bool has_list(int l) const { return !lists_[l].ptrs.empty(); }
  const ListSpec& list(int l) const { return lists_[l]; }
  // True when every tensor of list l has dtype d (DType::None: the list is
  // absent). Lets an engine pick a kernel compiled for fixed dtypes.
  bool list_dtype_is(int l, DType d) const { return uniform_dtype_[l] == uint8_t(d); }
  bool blockwise() const { return blockwise_; }
  // First chunk of group g; group_chunk_begin(num_groups) == num_chunks.
  int64_t group_chunk_begin(int64_t g) const { return group_chunk_begin_[g]; }

  const std::vector<uint8_t>& blob() const { return blob_; }
  // View over a copy of blob() at `base` (the host blob itself, or its device copy).
  TableView view(const void* base) const;
  TableView host_view() const { return view(blob_.data()); }

  // The per-step path for a read-only list (gradients re-created by autograd):
  // writes the new addresses into the blob in place, O(n) with no sort. The
  // caller guarantees the new tensors have the validated sizes and dtypes;
  // addresses are checked for null and alignment only. Returns true when a
  // tensor lost vector alignment (its aligned flag changed too), false when
  // only the list's address column (ptrs_offset) changed: a device copy of
  // the blob then needs just that column patched.
  bool refresh_read_list(int l, const std::vector<uint64_t>& ptrs);
  // Refuses (std::invalid_argument) when list l, built read-only, overlaps
  // any other tensor of the table or of itself: an op may then write it (the
  // update's unscale_grads). The answer is kept until refresh_read_list(l)
  // re-points the list, so the steady state pays nothing.
  void check_writable(int l) const;
  // Byte offset of list l's address column in the blob.
  int64_t ptrs_offset(int l) const { return int64_t(off_ptrs_) + int64_t(l) * num_tensors_ * 8; }

 private:
  // also_written: bit l set: read-only list l is checked as if written.
  void validate_overlap(uint32_t also_written = 0) const;
  void validate_blocks() const;
  void build_blob();

  std::vector<ListSpec> lists_;
  std::vector<uint32_t> groups_;
  std::vector<Chunk> chunks_;
  std::vector<int64_t> tensor_chunks_;
  std::vector<int64_t> group_chunk_begin_;
  std::vector<uint8_t> blob_;
  int64_t num_tensors_ = 0;
  int64_t num_groups_ = 1;
  int64_t total_numel_ = 0;
  int64_t chunk_size_ = 0;
  int alias_list_ = -1;
  std::vector<uint8_t> uniform_dtype_;  // per list: its tensors' one dtype, kMixed, or None when absent
  bool blockwise_ = false;
  mutable uint32_t checked_writable_ = 0;  // bit l: check_writable(l) passed since the last refresh
  size_t off_ptrs_ = 0, off_dtypes_ = 0, off_numels_ = 0, off_groups_ = 0, off_aligned_ = 0,
         off_tensor_chunks_ = 0, off_chunks_ = 0, off_q8_ = 0;
};

}  // namespace shardadam
