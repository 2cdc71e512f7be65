// flash_c.cu -- stage C's CUDA C++ twin: the optimized FlashAttention forward kernel.
//
// Same algorithm as flash_b.cu (Q tile resident, loop over K/V tiles, online softmax), with every
// mechanism that Triton hides written out by hand:
//
//   1. 16-byte copies global -> shared with `cp.async.cg.shared.global` (SASS: LDGSTS). The copy
//      bypasses the registers and runs in the background while the warp computes.
//   2. Double buffering: two K buffers and two V buffers. Tile j+1 is in flight while tile j is
//      used; `cp.async.commit_group` closes a batch of copies, `cp.async.wait_group 1` waits for
//      all batches but the newest, placed right before the data is needed (K before QK^T, V before PV).
//   3. Shared-memory layout switch (template LAYOUT): UNPADDED rows of D halves; PADDED rows of
//      D+8 halves (+16 bytes), which spreads the 8 rows an `ldmatrix` phase reads over all 32 banks;
//      SWIZZLED: unpadded rows whose 16-byte chunks are permuted by XOR with (row % 8), same effect
//      without wasting memory.
//   4. Tensor cores: `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}...` (SASS: HMMA), operands
//      fetched from shared memory with `ldmatrix` (SASS: LDSM), `.trans` for V.
//   5. Register tiling: each warp owns 16 query rows; Q fragments, the S tile and the O accumulator
//      live in registers for the whole kernel. S and P never touch shared memory.
//   6. Online softmax in registers, with exp2: log2(e) is folded into the scale so exp(x) = exp2(x*log2e)
//      costs one FFMA + one MUFU.EX2.
//   7. Causal tile skipping: a Q tile only visits K/V tiles at or below the diagonal; only the
//      diagonal tile (and the ragged last tile) pays for the element-wise mask. Q tiles are
//      scheduled longest-first so the long causal tiles do not end up as a tail.
//
// The file is plain CUDA (no torch headers): `nvcc` compiles it alone in seconds, the tests do
// exactly that, and the Python wrapper calls the extern "C" launcher at the bottom through ctypes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

namespace flash_c {

constexpr int BR = 64;        // query rows per thread block (Q tile)
constexpr int BC = 64;        // keys per K/V tile
constexpr int WARPS = 4;      // each warp owns BR / WARPS = 16 query rows: one m16 MMA row block
constexpr int THREADS = WARPS * 32;
static_assert(BR == WARPS * 16, "one 16-row MMA block per warp");
static_assert(BR == BC, "the causal tile count below assumes square tiles");

enum Layout { UNPADDED = 0, PADDED = 1, SWIZZLED = 2 };

// ---------------------------------------------------------------------------------------------
// Shared-memory tile layout: where element (row, col) of a [64, D] tile lives, in elements.
// Every access in this kernel starts at a column that is a multiple of 8 (one 16-byte chunk), so
// the swizzle may permute whole chunks.
template <int D, int LAYOUT>
struct Tile {
    static constexpr int ROW = (LAYOUT == PADDED) ? D + 8 : D;  // row stride in elements
    static constexpr int ELEMS = BR * ROW;                      // elements per tile
    __device__ __forceinline__ static int offset(int row, int col) {
        if (LAYOUT == SWIZZLED) {
            // chunk c of row r is stored at chunk c ^ (r % 8): 8 consecutive rows read at the same
            // logical chunk land in 8 different chunks, i.e. 8 different groups of 4 banks.
            const int chunk = (col >> 3) ^ (row & 7);
            return row * ROW + (chunk << 3) + (col & 7);
        }
        return row * ROW + col;
    }
};

// ---------------------------------------------------------------------------------------------
// Thin wrappers around the PTX instructions, so the kernel body reads like the algorithm.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));  // 32-bit shared-window address
}

