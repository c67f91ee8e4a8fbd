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
// * lora_segments: the LoRA deltas of all the fine-tuned tasks of a step on one fused linear, one
//   call per linear and layer (node_agent/task_ops.py; per task, PyTorch needs two to four ops).

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

// lora_segments: the LoRA deltas of every task in a step on one fused linear of a layer, in one call
// (Punica's SGMV, on CPU): y[rows_e, cols_k] += scale_k * (x[rows_e] @ a[e][ranks_k]^T) @ b[k].
//
// Entry e is a task's rows [row_start, row_end) of the step and a[e] its [R, in] down-projection of
// this linear (PEFT's lora_A, the modules of a fused linear stacked: R = their ranks summed); its
// blocks k = first_block .. first_block + block_count - 1 are its modules: b[k] [r_k, out_k] is a
// module's up-projection (lora_B transposed), reading ranks [rank_start_k, rank_start_k + r_k) and
// writing columns [col_start_k, col_start_k + out_k) of y. Entries write disjoint rows. Each row is
// computed on its own (no blocking across rows), so a row's delta does not depend on the batch.
void lora_segments(const at::Tensor& y, const at::Tensor& x, at::TensorList a, at::TensorList b,
                   at::IntArrayRef segments, at::IntArrayRef blocks, at::ArrayRef<double> scales) {
  check_rows(y, "lora_segments");
  check_rows(x, "lora_segments");
  const int64_t T = x.size(0), N = x.size(1), E = static_cast<int64_t>(a.size()), K = static_cast<int64_t>(b.size());
  TORCH_CHECK(y.size(0) == T, "lora_segments: x and y must have the same rows");
  TORCH_CHECK(static_cast<int64_t>(segments.size()) == 4 * E, "lora_segments: 4 numbers per entry");
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == 2 * K && static_cast<int64_t>(scales.size()) == K,
              "lora_segments: 2 numbers and one scale per block");
  for (int64_t e = 0; e < E; ++e) {
    const at::Tensor& ae = a[e];
    const int64_t rs = segments[4 * e], re = segments[4 * e + 1], k0 = segments[4 * e + 2], nk = segments[4 * e + 3];
    TORCH_CHECK(ae.dim() == 2 && ae.scalar_type() == at::kFloat && ae.device().is_cpu() && ae.is_contiguous() &&
                ae.size(1) == N, "lora_segments: a[", e, "] must be contiguous float32 [R, in]");
    TORCH_CHECK(0 <= rs && rs <= re && re <= T && 0 <= k0 && nk >= 0 && k0 + nk <= K,
                "lora_segments: entry ", e, " out of range");
    for (int64_t k = k0; k < k0 + nk; ++k) {
      const at::Tensor& bk = b[k];
      TORCH_CHECK(bk.dim() == 2 && bk.scalar_type() == at::kFloat && bk.device().is_cpu() && bk.is_contiguous(),
                  "lora_segments: b[", k, "] must be contiguous float32 [r, out]");
      TORCH_CHECK(blocks[2 * k] >= 0 && blocks[2 * k] + bk.size(0) <= ae.size(0) && blocks[2 * k + 1] >= 0 &&
                  blocks[2 * k + 1] + bk.size(1) <= y.size(1), "lora_segments: block ", k, " out of range");
    }
  }
  const float* xd = x.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  at::parallel_for(0, E, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xa;
    for (int64_t e = begin; e < end; ++e) {
      const float* ad = a[e].data_ptr<float>();
      const int64_t R = a[e].size(0), k0 = segments[4 * e + 2], nk = segments[4 * e + 3];
      xa.resize(R);
      for (int64_t row = segments[4 * e]; row < segments[4 * e + 1]; ++row) {
        const float* xr = xd + row * xs;
        for (int64_t r = 0; r < R; ++r) {  // x·Aᵀ: one contiguous dot product per rank
          const float* ar = ad + r * N;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < N; ++i) dot += xr[i] * ar[i];
          xa[r] = dot;
        }
        float* yr = yd + row * ys;
        for (int64_t k = k0; k < k0 + nk; ++k) {  // each module's (x·Aᵀ)·B into its columns, four ranks a pass
          const float* bd = b[k].data_ptr<float>();
          const int64_t rk = b[k].size(0), out = b[k].size(1);
          const float s = static_cast<float>(scales[k]);
          float* yc = yr + blocks[2 * k + 1];
          const float* c = xa.data() + blocks[2 * k];
          int64_t r = 0;
          for (; r + 4 <= rk; r += 4) {
            const float c0 = s * c[r], c1 = s * c[r + 1], c2 = s * c[r + 2], c3 = s * c[r + 3];
            const float *b0 = bd + r * out, *b1 = b0 + out, *b2 = b1 + out, *b3 = b2 + out;
#pragma omp simd
            for (int64_t j = 0; j < out; ++j) yc[j] += c0 * b0[j] + c1 * b1[j] + c2 * b2[j] + c3 * b3[j];
          }
          for (; r < rk; ++r) {
            const float cr = s * c[r];
            const float* br = bd + r * out;
#pragma omp simd
            for (int64_t j = 0; j < out; ++j) yc[j] += cr * br[j];
          }
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(helix, m) {
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, "
        "Tensor positions, Tensor cache_layers, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("lora_segments(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, int[] segments, int[] blocks, "
        "float[] scales) -> ()");
}

TORCH_LIBRARY_IMPL(helix, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("lora_segments", &lora_segments);
}
