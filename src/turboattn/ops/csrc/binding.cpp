// Python binding of the CUDA kernels (the decode kernel, ops/cached/csrc; quantize-append, ops/quantize/csrc):
// checks nothing the wrappers check (ops/cached/cuda.py and ops/quantize/cuda.py validated the call), fills the
// parameter blocks from tensors and launches on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "decode.h"
#include "quantize.h"

namespace {
// The kernels' dtype codes: 0 float16, 1 bfloat16, 2 float32.
int dtype_code(const torch::Tensor& t) {
  return t.scalar_type() == at::kHalf ? 0 : (t.scalar_type() == at::kBFloat16 ? 1 : 2);
}
}  // namespace

// o_part, lse_part: the parts' buffers, or None (allocated here: one allocation, cheaper in C++ than two
// torch.empty calls from Python on a decode step's host path); out: the output, or None (allocated here, [B, Hq, Tq,
// D] contiguous in q's dtype).  Returns the output.
torch::Tensor decode(const torch::Tensor& q, const torch::Tensor& k_codes, const torch::Tensor& k_scales,
                     const torch::Tensor& v_codes, const torch::Tensor& v_scales, const torch::Tensor& seen,
                     const torch::Tensor& starts, const c10::optional<torch::Tensor>& gain_inv,
                     const torch::Tensor& signs, int64_t k_bits_arg, int64_t v_bits_arg,
                     const c10::optional<torch::Tensor>& o_part, const c10::optional<torch::Tensor>& lse_part,
                     double q_scale, double softcap, int64_t window, int64_t num_splits, int64_t num_parts, bool ring,
                     bool has_fresh, int64_t chunk_align, const c10::optional<torch::Tensor>& counters,
                     const c10::optional<torch::Tensor>& out, const c10::optional<torch::Tensor>& sinks,
                     const c10::optional<torch::Tensor>& k_new, const c10::optional<torch::Tensor>& v_new,
                     const c10::optional<torch::Tensor>& key_shift, const c10::optional<torch::Tensor>& recent_k,
                     const c10::optional<torch::Tensor>& recent_v, const c10::optional<torch::Tensor>& first_k,
                     const c10::optional<torch::Tensor>& first_v, int64_t merge_slices, int64_t key_group_a,
                     int64_t k_bits_b, const c10::optional<torch::Tensor>& key_order,
                     const c10::optional<torch::Tensor>& hartley_a, const c10::optional<torch::Tensor>& hartley_b) {
  turboattn::DecodeParams p{};
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.q_stride_t = q.stride(2);
  p.q_dtype = dtype_code(q);
  p.k_codes = k_codes.data_ptr<uint8_t>();
  p.k_scales = k_scales.data_ptr();
  p.v_codes = v_codes.data_ptr<uint8_t>();
  p.v_scales = v_scales.data_ptr();
  p.scale_bf16 = k_scales.scalar_type() == at::kBFloat16;  // else float32 (K and V alike)
  p.seen = seen.data_ptr<int>();
  p.starts = starts.data_ptr<int>();
  p.gain_inv = gain_inv.has_value() ? gain_inv->data_ptr<float>() : nullptr;
  p.signs = signs.data_ptr<float>();
  // Keys in two channel groups (key_group_a > 0): the channel order (int16 [B, Hkv, D] contiguous, or none: the
  // model's) and the groups' Hartley factors.
  TORCH_CHECK(key_group_a == 0 || (hartley_a.has_value() && hartley_b.has_value()),
              "turboattn decode: key groups need their Hartley factors");
  TORCH_CHECK(!key_order.has_value() || (key_order->is_contiguous() && key_order->scalar_type() == at::kShort &&
                                         key_order->numel() == k_codes.size(0) * k_codes.size(1) * q.size(3)),
              "turboattn decode: key_order must be int16 [B, Hkv, D], contiguous");
  p.key_order = key_group_a > 0 && key_order.has_value() ? key_order->data_ptr<int16_t>() : nullptr;
  p.hartley_a = key_group_a > 0 ? hartley_a->data_ptr<float>() : nullptr;
  p.hartley_b = key_group_a > 0 ? hartley_b->data_ptr<float>() : nullptr;
  const int64_t rows = q.size(2) * (q.size(1) / k_codes.size(1));
  const int64_t part_rows = k_codes.size(0) * k_codes.size(1) * num_parts * rows;
  TORCH_CHECK(o_part.has_value() == lse_part.has_value(),
              "turboattn decode: pass both o_part and lse_part, or neither");
  torch::Tensor scratch;  // held until the launch is queued (the allocator orders its reuse on the stream)
  if (o_part.has_value()) {
    p.o_part = o_part->data_ptr<float>();
    p.lse_part = lse_part->data_ptr<float>();
  } else {
    scratch = at::empty({part_rows * (q.size(3) + 1)}, q.options().dtype(at::kFloat));
    p.o_part = scratch.data_ptr<float>();
    p.lse_part = p.o_part + part_rows * q.size(3);
  }
  // The kernel stores a lane's elements of a row with wide (up to 16-byte) stores: the output must be contiguous
  // and 16-byte aligned.
  TORCH_CHECK(!out.has_value() || (out->is_contiguous() && out->sizes() == q.sizes() && out->dtype() == q.dtype() &&
                                   reinterpret_cast<uintptr_t>(out->data_ptr()) % 16 == 0),
              "turboattn decode: out must be contiguous and 16-byte aligned, with q's shape and dtype");
  const torch::Tensor output = out.has_value() ? *out : at::empty(q.sizes(), q.options());
  p.counters = counters.has_value() ? counters->data_ptr<int>() : nullptr;
  p.out = output.data_ptr();
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  if (k_new.has_value()) {  // v_new shares k_new's strides and dtype (q's)
    p.k_new = k_new->data_ptr();
    p.v_new = v_new->data_ptr();
    p.kv_stride_b = k_new->stride(0);
    p.kv_stride_h = k_new->stride(1);
    p.kv_stride_t = k_new->stride(2);
  }
  p.key_shift = key_shift.has_value() ? key_shift->data_ptr<float>() : nullptr;
  // Exact rows: each pair shares strides and the exact dtype (cuda.py makes sure).
  if (recent_k.has_value()) {
    p.recent_k = recent_k->data_ptr();
    p.recent_v = recent_v->data_ptr();
    p.recent_stride_b = recent_k->stride(0);
    p.recent_stride_h = recent_k->stride(1);
    p.recent_stride_t = recent_k->stride(2);
    p.exact_recent = recent_k->size(2) - 1;  // R rows and the scratch row
    p.exact_dtype = dtype_code(*recent_k);
  }
  if (first_k.has_value()) {
    p.first_k = first_k->data_ptr();
    p.first_v = first_v->data_ptr();
    p.first_stride_b = first_k->stride(0);
    p.first_stride_h = first_k->stride(1);
    p.first_stride_t = first_k->stride(2);
    p.exact_first = first_k->size(2);
    p.exact_dtype = dtype_code(*first_k);
  }
  p.q_scale = static_cast<float>(q_scale);
  p.softcap = static_cast<float>(softcap);
  p.tq = q.size(2);
  p.capacity = k_codes.size(2);
  p.window = window;
  p.num_kv_heads = k_codes.size(1);
  p.group = q.size(1) / k_codes.size(1);
  p.num_splits = num_splits;
  p.num_parts = num_parts;
  p.ring = ring;
  p.has_fresh = has_fresh && k_new.has_value();
  p.chunk_align = chunk_align;
  TORCH_CHECK(chunk_align > 0 && (chunk_align & (chunk_align - 1)) == 0, "turboattn decode: chunk_align must be a "
              "power of two, got ", chunk_align);
  TORCH_CHECK(num_splits >= 1, "turboattn decode: at least one split, got ", num_splits);
  p.batch_kv_heads = k_codes.size(0) * k_codes.size(1);
  p.splits_div = turboattn::make_divisor(p.num_splits);
  p.kv_heads_div = turboattn::make_divisor(p.num_kv_heads);
  p.group_div = turboattn::make_divisor(p.group);
  p.rows_div = turboattn::make_divisor(p.tq * p.group);
  p.capacity_div = turboattn::make_divisor(p.capacity);
  // The bit widths pick the kernel; it builds its code tables from the codebooks compiled in (csrc/codebooks.h).
  const int k_bits = static_cast<int>(k_bits_arg);
  const int v_bits = static_cast<int>(v_bits_arg);
  const c10::cuda::CUDAGuard guard(q.device());
  void* stream = at::cuda::getCurrentCUDAStream().stream();
  const int batch_kv_heads = p.batch_kv_heads;
  const int head_dim = q.size(3);
  const bool exact = p.exact_recent > 0 || p.exact_first > 0;
  // With exact rows, parts past the splits are the exact CTAs' (one or more: ops/cached/config.cuda_exact_parts).
  TORCH_CHECK(exact ? num_parts > num_splits : num_parts == num_splits, "turboattn decode: num_parts must be ",
              exact ? "more than num_splits (the exact parts follow the splits)" : "num_splits");
  TORCH_CHECK(num_parts >= 1 && num_parts <= turboattn::MAX_PARTS, "turboattn decode: 1 to ", turboattn::MAX_PARTS,
              " parts (the merge's scratch), got ", num_parts);
  // merge_slices > 0: the merge runs in a launch of its own (merge_rows, that many CTAs per output row, each a slice
  // of D / merge_slices dims), and the decode launch only writes the parts; 0: the fused merge.
  const bool merge_apart = merge_slices > 0;
  TORCH_CHECK(merge_apart || counters.has_value(), "turboattn decode: the fused merge needs the arrival counters");
  // Slices of a row need parts in the model's domain, which the kernel writes at D = 512 (decode.h).
  const int most_slices = turboattn::most_merge_slices(head_dim);
  TORCH_CHECK(merge_slices >= 0 && merge_slices <= most_slices && (merge_slices & (merge_slices - 1)) == 0,
              "turboattn decode: merge_slices must be 0 or a power of two of at most ", most_slices, " at head_dim ",
              head_dim, ", got ", merge_slices);
  p.merge_slices = static_cast<int>(merge_slices);
  p.sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (merge_apart) p.counters = nullptr;
  int err = -1;
  if (key_group_a > 0) {
    err = launch_decode_groups(p, head_dim, key_group_a, k_bits, k_bits_b, v_bits, exact, batch_kv_heads, stream);
    TORCH_CHECK(err != -1, "turboattn decode: no kernel for key groups (", key_group_a, " x ", k_bits, ", ",
                head_dim - key_group_a, " x ", k_bits_b, "), v_bits ", v_bits, " at head_dim ", head_dim);
  } else if (head_dim == 64) {
    err = (exact ? launch_decode_d64_exact : launch_decode_d64)(p, k_bits, v_bits, batch_kv_heads, stream);
  } else if (head_dim == 128) {
    err = (exact ? launch_decode_d128_exact : launch_decode_d128)(p, k_bits, v_bits, batch_kv_heads, stream);
  } else if (head_dim == 256) {
    err = (exact ? launch_decode_d256_exact : launch_decode_d256)(p, k_bits, v_bits, batch_kv_heads, stream);
  } else if (head_dim == 512) {
    err = (exact ? launch_decode_d512_exact : launch_decode_d512)(p, k_bits, v_bits, batch_kv_heads, stream);
  }
  TORCH_CHECK(err != -1, "turboattn decode: no kernel for head_dim ", head_dim, ", k_bits ", k_bits, ", v_bits ", v_bits);
  TORCH_CHECK(err == 0, "turboattn decode launch failed: CUDA error ", err);
  if (merge_apart) {
    err = head_dim == 64    ? launch_merge_d64(p, batch_kv_heads, stream)
          : head_dim == 128 ? launch_merge_d128(p, batch_kv_heads, stream)
          : head_dim == 256 ? launch_merge_d256(p, batch_kv_heads, stream)
                            : launch_merge_d512(p, batch_kv_heads, stream);
    TORCH_CHECK(err == 0, "turboattn decode: the merge's launch failed: CUDA error ", err);
  }
  return output;
}