// 16-byte asynchronous copy global -> shared. `.cg` caches in L2 only (the data is used once per
// block, from shared memory). src_bytes = 0 copies nothing and zero-fills the 16 bytes: that is how
// the ragged tail (rows >= N) becomes zeros without a branch around the copy.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8x8 b16 matrices from shared memory; lane i gives the address of one 16-byte matrix row
// (lanes 0-7: matrix 0, 8-15: matrix 1, ...). Lane l receives, of each matrix, row l/4 and the two
// elements at columns 2*(l%4), 2*(l%4)+1 -- exactly the mma.sync fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// Same, transposed on the way: lane l receives column l/4, rows 2*(l%4) and 2*(l%4)+1.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// c[16x8, f32] += a[16x16] * b[16x8] on the tensor cores. Fragment layout (g = lane/4, t = lane%4):
//   a: {a0: (g, 2t..2t+1), a1: (g+8, 2t..), a2: (g, 2t+8..), a3: (g+8, 2t+8..)}
//   b: {b0: (k=2t..2t+1, n=g), b1: (k=2t+8.., n=g)}
//   c: {c0,c1: (g, 2t..2t+1), c2,c3: (g+8, 2t..2t+1)}
template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one 32-bit register of two 16-bit values (first argument in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

// ---------------------------------------------------------------------------------------------

struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    // strides in elements of the [B, H, N, D] tensors (the head dim has stride 1)
    int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn;
    int H, N;
    float scale_log2;  // sm_scale * log2(e): softmax in base 2
    int causal;
};

// Issue (not wait for) the copies of rows [row0, row0+64) of one head's [N, D] matrix into a
// shared tile: 64*D/8 chunks of 16 bytes, spread over the 128 threads. Consecutive threads take
// consecutive chunks of a row, so 8 threads (one quarter-warp phase) write 128 contiguous bytes.
template <typename T, int D, int LAYOUT>
__device__ __forceinline__ void load_tile_async(T* tile, const T* src, int64_t row_stride, int row0, int N) {
    constexpr int CHUNKS_PER_ROW = D / 8;
    constexpr int ITERS = BR * CHUNKS_PER_ROW / THREADS;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int i = it * THREADS + threadIdx.x;
        const int r = i / CHUNKS_PER_ROW;
        const int c = (i % CHUNKS_PER_ROW) * 8;
        const bool valid = row0 + r < N;
        // an out-of-range row still needs a legal address: use row 0 (nothing is read from it)
        const T* g = src + (valid ? (int64_t)(row0 + r) * row_stride : 0) + c;
        cp_async_16(smem_addr(tile + Tile<D, LAYOUT>::offset(r, c)), g, valid);
    }
}

