// The only file that meets Python. Tensors never cross this boundary: Python
// passes addresses, sizes and dtype codes once (TensorTable), then each call
// passes the table, a few scalars and the stream.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bucket_layout.h"
#include "cpu_gather.h"
#include "cuda_api.h"
#include "kernels_cpu.h"
#include "lion_math.h"
#include "muon_math.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace shardadam;

namespace {

using ListTuple = std::tuple<std::string, std::vector<uint64_t>, std::vector<int64_t>,
                             std::vector<uint8_t>, bool, int>;

TensorTable make_table(const std::vector<ListTuple>& lists, std::vector<uint32_t> groups,
                       int64_t num_groups, int64_t chunk_size, int alias_list) {
  std::vector<ListSpec> specs;
  for (const ListTuple& l : lists)
    specs.push_back(
        ListSpec{std::get<0>(l), std::get<1>(l), std::get<2>(l), std::get<3>(l), std::get<4>(l), std::get<5>(l)});
  return TensorTable(std::move(specs), std::move(groups), num_groups, chunk_size, alias_list);
}

ScalarSrc make_scalar(double value, uint64_t ptr, int dtype) {
  return ScalarSrc{value, reinterpret_cast<const void*>(ptr), DType(dtype)};
}

using CpuUpdate = void (*)(const TensorTable&, const std::vector<AdamGroup>&, const AdamExtras&, int);
using CudaUpdate = void (*)(const TensorTable&, const CudaTarget&, const std::vector<AdamGroup>&,
                            const AdamExtras&);

// An update rule's functions: its table check, and one step on the CPU
// (device < 0) or on a CUDA device.
template <class Rule>
void def_update(nb::module_& m, const char* check_name, CpuUpdate cpu, CudaUpdate cuda) {
  m.def(check_name, &check_table<Rule>, "table"_a, "scaled"_a,
        "scaled: bit i set when ScaledState i (master, exp_avg, exp_avg_sq) has per-tensor scales.");
  m.def(
      Rule::kName,
      [cpu, cuda](const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x, int device,
                  uint64_t stream, uint64_t blob, int threads) {
        if (device < 0) cpu(t, groups, x, threads);
        else cuda(t, CudaTarget{device, stream, blob}, groups, x);
      },
      "table"_a, "groups"_a, "extras"_a, "device"_a, "stream"_a, "blob"_a, "threads"_a,
      nb::call_guard<nb::gil_scoped_release>());
}

using CpuPass = void (*)(const TensorTable&, int);
using CudaPass = void (*)(const TensorTable&, const CudaTarget&);

// A pass over a table with no arguments of its own, on the CPU (device < 0)
// or on a CUDA device.
void def_pass(nb::module_& m, const char* name, CpuPass cpu, CudaPass cuda, const char* doc) {
  m.def(
      name,
      [cpu, cuda](const TensorTable& t, int device, uint64_t stream, uint64_t blob, int threads) {
        if (device < 0) cpu(t, threads);
        else cuda(t, CudaTarget{device, stream, blob});
      },
      "table"_a, "device"_a, "stream"_a, "blob"_a, "threads"_a, doc,
      nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "shardadam compiled core: tensor tables, multi-tensor engine, Adam and Lion kernels (CPU and CUDA).";
  // Optimizers hold tables and layouts, and autograd hooks on the model's
  // parameters hold the optimizer: objects still reachable from module globals
  // at interpreter exit are normal for a training script, not refcount bugs.
  nb::set_leak_warnings(false);

  nb::enum_<DType>(m, "DType")
      .value("none", DType::None)
      .value("float32", DType::F32)
      .value("float16", DType::F16)
      .value("bfloat16", DType::BF16)
      .value("int16", DType::I16)
      .value("float64", DType::F64)
      .value("int32", DType::I32)
      .value("int64", DType::I64)
      .value("float8_e4m3fn", DType::F8E4M3)
      .value("q8_signed", DType::Q8S)
      .value("q8_unsigned", DType::Q8U);

  nb::class_<ScalarSrc>(m, "Scalar", "A number, or the address of a one-element tensor read by the kernel.")
      .def("__init__",
           [](ScalarSrc* s, double value, uint64_t ptr, int dtype) { new (s) ScalarSrc(make_scalar(value, ptr, dtype)); },
           "value"_a, "ptr"_a = 0, "dtype"_a = 0);

  nb::class_<AdamGroup>(m, "AdamGroup", "Hyperparameters of one parameter group.")
      .def(nb::init<>())
      .def_rw("beta1", &AdamGroup::beta1)
      .def_rw("beta2", &AdamGroup::beta2)
      .def_rw("eps", &AdamGroup::eps)
      .def_rw("weight_decay", &AdamGroup::weight_decay)
      .def_rw("adam_w_mode", &AdamGroup::adam_w_mode)
      .def_rw("bias_correction", &AdamGroup::bias_correction)
      .def_rw("maximize", &AdamGroup::maximize)
      .def_rw("nesterov", &AdamGroup::nesterov)
      .def_rw("lr_ratio", &AdamGroup::lr_ratio)
      .def_rw("lr", &AdamGroup::lr)
      .def_rw("step", &AdamGroup::step);

  nb::class_<AdamExtras>(m, "AdamExtras", "Per-call inputs of adam beyond the groups.")
      .def(nb::init<>())
      .def_rw("grad_scale", &AdamExtras::grad_scale)
      .def_rw("found_inf", &AdamExtras::found_inf)
      .def_prop_rw(
          "scales", [](const AdamExtras& x) { return std::make_tuple(x.scales[0], x.scales[1], x.scales[2]); },
          [](AdamExtras& x, std::tuple<uint64_t, uint64_t, uint64_t> s) {
            x.scales[0] = std::get<0>(s);
            x.scales[1] = std::get<1>(s);
            x.scales[2] = std::get<2>(s);
          },
          "Addresses of the per-tensor scales of (master, exp_avg, exp_avg_sq); 0 = unscaled.")
      .def_rw("amax_scratch", &AdamExtras::amax_scratch)
      .def_rw("unscale_grads", &AdamExtras::unscale_grads)
      .def_rw("stochastic_rounding", &AdamExtras::stochastic_rounding,
              "bf16 parameters without a master round stochastically, keyed by rounding_seed.")
      .def_rw("rounding_seed", &AdamExtras::rounding_seed);

  nb::class_<TensorTable>(m, "TensorTable",
                          "Validated lists of equally sized tensors, cut into chunks.")
      .def("__init__",
           [](TensorTable* t, const std::vector<ListTuple>& lists, std::vector<uint32_t> groups,
              int64_t num_groups, int64_t chunk_size, int alias_list) {
             new (t) TensorTable(make_table(lists, std::move(groups), num_groups, chunk_size, alias_list));
           },
           "lists"_a, "groups"_a, "num_groups"_a, "chunk_size"_a, "alias_list"_a = -1,
           "lists: (name, addresses, numels, dtype codes, written, blocks_of) per list; an absent "
           "list has no addresses; blocks_of: the list whose block maxima this one holds, or -1. groups: a non-decreasing group index per tensor, or empty (one group). "
           "alias_list: a written list may be exactly this list's tensor (in place).")
      .def_prop_ro("num_lists", &TensorTable::num_lists)
      .def_prop_ro("num_tensors", &TensorTable::num_tensors)
      .def_prop_ro("num_chunks", &TensorTable::num_chunks)
      .def_prop_ro("num_groups", &TensorTable::num_groups)
      .def_prop_ro("total_numel", &TensorTable::total_numel)
      .def_prop_ro("chunk_size", &TensorTable::chunk_size)
      .def("blob", [](const TensorTable& t) { return nb::bytes(t.blob().data(), t.blob().size()); },
           "The table as bytes, to be copied to the device once.")
      .def("refresh_read_list", &TensorTable::refresh_read_list, "list"_a, "ptrs"_a,
           "Per-step address update of a read-only list. True when a tensor lost vector "
           "alignment (re-copy the whole blob), else only the column at ptrs_offset changed.")
      .def("ptrs_offset", &TensorTable::ptrs_offset, "list"_a,
           "Byte offset of a list's address column in the blob.");

  def_update<AdamRule>(m, "check_adam_table", cpu_adam, cuda_adam);
  def_update<LionRule>(m, "check_lion_table", cpu_lion, cuda_lion);
  def_update<MuonMomentumRule>(m, "check_muon_momentum_table", cpu_muon_momentum, cuda_muon_momentum);
  def_update<MuonUpdateRule>(m, "check_muon_update_table", cpu_muon_update, cuda_muon_update);

  m.def(
      "scale",
      [](const TensorTable& t, const ScalarSrc& scale, uint64_t found_inf, uint64_t skip_if, int device,
         uint64_t stream, uint64_t blob, int threads) {
        if (device < 0) cpu_scale(t, scale, found_inf, skip_if, threads);
        else cuda_scale(t, CudaTarget{device, stream, blob}, scale, found_inf, skip_if);
      },
      "table"_a, "scale"_a, "found_inf"_a, "skip_if"_a, "device"_a, "stream"_a, "blob"_a, "threads"_a,
      nb::call_guard<nb::gil_scoped_release>());

  def_pass(m, "split_remainders", cpu_split_remainders, cuda_split_remainders,
           "Lists (fp32 masters, bf16 params, int16 remainders): write each master's high half, "
           "rounded to nearest, to the param and its low half to the remainder (cpp/dtype.h).");
  def_pass(m, "join_remainders", cpu_join_remainders, cuda_join_remainders,
           "Lists (bf16 params, int16 remainders, fp32 masters): write the exact fp32 master that "
           "each param and remainder represent (the inverse of split_remainders).");
  m.def("pow2_scale_for", &pow2_scale_for, "amax"_a, "old_scale"_a, "top"_a = kF16ScaleTop,
        "The per-tensor scale the kernels choose for scaled states (cpp/ops.h), in float32: "
        "amax * scale just under 2^top (15 for fp16, 8 for FP8 E4M3), a power of two; old_scale when "
        "amax is 0 or not finite.");

  m.def(
      "q8_map",
      [](bool is_signed) {
        const Q8Map& q = q8_maps().map[is_signed ? 0 : 1];
        return std::vector<float>(q.decode, q.decode + 256);
      },
      "signed"_a,
      "The dynamic map of blockwise 8-bit states (cpp/dtype.h): the value / block maximum of each code.");
  m.def("q8_block", []() { return kQuantBlock; }, "Elements per block of blockwise 8-bit states.");

  m.def(
      "l2_norm",
      [](const TensorTable& t, uint64_t partials, uint64_t per_tensor, uint64_t total, uint64_t nonfinite,
         int device, uint64_t stream, uint64_t blob, int threads) {
        if (device < 0) cpu_l2_norm(t, partials, per_tensor, total, nonfinite, threads);
        else cuda_l2_norm(t, CudaTarget{device, stream, blob}, partials, per_tensor, total, nonfinite);
      },
      "table"_a, "partials"_a, "per_tensor"_a, "total"_a, "nonfinite"_a, "device"_a, "stream"_a,
      "blob"_a, "threads"_a, nb::call_guard<nb::gil_scoped_release>());

  // Layout results cross as plain tuples: one conversion per call, no bound
  // object per fragment; python/shardadam/distributed/layout.py names the fields.
  nb::class_<BucketLayout>(m, "BucketLayout",
                           "ZeRO-2 bucket layout and shard math: pure integer math, no tensors.")
      .def(nb::init<const std::vector<int64_t>&, const std::vector<int>&, int64_t, int64_t,
                    const std::map<int, int64_t>&, int64_t>(),
           "numels"_a, "keys"_a, "world_size"_a, "bucket_cap_bytes"_a, "elem_sizes"_a, "alignment"_a = 128,
           "numels, keys: size and dtype-group key of each parameter, in packing order. "
           "elem_sizes: {key: bytes per element}. bucket_cap_bytes: target bucket size, rounded up "
           "so each of the world_size shards is a whole number of alignment bytes.")
      .def_prop_ro("num_params", &BucketLayout::num_params)
      .def_prop_ro("world_size", &BucketLayout::world_size)
      .def_prop_ro("alignment", &BucketLayout::alignment)
      .def_prop_ro("total_numel", &BucketLayout::total_numel)
      .def("shard_size", &BucketLayout::shard_size, "key"_a, "Elements per rank in every bucket of this key.")
      .def("bucket_size", &BucketLayout::bucket_size, "key"_a, "shard_size(key) * world_size.")
      .def("align_elems", &BucketLayout::align_elems, "key"_a, "The alignment in elements of this key.")
      .def("buckets",
           [](const BucketLayout& l) {
             std::vector<std::tuple<int, int64_t, int64_t>> out;
             out.reserve(l.buckets().size());
             for (const LayoutBucket& b : l.buckets()) out.emplace_back(b.key, b.index, b.used);
             return out;
           },
           "(key, index within key, used) per bucket, in creation order.")
      .def("fragments",
           [](const BucketLayout& l) {
             std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> out;
             out.reserve(l.fragments().size());
             for (const LayoutFragment& f : l.fragments())
               out.emplace_back(f.param, f.param_start, f.param_end, f.bucket, f.bucket_start);
             return out;
           },
           "(param, param_start, param_end, bucket, bucket_start) per fragment, in parameter order.")
      .def("shard_fragments",
           [](const BucketLayout& l, int64_t rank) {
             std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> out;
             for (const LayoutShardFragment& f : l.shard_fragments(rank))
               out.emplace_back(f.param, f.param_start, f.param_end, f.bucket, f.shard_start);
             return out;
           },
           "rank"_a, "(param, param_start, param_end, bucket, shard_start) of each non-empty piece rank owns.");

  // CUDA IPC, peer copies and counters for the copy-engine collectives (distributed/_peer.py).
  m.def(
      "ipc_export",
      [](int device, uint64_t ptr) {
        PeerExport e = cuda_ipc_export(device, ptr);
        return std::make_tuple(nb::bytes(e.handle.data(), e.handle.size()), e.offset);
      },
      "device"_a, "ptr"_a, "(handle, offset): the allocation holding ptr, for ipc_open in another process.");
  m.def(
      "ipc_open", [](int device, nb::bytes handle) { return cuda_ipc_open(device, std::string(handle.c_str(), handle.size())); },
      "device"_a, "handle"_a, "Map a peer's exported allocation on this device; returns its base address.");
  m.def("ipc_close", &cuda_ipc_close, "device"_a, "base"_a, "Unmap what ipc_open mapped.");
  // These three may block while the stream's queue is full: without the GIL,
  // so that the copy-engine watchdog thread (distributed/_watchdog.py) runs.
  m.def("copy_async", &cuda_copy_async, "device"_a, "dst"_a, "src"_a, "nbytes"_a, "stream"_a,
        "cudaMemcpyAsync of nbytes on the stream: to a peer's mapped memory it runs on the copy engines.",
        nb::call_guard<nb::gil_scoped_release>());
  m.def("stream_write_value", &cuda_stream_write_value, "device"_a, "addr"_a, "value"_a, "stream"_a,
        "Write the 64-bit value to addr once the stream's earlier work is done (and visible).",
        nb::call_guard<nb::gil_scoped_release>());
  m.def("stream_wait_value", &cuda_stream_wait_value, "device"_a, "addr"_a, "value"_a, "stream"_a,
        "The stream's later work waits until the 64-bit counter at addr is at least value.",
        nb::call_guard<nb::gil_scoped_release>());

  m.def("build_info", []() {
    nb::dict d;
    d["cuda"] = cuda_built();
    d["cuda_architectures"] = cuda_architectures();
    d["cuda_runtime_version"] = cuda_runtime_version();
    d["cuda_device_count"] = cuda_device_count();
    d["version"] = SHARDADAM_VERSION;
    d["max_groups_per_launch"] = kMaxGroupsPerLaunch;
    d["cpu_isa"] = cpu_isa();
    d["cpu_gathers"] = cpu_gathers();
    return d;
  }, "What this build contains: CUDA kernels and their architectures, runtime and device count.");
}