int64_t ctas_per_sm(int64_t head_dim, int64_t k_bits, int64_t v_bits, bool exact, int64_t key_group_a,
                    int64_t k_bits_b) {
  if (key_group_a > 0) return ctas_per_sm_groups(head_dim, key_group_a, k_bits, k_bits_b, v_bits, exact);
  if (head_dim == 64) return ctas_per_sm_d64(k_bits, v_bits, exact);
  if (head_dim == 128) return ctas_per_sm_d128(k_bits, v_bits, exact);
  if (head_dim == 256) return ctas_per_sm_d256(k_bits, v_bits, exact);
  if (head_dim == 512) return ctas_per_sm_d512(k_bits, v_bits, exact);
  return -1;
}

void quantize_append(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_codes, torch::Tensor& k_scales,
                     torch::Tensor& v_codes, torch::Tensor& v_scales, const torch::Tensor& k_centroids,
                     const torch::Tensor& k_bounds, const torch::Tensor& k_grid, double k_grid_lo, double k_grid_scale,
                     const torch::Tensor& v_centroids, const torch::Tensor& v_bounds, const torch::Tensor& v_grid,
                     double v_grid_lo, double v_grid_scale, const torch::Tensor& signs, const c10::optional<torch::Tensor>& key_shift,
                     const c10::optional<torch::Tensor>& key_gain, torch::Tensor& seen, const torch::Tensor& starts,
                     const c10::optional<torch::Tensor>& arrivals, const c10::optional<torch::Tensor>& new_lengths,
                     const c10::optional<torch::Tensor>& nonfinite, const c10::optional<torch::Tensor>& recent_k,
                     const c10::optional<torch::Tensor>& recent_v, const c10::optional<torch::Tensor>& first_k,
                     const c10::optional<torch::Tensor>& first_v, int64_t k_bits, int64_t v_bits, int64_t rule,
                     bool ring, int64_t key_group_a, int64_t k_bits_b, const c10::optional<torch::Tensor>& key_order,
                     const c10::optional<torch::Tensor>& k2_centroids, const c10::optional<torch::Tensor>& k2_bounds,
                     const c10::optional<torch::Tensor>& k2_grid, double k2_grid_lo, double k2_grid_scale,
                     const c10::optional<torch::Tensor>& hartley_a, const c10::optional<torch::Tensor>& hartley_b) {
  turboattn::QuantizeParams p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_stride_b = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.k_stride_t = k.stride(2);
  p.v_stride_b = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.v_stride_t = v.stride(2);
  p.in_dtype = dtype_code(k);
  p.k_codes = k_codes.data_ptr<uint8_t>();
  p.k_scales = k_scales.data_ptr();
  p.v_codes = v_codes.data_ptr<uint8_t>();
  p.v_scales = v_scales.data_ptr();
  p.scale_bf16 = k_scales.scalar_type() == at::kBFloat16;
  p.k_centroids = k_centroids.data_ptr<float>();
  p.k_bounds = k_bounds.data_ptr<float>();
  p.k_grid = k_grid.data_ptr<uint8_t>();
  p.k_grid_lo = static_cast<float>(k_grid_lo);
  p.k_grid_scale = static_cast<float>(k_grid_scale);
  p.k_grid_size = k_grid.numel();
  p.v_centroids = v_centroids.data_ptr<float>();
  p.v_bounds = v_bounds.data_ptr<float>();
  p.v_grid = v_grid.data_ptr<uint8_t>();
  p.v_grid_lo = static_cast<float>(v_grid_lo);
  p.v_grid_scale = static_cast<float>(v_grid_scale);
  p.v_grid_size = v_grid.numel();
  p.signs = signs.data_ptr<float>();
  p.key_shift = key_shift.has_value() ? key_shift->data_ptr<float>() : nullptr;
  p.key_gain = key_gain.has_value() ? key_gain->data_ptr<float>() : nullptr;
  p.seen = seen.data_ptr<int>();
  p.arrivals = arrivals.has_value() ? arrivals->data_ptr<int>() : nullptr;  // none: seen is the caller's to advance
  if (arrivals.has_value()) {
    // A cache's merge counters [B, Hkv, 1]: sequence b's are its first; a flat buffer: one per sequence.
    p.arrival_stride = arrivals->dim() == 3 ? static_cast<int>(arrivals->size(1) * arrivals->size(2)) : 1;
    TORCH_CHECK((k.size(0) - 1) * p.arrival_stride < arrivals->numel(),
                "turboattn quantize_append: the arrival counters hold fewer than one per sequence");
  }
  p.new_lengths = new_lengths.has_value() ? new_lengths->data_ptr<int>() : nullptr;
  p.nonfinite = nonfinite.has_value() ? nonfinite->data_ptr<int>() : nullptr;
  p.starts = starts.data_ptr<int>();
  // Exact rows: unit stride along D, one dtype (quantize/cuda.py makes sure); each tensor's own strides.
  auto exact_rows = [&](const c10::optional<torch::Tensor>& k_rows, const c10::optional<torch::Tensor>& v_rows,
                        void* (&ptr)[2], long long (&stride)[2][3]) {
    if (!k_rows.has_value()) return 0;
    const torch::Tensor* rows[2] = {&*k_rows, &*v_rows};
    for (int side = 0; side < 2; ++side) {
      ptr[side] = rows[side]->data_ptr();
      for (int i = 0; i < 3; ++i) stride[side][i] = rows[side]->stride(i);
    }
    p.exact_dtype = dtype_code(*k_rows);
    return static_cast<int>(k_rows->size(2));
  };
  const int recent_rows = exact_rows(recent_k, recent_v, p.recent, p.recent_stride);
  p.exact_recent = recent_rows > 0 ? recent_rows - 1 : 0;  // R rows and the scratch row
  p.exact_first = exact_rows(first_k, first_v, p.first, p.first_stride);
  p.k_bits = static_cast<int>(k_bits);
  p.v_bits = static_cast<int>(v_bits);
  p.rule = static_cast<int>(rule);
  p.tokens = k.size(2);
  p.capacity = k_codes.size(2);
  p.num_kv_heads = k_codes.size(1);
  p.ring = ring;
  // Keys in two channel groups (key_group_a 0: one width; k_bits is then group a's bits).
  p.key_group_a = static_cast<int>(key_group_a);
  if (key_group_a != 0) {
    p.k_bits_b = static_cast<int>(k_bits_b);
    p.key_order = key_order.has_value() ? key_order->data_ptr<int16_t>() : nullptr;
    p.k2_centroids = k2_centroids->data_ptr<float>();
    p.k2_bounds = k2_bounds->data_ptr<float>();
    p.k2_grid = k2_grid->data_ptr<uint8_t>();
    p.k2_grid_lo = static_cast<float>(k2_grid_lo);
    p.k2_grid_scale = static_cast<float>(k2_grid_scale);
    p.k2_grid_size = k2_grid->numel();
    p.hartley_a = hartley_a->data_ptr<float>();
    p.hartley_b = hartley_b->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(k.device());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int err = launch_quantize_append(p, k.size(3), k.size(0), sms, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err != -1, "turboattn quantize_append: no kernel for head_dim ", k.size(3),
              key_group_a != 0 ? " with these key groups" : "");
  TORCH_CHECK(err == 0, "turboattn quantize_append launch failed: CUDA error ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "split-K decode over K and V codes of TURBOATTN_BIT_PAIRS (float32 or bfloat16 scales, exact rows), "
        "D = 64 / 128 / 256 / 512");
  m.def("quantize_append", &quantize_append, "fused quantize-append of k, v into the cache's codes, scales and exact "
        "rows, advancing its lengths; D = 64 / 128 / 256 / 512, every bit width, keys in the groups of "
        "TURBOATTN_KEY_GROUPS");
  m.attr("COUNTERS_PER_HEAD") = turboattn::COUNTERS_PER_HEAD;
  m.def("ctas_per_sm", &ctas_per_sm, "CTAs per SM the kernel of (head_dim, k_bits, v_bits, exact rows, key group a's "
        "width or 0, group b's bits) is built for; -1: none", py::arg("head_dim"), py::arg("k_bits"),
        py::arg("v_bits"), py::arg("exact"), py::arg("key_group_a") = 0, py::arg("k_bits_b") = 0);
}
