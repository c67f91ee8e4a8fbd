// The engine's CPU kernels, registered as torch.ops.helix.*; node_agent/native.py builds and loads
// this file and node_agent/model.py calls it. Float32 on CPU; compiled with -ffast-math
// (reassociated sums, vectorized exp), so results match PyTorch to float rounding, not bit for bit.
//
// * decode_attention: all the one-token decodes of a step in one call. Each request writes its new
//   K/V row into its own cache and attends over all its cached keys. The cost of decode attention
//   is reading the cache: one pass reads each request's keys once and values once, and the query
//   heads of a KV head (grouped-query attention) share each key row.
// * rms_norm: one pass per row (PyTorch's CPU rms_norm is a chain of five ops).
// * silu_mul: SiLU(gate) * up of the fused [gate | up] projection, one pass.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

struct Step {
  int64_t requests, heads, kv_heads, head_dim;
  const int64_t* positions;           // position of each request's new token
  std::vector<float*> k, v;           // each request's [kv_heads, capacity, head_dim] cache of this layer
  std::vector<int64_t> capacity;
  const float* q; int64_t q_s0, q_s1;  // [requests, heads, head_dim], last dim contiguous
  const float* k_new; int64_t kn_s0, kn_s1;
  const float* v_new; int64_t vn_s0, vn_s1;
  float* out;                         // [requests, heads * head_dim]
  float scale;
};

// DC: head_dim known at compile time (the common 64 / 128 unroll fully), 0 = read it from the step.
template <int64_t DC>
void attend(const Step& s) {
  const int64_t D = DC ? DC : s.head_dim;
  const int64_t G = s.heads / s.kv_heads;
  at::parallel_for(0, s.requests * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.kv_heads, h = bh % s.kv_heads, pos = s.positions[b], L = pos + 1;
      float* kh = s.k[b] + h * s.capacity[b] * D;
      float* vh = s.v[b] + h * s.capacity[b] * D;
      std::memcpy(kh + pos * D, s.k_new + b * s.kn_s0 + h * s.kn_s1, D * sizeof(float));
      std::memcpy(vh + pos * D, s.v_new + b * s.vn_s0 + h * s.vn_s1, D * sizeof(float));
      const float* qg = s.q + b * s.q_s0 + h * G * s.q_s1;  // query head h * G + j at qg + j * q_s1
      scores.resize(G * L);
      for (int64_t l = 0; l < L; ++l) {
        const float* kr = kh + l * D;
        for (int64_t j = 0; j < G; ++j) {
          const float* qj = qg + j * s.q_s1;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < D; ++x) dot += qj[x] * kr[x];
          scores[j * L + l] = dot * s.scale;
        }
      }
      for (int64_t j = 0; j < G; ++j) {  // softmax over the keys, per query head
        float* sj = scores.data() + j * L;
        const float m = *std::max_element(sj, sj + L);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < L; ++l) {
          sj[l] = std::exp(sj[l] - m);
          sum += sj[l];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) sj[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const float* vr = vh + l * D;
        for (int64_t j = 0; j < G; ++j) {
          const float p = scores[j * L + l];
          float* aj = acc.data() + j * D;
#pragma omp simd
          for (int64_t x = 0; x < D; ++x) aj[x] += p * vr[x];
        }
      }
      std::memcpy(s.out + b * s.heads * D + h * G * D, acc.data(), G * D * sizeof(float));
    }
  });
}

