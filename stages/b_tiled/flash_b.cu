// flash_b.cu -- stage B's CUDA C++ twin: the basic tiled FlashAttention forward kernel.
//
// One thread block per (tile of BR = 32 query rows, batch*head). The Q tile is copied to shared
// memory once; then the block walks over the K/V tiles (BC = 32 keys each):
//
//   copy K_j, V_j global -> registers -> shared   (plain synchronous 4-byte loads; everybody waits)
//   __syncthreads()
//   S = Q K_j^T * scale            (fp32 FMAs on the CUDA cores; one score per lane)
//   online softmax: m_new = max(m, rowmax S); alpha = exp(m - m_new); P = exp(S - m_new);
//                   l = l*alpha + rowsum P;  O = O*alpha
//   O += P V_j                     (P through a small shared buffer)
//
// and divides O by l at the end. S and P never go to global memory: that alone is the
// O(N^2) -> O(N^2 d / BR) traffic cut. What it does NOT do (stage C does): overlap copies with
// math, use tensor cores, keep S in registers, skip causal tiles above the diagonal (here they
// are loaded and masked), use exp2.
//
// Shared-memory layout switch (template PAD): K is read "down a column" -- lane c reads row c of
// K_j at the same d -- so with rows of D halves (128 or 256 bytes, a multiple of the 32 banks x
// 4 bytes) all 32 lanes hit the same bank: a 32-way conflict. PAD adds 2 halves (4 bytes, one
// bank) per row, so row c starts one bank further and the 32 lanes hit 32 different banks.
//
// Plain CUDA (no torch headers); the Python wrapper calls the extern "C" launcher through ctypes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

namespace flash_b {

constexpr int BR = 32;               // query rows per block
constexpr int BC = 32;               // keys per K/V tile: one key per lane
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS_PER_WARP = BR / WARPS;  // 8 query rows per warp
static_assert(BC == 32, "one key per lane of a warp");

// A pair of 16-bit values and its conversions, so the kernel is written once for fp16 and bf16.
template <typename T> struct Pair;
template <> struct Pair<__half> {
    using type = __half2;
    __device__ static float2 to_float2(type x) { return __half22float2(x); }
    __device__ static type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Pair<__nv_bfloat16> {
    using type = __nv_bfloat162;
    __device__ static float2 to_float2(type x) { return __bfloat1622float2(x); }
    __device__ static type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    // strides in elements of the [B, H, N, D] tensors (the head dim has stride 1)
    int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn;
    int H, N;
    float sm_scale;
    int causal;
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// Copy rows [row0, row0 + 32) of one head's [N, D] matrix into a shared tile, 2 elements (4 bytes)
// per thread per step: an ordinary load into a register, then an ordinary store to shared memory.
// Rows >= N become zeros (a zero V row times p = 0 stays 0; garbage could be NaN).
template <typename T, int D, int ROW>
__device__ __forceinline__ void load_tile(T (*tile)[ROW], const T* src, int64_t row_stride, int row0, int N) {
    using P2 = typename Pair<T>::type;
    constexpr int PAIRS_PER_ROW = D / 2;
    for (int i = threadIdx.x; i < BR * PAIRS_PER_ROW; i += THREADS) {
        const int r = i / PAIRS_PER_ROW, c = (i % PAIRS_PER_ROW) * 2;
        P2 x = Pair<T>::from_floats(0.f, 0.f);
        if (row0 + r < N) x = *reinterpret_cast<const P2*>(src + (int64_t)(row0 + r) * row_stride + c);
        *reinterpret_cast<P2*>(&tile[r][c]) = x;
    }
}

template <typename T, int D, bool PAD>
__global__ void __launch_bounds__(THREADS) flash_b_fwd_kernel(const Params p) {
    using P2 = typename Pair<T>::type;
    constexpr int ROW = D + (PAD ? 2 : 0);  // row stride in elements; +2 halves = +1 bank
    __shared__ __align__(16) T Qs[BR][ROW];
    __shared__ __align__(16) T Ks[BC][ROW];
    __shared__ __align__(16) T Vs[BC][ROW];
    __shared__ float Ps[BR][BC];  // this tile's probabilities; each warp uses only its own 8 rows

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = blockIdx.x * BR;
    const int b = blockIdx.y / p.H, h = blockIdx.y % p.H;
    const int N = p.N;
    const T* q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
    const T* k = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh;
    const T* v = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh;
    T* o = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;

    // Per warp: 8 query rows r0 .. r0+7 of the tile. Per lane: key `lane` of each K/V tile for the
    // scores, and output columns 64*cc + 2*lane, +1 (cc < D/64) for the accumulator.
    const int r0 = warp * ROWS_PER_WARP;
    constexpr int COLS = D / 64;  // column pairs per lane
    float acc[ROWS_PER_WARP][COLS][2];
    float m_run[ROWS_PER_WARP], l_run[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        m_run[i] = -CUDART_INF_F;
        l_run[i] = 0.f;
#pragma unroll
        for (int cc = 0; cc < COLS; ++cc) acc[i][cc][0] = acc[i][cc][1] = 0.f;
    }

    load_tile<T, D, ROW>(Qs, q, p.q_sn, q0, N);

    // Every K/V tile is visited, also under causal masking (tiles above the diagonal are loaded
    // and then fully masked: stage C skips them).
    const int n_kv = (N + BC - 1) / BC;
    for (int j = 0; j < n_kv; ++j) {
        const int kv0 = j * BC;
        __syncthreads();  // everybody is done with the previous K/V tile before we overwrite it
        load_tile<T, D, ROW>(Ks, k, p.k_sn, kv0, N);
        load_tile<T, D, ROW>(Vs, v, p.v_sn, kv0, N);
        __syncthreads();  // the tile (and, at j = 0, Q) is complete in shared memory

        // ---- S = Q K^T: lane c computes the scores of key kv0 + c against the warp's 8 rows.
        // Q reads are broadcasts (all lanes, same address); the K read is the column access.
        float s[ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) s[i] = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; d += 2) {
            const float2 kk = Pair<T>::to_float2(*reinterpret_cast<const P2*>(&Ks[lane][d]));
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) {
                const float2 qq = Pair<T>::to_float2(*reinterpret_cast<const P2*>(&Qs[r0 + i][d]));
                s[i] = fmaf(qq.x, kk.x, fmaf(qq.y, kk.y, s[i]));
            }
        }

        // ---- online softmax, one row at a time; the row's 32 scores are one per lane.
        const int key = kv0 + lane;
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int row = q0 + r0 + i;
            float x = s[i] * p.sm_scale;
            if (key >= N || (p.causal && key > row)) x = -CUDART_INF_F;
            const float m_new = fmaxf(m_run[i], warp_max(x));
            // A row whose scores are all masked so far has m = -inf: subtract 0 instead (p = 0, no NaN).
            const float m_use = (m_new == -CUDART_INF_F) ? 0.f : m_new;
            const float alpha = expf(m_run[i] - m_use);
            const float pv = expf(x - m_use);
            l_run[i] = l_run[i] * alpha + warp_sum(pv);
            m_run[i] = m_new;
#pragma unroll
            for (int cc = 0; cc < COLS; ++cc) {
                acc[i][cc][0] *= alpha;
                acc[i][cc][1] *= alpha;
            }
            Ps[r0 + i][lane] = pv;
        }
        __syncwarp();  // the warp's P rows are written before its lanes read them back

        // ---- O += P V: lane owns output columns 64*cc + 2*lane, +1. V reads are row-contiguous
        // (conflict-free); P reads are broadcasts.
#pragma unroll 4
        for (int c = 0; c < BC; ++c) {
#pragma unroll
            for (int cc = 0; cc < COLS; ++cc) {
                const float2 vv = Pair<T>::to_float2(*reinterpret_cast<const P2*>(&Vs[c][cc * 64 + 2 * lane]));
#pragma unroll
                for (int i = 0; i < ROWS_PER_WARP; ++i) {
                    const float pv = Ps[r0 + i][c];
                    acc[i][cc][0] = fmaf(pv, vv.x, acc[i][cc][0]);
                    acc[i][cc][1] = fmaf(pv, vv.y, acc[i][cc][1]);
                }
            }
        }
        __syncwarp();  // done reading P before the next tile overwrites it
    }