template <typename T, int D, int LAYOUT>
// (THREADS, 1): one block per SM is enough to promise; without the "1" ptxas aimed at 128 registers
// for the swizzled D=64 kernel and spilled. Shared memory, not registers, limits residency anyway.
__global__ void __launch_bounds__(THREADS, 1) flash_c_fwd_kernel(const Params p) {
    using L = Tile<D, LAYOUT>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Qs = reinterpret_cast<T*>(smem_raw);  // [64][ROW]
    T* Ks = Qs + L::ELEMS;                   // 2 x [64][ROW]  (double buffer)
    T* Vs = Ks + 2 * L::ELEMS;               // 2 x [64][ROW]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment coordinates (see mma_16816)
    // Longest-first: with causal masking, Q tile i visits i+1 K/V tiles, so launch the last Q tile first.
    const int q_tile = gridDim.x - 1 - blockIdx.x;
    const int q0 = q_tile * BR;
    const int b = blockIdx.y / p.H, h = blockIdx.y % p.H;
    const int N = p.N;
    const T* q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
    const T* k = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh;
    const T* v = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh;
    T* o = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;

    const int n_kv_all = (N + BC - 1) / BC;
    // Causal tile skipping: tiles strictly above the diagonal would be fully masked; never load them.
    const int n_kv = p.causal ? min(n_kv_all, q_tile + 1) : n_kv_all;

    // ---- prologue: group 0 = Q and K tile 0, group 1 = V tile 0 ---------------------------------
    load_tile_async<T, D, LAYOUT>(Qs, q, p.q_sn, q0, N);
    load_tile_async<T, D, LAYOUT>(Ks, k, p.k_sn, 0, N);
    cp_async_commit();
    load_tile_async<T, D, LAYOUT>(Vs, v, p.v_sn, 0, N);
    cp_async_commit();

    // Q fragments stay in registers for the whole kernel (register tiling): D/16 A-fragments of 16x16.
    cp_async_wait<1>();  // group 0 (Q, K0) has landed for this thread's copies ...
    __syncthreads();     // ... and for everybody's
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        // lanes 0-15 point at rows 0-15 of the warp's block, column kk*16; lanes 16-31 at column kk*16+8
        const int row = warp * 16 + (lane % 16), col = kk * 16 + (lane / 16) * 8;
        ldmatrix_x4(qf[kk], smem_addr(Qs + L::offset(row, col)));
    }

    float o_acc[D / 8][4];  // O rows (g, g+8) of the warp's 16, columns 8*dt + 2t, +1
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
        o_acc[dt][0] = o_acc[dt][1] = o_acc[dt][2] = o_acc[dt][3] = 0.f;
    float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};  // running max of scaled scores (base-2 units)
    float l_run[2] = {0.f, 0.f};  // running sum of this thread's p values; summed over the quad at the end

    const int row_g = q0 + warp * 16 + g;  // this thread's two query rows: row_g and row_g + 8

    for (int j = 0; j < n_kv; ++j) {
        const int kv0 = j * BC;
        const T* Kb = Ks + (j & 1) * L::ELEMS;
        const T* Vb = Vs + (j & 1) * L::ELEMS;

        // K_j is needed now; V_j may still be in flight (it is the newest group).
        cp_async_wait<1>();
        __syncthreads();  // K_j visible to all; and every warp is done with tile j-1's buffers
        // Prefetch K_{j+1} into the buffer tile j-1 used. Commit even when nothing was issued: an
        // empty group keeps "wait_group 1" meaning "all but the newest" on every iteration.
        if (j + 1 < n_kv) load_tile_async<T, D, LAYOUT>(Ks + ((j + 1) & 1) * L::ELEMS, k, p.k_sn, kv0 + BC, N);
        cp_async_commit();

        // ---- S = Q K^T: 16 x 64 per warp, 8 n-tiles of 16x8 in registers ----------------------
        float s[BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < BC / 16; ++np) {
                // K is stored [key][d]: an 8x8 block with rows = keys is already the "col" B operand.
                // matrices: (keys +0..7, d +0..7), (keys +0..7, d +8..15), (keys +8..15, d +0..7), (keys +8..15, d +8..15)
                const int key = np * 16 + (lane % 8) + (lane / 16) * 8;
                const int col = kk * 16 + ((lane / 8) % 2) * 8;
                uint32_t kf[4];
                ldmatrix_x4(kf, smem_addr(Kb + L::offset(key, col)));
                mma_16816<T>(s[2 * np], qf[kk], kf[0], kf[1]);
                mma_16816<T>(s[2 * np + 1], qf[kk], kf[2], kf[3]);
            }
        }

        // ---- mask: only the ragged last tile and the diagonal tile need it ----------------------
        if (kv0 + BC > N || (p.causal && kv0 + BC - 1 > q0)) {
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kv0 + nt * 8 + 2 * t + (e & 1);
                    const int row = row_g + (e / 2) * 8;
                    if (key >= N || (p.causal && key > row)) s[nt][e] = -CUDART_INF_F;
                }
        }

        // ---- online softmax, in registers. A row's 64 scores are spread over the 4 lanes of a
        // quad (16 each), so a row max needs two butterfly shuffles. ------------------------------
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run[r], mx * p.scale_log2);  // scale > 0 keeps the order
            // A row with every score masked so far has m = -inf; subtract 0 instead (p = 0, no NaN).
            const float m_use = (m_new == -CUDART_INF_F) ? 0.f : m_new;
            const float alpha = exp2f(m_run[r] - m_use);  // rescales what was accumulated so far
            m_run[r] = m_new;
            float row_sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    // exp(x*scale - m) == exp2(x*scale*log2e - m'): one FFMA + one EX2
                    const float pe = exp2f(fmaf(s[nt][e], p.scale_log2, -m_use));
                    s[nt][e] = pe;
                    row_sum += pe;
                }
            l_run[r] = l_run[r] * alpha + row_sum;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                o_acc[dt][2 * r] *= alpha;
                o_acc[dt][2 * r + 1] *= alpha;
            }
        }

        // V_j is needed now; K_{j+1} may stay in flight.
        cp_async_wait<1>();
        __syncthreads();  // V_j visible to all; every warp is done with V of tile j-1
        if (j + 1 < n_kv) load_tile_async<T, D, LAYOUT>(Vs + ((j + 1) & 1) * L::ELEMS, v, p.v_sn, kv0 + BC, N);
        cp_async_commit();

        // ---- O += P V. The S accumulator layout of two neighbouring n-tiles *is* the A-fragment
        // layout of a 16x16 block, so P goes from registers to the tensor cores without shared memory.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t pf[4];
            pf[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
            pf[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
            pf[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pf[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                // V is stored [key][d] but the B operand wants pairs of keys: ldmatrix.trans.
                // matrices: (keys +0..7, d +0..7), (keys +8..15, d +0..7), (keys +0..7, d +8..15), (keys +8..15, d +8..15)
                const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                const int col = dp * 16 + (lane / 16) * 8;
                uint32_t vf[4];
                ldmatrix_x4_trans(vf, smem_addr(Vb + L::offset(key, col)));
                mma_16816<T>(o_acc[2 * dp], pf, vf[0], vf[1]);
                mma_16816<T>(o_acc[2 * dp + 1], pf, vf[2], vf[3]);
            }
        }
    }
    cp_async_wait<0>();  // only empty groups can be left; drain them before the block exits

    // ---- epilogue: finish the row sums across the quad, divide, store ---------------------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
        const int row = row_g + r * 8;
        if (row < N) {
            T* orow = o + (int64_t)row * p.o_sn;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt)
                *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) =
                    pack2<T>(o_acc[dt][2 * r] * inv_l, o_acc[dt][2 * r + 1] * inv_l);
        }
    }
}