// q [B, H, D], k_new / v_new [B, KVH, D] (rows may be strided; the last dim contiguous).
// k_cache[b] / v_cache[b]: request b's contiguous [layers_b, KVH, capacity_b, D] cache;
// cache_layers[b] is the layer slot to use, positions[b] the position of the new token.
// Returns [B, H * D]: head j of request b attends with KV head j / (H / KVH) (transformers' order).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            at::TensorList k_cache, at::TensorList v_cache,
                            const at::Tensor& positions, const at::Tensor& cache_layers, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3, "decode_attention: q, k_new, v_new must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_new.scalar_type() == at::kFloat && v_new.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.device().is_cpu(), "decode_attention: CPU tensors only");
  Step s;
  s.requests = q.size(0), s.heads = q.size(1), s.head_dim = q.size(2), s.kv_heads = k_new.size(1);
  const int64_t B = s.requests, D = s.head_dim, KVH = s.kv_heads;
  TORCH_CHECK(KVH > 0 && s.heads % KVH == 0, "decode_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(k_new.size(0) == B && v_new.size(0) == B && v_new.size(1) == KVH && k_new.size(2) == D && v_new.size(2) == D,
              "decode_attention: k_new / v_new shape mismatch");
  TORCH_CHECK(q.stride(2) == 1 && k_new.stride(2) == 1 && v_new.stride(2) == 1, "decode_attention: last dim must be contiguous");
  TORCH_CHECK(static_cast<int64_t>(k_cache.size()) == B && static_cast<int64_t>(v_cache.size()) == B,
              "decode_attention: one K and one V cache per request");
  TORCH_CHECK(positions.scalar_type() == at::kLong && cache_layers.scalar_type() == at::kLong &&
              positions.numel() == B && cache_layers.numel() == B && positions.is_contiguous() && cache_layers.is_contiguous(),
              "decode_attention: positions / cache_layers must be int64 [B]");
  s.positions = positions.data_ptr<int64_t>();
  const int64_t* layer = cache_layers.data_ptr<int64_t>();
  s.k.resize(B), s.v.resize(B), s.capacity.resize(B);
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor& kc = k_cache[b];
    const at::Tensor& vc = v_cache[b];
    TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() && vc.is_contiguous() &&
                kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(1) == KVH && kc.size(3) == D,
                "decode_attention: cache ", b, " must be contiguous float32 [layers, KVH, capacity, D]");
    TORCH_CHECK(layer[b] >= 0 && layer[b] < kc.size(0), "decode_attention: layer slot out of range for request ", b);
    TORCH_CHECK(s.positions[b] >= 0 && s.positions[b] < kc.size(2),
                "decode_attention: position out of the reserved KV for request ", b);
    s.capacity[b] = kc.size(2);
    s.k[b] = kc.data_ptr<float>() + layer[b] * KVH * s.capacity[b] * D;
    s.v[b] = vc.data_ptr<float>() + layer[b] * KVH * s.capacity[b] * D;
  }
  at::Tensor out = at::empty({B, s.heads * D}, q.options());
  s.q = q.data_ptr<float>(), s.q_s0 = q.stride(0), s.q_s1 = q.stride(1);
  s.k_new = k_new.data_ptr<float>(), s.kn_s0 = k_new.stride(0), s.kn_s1 = k_new.stride(1);
  s.v_new = v_new.data_ptr<float>(), s.vn_s0 = v_new.stride(0), s.vn_s1 = v_new.stride(1);
  s.out = out.data_ptr<float>();
  s.scale = static_cast<float>(scale);
  if (D == 64) attend<64>(s);
  else if (D == 128) attend<128>(s);
  else attend<0>(s);
  return out;
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              op, ": float32 CPU rows [T, N] with contiguous rows expected");
}

// x [T, N] -> x / sqrt(mean(x^2) + eps) * weight, per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: weight must be float32 [N]");
  const int64_t T = x.size(0), N = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({T, N}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xd + t * xs;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < N; ++i) sq += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(N) + static_cast<float>(eps));
      float* orow = od + t * N;
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) orow[i] = w[i] * (xr[i] * inv);
    }
  });
  return out;
}

// gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: the last dim must be [gate | up]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* gd = gate_up.data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gd + t * gs;
      const float* u = g + I;
      float* orow = od + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) orow[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(helix, m) {
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, "
        "Tensor positions, Tensor cache_layers, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(helix, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
}