    // ---- epilogue: O / l, rows < N only
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const int row = q0 + r0 + i;
        if (row >= N) continue;
        const float inv_l = l_run[i] > 0.f ? 1.f / l_run[i] : 0.f;
#pragma unroll
        for (int cc = 0; cc < COLS; ++cc)
            *reinterpret_cast<P2*>(o + (int64_t)row * p.o_sn + cc * 64 + 2 * lane) =
                Pair<T>::from_floats(acc[i][cc][0] * inv_l, acc[i][cc][1] * inv_l);
    }
}

template <typename T, int D, bool PAD>
cudaError_t launch(const Params& p, int B, cudaStream_t stream) {
    const dim3 grid((p.N + BR - 1) / BR, B * p.H);
    flash_b_fwd_kernel<T, D, PAD><<<grid, THREADS, 0, stream>>>(p);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dim(const Params& p, int B, int D, int pad, cudaStream_t stream) {
    if (D == 64) return pad ? launch<T, 64, true>(p, B, stream) : launch<T, 64, false>(p, B, stream);
    if (D == 128) return pad ? launch<T, 128, true>(p, B, stream) : launch<T, 128, false>(p, B, stream);
    return cudaErrorInvalidValue;
}

}  // namespace flash_b

// C ABI for ctypes. dtype: 0 = fp16, 1 = bf16; pad: 0 = rows of D elements, 1 = rows of D+2.
// Pointers must be 4-byte aligned and the B/H/N strides even (the wrapper checks).
// Returns a cudaError_t (0 = success).
extern "C" int flash_b_forward(const void* q, const void* k, const void* v, void* o, const int64_t* strides,
                               int B, int H, int N, int D, float sm_scale, int causal, int dtype, int pad,
                               int device, void* stream) {
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) return (int)err;
    flash_b::Params p;
    p.q = q; p.k = k; p.v = v; p.o = o;
    p.q_sb = strides[0]; p.q_sh = strides[1]; p.q_sn = strides[2];
    p.k_sb = strides[3]; p.k_sh = strides[4]; p.k_sn = strides[5];
    p.v_sb = strides[6]; p.v_sh = strides[7]; p.v_sn = strides[8];
    p.o_sb = strides[9]; p.o_sh = strides[10]; p.o_sn = strides[11];
    p.H = H; p.N = N;
    p.sm_scale = sm_scale;
    p.causal = causal;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (dtype == 0) return (int)flash_b::launch_dim<__half>(p, B, D, pad, s);
    if (dtype == 1) return (int)flash_b::launch_dim<__nv_bfloat16>(p, B, D, pad, s);
    return (int)cudaErrorInvalidValue;
}

extern "C" const char* flash_b_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