template <typename T, int D, int LAYOUT>
cudaError_t launch(const Params& p, int B, cudaStream_t stream) {
    auto kernel = flash_c_fwd_kernel<T, D, LAYOUT>;
    // Q + 2 K + 2 V tiles; 87,040 bytes for padded D=128, above the 48 KiB default: opt in.
    constexpr int smem_bytes = 5 * Tile<D, LAYOUT>::ELEMS * (int)sizeof(T);
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    const dim3 grid((p.N + BR - 1) / BR, B * p.H);
    kernel<<<grid, THREADS, smem_bytes, stream>>>(p);
    return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_layout(const Params& p, int B, int layout, cudaStream_t stream) {
    switch (layout) {
        case UNPADDED: return launch<T, D, UNPADDED>(p, B, stream);
        case PADDED: return launch<T, D, PADDED>(p, B, stream);
        case SWIZZLED: return launch<T, D, SWIZZLED>(p, B, stream);
        default: return cudaErrorInvalidValue;
    }
}

template <typename T>
cudaError_t launch_dim(const Params& p, int B, int D, int layout, cudaStream_t stream) {
    switch (D) {
        case 64: return launch_layout<T, 64>(p, B, layout, stream);
        case 128: return launch_layout<T, 128>(p, B, layout, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace flash_c

// C ABI for ctypes. dtype: 0 = fp16, 1 = bf16. layout: 0 unpadded, 1 padded, 2 swizzled.
// Pointers must be 16-byte aligned and the B/H/N strides multiples of 8 elements (the wrapper checks).
// Returns a cudaError_t (0 = success).
extern "C" int flash_c_forward(const void* q, const void* k, const void* v, void* o, const int64_t* strides,
                               int B, int H, int N, int D, float sm_scale, int causal, int dtype, int layout,
                               int device, void* stream) {
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) return (int)err;
    flash_c::Params p;
    p.q = q; p.k = k; p.v = v; p.o = o;
    p.q_sb = strides[0]; p.q_sh = strides[1]; p.q_sn = strides[2];
    p.k_sb = strides[3]; p.k_sh = strides[4]; p.k_sn = strides[5];
    p.v_sb = strides[6]; p.v_sh = strides[7]; p.v_sn = strides[8];
    p.o_sb = strides[9]; p.o_sh = strides[10]; p.o_sn = strides[11];
    p.H = H; p.N = N;
    p.scale_log2 = sm_scale * 1.4426950408889634f;  // log2(e)
    p.causal = causal;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (dtype == 0) return (int)flash_c::launch_dim<__half>(p, B, D, layout, s);
    if (dtype == 1) return (int)flash_c::launch_dim<__nv_bfloat16>(p, B, D, layout, s);
    return (int)cudaErrorInvalidValue;
}

extern "C" const char* flash_c_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
