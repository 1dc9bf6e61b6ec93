// Causal GQA attention forward, flash style: a block owns 64 query rows of one head, streams
// 64-key tiles of K and V through shared memory, and keeps a running max and sum per row
// (online softmax), so no [seq, seq] score matrix ever exists; it saves lse for backward. With a
// sliding window the block streams only the key tiles its rows' windows reach, and masks the
// keys left of each row's window inside them.
#include "attention_flash.cuh"

namespace strata::kernels {
namespace {

using namespace flash;  // NOLINT(google-build-using-namespace): this file's own toolkit

constexpr int kBr = 64;  // query rows per block: 16 per warp
constexpr int kBc = 64;  // keys per tile

template <int HD>
struct FwdLayout {
  static constexpr int kLdKV = HD + 8;  // bf16 K and V tiles (also stages Q)
  static constexpr int kLdS = kBc + 4;  // fp32 scores
  static constexpr int kLdP = kBc + 8;  // bf16 probabilities
  static constexpr int kLdO = HD + 4;   // fp32 output accumulator
  static constexpr std::size_t kK = 0;
  static constexpr std::size_t kV = kK + align_region(kBc * kLdKV * 2);
  static constexpr std::size_t kS = kV + align_region(kBc * kLdKV * 2);
  static constexpr std::size_t kP = kS + align_region(kBr * kLdS * 4);
  static constexpr std::size_t kO = kP + align_region(kBr * kLdP * 2);
  static constexpr std::size_t kM = kO + align_region(kBr * kLdO * 4);
  static constexpr std::size_t kL = kM + align_region(kBr * 4);
  static constexpr std::size_t kBytes = kL + align_region(kBr * 4);
};

// grid (ceil(seq / kBr), heads, batch); the last query tiles (the most keys) start first.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                         const bf16_t* __restrict__ v, bf16_t* __restrict__ out,
                         float* __restrict__ lse, Dims d) {
  using L = FwdLayout<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* Ks = reinterpret_cast<bf16_t*>(smem + L::kK);
  bf16_t* Vs = reinterpret_cast<bf16_t*>(smem + L::kV);
  float* Ss = reinterpret_cast<float*>(smem + L::kS);
  bf16_t* Ps = reinterpret_cast<bf16_t*>(smem + L::kP);
  float* Os = reinterpret_cast<float*>(smem + L::kO);
  float* Ms = reinterpret_cast<float*>(smem + L::kM);
  float* Ls = reinterpret_cast<float*>(smem + L::kL);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t qt = gridDim.x - 1 - blockIdx.x;
  const std::int64_t h = blockIdx.y, b = blockIdx.z, g = h / d.group;
  const std::int64_t i0 = qt * kBr;

  // This warp's 16 query rows as A fragments, staged through the K buffer.
  load_tile<kBr, HD>(Ks, L::kLdKV, q, b, i0, d.seq, d.heads, h);
  for (int idx = threadIdx.x; idx < kBr * L::kLdO; idx += kThreads) Os[idx] = 0.0f;
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    Ms[r] = -INFINITY;
    Ls[r] = 0.0f;
  }
  __syncthreads();
  FragA qf[HD / 16];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    wmma::load_matrix_sync(qf[kk], Ks + warp * 16 * L::kLdKV + kk * 16, L::kLdKV);
  }

  // Softmax work split: lane pair (2r, 2r + 1) owns row warp * 16 + r, one half of it each.
  const int row = warp * 16 + (lane >> 1);
  const int half = lane & 1;
  const std::int64_t i = i0 + row;
  const std::int64_t last = (i0 + kBr < d.seq ? i0 + kBr : d.seq) - 1;
  const std::int64_t num_tiles = last / kBc + 1;  // causal: keys up to the tile's last row
  // Window: no key before the first row's first key (tiles wholly left of it are skipped).
  // A row may still find no key in some tile it shares with other rows; its running max then
  // stays as it was (-inf before its first key: the `none` case below), and every row's window
  // holds its own diagonal key, so each valid row ends with l > 0 and a finite lse.
  const std::int64_t first_tile = first_key(d, i0) / kBc;

  for (std::int64_t jt = first_tile; jt < num_tiles; ++jt) {
    const std::int64_t j0 = jt * kBc;
    __syncthreads();  // the Q staging and the previous tile's K/V are no longer read
    load_tile<kBc, HD>(Ks, L::kLdKV, k, b, j0, d.seq, d.kv_heads, g);
    load_tile<kBc, HD>(Vs, L::kLdKV, v, b, j0, d.seq, d.kv_heads, g);
    __syncthreads();

    // S (16 x kBc per warp) = Q K^T; K's rows are B's columns: col_major with ld kLdKV.
#pragma unroll
    for (int n = 0; n < kBc / 16; ++n) {
      FragC c;
      wmma::fill_fragment(c, 0.0f);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        FragBCol bf;
        wmma::load_matrix_sync(bf, Ks + n * 16 * L::kLdKV + kk * 16, L::kLdKV);
        wmma::mma_sync(c, qf[kk], bf, c);
      }
      wmma::store_matrix_sync(Ss + warp * 16 * L::kLdS + n * 16, c, L::kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax on this lane's half row; masked (j > i, i - j >= window or j >= seq)
    // scores are -inf.
    constexpr int kHalf = kBc / 2;
    float sv[kHalf];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const int col = half * kHalf + c;
      const std::int64_t j = j0 + col;
      sv[c] = (attends(d, i, j) && j < d.seq) ? d.scale * Ss[row * L::kLdS + col] : -INFINITY;
      mx = fmaxf(mx, sv[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_old = Ms[row];
    const float m_new = fmaxf(m_old, mx);
    const bool none = m_new == -INFINITY;  // no valid key yet: keep everything at zero
    const float alpha = none ? 1.0f : expf(m_old - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const float p = (none || sv[c] == -INFINITY) ? 0.0f : expf(sv[c] - m_new);
      sum += p;
      Ps[row * L::kLdP + half * kHalf + c] = __float2bfloat16_rn(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // also orders both lanes' reads of Ms[row]
    if (half == 0) {
      Ms[row] = m_new;
      Ls[row] = Ls[row] * alpha + sum;
    }
#pragma unroll 8
    for (int c = 0; c < HD / 2; ++c) Os[row * L::kLdO + half * (HD / 2) + c] *= alpha;
    __syncwarp();

    // O (16 x HD per warp) += P V; V's rows are B's rows: row_major with ld kLdKV.
#pragma unroll
    for (int dn = 0; dn < HD / 16; ++dn) {
      FragC c;
      float* o_tile = Os + warp * 16 * L::kLdO + dn * 16;
      wmma::load_matrix_sync(c, o_tile, L::kLdO, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        FragA af;
        FragBRow bf;
        wmma::load_matrix_sync(af, Ps + warp * 16 * L::kLdP + kk * 16, L::kLdP);
        wmma::load_matrix_sync(bf, Vs + kk * 16 * L::kLdKV + dn * 16, L::kLdKV);
        wmma::mma_sync(c, af, bf, c);
      }
      wmma::store_matrix_sync(o_tile, c, L::kLdO, wmma::mem_row_major);
    }
    __syncwarp();
  }

  // lse = m + log(l); then Ls holds 1 / l for the output's normalization.
  if (lane < 16) {
    const int r = warp * 16 + lane;
    if (i0 + r < d.seq) lse[(b * d.heads + h) * d.seq + i0 + r] = Ms[r] + logf(Ls[r]);
    Ls[r] = 1.0f / Ls[r];
  }
  __syncwarp();
  store_rows<HD>(Os, L::kLdO, warp * 16, Ls, out, b, i0, d.seq, d.heads, h);
}

template <int HD>
int launch_forward(const LaunchContext& ctx, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                   bf16_t* out, float* lse, const AttentionDims& ad) {
  using L = FwdLayout<HD>;
  const Dims d = dims_of(ad);
  const cudaError_t e =
      cudaFuncSetAttribute(flash_forward_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(L::kBytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>((ad.seq + kBr - 1) / kBr), static_cast<unsigned>(ad.heads),
                  static_cast<unsigned>(ad.batch));
  flash_forward_kernel<HD><<<grid, kThreads, L::kBytes, stream_of(ctx)>>>(q, k, v, out, lse, d);
  return launch_check();
}

}  // namespace

std::size_t flash_forward_smem_bytes(std::int64_t head_dim) {
  if (head_dim == 64) return FwdLayout<64>::kBytes;
  if (head_dim == 128) return FwdLayout<128>::kBytes;
  return 0;
}

int attention_forward_flash(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                            void* out, float* lse, const AttentionDims& d) {
  if (d.seq == 0 || d.batch == 0) return 0;
  if (!flash_attention_applies(ctx, d, Elem::kBF16, false) || !aligned16(q) || !aligned16(k) ||
      !aligned16(v) || !aligned16(out)) {
    return static_cast<int>(cudaErrorNotSupported);
  }
  const auto* qb = static_cast<const bf16_t*>(q);
  const auto* kb = static_cast<const bf16_t*>(k);
  const auto* vb = static_cast<const bf16_t*>(v);
  auto* ob = static_cast<bf16_t*>(out);
  return d.head_dim == 64 ? launch_forward<64>(ctx, qb, kb, vb, ob, lse, d)
                          : launch_forward<128>(ctx, qb, kb, vb, ob, lse, d);
}

}  // namespace strata::kernels
