// Python binding of the CUDA decode kernel: checks nothing (ops/cached/cuda.py validated the call), fills the
// parameter block from tensors and launches on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "decode_k4.h"

void decode_k4(const torch::Tensor& q, const torch::Tensor& k_codes, const torch::Tensor& k_scales,
               const torch::Tensor& v_codes, const torch::Tensor& v_scales, const torch::Tensor& seen,
               const torch::Tensor& starts, const c10::optional<torch::Tensor>& gain_inv, const torch::Tensor& signs,
               const torch::Tensor& centroids, torch::Tensor& o_part, torch::Tensor& lse_part, double q_scale,
               double softcap, int64_t window, int64_t num_splits, int64_t num_parts, bool ring, bool has_fresh,
               int64_t chunk_align, int64_t min_blocks, const c10::optional<torch::Tensor>& counters,
               const c10::optional<torch::Tensor>& out, const c10::optional<torch::Tensor>& sinks,
               const c10::optional<torch::Tensor>& k_new, const c10::optional<torch::Tensor>& v_new,
               const c10::optional<torch::Tensor>& key_shift) {
  turboattn::DecodeParams p{};
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.q_stride_t = q.stride(2);
  p.q_dtype = q.scalar_type() == at::kHalf ? 0 : (q.scalar_type() == at::kBFloat16 ? 1 : 2);
  p.k_codes = k_codes.data_ptr<uint8_t>();
  p.k_scales = k_scales.data_ptr<float>();
  p.v_codes = v_codes.data_ptr<uint8_t>();
  p.v_scales = v_scales.data_ptr<float>();
  p.seen = seen.data_ptr<int>();
  p.starts = starts.data_ptr<int>();
  p.gain_inv = gain_inv.has_value() ? gain_inv->data_ptr<float>() : nullptr;
  p.signs = signs.data_ptr<float>();
  p.centroids = centroids.data_ptr<float>();
  p.o_part = o_part.data_ptr<float>();
  p.lse_part = lse_part.data_ptr<float>();
  p.counters = counters.has_value() ? counters->data_ptr<int>() : nullptr;
  p.out = out.has_value() ? out->data_ptr() : nullptr;
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  if (k_new.has_value()) {  // v_new shares k_new's strides and dtype (q's)
    p.k_new = k_new->data_ptr();
    p.v_new = v_new->data_ptr();
    p.kv_stride_b = k_new->stride(0);
    p.kv_stride_h = k_new->stride(1);
    p.kv_stride_t = k_new->stride(2);
  }
  p.key_shift = key_shift.has_value() ? key_shift->data_ptr<float>() : nullptr;
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
  const c10::cuda::CUDAGuard guard(q.device());
  const int err = launch_decode_k4(p, q.size(3), num_splits, k_codes.size(0) * k_codes.size(1), min_blocks,
                                        at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "turboattn decode_k4 launch failed: CUDA error ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_k4", &decode_k4, "split-K decode, 4-bit K/V, D = 64 / 128 / 256"); }
