/*
Causal grouped-query attention for NanoEuler, forward and backward, tiled with
an online softmax so that the (T x T) attention matrix is never stored
(Dao et al., FlashAttention, 2022; the backward as in FlashAttention-2).

  forward:  for each query row, walk the key tiles up to the diagonal, keep a
            running max m and sum l of exp(s - m), rescale the output when m
            grows; y = o / l, and lse = m + log(l) is saved for the backward.
  backward: recompute p = exp(s - lse) tile by tile. One kernel owns a tile of
            keys of one kv head and sums dk, dv over every query head that
            reads it (GQA: query head h reads kv head h / (Hq/Hkv)), so no
            atomics and no repeated k/v; another owns query rows and sums dq
            (in bf16 from the ds that the first one stores, not recomputed).

Layout: qkv is (B, T, (Hq + 2 Hkv) D) row-major, as the wqkv matmul writes it:
q heads, then k heads, then v heads. y is (B, T, Hq D); lse and delta (B, Hq, T).
qkv, y, dy and dqkv are the model's activations: fp32 (--precision fp32 and
tf32) or bf16 (--precision bf16; nanoeuler_cuda's floatX); lse and delta fp32.
Three versions of the three passes, read in this order:
- fp32 (--precision fp32), exact, on CUDA cores. In the forward and the dq
  kernel one thread owns one query row, its accumulators in registers. In the
  dk/dv kernel two threads share a key row, each owning every other one of its
  D dims (neighbouring words of shared memory: different banks); the halves of
  each dot product meet in one shuffle.
- tf32 tensor cores (--precision tf32): the same passes with tf32 mma.sync, a
  warp per 16 rows; see "tensor cores" below. On an H200, for the big model:
  13 ms of attention per step against 43 ms on CUDA cores.
- bf16 tensor cores (--precision bf16): bf16 mma.sync reading and writing
  bf16 activations, each score tile kept in registers from the first product
  into the second; the dk/dv pass also stores ds, from which the dq pass makes
  dq in one product; see "bf16 tensor cores" below.
- and on an H100 or H200 (sm_90a), the bf16 forward at D = 64 fed by TMA to
  warpgroup MMA (FlashAttention-3's way), 0.67x the mma.sync forward's time;
  see "the bf16 forward on Hopper" below; and the backward's dk/dv pass in the
  same design (its dq pass the mma.sync one, on the same ds; not yet measured
  on a GPU): "the bf16 backward's dk/dv pass on Hopper".
The file also holds the Hopper product of the bf16 forward (c = a @ b.T, and
w_gate_up's with SwiGLU in its epilogue: "the bf16 product on Hopper", after
the attention passes) and of the backward's data gradients (c = a @ b, and
w_down's with swiglu_backward in its epilogue: "the backward's data gradients
on Hopper", after it), not attention, but built on the same TMA, mbarrier and
wgmma helpers, which live here and need this file's sm_90a build.
D is a template parameter; the entry points at the bottom are written out for
16, 32 and 64 (128 would need more than the 48 KB of shared memory a block gets
without opting in).

Tiles (fp32): 64 query rows per block; keys loaded 32 at a time into shared
memory, 2 x 32 x D floats = 16 KB at D = 64, and 32 scores per row in registers.
No pass uses atomics: dk and dv, and dq, are each summed by the one block that
owns them, so every run gives the same bits.
*/

#define BR 64   // query rows per block (= threads per block in the forward and dq)
#define BC 32   // key rows per shared-memory tile
#define DKV_KEYS 64   // keys per block of the dk/dv pass, two threads to a key
#define DKV_THREADS (2 * DKV_KEYS)

// NVRTC compiles without the C headers, so infinity is spelled out in its bits
#define INFINITY __int_as_float(0x7f800000)

// -----------------------------------------------------------------------------
// forward

// keys and values k0..k0+BC-1 of kv head kvh into shared memory (zeros past T),
// between two barriers; the BR threads of the block share the copy
template <int D>
__device__ void load_kv_tile(float (*ks)[D], float (*vs)[D], const float* base, int k0, int T, int stride,
                             int Hq, int Hkv, int kvh) {
    __syncthreads();                      // the previous tile is no longer read
    for (int e = threadIdx.x; e < BC * D; e += BR) {
        int r = e / D, d = e % D, j = k0 + r;
        ks[r][d] = j < T ? base[(long)j * stride + (Hq + kvh) * D + d] : 0.0f;
        vs[r][d] = j < T ? base[(long)j * stride + (Hq + Hkv + kvh) * D + d] : 0.0f;
    }
    __syncthreads();
}

// y and lse of causal GQA attention in fp32 (the forward above): each thread owns one
// query row, walks the key tiles up to its row with an online softmax, and writes y = o / l.
// grid = (ceil(T / BR), Hq, B); block = BR threads, one per query row
template <int D>
__device__ void attention_forward(float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {
    __shared__ float ks[BC][D], vs[BC][D];
    int b = blockIdx.z, h = blockIdx.y, kvh = h / (Hq / Hkv);
    int i = blockIdx.x * BR + threadIdx.x;
    int stride = (Hq + 2 * Hkv) * D;
    const float* base = qkv + (long)b * T * stride;
    float q[D], o[D];
    for (int d = 0; d < D; d++) {
        q[d] = i < T ? base[(long)i * stride + h * D + d] * scale : 0.0f;
        o[d] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    int last = min(T - 1, blockIdx.x * BR + BR - 1);              // causal: no key past the last query
    for (int k0 = 0; k0 <= last; k0 += BC) {
        load_kv_tile<D>(ks, vs, base, k0, T, stride, Hq, Hkv, kvh);
        if (i >= T || k0 > i) continue;
        float s[BC], m_tile = m;
        for (int r = 0; r < BC; r++) {
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += q[d] * ks[r][d];
            s[r] = k0 + r <= i ? dot : -INFINITY;                     // causal mask
            m_tile = fmaxf(m_tile, s[r]);
        }
        float correction = expf(m - m_tile);                          // rescale what came before
        l *= correction;
        for (int d = 0; d < D; d++) o[d] *= correction;
        for (int r = 0; r < BC; r++) {
            float p = expf(s[r] - m_tile);
            l += p;
            for (int d = 0; d < D; d++) o[d] += p * vs[r][d];
        }
        m = m_tile;
    }
    if (i >= T) return;
    for (int d = 0; d < D; d++) {
        long e = ((long)b * T + i) * Hq * D + h * D + d;
        y[e] = o[d] / l;
    }
    lse[((long)b * Hq + h) * T + i] = m + logf(l);
}

// -----------------------------------------------------------------------------
// backward

// two neighbouring elements of a row of dy or y, as the passes read them: fp32, or bf16
// (the bf16 passes' activations, nanoeuler_cuda's floatX)
__device__ __forceinline__ float2 load_pair(const float* p) { return *(const float2*)p; }

__device__ __forceinline__ float2 load_pair(const unsigned short* p) {
    unsigned two = *(const unsigned*)p;
    return make_float2(__uint_as_float(two << 16), __uint_as_float(two & 0xFFFF0000u));
}

// the dot product of two 16-byte packs of a row of dy and y: 4 floats, or 8 bf16
__device__ __forceinline__ float dot_pack(const float* a, const float* b) {
    float4 x = *(const float4*)a, y = *(const float4*)b;
    return x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
}

__device__ __forceinline__ float dot_pack(const unsigned short* a, const unsigned short* b) {
    uint4 x = *(const uint4*)a, y = *(const uint4*)b;
    unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
        s += __uint_as_float(xs[i] << 16) * __uint_as_float(ys[i] << 16) +
             __uint_as_float(xs[i] & 0xFFFF0000u) * __uint_as_float(ys[i] & 0xFFFF0000u);
    return s;
}

// delta = rowsum(dy * y), the softmax backward's correction term, from dy and y in the
// type the passes read them (X: float, or unsigned short for bf16), so that delta
// matches the dp the passes compute (in bf16, the dk/dv pass alone).
// P = D * sizeof(X) / 16 neighbouring lanes per (b, query row, head), a 16-byte pack each,
// rows in memory order: a warp reads 512 contiguous bytes of dy and of y, and the P
// lanes' sums meet in log2(P) shuffles. (One warp a row, a 4-byte pair a lane, as this
// kernel was first, moved 1 TB/s on an H200.) grid = ceil(B*T*Hq*P / block)
template <typename X>
__device__ void attention_backward_delta(float* delta, const X* dy, const X* y, int B, int T, int Hq, int D) {
    constexpr int PACK = 16 / sizeof(X);
    int P = D / PACK;                                                 // lanes per row: 2..16, a power of 2
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x, e = t / P;  // e = (b * T + i) * Hq + h
    bool live = e < (long)B * T * Hq;
    float s = live ? dot_pack(&dy[t * PACK], &y[t * PACK]) : 0.0f;  // pack t % P of row e
    for (int offset = P / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
    if (!live || t % P != 0) return;
    int h = e % Hq, i = (e / Hq) % T;
    long b = e / ((long)Hq * T);
    delta[(b * Hq + h) * T + i] = s;
}

// dk and dv for 64 keys of one kv head, summed over its G query heads and every
// query at or after each key. Two threads share a key row, each owning every
// other one of its D dims (so that the pair reads neighbouring words of a
// shared-memory row: different banks); k, v, dk and dv stay in registers, and
// the two halves of each dot product meet in one shuffle. Query tiles of BC
// rows are loaded into shared memory and read by every thread.
// grid = (ceil(T / DKV_KEYS), Hkv, B); block = DKV_THREADS, two per key row
template <int D>
__device__ void attention_backward_dkv(float* dqkv, const float* qkv, const float* dy,
                                       const float* lse, const float* delta, int T, int Hq, int Hkv, float scale) {
    constexpr int HALF = D / 2;
    __shared__ float qs[BC][D], dys[BC][D], lse_s[BC], delta_s[BC];
    int b = blockIdx.z, kvh = blockIdx.y, G = Hq / Hkv;
    int half = threadIdx.x & 1;
    int j = blockIdx.x * DKV_KEYS + threadIdx.x / 2;
    int stride = (Hq + 2 * Hkv) * D;
    const float* base = qkv + (long)b * T * stride;
    float k[HALF], v[HALF], dk[HALF], dv[HALF];
    for (int e = 0; e < HALF; e++) {
        int d = 2 * e + half;
        k[e] = j < T ? base[(long)j * stride + (Hq + kvh) * D + d] : 0.0f;
        v[e] = j < T ? base[(long)j * stride + (Hq + Hkv + kvh) * D + d] : 0.0f;
        dk[e] = dv[e] = 0.0f;
    }
    for (int h = kvh * G; h < (kvh + 1) * G; h++) {
        for (int q0 = blockIdx.x * DKV_KEYS; q0 < T; q0 += BC) {      // causal: queries from the first key on
            __syncthreads();
            for (int e = threadIdx.x; e < BC * D; e += blockDim.x) {
                int r = e / D, d = e % D, i = q0 + r;
                qs[r][d] = i < T ? base[(long)i * stride + h * D + d] * scale : 0.0f;
                dys[r][d] = i < T ? dy[((long)b * T + i) * Hq * D + h * D + d] : 0.0f;
            }
            if (threadIdx.x < BC) {
                int i = q0 + threadIdx.x;
                lse_s[threadIdx.x] = i < T ? lse[((long)b * Hq + h) * T + i] : 0.0f;
                delta_s[threadIdx.x] = i < T ? delta[((long)b * Hq + h) * T + i] : 0.0f;
            }
            __syncthreads();
            for (int r = 0; r < BC && q0 + r < T; r++) {
                float s = 0.0f, dp = 0.0f;
                for (int e = 0; e < HALF; e++) {
                    s += qs[r][2 * e + half] * k[e];
                    dp += dys[r][2 * e + half] * v[e];
                }
                s += __shfl_xor_sync(0xffffffff, s, 1);               // the other half of the dot products
                dp += __shfl_xor_sync(0xffffffff, dp, 1);
                if (q0 + r < j || j >= T) continue;                   // query before this key: masked
                float p = expf(s - lse_s[r]);
                float ds = p * (dp - delta_s[r]);                     // softmax backward
                for (int e = 0; e < HALF; e++) {
                    dv[e] += p * dys[r][2 * e + half];
                    dk[e] += ds * qs[r][2 * e + half];                // qs holds q * scale already
                }
            }
        }
    }
    if (j >= T) return;
    long row = ((long)b * T + j) * stride;
    for (int e = 0; e < HALF; e++) {
        dqkv[row + (Hq + kvh) * D + 2 * e + half] = dk[e];
        dqkv[row + (Hq + Hkv + kvh) * D + 2 * e + half] = dv[e];
    }
}

// dq for BR query rows of one query head, summed over the keys up to each row
// grid = (ceil(T / BR), Hq, B); block = BR threads, one per query row
template <int D>
__device__ void attention_backward_dq(float* dqkv, const float* qkv, const float* dy, const float* lse,
                                      const float* delta, int T, int Hq, int Hkv, float scale) {
    __shared__ float ks[BC][D], vs[BC][D];
    int b = blockIdx.z, h = blockIdx.y, kvh = h / (Hq / Hkv);
    int i = blockIdx.x * BR + threadIdx.x;
    int stride = (Hq + 2 * Hkv) * D;
    const float* base = qkv + (long)b * T * stride;
    float q[D], dyr[D], dq[D];
    for (int d = 0; d < D; d++) {
        q[d] = i < T ? base[(long)i * stride + h * D + d] * scale : 0.0f;
        dyr[d] = i < T ? dy[((long)b * T + i) * Hq * D + h * D + d] : 0.0f;
        dq[d] = 0.0f;
    }
    float lse_i = i < T ? lse[((long)b * Hq + h) * T + i] : 0.0f;
    float delta_i = i < T ? delta[((long)b * Hq + h) * T + i] : 0.0f;
    int last = min(T - 1, blockIdx.x * BR + BR - 1);
    for (int k0 = 0; k0 <= last; k0 += BC) {
        load_kv_tile<D>(ks, vs, base, k0, T, stride, Hq, Hkv, kvh);
        if (i >= T) continue;
        for (int r = 0; r < BC && k0 + r <= i; r++) {
            float s = 0.0f, dp = 0.0f;
            for (int d = 0; d < D; d++) {
                s += q[d] * ks[r][d];
                dp += dyr[d] * vs[r][d];
            }
            float ds = expf(s - lse_i) * (dp - delta_i);
            for (int d = 0; d < D; d++) dq[d] += ds * ks[r][d];
        }
    }
    if (i >= T) return;
    for (int d = 0; d < D; d++) dqkv[((long)b * T + i) * stride + h * D + d] = dq[d] * scale;
}

// -----------------------------------------------------------------------------
// tensor cores: the same three passes with tf32 mma.sync (m16n8k8)
//
// For --precision tf32 and bf16. Each warp owns 16 rows; scores, softmax and
// accumulators stay in the mma fragments' registers, whose layout the PTX ISA
// fixes: lane = 4 group + in_group (the ISA's groupID and threadID_in_group; g and t
// in this table): A (16x8, row-major): a0 = A[g][t], a1 = A[g+8][t],
// a2 = A[g][t+4], a3 = A[g+8][t+4];  B (8x8): b0 = B[t][g], b1 = B[t+4][g];
// C (16x8): c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1].
// A row's values sit in the 4 lanes of one group, so row reductions are two
// shuffles. Every loop over fragments is unrolled, so that they stay in
// registers (an array indexed at run time would go to local memory). A score
// tile goes through shared memory once, from the C layout into the A layout, on
// its way into the second product: mma_scores_tf32 makes the scores (a @ tile.T),
// mma_weighted_sum_tf32 adds the rows of a tile weighted by them (p @ tile).

#define MMA_ROWS 16   // rows per warp
#define MMA_WARPS 4   // warps per block, here and in the bf16 passes
#define MMA_THREADS (32 * MMA_WARPS)
#define MMA_BLOCK_ROWS (MMA_WARPS * MMA_ROWS)   // 64 rows per block
#define BK 32         // keys (or queries) per shared-memory tile

__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// d += a b on tensor cores: a (16x8) and b (8x8) in tf32, d (16x8) in fp32
__device__ __forceinline__ void mma_tf32(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ float group_max(float v) {          // over the 4 lanes of a row
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}

__device__ __forceinline__ float group_sum(float v) {
    v += __shfl_xor_sync(0xffffffff, v, 1);
    return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// A fragments of rows r0.. of a row-major global matrix (row stride ld), all D/8 steps
template <int D>
__device__ void load_a_rows(unsigned (*a)[4], const float* m, long ld, int r0, int T, float scale) {
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    #pragma unroll
    for (int kk = 0; kk < D / 8; kk++) {
        int c = kk * 8 + in_group;
        a[kk][0] = tf32(r0 + group < T ? m[(r0 + group) * ld + c] * scale : 0.0f);
        a[kk][1] = tf32(r0 + group + 8 < T ? m[(r0 + group + 8) * ld + c] * scale : 0.0f);
        a[kk][2] = tf32(r0 + group < T ? m[(r0 + group) * ld + c + 4] * scale : 0.0f);
        a[kk][3] = tf32(r0 + group + 8 < T ? m[(r0 + group + 8) * ld + c + 4] * scale : 0.0f);
    }
}

// c (16 x 8n) = a (16 x D) @ rows.T, where rows is a shared (8n x D) tf32 tile: scores
template <int D, int N>
__device__ void mma_scores_tf32(float (*c)[4], unsigned (*a)[4], const float* rows, int ld) {
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++) {
        c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
        #pragma unroll
        for (int kk = 0; kk < D / 8; kk++) {
            unsigned b[2] = {__float_as_uint(rows[(nt * 8 + group) * ld + kk * 8 + in_group]),
                             __float_as_uint(rows[(nt * 8 + group) * ld + kk * 8 + in_group + 4])};
            mma_tf32(c[nt], a[kk], b);
        }
    }
}

// acc (16 x D) += p (16 x N, C layout, staged through this warp's shared scratch) @ m (shared N x D, tf32)
template <int D, int N>
__device__ void mma_weighted_sum_tf32(float (*acc)[4], float (*p)[4], float* scratch, const float* m, int ld) {
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++) {                       // C layout -> shared, rows of N + 4
        scratch[group * (N + 4) + nt * 8 + 2 * in_group] = __uint_as_float(tf32(p[nt][0]));
        scratch[group * (N + 4) + nt * 8 + 2 * in_group + 1] = __uint_as_float(tf32(p[nt][1]));
        scratch[(group + 8) * (N + 4) + nt * 8 + 2 * in_group] = __uint_as_float(tf32(p[nt][2]));
        scratch[(group + 8) * (N + 4) + nt * 8 + 2 * in_group + 1] = __uint_as_float(tf32(p[nt][3]));
    }
    __syncwarp();
    #pragma unroll
    for (int kk = 0; kk < N / 8; kk++) {
        const float* sc = scratch;
        unsigned a[4] = {__float_as_uint(sc[group * (N + 4) + kk * 8 + in_group]),
                         __float_as_uint(sc[(group + 8) * (N + 4) + kk * 8 + in_group]),
                         __float_as_uint(sc[group * (N + 4) + kk * 8 + in_group + 4]),
                         __float_as_uint(sc[(group + 8) * (N + 4) + kk * 8 + in_group + 4])};
        #pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            unsigned b[2] = {__float_as_uint(m[(kk * 8 + in_group) * ld + nt * 8 + group]),
                             __float_as_uint(m[(kk * 8 + in_group + 4) * ld + nt * 8 + group])};
            mma_tf32(acc[nt], a, b);
        }
    }
    __syncwarp();                                               // scratch is free again
}

// rows r..r+BK-1 of the heads at column offset col of a (T, stride) matrix into a
// shared (BK, D+4) tile, zeros past T, scaled and already rounded to tf32 (so the
// mma loops read operands without converting them); between two barriers
template <int D>
__device__ void load_tile(float* tile, const float* m, long stride, int col, int r, int T, float scale) {
    __syncthreads();
    // float4 loads: a quarter of the load instructions, whose latency is what these kernels wait on
    for (int e = 4 * threadIdx.x; e < BK * D; e += 4 * blockDim.x) {
        int i = e / D, d = e % D;
        float4 x = r + i < T ? *(const float4*)&m[(long)(r + i) * stride + col + d] : make_float4(0, 0, 0, 0);
        float* out = &tile[i * (D + 4) + d];
        out[0] = __uint_as_float(tf32(x.x * scale));
        out[1] = __uint_as_float(tf32(x.y * scale));
        out[2] = __uint_as_float(tf32(x.z * scale));
        out[3] = __uint_as_float(tf32(x.w * scale));
    }
    __syncthreads();
}

// write a warp's accumulator c (16 x D, C layout) to rows r0.. of a row-major global
// matrix out (row stride ld),
// row r scaled by f[r >= r0 + 8], rows past T skipped
template <int D>
__device__ void store_rows(float* out, long ld, int r0, int T, float (*c)[4], const float* f) {
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    #pragma unroll
    for (int nt = 0; nt < D / 8; nt++)
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = r0 + group + 8 * (i >> 1);
            long e = row * ld + nt * 8 + 2 * in_group + (i & 1);
            if (row < T) out[e] = c[nt][i] * f[i >> 1];
        }
}

// the same y and lse with tf32 mma.sync: each warp owns 16 query rows, scores and output in
// registers, a BK-key tile of k and v in shared memory at a time.
// grid = (ceil(T / 64), Hq, B); block = 128 threads, 4 warps of 16 query rows
template <int D>
__device__ void attention_forward_tf32(float* y, float* lse, const float* qkv, int T, int Hq,
                                      int Hkv, float scale) {
    __shared__ float ks[BK * (D + 4)], vs[BK * (D + 4)], scratch[MMA_WARPS][MMA_ROWS * (BK + 4)];
    int b = blockIdx.z, h = blockIdx.y, kvh = h / (Hq / Hkv), warp = threadIdx.x / 32;
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    int r0 = blockIdx.x * MMA_BLOCK_ROWS + warp * MMA_ROWS;    // this warp's first query row
    long stride = (Hq + 2 * Hkv) * D;
    const float* base = qkv + (long)b * T * stride;
    unsigned qa[D / 8][4];
    load_a_rows<D>(qa, base + h * D, stride, r0, T, scale);
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    int last = min(T - 1, blockIdx.x * MMA_BLOCK_ROWS + MMA_BLOCK_ROWS - 1);
    for (int k0 = 0; k0 <= last; k0 += BK) {
        load_tile<D>(ks, base, stride, (Hq + kvh) * D, k0, T, 1.0f);
        load_tile<D>(vs, base, stride, (Hq + Hkv + kvh) * D, k0, T, 1.0f);
        if (k0 > r0 + MMA_ROWS - 1) continue;                   // the whole warp is before these keys
        float s[BK / 8][4];
        mma_scores_tf32<D, BK>(s, qa, ks, D + 4);
        float mt[2] = {m[0], m[1]};
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++)
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                int row = r0 + group + 8 * (i >> 1), col = k0 + nt * 8 + 2 * in_group + (i & 1);
                if (col > row || col >= T) s[nt][i] = -INFINITY;  // causal mask, and keys past T
                mt[i >> 1] = fmaxf(mt[i >> 1], s[nt][i]);
            }
        float correction[2], sum[2] = {0.0f, 0.0f};
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            mt[r] = group_max(mt[r]);
            correction[r] = expf(m[r] - mt[r]);                   // rescale what came before
        }
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++)
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                s[nt][i] = expf(s[nt][i] - mt[i >> 1]);
                sum[i >> 1] += s[nt][i];
            }
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            l[r] = l[r] * correction[r] + group_sum(sum[r]);
            m[r] = mt[r];
        }
        #pragma unroll
        for (int nt = 0; nt < D / 8; nt++)
            #pragma unroll
            for (int i = 0; i < 4; i++) o[nt][i] *= correction[i >> 1];
        mma_weighted_sum_tf32<D, BK>(o, s, scratch[warp], vs, D + 4);
    }
    float inv_l[2] = {1.0f / l[0], 1.0f / l[1]};
    long y0 = (long)b * T * Hq * D + h * D;
    store_rows<D>(y + y0, (long)Hq * D, r0, T, o, inv_l);
    #pragma unroll
    for (int r = 0; r < 2; r++)
        if (in_group == 0 && r0 + group + 8 * r < T)
            lse[((long)b * Hq + h) * T + r0 + group + 8 * r] = m[r] + logf(l[r]);
}

// dq for 16 query rows per warp: dq = scale * sum over keys of p (dp - delta) k
// grid = (ceil(T / 64), Hq, B); block = 128 threads
template <int D>
__device__ void attention_backward_dq_tf32(float* dqkv, const float* qkv, const float* dy, const float* lse,
                                          const float* delta, int T, int Hq, int Hkv, float scale) {
    __shared__ float ks[BK * (D + 4)], vs[BK * (D + 4)], scratch[MMA_WARPS][MMA_ROWS * (BK + 4)];
    int b = blockIdx.z, h = blockIdx.y, kvh = h / (Hq / Hkv), warp = threadIdx.x / 32;
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    int r0 = blockIdx.x * MMA_BLOCK_ROWS + warp * MMA_ROWS;
    long stride = (Hq + 2 * Hkv) * D;
    const float* base = qkv + (long)b * T * stride;
    unsigned qa[D / 8][4], dya[D / 8][4];
    load_a_rows<D>(qa, base + h * D, stride, r0, T, scale);
    load_a_rows<D>(dya, dy + (long)b * T * Hq * D + h * D, (long)Hq * D, r0, T, 1.0f);
    float lse_r[2], delta_r[2], dq[D / 8][4] = {};
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = r0 + group + 8 * r;
        lse_r[r] = row < T ? lse[((long)b * Hq + h) * T + row] : 0.0f;
        delta_r[r] = row < T ? delta[((long)b * Hq + h) * T + row] : 0.0f;
    }
    int last = min(T - 1, blockIdx.x * MMA_BLOCK_ROWS + MMA_BLOCK_ROWS - 1);
    for (int k0 = 0; k0 <= last; k0 += BK) {
        load_tile<D>(ks, base, stride, (Hq + kvh) * D, k0, T, 1.0f);
        load_tile<D>(vs, base, stride, (Hq + Hkv + kvh) * D, k0, T, 1.0f);
        if (k0 > r0 + MMA_ROWS - 1) continue;
        float s[BK / 8][4], dp[BK / 8][4];
        mma_scores_tf32<D, BK>(s, qa, ks, D + 4);
        mma_scores_tf32<D, BK>(dp, dya, vs, D + 4);
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++)
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                int row = r0 + group + 8 * (i >> 1), col = k0 + nt * 8 + 2 * in_group + (i & 1);
                float p = col > row || col >= T || row >= T ? 0.0f : expf(s[nt][i] - lse_r[i >> 1]);
                s[nt][i] = p * (dp[nt][i] - delta_r[i >> 1]);     // ds, the softmax backward
            }
        mma_weighted_sum_tf32<D, BK>(dq, s, scratch[warp], ks, D + 4);
    }
    float scales[2] = {scale, scale};
    store_rows<D>(dqkv + (long)b * T * stride + h * D, stride, r0, T, dq, scales);
}

// dk and dv for 16 keys per warp (64 per block) of one kv head, summed over its G
// query heads: with st = k q.T (keys as rows), pt = exp(st - lse), dst = pt (v dy.T - delta):
// dv = pt dy and dk = dst (q scale)
// grid = (ceil(T / 64), Hkv, B); block = 128 threads
template <int D>
__device__ void attention_backward_dkv_tf32(float* dqkv, const float* qkv, const float* dy,
                                           const float* lse, const float* delta, int T, int Hq, int Hkv,
                                           float scale) {
    __shared__ float qs[BK * (D + 4)], dys[BK * (D + 4)], scratch[MMA_WARPS][MMA_ROWS * (BK + 4)];
    __shared__ float lse_s[BK], delta_s[BK];
    int b = blockIdx.z, kvh = blockIdx.y, G = Hq / Hkv, warp = threadIdx.x / 32;
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    int r0 = blockIdx.x * MMA_BLOCK_ROWS + warp * MMA_ROWS;    // this warp's first key
    long stride = (Hq + 2 * Hkv) * D;
    const float* base = qkv + (long)b * T * stride;
    unsigned ka[D / 8][4], va[D / 8][4];
    load_a_rows<D>(ka, base + (Hq + kvh) * D, stride, r0, T, 1.0f);
    load_a_rows<D>(va, base + (Hq + Hkv + kvh) * D, stride, r0, T, 1.0f);
    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    for (int h = kvh * G; h < (kvh + 1) * G; h++) {
        // causal: queries from the block's first key
        for (int q0 = blockIdx.x * MMA_BLOCK_ROWS; q0 < T; q0 += BK) {
            load_tile<D>(qs, base, stride, h * D, q0, T, scale);
            load_tile<D>(dys, dy + (long)b * T * Hq * D, (long)Hq * D, h * D, q0, T, 1.0f);
            if (threadIdx.x < BK) {
                int i = q0 + threadIdx.x;
                lse_s[threadIdx.x] = i < T ? lse[((long)b * Hq + h) * T + i] : 0.0f;
                delta_s[threadIdx.x] = i < T ? delta[((long)b * Hq + h) * T + i] : 0.0f;
            }
            __syncthreads();
            if (q0 + BK - 1 < r0) continue;                        // every query before this warp's keys
            float st[BK / 8][4], dpt[BK / 8][4];
            mma_scores_tf32<D, BK>(st, ka, qs, D + 4);
            mma_scores_tf32<D, BK>(dpt, va, dys, D + 4);
            #pragma unroll
            for (int nt = 0; nt < BK / 8; nt++)
                #pragma unroll
                for (int i = 0; i < 4; i++) {
                    int key = r0 + group + 8 * (i >> 1), c = nt * 8 + 2 * in_group + (i & 1), query = q0 + c;
                    float p = query < key || query >= T ? 0.0f : expf(st[nt][i] - lse_s[c]);
                    st[nt][i] = p;
                    dpt[nt][i] = p * (dpt[nt][i] - delta_s[c]);
                }
            mma_weighted_sum_tf32<D, BK>(dv, st, scratch[warp], dys, D + 4);
            mma_weighted_sum_tf32<D, BK>(dk, dpt, scratch[warp], qs, D + 4);   // qs holds q * scale already
        }
    }
    float ones[2] = {1.0f, 1.0f};
    long k0 = (long)b * T * stride + (Hq + kvh) * D, v0 = (long)b * T * stride + (Hq + Hkv + kvh) * D;
    store_rows<D>(dqkv + k0, stride, r0, T, dk, ones);
    store_rows<D>(dqkv + v0, stride, r0, T, dv, ones);
}

// -----------------------------------------------------------------------------
// bf16 tensor cores: the three passes with bf16 mma.sync (m16n8k16), fp32 sums; dq from ds
//
// For --precision bf16, where the activations are bf16: qkv16 (q and k rotated by
// rope_forward, then v) and dy16 in, y16 and dqkv16 (dq and dk before rope_backward
// rotates them back, then dv) out, each rounded once as it is stored. Each warp owns 16 rows
// (queries, or keys in the dk/dv pass; 32 queries in the forward at D = 64, two m-tiles); a
// block of 4 warps owns 64 (that forward: 128) and walks the other side in tiles of 64 rows,
// copied into shared memory by cp.async two tiles deep (the next tile is on its
// way while this one is multiplied).
//
// Fragments, as the PTX ISA fixes them for m16n8k16 (lane = 4 group + in_group, g and t
// in this table; two bf16 to a register, the lower column in the lower half):
//   A (16x16): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16x8):  b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C (16x8):  c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]
// so the C tiles of columns 16j..16j+7 and 16j+8..16j+15, rounded to bf16 in
// pairs, are exactly the A fragment of k-step j: a score tile (or p, ds) goes
// from one product into the next in registers, without a trip through shared
// memory (the dq pass alone reads its ds back from memory: ds_tile). B fragments come from shared tiles by ldmatrix: a row-major tile X
// (rows x D) gives B = X.T as it stands (scores: q k.T) and B = X with .trans
// (p v). Rows are padded by 8 bf16 (16 bytes), so the 8 rows one ldmatrix
// matrix reads fall in 8 different groups of 4 banks.
//
// Softmax in base 2: exp(scale s - m) = exp2(s scale log2(e) - m log2(e)), one
// fma per score. Scores are s = q.k of the bf16 inputs, summed in fp32; p and
// ds are rounded to bf16 on their way into the second product.

#define TILE 64       // rows per shared-memory tile, and keys per block in the dk/dv pass
#define PAD 8         // bf16 elements of padding per shared row
#define LOG2E 1.4426950408889634f

// two floats -> one register of two bf16, rounded to nearest even; lo in the lower half
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// d (16x8, fp32) += a (16x16, bf16) b (16x8, bf16)
__device__ __forceinline__ void mma_bf16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// four 8x8 bf16 matrices from shared memory; lane l gives the address of row l % 8
// of matrix l / 8 and receives row group, columns 2 in_group and 2 in_group + 1 of each
// (.trans: column group, the same rows)
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const unsigned short* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const unsigned short* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}

// 16 (or 4) bytes global -> shared without passing through registers; zeros when !valid
__device__ __forceinline__ void cp_async16(unsigned short* dst, const unsigned short* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>   // wait until at most N groups of copies are still in flight
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// start copying rows r0..r0+TILE-1 of a row-major bf16 matrix (row stride ld, m
// pointing at the head's first column) into a shared (TILE, D+PAD) tile, zeros past T
template <int D>
__device__ void load_tile_async(unsigned short (*tile)[D + PAD], const unsigned short* m, long ld, int r0, int T) {
    for (int c = threadIdx.x; c < TILE * D / 8; c += blockDim.x) {
        int i = c / (D / 8), d = c % (D / 8) * 8;
        bool valid = r0 + i < T;
        cp_async16(&tile[i][d], m + (valid ? (long)(r0 + i) * ld : 0) + d, valid);
    }
}

// A fragments of 16 rows r0.. (zeros past T) of a row-major bf16 matrix m (row stride ld), every k-step of D
template <int D>
__device__ void load_a_bf16(unsigned (*a)[4], const unsigned short* m, long ld, int r0, int T) {
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    const unsigned* lo = (const unsigned*)(m + (long)(r0 + group) * ld);
    const unsigned* hi = (const unsigned*)(m + (long)(r0 + group + 8) * ld);
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        a[kk][0] = r0 + group < T ? lo[kk * 8 + in_group] : 0u;
        a[kk][1] = r0 + group + 8 < T ? hi[kk * 8 + in_group] : 0u;
        a[kk][2] = r0 + group < T ? lo[kk * 8 + 4 + in_group] : 0u;
        a[kk][3] = r0 + group + 8 < T ? hi[kk * 8 + 4 + in_group] : 0u;
    }
}

// c (16 x N) = a (16 x D) @ tile[0..N).T, for each of MT m-tiles of 16 rows: scores of
// a warp's rows against N rows of a shared tile; each B fragment serves every m-tile
template <int D, int MT, int N = TILE>
__device__ void mma_scores_bf16(float (*c)[N / 8][4], unsigned (*a)[D / 16][4],
                                unsigned short (*tile)[D + PAD]) {
    int lane = threadIdx.x % 32;
    #pragma unroll
    for (int mt = 0; mt < MT; mt++)
        #pragma unroll
        for (int nt = 0; nt < N / 8; nt++) c[mt][nt][0] = c[mt][nt][1] = c[mt][nt][2] = c[mt][nt][3] = 0.0f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        #pragma unroll
        for (int np = 0; np < N / 16; np++) {                     // two n-tiles (16 tile rows) per ldmatrix
            unsigned b[4];
            ldmatrix_x4(b, &tile[np * 16 + (lane & 7) + (lane >> 4) * 8][kk * 16 + ((lane >> 3) & 1) * 8]);
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16(c[mt][2 * np], a[mt][kk], b[0], b[1]);
                mma_bf16(c[mt][2 * np + 1], a[mt][kk], b[2], b[3]);
            }
        }
}

// acc (16 x D) += p (16 x N, C layout, fp32) @ tile[0..N), for each of MT m-tiles: p
// rounded to bf16 in registers into the A layout (see above), the tile read with ldmatrix .trans
template <int D, int MT, int N = TILE>
__device__ void mma_weighted_sum_bf16(float (*acc)[D / 8][4], float (*p)[N / 8][4],
                                      unsigned short (*tile)[D + PAD]) {
    int lane = threadIdx.x % 32;
    #pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        unsigned a[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            a[mt][0] = pack_bf16(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            a[mt][1] = pack_bf16(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            a[mt][2] = pack_bf16(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            a[mt][3] = pack_bf16(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
        #pragma unroll
        for (int np = 0; np < D / 16; np++) {
            unsigned b[4];
            ldmatrix_x4_trans(b, &tile[kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][np * 16 + (lane >> 4) * 8]);
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// write a warp's c (16 x D, C layout) times f[row half], rounded to bf16, to rows r0.. of a
// row-major bf16 matrix out (row stride ld); rows past T skipped
template <int D>
__device__ void store_c_rows(unsigned short* out, long ld, int r0, int T, float (*c)[4], const float* f) {
    int group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    #pragma unroll
    for (int half = 0; half < 2; half++) {
        int row = r0 + group + 8 * half;
        if (row >= T) continue;
        #pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            long e = row * ld + nt * 8 + 2 * in_group;
            *(unsigned*)&out[e] = pack_bf16(c[nt][2 * half] * f[half], c[nt][2 * half + 1] * f[half]);
        }
    }
}

// y and lse for 64 MT query rows of one query head, 16 MT per warp (MT m-tiles
// of 16 rows, which share every B fragment read from shared memory), walking the
// key tiles up to the diagonal with the online softmax of attention_forward, KEYS keys
// (a divisor of TILE) at a time: the fewer, the fewer registers hold scores
// grid = (Hq, B, ceil(T / rows)) with rows = 16 MT (block / 32), the last query tiles (most keys)
// first; block = 128 threads (rows = 64 MT)
template <int D, int MT, int KEYS>
__device__ void attention_forward_bf16(unsigned short* y16, float* lse, const unsigned short* qkv16, int T, int Hq,
                                       int Hkv, float scale) {
    static_assert(TILE % KEYS == 0 && KEYS % 16 == 0, "KEYS: whole ldmatrix pairs, a divisor of TILE");
    __shared__ __align__(16) unsigned short ks[2][TILE][D + PAD], vs[2][TILE][D + PAD];
    int rows = 16 * MT * (blockDim.x / 32);                        // query rows of this block
    int h = blockIdx.x, b = blockIdx.y, kvh = h / (Hq / Hkv), q0 = (gridDim.z - 1 - blockIdx.z) * rows;
    int warp = threadIdx.x / 32, group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    int r0 = q0 + warp * 16 * MT;                                  // this warp's first query row
    long stride = (long)(Hq + 2 * Hkv) * D;
    const unsigned short* base = qkv16 + (long)b * T * stride;
    const unsigned short *kbase = base + (Hq + kvh) * D, *vbase = base + (Hq + Hkv + kvh) * D;
    int tiles = min(T - 1, q0 + rows - 1) / TILE + 1;              // causal: no key past the block's last query
    load_tile_async<D>(ks[0], kbase, stride, 0, T);
    load_tile_async<D>(vs[0], vbase, stride, 0, T);
    cp_async_commit();
    unsigned qa[MT][D / 16][4];
    float o[MT][D / 8][4] = {}, m[MT][2], l[MT][2];               // l: this lane's part of the row sums
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        load_a_bf16<D>(qa[mt], base + h * D, stride, r0 + 16 * mt, T);
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    const float scale2 = scale * LOG2E;
    for (int j = 0; j < tiles; j++) {
        int cur = j & 1, k0 = j * TILE;
        if (j + 1 < tiles) {                                       // the next tile, while this one is used
            load_tile_async<D>(ks[cur ^ 1], kbase, stride, k0 + TILE, T);
            load_tile_async<D>(vs[cur ^ 1], vbase, stride, k0 + TILE, T);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        #pragma unroll
        for (int sub = 0; sub < TILE; sub += KEYS) {               // KEYS keys at a time (fewer registers)
            int kk0 = k0 + sub;
            if (kk0 > r0 + 16 * MT - 1) break;                     // every key is after this warp's rows
            float s[MT][KEYS / 8][4];
            mma_scores_bf16<D, MT, KEYS>(s, qa, ks[cur] + sub);
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                int row = r0 + 16 * mt + group;                    // and row + 8
                if (kk0 + KEYS - 1 > r0 + 16 * mt)                 // the diagonal: mask keys after the query
                    #pragma unroll
                    for (int nt = 0; nt < KEYS / 8; nt++)
                        #pragma unroll
                        for (int i = 0; i < 4; i++)
                            if (kk0 + nt * 8 + 2 * in_group + (i & 1) > row + 8 * (i >> 1)) s[mt][nt][i] = -INFINITY;
                float mx[2] = {m[mt][0], m[mt][1]}, correction[2], ms[2];
                #pragma unroll
                for (int nt = 0; nt < KEYS / 8; nt++)
                    #pragma unroll
                    for (int i = 0; i < 4; i++) mx[i >> 1] = fmaxf(mx[i >> 1], s[mt][nt][i]);
                #pragma unroll
                for (int r = 0; r < 2; r++) {                      // key 0 is in the first step: mx is finite
                    mx[r] = group_max(mx[r]);
                    correction[r] = exp2f((m[mt][r] - mx[r]) * scale2);   // rescale what came before
                    m[mt][r] = mx[r];
                    ms[r] = mx[r] * scale2;
                    l[mt][r] *= correction[r];
                }
                #pragma unroll
                for (int nt = 0; nt < KEYS / 8; nt++)
                    #pragma unroll
                    for (int i = 0; i < 4; i++) {
                        s[mt][nt][i] = exp2f(fmaf(s[mt][nt][i], scale2, -ms[i >> 1]));
                        l[mt][i >> 1] += s[mt][nt][i];
                    }
                #pragma unroll
                for (int nt = 0; nt < D / 8; nt++)
                    #pragma unroll
                    for (int i = 0; i < 4; i++) o[mt][nt][i] *= correction[i >> 1];
            }
            mma_weighted_sum_bf16<D, MT, KEYS>(o, s, vs[cur] + sub);
        }
        __syncthreads();                                           // before the next copy overwrites it
    }
    long y0 = (long)b * T * Hq * D + h * D;
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float inv_l[2];
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            int row = r0 + 16 * mt + group + 8 * r;
            l[mt][r] = group_sum(l[mt][r]);
            inv_l[r] = 1.0f / l[mt][r];
            if (in_group == 0 && row < T) lse[((long)b * Hq + h) * T + row] = m[mt][r] * scale + logf(l[mt][r]);
        }
        store_c_rows<D>(y16 + y0, (long)Hq * D, r0 + 16 * mt, T, o[mt], inv_l);
    }
}

// where the dk/dv pass leaves ds for the dq pass: for each (b, query head) the causal pairs of
// 64-row tiles, query tile qi's key tiles kj <= qi at pair qi (qi + 1) / 2 + kj, 64 x 64 bf16
// each, as the dk/dv pass's registers hold it (keys as rows, C layout): warp w's 16 keys at
// word 512 w of the tile, its register r (n-tile r / 2, row half r % 2) at word 32 r + lane.
// So each store of a warp writes 128 contiguous bytes, and the 16 bytes at bf16 1024 w +
// 64 r + 8 group hold key 16 w + 8 (r % 2) + group's 8 queries 8 (r / 2) ..: a row of an 8x8
// matrix, as ldmatrix reads one
__device__ __forceinline__ long ds_tile(int b, int h, int Hq, int T, int qi, int kj) {
    int tiles = (T - 1) / TILE + 1;
    return (((long)b * Hq + h) * (tiles * (tiles + 1) / 2) + qi * (qi + 1) / 2 + kj) * TILE * TILE;
}

// dq for 64 query rows of one query head, 16 per warp: dq = scale ds k, over the key tiles up
// to the diagonal, with ds as the dk/dv pass stored it (rounded to bf16, as it enters every
// product), read transposed from shared memory by ldmatrix .trans straight into A fragments.
// (This pass once recomputed s, p and dp from q, k, v and dy: three products a tile where
// one is left, for a write and a read of ds, about B Hq T^2 bytes: on an H200 at the big
// model's shape, a layer's attention forward and backward went from 681 to 596 us at B = 64.)
// grid = (Hq, B, ceil(T / 64)), the last query tiles first; block = 128 threads
template <int D>
__device__ void attention_backward_dq_bf16(unsigned short* dqkv16, const unsigned short* qkv16,
                                           const unsigned short* ds16, int T, int Hq, int Hkv, float scale) {
    __shared__ __align__(16) unsigned short ks[2][TILE][D + PAD], dss[2][TILE * TILE];
    int h = blockIdx.x, b = blockIdx.y, kvh = h / (Hq / Hkv), qi = gridDim.z - 1 - blockIdx.z;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = qi * TILE + warp * 16;
    long stride = (long)(Hq + 2 * Hkv) * D;
    const unsigned short* kbase = qkv16 + (long)b * T * stride + (Hq + kvh) * D;
    const unsigned short* dsbase = ds16 + ds_tile(b, h, Hq, T, qi, 0);
    auto load = [&](int kj, int buf) {                             // key tile kj and its ds tile
        load_tile_async<D>(ks[buf], kbase, stride, kj * TILE, T);
        for (int c = threadIdx.x; c < TILE * TILE / 8; c += blockDim.x)
            cp_async16(&dss[buf][8 * c], dsbase + (long)kj * TILE * TILE + 8 * c, true);
        cp_async_commit();
    };
    load(0, 0);
    float dq[D / 8][4] = {};
    for (int kj = 0; kj <= qi; kj++) {
        int cur = kj & 1;
        if (kj < qi) {
            load(kj + 1, cur ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < TILE / 16; kk++) {
            if (kj == qi && kk > warp) break;                      // keys after every row of this warp: ds = 0
            // A (16 rows x 16 keys) = the tile's keys 16 kk.. x queries 16 warp.., transposed: matrix
            // m of the four holds A's rows + 8 (m & 1) (n-tile 2 warp + (m & 1)) and keys + 8 (m >> 1)
            unsigned a[4];
            int m = lane >> 3, r = 2 * (2 * warp + (m & 1)) + (m >> 1);
            ldmatrix_x4_trans(a, &dss[cur][1024 * kk + 64 * r + 8 * (lane & 7)]);
            #pragma unroll
            for (int np = 0; np < D / 16; np++) {                  // B = the key tile's rows, as in mma_weighted_sum_bf16
                unsigned bf[4];
                ldmatrix_x4_trans(bf, &ks[cur][kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][np * 16 + (lane >> 4) * 8]);
                mma_bf16(dq[2 * np], a, bf[0], bf[1]);
                mma_bf16(dq[2 * np + 1], a, bf[2], bf[3]);
            }
        }
        __syncthreads();                                           // before the next copy overwrites it
    }
    float scales[2] = {scale, scale};
    store_c_rows<D>(dqkv16 + (long)b * T * stride + h * D, stride, r0, T, dq, scales);   // rope_backward rotates it
}

// dk and dv for 64 keys of one kv head, 16 per warp, summed over its G query heads
// and every query tile from the keys' own on. Keys are the rows here: st = k q.T,
// pt = exp(scale st - lse), dpt = v dy.T, dst = pt (dpt - delta);
// dv = pt dy, dk = scale dst q, both second products fed from registers; and dst, rounded to
// bf16, stored for the dq pass (ds_tile)
// grid = (Hkv, B, ceil(T / 64)), the first key tiles (most queries) first; block = 128 threads
template <int D>
__device__ void attention_backward_dkv_bf16(unsigned short* dqkv16, unsigned short* ds16, const unsigned short* qkv16,
                                            const unsigned short* dy16, const float* lse, const float* delta, int T,
                                            int Hq, int Hkv, float scale) {
    __shared__ __align__(16) unsigned short qs[2][TILE][D + PAD], dys[2][TILE][D + PAD];
    __shared__ float lse_s[2][TILE], delta_s[2][TILE];
    int kvh = blockIdx.x, b = blockIdx.y, G = Hq / Hkv, k0 = blockIdx.z * TILE;
    int warp = threadIdx.x / 32, group = (threadIdx.x % 32) >> 2, in_group = threadIdx.x & 3;
    int r0 = k0 + warp * 16;                                       // this warp's first key
    long stride = (long)(Hq + 2 * Hkv) * D;
    const unsigned short* base = qkv16 + (long)b * T * stride;
    const unsigned short* dybase = dy16 + (long)b * T * Hq * D;
    int qtiles = (T - 1) / TILE + 1 - blockIdx.z, steps = G * qtiles;    // step = (head, query tile)
    auto load = [&](int step, int buf) {                           // the step's q and dy tiles, lse and delta
        int h = kvh * G + step / qtiles, q0 = k0 + step % qtiles * TILE;
        load_tile_async<D>(qs[buf], base + h * D, stride, q0, T);
        load_tile_async<D>(dys[buf], dybase + h * D, (long)Hq * D, q0, T);
        if (threadIdx.x < TILE) {
            int i = q0 + threadIdx.x;
            long e = ((long)b * Hq + h) * T + (i < T ? i : 0);
            cp_async4(&lse_s[buf][threadIdx.x], lse + e, i < T);
            cp_async4(&delta_s[buf][threadIdx.x], delta + e, i < T);
        }
        cp_async_commit();
    };
    load(0, 0);
    unsigned ka[D / 16][4], va[D / 16][4];
    load_a_bf16<D>(ka, base + (Hq + kvh) * D, stride, r0, T);
    load_a_bf16<D>(va, base + (Hq + Hkv + kvh) * D, stride, r0, T);
    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    const float scale2 = scale * LOG2E;
    for (int j = 0; j < steps; j++) {
        int cur = j & 1, q0 = k0 + j % qtiles * TILE;
        if (j + 1 < steps) {
            load(j + 1, cur ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        float st[TILE / 8][4], dpt[TILE / 8][4];
        mma_scores_bf16<D, 1>(&st, &ka, qs[cur]);
        mma_scores_bf16<D, 1>(&dpt, &va, dys[cur]);
        bool edge = q0 < r0 + 16 || q0 + TILE > T;                 // the diagonal, or queries past T
        #pragma unroll
        for (int nt = 0; nt < TILE / 8; nt++)
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                int c = nt * 8 + 2 * in_group + (i & 1), query = q0 + c, key = r0 + group + 8 * (i >> 1);
                float p = exp2f(fmaf(st[nt][i], scale2, -lse_s[cur][c] * LOG2E));
                if (edge && (query < key || query >= T)) p = 0.0f;
                st[nt][i] = p;
                dpt[nt][i] = p * (dpt[nt][i] - delta_s[cur][c]);
            }
        mma_weighted_sum_bf16<D, 1>(&dv, &st, dys[cur]);
        unsigned* ds_mine = (unsigned*)(ds16 + ds_tile(b, kvh * G + j / qtiles, Hq, T, q0 / TILE, blockIdx.z)) +
                            512 * warp + threadIdx.x % 32;
        #pragma unroll
        for (int nt = 0; nt < TILE / 8; nt++)                      // this warp's 16 keys x 64 queries of it
            #pragma unroll
            for (int half = 0; half < 2; half++)
                ds_mine[32 * (2 * nt + half)] = pack_bf16(dpt[nt][2 * half], dpt[nt][2 * half + 1]);
        mma_weighted_sum_bf16<D, 1>(&dk, &dpt, qs[cur]);
        __syncthreads();
    }
    float ones[2] = {1.0f, 1.0f}, scales[2] = {scale, scale};
    long kc = (long)b * T * stride + (Hq + kvh) * D, vc = (long)b * T * stride + (Hq + Hkv + kvh) * D;
    store_c_rows<D>(dqkv16 + kc, stride, r0, T, dk, scales);                         // rope_backward rotates dk
    store_c_rows<D>(dqkv16 + vc, stride, r0, T, dv, ones);
}

// -----------------------------------------------------------------------------
// the bf16 forward on Hopper (sm_90a: an H100 or H200): TMA, mbarriers and warpgroup MMA
//
// The same math and layouts as attention_forward_bf16 above (so the backward reads its y and lse as they are):
// scores s = q.k of the bf16 inputs summed in fp32, the online softmax in base 2 with the scale folded into one
// fma, p rounded to bf16 on its way into p v, y = o / l rounded to bf16, lse = m scale + log(l). Fed the way
// FlashAttention-3 feeds it (Shah et al., 2024): one warpgroup copies, the others multiply, and no block-wide
// barrier a step. On an H100 at the big model's B 64, T 512: 96.1 us a layer against attention_forward_bf16's
// 143.7 (dev/LOG.md; dev/variants/attention_forward_tma.cu holds the versions that were tried, this one its
// `_pipelined_turns_128`). D = 64 only; compiled where sm_90a's instructions exist (nanoeuler_cuda compiles this
// file for sm_90a on compute capability 9.0: the other kernels' machine code is the same as for sm_90) and on the
// CPU emulator, which defines these helpers in C++ (tools/emulate_cuda.py's WGMMA_HELPERS and TMA_HELPERS).
//
// The copies: TMA (cp.async.bulk.tensor.2d) through two tensor maps that nanoeuler_cuda makes once per qkv16
// buffer, over qkv16 seen as a 2D tensor of B T rows and (Hq + 2 Hkv) 64 columns: boxes of 64 columns (a head) by
// 64 rows (map_q) or 128 (map_kv), with the 128-byte swizzle that wgmma reads (row r's 16-byte chunk c at
// 128 r + 16 (c ^ r % 8)). Rows past a batch row's T are the next batch row's (zeros past B T): keys there fall
// on the diagonal step, after every query row, and are masked; query rows there are never stored.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)   // sm_90a, or the CPU emulator

#define HD 64                 // head dim (wgmma's K of q k.T, its N of p v)
#define WG_ROWS 64            // query rows of a consumer warpgroup (wgmma's M)
#define STEP_KEYS 128         // keys a step (wgmma's N of q k.T)
#define STAGES 4              // K/V stages in shared memory
#define TILE_BYTES 8192       // a 64 x 64 bf16 tile
#define PRODUCER_REGS 32      // setmaxnreg: 32 128 + 160 384 = 65536, the SM's registers, for 3 consumers
#define CONSUMER_REGS 160

// order the registers' accesses before it against the wgmma after it (the warpgroup runs it together)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// d (64 x N fp32) = a (64 x 16) b (16 x N) + (scale_d ? d : 0), a and b bf16 in shared memory by their
// descriptors (A_MN, B_MN: 0 K-major, 1 MN-major)
template <int N, int A_MN, int B_MN>
__device__ __forceinline__ void wgmma_bf16(float* d, unsigned long long a, unsigned long long b, int scale_d) {
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
              "+f"(d[i + 6]), "+f"(d[i + 7])
    static_assert(N == 256 || N == 128 || N == 64, "wgmma_bf16: N is 256 (the product), 128 (the forward) or 64 "
                  "(the backward) here");
    if constexpr (N == 256)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
                     "{"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                     "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                     "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                     "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "
                     "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "
                     "%124, %125, %126, %127}, "
                     "%128, %129, p, 1, 1, %131, %132;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56),
                       D8(64), D8(72), D8(80), D8(88), D8(96), D8(104), D8(112), D8(120)
                     : "l"(a), "l"(b), "r"(scale_d), "n"(A_MN), "n"(B_MN));
    else if constexpr (N == 128)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                     "%64, %65, p, 1, 1, %67, %68;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
                     : "l"(a), "l"(b), "r"(scale_d), "n"(A_MN), "n"(B_MN));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "%32, %33, p, 1, 1, %35, %36;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24)
                     : "l"(a), "l"(b), "r"(scale_d), "n"(A_MN), "n"(B_MN));
#undef D8
}

// the same with a from registers: a[0..3] this thread's part of a (64 x 16) as mma.sync's m16n8k16 a fragment;
// not to be written until the wgmma is waited for
template <int N, int B_MN>
__device__ __forceinline__ void wgmma_bf16_rs(float* d, const unsigned* a, unsigned long long b, int scale_d) {
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
              "+f"(d[i + 6]), "+f"(d[i + 7])
    static_assert(N == 64, "wgmma_bf16_rs: N is 64 here");
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : D8(0), D8(8), D8(16), D8(24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(B_MN));
#undef D8
}

// close the group of the wgmma this thread issued since the last commit
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int N>   // wait until at most N groups of wgmma are still in flight
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// a CUtensorMap: 128 opaque bytes that cuTensorMapEncodeTiled writes on the host; a kernel takes it as a
// const __grid_constant__ parameter and gives the copy its address
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

// an mbarrier (8 bytes of shared memory) whose phases complete after count arrivals (and the bytes expected)
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

// make mbarrier.init visible to the async proxy (the TMA unit) and to the other threads
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

// expect `bytes` more on the current phase, then arrive
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
                 "r"(bytes) : "memory");
}

// whether the phase of this parity has completed (waits a while first, as the hardware decides)
__device__ __forceinline__ bool mbarrier_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(shared_address(bar)), "r"(parity) : "memory");
    return done;
}

__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    while (!mbarrier_try_wait(bar, parity)) {
    }
}

// the box of the tensor map at element (x, y) (x along rows, the inner dimension) -> dst in shared memory,
// its bytes completed on bar
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, int x, int y, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
                 "[%2];" ::"r"(shared_address(dst)), "l"(map), "r"(shared_address(bar)), "r"(x), "r"(y)
                 : "memory");
}

// named barrier id (1 .. 15): wait until n threads (a multiple of 32) have arrived; or arrive without waiting
__device__ __forceinline__ void named_barrier_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// a warpgroup's registers a thread: raised to N, or lowered to N
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }

template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

// keep the compiler from moving accesses to the n accumulators across a wgmma fence or wait (CUTLASS's
// warpgroup_fence_operand): each register passes through an empty asm
template <int n>
__device__ __forceinline__ void fence_registers(float* d) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// a shared-memory matrix descriptor of a 128-byte-swizzled operand: bits 0-13 the start address >> 4, 16-29
// the leading byte offset >> 4, 32-45 the stride byte offset >> 4 (8 rows of 128 bytes: 1024), 62-63 1
__device__ __forceinline__ unsigned long long sw128_descriptor(unsigned address, unsigned lbo) {
    return (address & 0x3FFFF) >> 4 | (unsigned long long)(lbo >> 4 & 0x3FFF) << 16 |
           (unsigned long long)(1024 >> 4) << 32 | 1ull << 62;
}

// s = q k.T: 4 wgmma of 16 dims, q (64 rows) and k (128 keys) K-major (the 16 dims from kk at byte 32 kk of each
// 128-byte row)
__device__ __forceinline__ void issue_scores(float* s, unsigned q, unsigned k) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        wgmma_bf16<STEP_KEYS, 0, 0>(s, sw128_descriptor(q + 32 * kk, 16), sw128_descriptor(k + 32 * kk, 16), kk > 0);
    wgmma_commit();
}

// o += p v: 8 wgmma of 16 keys, p[kk] from registers, v N-major (keys 16 kk .. at byte 2048 kk; the 64 dims of a
// key one row, so the leading byte offset, between groups of 64 dims, is never used)
__device__ __forceinline__ void issue_weighted_sum(float* o, const unsigned (*p)[4], unsigned v) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < STEP_KEYS / 16; kk++)
        wgmma_bf16_rs<HD, 1>(o, p[kk], sw128_descriptor(v + 2048 * kk, 8192), 1);
    wgmma_commit();
}

// x[0] = the max of x[0 .. 2 W - 1], as a tree (a template: NVRTC leaves a loop of 4 levels rolled, x in local memory)
template <int W>
__device__ __forceinline__ void tree_max(float* x) {
#pragma unroll
    for (int a = 0; a < W; a++) x[a] = fmaxf(x[a], x[a + W]);
    if constexpr (W > 1) tree_max<W / 2>(x);
}

// the online softmax of one step on this thread's scores s (accumulator layout: thread t holds rows row0 = 16 (t
// / 32 % 4) + t % 32 / 4 and row0 + 8, columns 8 j + 2 (t % 4) + 0, 1; 128 keys from k0): mask keys after the
// query on the diagonal step, update the running max m and sum l, s <- p = exp2(s scale2 - m scale2) in fp32;
// -> correction[r], what o's row r is to be multiplied by
__device__ __forceinline__ void softmax_step(float* s, float* m, float* l, float* correction, int k0, int row0,
                                             bool diagonal, float scale2) {
    int q = threadIdx.x % 4;
    if (diagonal)
#pragma unroll
        for (int i = 0; i < STEP_KEYS / 2; i++)
            if (k0 + 8 * (i / 4) + 2 * q + i % 2 > row0 + 8 * (i / 2 % 2)) s[i] = -INFINITY;
    // a row's 32 scores here (registers 4 a + 2 r, + 1) reduced as a tree and summed 4 ways: short chains, as
    // a warp's softmax waits on its own latency
    constexpr int A = STEP_KEYS / 8;
    float mx[2][A], sum[2][4], ms[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
#pragma unroll
        for (int a = 0; a < A; a++) mx[r][a] = fmaxf(s[4 * a + 2 * r], s[4 * a + 2 * r + 1]);
        tree_max<A / 2>(mx[r]);
        mx[r][0] = group_max(fmaxf(m[r], mx[r][0]));              // a step's first key is at or before each row
        correction[r] = exp2f((m[r] - mx[r][0]) * scale2);        // rescale what came before
        m[r] = mx[r][0];
        ms[r] = mx[r][0] * scale2;
    }
#pragma unroll
    for (int i = 0; i < STEP_KEYS / 2; i++) {
        s[i] = exp2f(fmaf(s[i], scale2, -ms[i / 2 % 2]));
        if (i < 8) sum[i / 2 % 2][i / 4 * 2 + i % 2] = s[i];
        else sum[i / 2 % 2][i / 4 % 2 * 2 + i % 2] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; r++) l[r] = l[r] * correction[r] + ((sum[r][0] + sum[r][1]) + (sum[r][2] + sum[r][3]));
}

// p (fp32, accumulator layout) -> bf16 pairs in wgmma's register a layout, 16 keys a k-step: register j of
// k-step kk holds row g (+ 8 for odd j), keys 16 kk + 2 (t % 4), +1 (+ 8 for j >= 2): s[8 kk + 2 j], + 1
__device__ __forceinline__ void pack_p(unsigned (*p)[4], const float* s) {
#pragma unroll
    for (int kk = 0; kk < STEP_KEYS / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) p[kk][j] = pack_bf16(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
}

__device__ __forceinline__ void scale_o(float* o, const float* correction) {
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] *= correction[i / 2 % 2];
}

// the end of a tile, rows row0 and row0 + 8 of head h: lse = m scale + log(l) (rows past T skipped); -> inv, 1 / l
__device__ __forceinline__ void store_lse(float* lse, const float* m, const float* l, float* inv, int b, int h,
                                          int row0, int T, int Hq, float scale) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = group_sum(l[r]);
        inv[r] = 1.0f / sum;
        if (threadIdx.x % 4 == 0 && row0 + 8 * r < T)
            lse[((long)b * Hq + h) * T + row0 + 8 * r] = m[r] * scale + logf(sum);
    }
}

// and y = o / l rounded to bf16
__device__ __forceinline__ void store_y(unsigned short* y16, const float* o, const float* inv, int b, int h, int row0,
                                        int T, int Hq) {
    int q = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = row0 + 8 * r;
        if (row >= T) continue;
        unsigned short* out = y16 + ((long)b * T + row) * Hq * HD + h * HD;
#pragma unroll
        for (int j = 0; j < HD / 8; j++)
            *(unsigned*)(out + 8 * j + 2 * q) = pack_bf16(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
}

// The work: a unit is query tiles nq - 1 - p and p (nq = ceil(T / 64) tiles of 64 rows, p < ceil(nq / 2); one
// tile when the two are the same) of W query heads that read the same kv head, of one batch row: both tiles
// together take about the same number of key steps whatever p. Unit u: p = u % pairs, the group of W heads
// x = u / pairs % groups, the batch row b = u / pairs / groups. A tile qi takes the key steps j = 0 .. (64 qi +
// 63) / 128, the last one the diagonal. A block walks units blockIdx.x, + gridDim.x, ..., tile by tile and step
// by step, every thread of it the same way (so producer and consumers agree on which step uses which stage without
// telling each other); the cursor keeps its tile, so that a step costs no division (u % pairs once a unit).
struct Cursor {
    int u, second, j, qi;                // the unit, its second tile (0 or 1), the key step of the tile, the tile
};

struct Work {
    int nq, pairs, groups, units;
    __device__ Work(int B, int T, int Hq, int W) {
        nq = (T + WG_ROWS - 1) / WG_ROWS, pairs = (nq + 1) / 2, groups = Hq / W, units = B * groups * pairs;
    }
    __device__ Cursor first() const { return {(int)blockIdx.x, 0, 0, nq - 1 - (int)blockIdx.x % pairs}; }
    __device__ int last(const Cursor& c) const { return (c.qi * WG_ROWS + WG_ROWS - 1) / STEP_KEYS; }   // diagonal
    __device__ bool valid(const Cursor& c) const { return c.u < units; }
    __device__ void advance(Cursor& c) const {
        if (c.j < last(c)) {
            c.j++;
            return;
        }
        c.j = 0;
        if (!c.second && 2 * c.qi != nq - 1) c.second = 1, c.qi = nq - 1 - c.qi;     // tile p after nq - 1 - p
        else c.second = 0, c.u += gridDim.x, c.qi = nq - 1 - c.u % pairs;
    }
};

// what the warpgroups share in shared memory: q, two buffers of W tiles (buffer i of consumer g at (i W + g) 8192
// bytes), each with mbarriers q_full (the producer's expect_tx, the bytes) and q_empty (W arrivals: each consumer
// once its last scores of the tile are done); K and V, STAGES stages of 128 keys (stage i at kv + 2 128 128 i
// bytes, v 128 128 bytes after k), each with full_k and full_v (so the scores may start before V is in) and empty
// (W arrivals: each consumer once its p v of the step is done). Step n of a block uses stage n % STAGES in round
// n / STAGES: consumers wait for full's phase of parity (n / STAGES) % 2, the producer for empty's of the round
// before (the first round's counts as complete).
struct Block {
    unsigned char *qs, *kv;
    unsigned long long *full_k, *full_v, *empty, *q_full, *q_empty;
    Work work;
    int W, T, Hq, Hkv;
    __device__ Block(unsigned char* tiles, int B, int T_, int Hq_, int Hkv_)
        : work(B, T_, Hq_, blockDim.x / 128 - 1) {
        W = blockDim.x / 128 - 1, T = T_, Hq = Hq_, Hkv = Hkv_;
        qs = tiles, kv = tiles + 2 * W * TILE_BYTES;
        full_k = (unsigned long long*)(kv + STAGES * 2 * STEP_KEYS * 128);
        full_v = full_k + STAGES, empty = full_v + STAGES, q_full = empty + STAGES, q_empty = q_full + 2;
    }
    __device__ unsigned q_tile(int i, int g) const { return shared_address(qs + (i % 2 * W + g) * TILE_BYTES); }
    __device__ unsigned k_tile(int n) const { return shared_address(kv + n % STAGES * 2 * STEP_KEYS * 128); }
    __device__ unsigned v_tile(int n) const { return k_tile(n) + STEP_KEYS * 128; }
    __device__ int batch(int u) const { return u / work.pairs / work.groups; }
    __device__ int head0(int u) const { return u / work.pairs % work.groups * W; }   // the unit's first q head
};

// the producer: one thread issues, step by step, the copies of the block's tiles of q (each tile's W heads at its
// first step) and K/V (into stage n % STAGES once every consumer has freed it)
__device__ void produce(const Block& k, const TensorMap* map_q, const TensorMap* map_kv) {
    int n = 0, tiles = 0;
    for (Cursor c = k.work.first(); k.work.valid(c); k.work.advance(c), n++) {
        int row = k.batch(c.u) * k.T, h = k.head0(c.u), kvh = h / (k.Hq / k.Hkv);
        if (c.j == 0) {
            int i = tiles % 2;
            mbarrier_wait(&k.q_empty[i], (tiles / 2 + 1) % 2);
            mbarrier_arrive_expect_tx(&k.q_full[i], k.W * TILE_BYTES);
            for (int g = 0; g < k.W; g++)
                tma_load_2d(k.qs + (i * k.W + g) * TILE_BYTES, map_q, (h + g) * HD, row + c.qi * WG_ROWS,
                            &k.q_full[i]);
            tiles++;
        }
        int s = n % STAGES;
        mbarrier_wait(&k.empty[s], (n / STAGES + 1) % 2);
        unsigned char* stage = k.kv + s * 2 * STEP_KEYS * 128;
        mbarrier_arrive_expect_tx(&k.full_k[s], STEP_KEYS * 128);
        tma_load_2d(stage, map_kv, (k.Hq + kvh) * HD, row + c.j * STEP_KEYS, &k.full_k[s]);
        mbarrier_arrive_expect_tx(&k.full_v[s], STEP_KEYS * 128);
        tma_load_2d(stage + STEP_KEYS * 128, map_kv, (k.Hq + k.Hkv + kvh) * HD, row + c.j * STEP_KEYS, &k.full_v[s]);
    }
}

// the running state of a warpgroup's tile: o, the running max m and sum l of its two rows a thread
struct Rows {
    float o[HD / 2], m[2], l[2];
    __device__ void reset() {
#pragma unroll
        for (int i = 0; i < HD / 2; i++) o[i] = 0.0f;
        m[0] = m[1] = -INFINITY, l[0] = l[1] = 0.0f;
    }
};

// one step of a consumer (FlashAttention-3's IntraWGOverlap order) on the step at c, the n-th of the block, whose
// p (softmax done, o rescaled for it) is in p: with NEXT (not the block's last step), issue the next step's scores
// into s (its q the next tile's at this tile's last step), then this step's p v; wait for the scores, leaving the
// p v in flight, and do the next step's softmax on them; wait for the p v: its stage is free, o is rescaled for the
// next step (or, at a tile's last step, the tile's lse and y stored and o zeroed), and the next p packed. A
// warpgroup keeps one score accumulator (64 registers), p (32) and o (32). The consumers take turns to issue their
// wgmma (FlashAttention-3's warp scheduler barrier): consumer g waits at named barrier 1 + g (256 threads: its own
// and the consumer before it, which arrives once it has issued), so each one's softmax runs while the others'
// wgmma do. The waits are the same whatever the step, so that ptxas can follow the groups in flight (a wait_group
// chosen at run time, or a wgmma under a branch, and it serializes them)
template <bool NEXT>
__device__ __forceinline__ void consume_step(const Block& k, int g, Cursor& c, int n, int& tiles, float* s,
                                             unsigned (*p)[4], Rows& r, unsigned short* y16, float* lse, float scale,
                                             float scale2) {
    int t = threadIdx.x % 128, row0 = c.qi * WG_ROWS + 16 * (t / 32) + t % 32 / 4;
    bool last = c.j == k.work.last(c);
    int next_q = (tiles + last) % 2;                                // the q buffer of the next step's tile
    Cursor nx = c;
    k.work.advance(nx);
    float correction[2], m[2] = {r.m[0], r.m[1]}, l[2] = {r.l[0], r.l[1]};   // (the tile's, if it ends here)
    named_barrier_sync(1 + g, 256);                                 // this warpgroup's turn to issue
    if constexpr (NEXT) {
        if (last) mbarrier_wait(&k.q_full[next_q], (tiles + 1) / 2 % 2);
        mbarrier_wait(&k.full_k[(n + 1) % STAGES], (n + 1) / STAGES % 2);
        fence_registers<STEP_KEYS / 2>(s);
        issue_scores(s, k.q_tile(next_q, g), k.k_tile(n + 1));
    }
    mbarrier_wait(&k.full_v[n % STAGES], n / STAGES % 2);
    fence_registers<HD / 2>(r.o);
    issue_weighted_sum(r.o, p, k.v_tile(n));
    fence_registers<HD / 2>(r.o);
    named_barrier_arrive(1 + (g + 1) % k.W, 256);                   // the next warpgroup's turn
    if constexpr (NEXT) {
        wgmma_wait<1>();                                            // the next scores
        fence_registers<STEP_KEYS / 2>(s);
        bool next_last = nx.j == k.work.last(nx);
        if (next_last && t == 0) mbarrier_arrive(&k.q_empty[next_q]);
        if (last) r.m[0] = r.m[1] = -INFINITY, r.l[0] = r.l[1] = 0.0f;
        softmax_step(s, r.m, r.l, correction, nx.j * STEP_KEYS, nx.qi * WG_ROWS + 16 * (t / 32) + t % 32 / 4,
                     next_last, scale2);
    }
    wgmma_wait<0>();                                                // this p v: o, p and the stage are free
    fence_registers<HD / 2>(r.o);
    if (t == 0) mbarrier_arrive(&k.empty[n % STAGES]);
    if (last) {
        float inv[2];
        store_lse(lse, m, l, inv, k.batch(c.u), k.head0(c.u) + g, row0, k.T, k.Hq, scale);
        store_y(y16, r.o, inv, k.batch(c.u), k.head0(c.u) + g, row0, k.T, k.Hq);
#pragma unroll
        for (int i = 0; i < HD / 2; i++) r.o[i] = 0.0f;
        tiles++;
    } else if constexpr (NEXT) {
        scale_o(r.o, correction);
    }
    if constexpr (NEXT) pack_p(p, s);
    c = nx;
}

// a consumer (warpgroup g = 0 .. W - 1 of the consumers, query head head0 + g): the first step's scores and
// softmax, then every step but the last with NEXT; consumer 0 is given the first turn
__device__ void consume(const Block& k, int g, unsigned short* y16, float* lse, float scale) {
    const float scale2 = scale * LOG2E;
    int t = threadIdx.x % 128, tiles = 0, steps = 0;
    Cursor c = k.work.first();
    for (Cursor x = c; k.work.valid(x); k.work.advance(x)) steps++;
    if (!steps) return;
    Rows r;
    r.reset();
    float s[STEP_KEYS / 2], correction[2];
    unsigned p[STEP_KEYS / 16][4];
    bool last = c.j == k.work.last(c);
    if (g == 0) named_barrier_arrive(1, 256);
    mbarrier_wait(&k.q_full[0], 0);
    mbarrier_wait(&k.full_k[0], 0);
    named_barrier_sync(1 + g, 256);
    fence_registers<STEP_KEYS / 2>(s);
    issue_scores(s, k.q_tile(0, g), k.k_tile(0));
    named_barrier_arrive(1 + (g + 1) % k.W, 256);
    wgmma_wait<0>();
    fence_registers<STEP_KEYS / 2>(s);
    if (last && t == 0) mbarrier_arrive(&k.q_empty[0]);
    softmax_step(s, r.m, r.l, correction, 0, c.qi * WG_ROWS + 16 * (t / 32) + t % 32 / 4, last, scale2);
    pack_p(p, s);
    int n = 0;
    for (; n + 1 < steps; n++) consume_step<true>(k, g, c, n, tiles, s, p, r, y16, lse, scale, scale2);
    consume_step<false>(k, g, c, n, tiles, s, p, r, y16, lse, scale, scale2);
}

// y16 and lse as attention_forward_bf16<64> writes them. The work is split as the section's header and Work say:
// a block is 1 + W warpgroups (W a divisor of Hq / Hkv, at most 3: 3 for the big model): warpgroup 0 the producer
// (setmaxnreg lowers its registers to 32; one thread issues every copy), warpgroups 1 .. W the consumers, one per
// query head of the unit's W (setmaxnreg raises theirs to 160), each 64 query rows of its head a tile; each key
// step of 128 keys: s = q k.T by 4 wgmma m64n128k16 from shared memory, the online softmax on s in the
// accumulator layout (the causal mask on the diagonal step alone), o += p v by 8 wgmma m64n64k16 with p from
// registers. grid = the number of SMs (or the units, if fewer): persistent blocks, each walking units gridDim.x
// apart. Dynamic shared memory: 2 W 8192 (q) + 4 32768 (K/V) + 1024 (to align the tiles) + 8 16 (the mbarriers)
__device__ void attention_forward_tma(unsigned short* y16, float* lse, const TensorMap* map_q, const TensorMap* map_kv,
                                      int B, int T, int Hq, int Hkv, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    Block k(smem + (1024 - shared_address(smem) % 1024) % 1024, B, T, Hq, Hkv);   // the 128-byte swizzle's 1024
    int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++)
            mbarrier_init(&k.full_k[s], 1), mbarrier_init(&k.full_v[s], 1), mbarrier_init(&k.empty[s], k.W);
        for (int i = 0; i < 2; i++) mbarrier_init(&k.q_full[i], 1), mbarrier_init(&k.q_empty[i], k.W);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) produce(k, map_q, map_kv);
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
    consume(k, wg - 1, y16, lse, scale);
}

// -----------------------------------------------------------------------------
// the bf16 backward's dk/dv pass on Hopper (sm_90a), in the forward's design: TMA, mbarriers and warpgroup MMA
//
// The same math and layouts as attention_backward_dkv_bf16 above, so that its dq pass (attention_backward_dq_bf16)
// runs on the ds this one stores: keys are the rows, st = k q.T, pt = exp(scale st - lse) (0 for a query before the
// key or past T), dpt = v dy.T, dst = pt (dpt - delta); dv = sum pt dy, dk = scale sum dst q over the G query heads
// that read the kv head and every query tile from the keys' own on; dst rounded to bf16 and stored in ds_tile's
// order (each 64 x 64 tile in mma.sync's C order, which is wgmma's accumulator order too). Taken from
// dev/variants/attention_backward_tma.cu (its `_turns_64`, run persistent), which holds the versions that were
// tried; it ran on the CPU emulator only when it came here (not yet measured on a GPU: dev/LOG.md).
//
// The copies: TMA through four tensor maps that nanoeuler_cuda makes once per buffer: qkv16's (the forward's
// map_q: boxes of a head's 64 columns by 64 rows, the 128-byte swizzle), dy16's (the same over (B T, Hq 64)), and
// lse's and delta's, each seen as one row of B Hq T floats (a 2D map of one row, so any T does: rows of T floats
// would need 4 T bytes a multiple of 16), boxes of DKV_STAT_BOX = 68 floats. A TMA copy's first element must be
// 16-byte aligned in global memory (its inner coordinate times the element's bytes a multiple of 16; the hardware
// stops the kernel with CUDA_ERROR_ILLEGAL_INSTRUCTION otherwise, the emulator with a named failure): a step's
// 64 floats start at e = (b Hq + h) T + q0, which is no multiple of 4 when T is none (T 150: e 150 for b Hq + h
// = 1), so the copy starts at e & ~3 and takes 68 floats, and the consumer reads from e & 3 on. Query rows past
// a batch row's T are the next batch row's (zeros past B T), their lse and delta the next head's (zeros past the
// end): all of them masked (p = 0).

#define DKV_STAGES 4              // q, dy, lse and delta stages of the dk/dv pass
#define DKV_PRODUCER_REGS 24      // setmaxnreg: 24 128 + 240 256 = 64512 of the SM's 65536, for 2 consumers
#define DKV_CONSUMER_REGS 240
#define DKV_STAT_BOX 68           // floats of lse (and of delta) a copy: a step's 64 from e & 3 on (above)
#define DKV_STAT_STRIDE 96        // floats of lse (and of delta) a stage: 384 bytes, TMA's 128-byte alignment kept

// d = a b.T (64 x 64): 4 wgmma of 16 dims, a (64 rows) and b (64 rows) K-major (the 16 dims from kk at byte 32 kk
// of each 128-byte row): st = k q.T, dpt = v dy.T
__device__ __forceinline__ void issue_products_t(float* d, unsigned a, unsigned b) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        wgmma_bf16<64, 0, 0>(d, sw128_descriptor(a + 32 * kk, 16), sw128_descriptor(b + 32 * kk, 16), kk > 0);
}

// d += a b: 4 wgmma of 16 queries, a[kk] from registers, b (64 query rows of 64 dims) N-major (queries 16 kk .. at
// byte 2048 kk): dv += pt dy, dk += dst q
__device__ __forceinline__ void issue_products(float* d, const unsigned (*a)[4], unsigned b) {
#pragma unroll
    for (int kk = 0; kk < TILE / 16; kk++) wgmma_bf16_rs<HD, 1>(d, a[kk], sw128_descriptor(b + 2048 * kk, 8192), 1);
}

// x (fp32, accumulator layout) -> bf16 pairs in wgmma's register a layout, 16 queries a k-step: register j of
// k-step kk holds row g (+ 8 for odd j), queries 16 kk + 2 (t % 4), +1 (+ 8 for j >= 2): x[8 kk + 2 j], + 1
__device__ __forceinline__ void pack_a(unsigned (*a)[4], const float* x) {
#pragma unroll
    for (int kk = 0; kk < TILE / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) a[kk][j] = pack_bf16(x[8 * kk + 2 * j], x[8 * kk + 2 * j + 1]);
}

// rows row0 and row0 + 8 of x (accumulator layout) times f, rounded to bf16, into a row-major bf16 matrix (row
// stride ld) from out; rows past T skipped
__device__ __forceinline__ void store_key_rows(unsigned short* out, long ld, const float* x, float f, int row0,
                                               int T) {
    int q = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = row0 + 8 * r;
        if (row >= T) continue;
#pragma unroll
        for (int j = 0; j < HD / 8; j++)
            *(unsigned*)(out + row * ld + 8 * j + 2 * q) = pack_bf16(x[4 * j + 2 * r] * f, x[4 * j + 2 * r + 1] * f);
    }
}

// The work: a unit is W key tiles of 64 keys (keys 64 W x .. 64 W x + 64 W - 1) of one kv head of one batch row,
// the units ordered by x first, so that the heaviest (the first key tiles: the most queries) come first: unit u has
// x = u / (B Hkv), kv head u % (B Hkv) % Hkv, batch row u % (B Hkv) / Hkv. Its steps: j = 0 .. G m - 1 (m = nq -
// W x), step j is query head kvh G + j / m and query tile W x + j % m. A block walks units blockIdx.x, +
// gridDim.x, ..., every thread of it the same way, and its steps are counted over all its units, so the stages'
// ring and their parities run on from one unit to the next.
struct DkvUnit {
    int x, kvh, b, m, steps;
};

// what the warpgroups share: the unit's key tiles (K of consumer g at g 8192 bytes, V at (W + g) 8192), the stages
// (stage s: q at 2 W 8192 + 2 s 8192, dy 8192 after it; lse and delta, 384 bytes each, after every tile), the
// mbarriers: full (the producer's expect_tx) and empty (W arrivals, each consumer once its dk and dv products of
// the step are done) a stage; kv_full and kv_empty, the key tiles of the block's i-th unit in phase i
struct DkvBlock {
    unsigned char* tiles;
    float* stats;                                   // lse of stage s at 192 s, delta at 192 s + 96
    unsigned long long *full, *empty, *kv_full, *kv_empty;
    int W, B, T, Hq, Hkv, G, nq, units;
    __device__ DkvBlock(unsigned char* tiles_, int B_, int T_, int Hq_, int Hkv_) : tiles(tiles_) {
        W = blockDim.x / 128 - 1, B = B_, T = T_, Hq = Hq_, Hkv = Hkv_, G = Hq / Hkv;
        nq = (T + TILE - 1) / TILE, units = (nq + W - 1) / W * B * Hkv;
        stats = (float*)(tiles + (2 * W + 2 * DKV_STAGES) * TILE_BYTES);
        full = (unsigned long long*)(stats + 2 * DKV_STAT_STRIDE * DKV_STAGES);
        empty = full + DKV_STAGES, kv_full = empty + DKV_STAGES, kv_empty = kv_full + 1;
    }
    __device__ DkvUnit unit(int u) const {
        int x = u / (B * Hkv), m = nq - W * x;
        return {x, u % (B * Hkv) % Hkv, u % (B * Hkv) / Hkv, m, G * m};
    }
    __device__ unsigned char* k_bytes(int g) const { return tiles + g * TILE_BYTES; }
    __device__ unsigned char* v_bytes(int g) const { return tiles + (W + g) * TILE_BYTES; }
    __device__ unsigned char* q_bytes(int n) const { return tiles + (2 * W + 2 * (n % DKV_STAGES)) * TILE_BYTES; }
    __device__ unsigned char* dy_bytes(int n) const { return q_bytes(n) + TILE_BYTES; }
    __device__ float* lse_s(int n) const { return stats + 2 * DKV_STAT_STRIDE * (n % DKV_STAGES); }
    __device__ float* delta_s(int n) const { return lse_s(n) + DKV_STAT_STRIDE; }
};

// the producer: one thread issues, unit by unit, its K and V tiles (once every consumer is done with the unit
// before), then step by step the stage's q, dy, lse and delta (into stage n % DKV_STAGES once every consumer has
// freed it; n counts the block's steps)
__device__ void produce_dkv(const DkvBlock& k, const TensorMap* map_qkv, const TensorMap* map_dy,
                            const TensorMap* map_lse, const TensorMap* map_delta) {
    int n = 0, i = 0;
    for (int u = blockIdx.x; u < k.units; u += gridDim.x, i++) {
        DkvUnit w = k.unit(u);
        int row = w.b * k.T;
        mbarrier_wait(k.kv_empty, (i + 1) % 2);
        mbarrier_arrive_expect_tx(k.kv_full, 2 * k.W * TILE_BYTES);
        for (int g = 0; g < k.W; g++) {
            int r = row + (k.W * w.x + g) * TILE;
            tma_load_2d(k.k_bytes(g), map_qkv, (k.Hq + w.kvh) * HD, r, k.kv_full);
            tma_load_2d(k.v_bytes(g), map_qkv, (k.Hq + k.Hkv + w.kvh) * HD, r, k.kv_full);
        }
        for (int j = 0; j < w.steps; j++, n++) {
            int s = n % DKV_STAGES, h = w.kvh * k.G + j / w.m, q0 = (k.W * w.x + j % w.m) * TILE;
            int e = ((w.b * k.Hq + h) * k.T + q0) & ~3;  // lse's, delta's first: 16-byte aligned
            mbarrier_wait(&k.empty[s], (n / DKV_STAGES + 1) % 2);
            mbarrier_arrive_expect_tx(&k.full[s], 2 * TILE_BYTES + 2 * DKV_STAT_BOX * 4);
            tma_load_2d(k.q_bytes(n), map_qkv, h * HD, row + q0, &k.full[s]);
            tma_load_2d(k.dy_bytes(n), map_dy, h * HD, row + q0, &k.full[s]);
            tma_load_2d(k.lse_s(n), map_lse, e, 0, &k.full[s]);
            tma_load_2d(k.delta_s(n), map_delta, e, 0, &k.full[s]);
        }
    }
}

// a consumer (warpgroup g of the consumers, key tile W x + g of each unit), every step's products waited for at
// once. The consumers take turns to issue (FlashAttention-3's warp scheduler barrier, named barriers 1 .. W, as in
// the forward): each issues its st and dpt, then its dk and dv products, in its turn, so that one's gradients run
// while the other's wgmma do. A consumer whose key tile is after the step's query tile computes it all masked (p
// = 0: nothing added) and stores no ds, so that no wgmma is under a branch
__device__ void consume_dkv(const DkvBlock& k, int g, unsigned short* dqkv16, unsigned short* ds16, float scale) {
    const float scale2 = scale * LOG2E;
    int t = threadIdx.x % 128, q = t % 4, n = 0, i = 0;
    unsigned ka = shared_address(k.k_bytes(g)), va = shared_address(k.v_bytes(g));
    float dk[HD / 2], dv[HD / 2], st[TILE / 2], dpt[TILE / 2];
    unsigned pa[TILE / 16][4], da[TILE / 16][4];
    long stride = (long)(k.Hq + 2 * k.Hkv) * HD;
    if (g == 0) named_barrier_arrive(1, 256);                     // the first turn is consumer 0's
    for (int u = blockIdx.x; u < k.units; u += gridDim.x, i++) {
        DkvUnit w = k.unit(u);
        int kt = k.W * w.x + g, row0 = kt * TILE + 16 * (t / 32) + t % 32 / 4;
#pragma unroll
        for (int a = 0; a < HD / 2; a++) dk[a] = dv[a] = 0.0f;
        mbarrier_wait(k.kv_full, i % 2);
        for (int j = 0; j < w.steps; j++, n++) {
            int s = n % DKV_STAGES, h = w.kvh * k.G + j / w.m, qt = k.W * w.x + j % w.m, q0 = qt * TILE;
            mbarrier_wait(&k.full[s], n / DKV_STAGES % 2);
            unsigned qa = shared_address(k.q_bytes(n)), dya = shared_address(k.dy_bytes(n));
            fence_registers<TILE / 2>(st);
            fence_registers<TILE / 2>(dpt);
            named_barrier_sync(1 + g, 256);                         // this consumer's turn to issue
            wgmma_fence();
            issue_products_t(st, ka, qa);
            issue_products_t(dpt, va, dya);
            wgmma_commit();
            named_barrier_arrive(1 + (g + 1) % k.W, 256);           // the next consumer's turn
            wgmma_wait<0>();
            fence_registers<TILE / 2>(st);
            fence_registers<TILE / 2>(dpt);
            // pt and dst in place of st and dpt; keys after a query, or queries past T, are masked (p = 0)
            int o = ((w.b * k.Hq + h) * k.T + q0) & 3;     // the step's first in the stage (the copy's start aligned)
            const float *lse = k.lse_s(n) + o, *delta = k.delta_s(n) + o;
            bool edge = q0 < kt * TILE + TILE || q0 + TILE > k.T;
#pragma unroll
            for (int a = 0; a < TILE / 2; a++) {
                int c = 8 * (a / 4) + 2 * q + a % 2, query = q0 + c, key = row0 + 8 * (a / 2 % 2);
                float p = exp2f(fmaf(st[a], scale2, -lse[c] * LOG2E));
                if (edge && (query < key || query >= k.T)) p = 0.0f;
                st[a] = p;
                dpt[a] = p * (dpt[a] - delta[c]);
            }
            pack_a(pa, st);
            pack_a(da, dpt);
            if (qt >= kt) {                              // this warp's 16 keys x 64 queries of the ds tile
                unsigned* ds = (unsigned*)(ds16 + ds_tile(w.b, h, k.Hq, k.T, qt, kt)) + 512 * (t / 32) + t % 32;
#pragma unroll
                for (int kk = 0; kk < TILE / 16; kk++)
#pragma unroll
                    for (int b = 0; b < 4; b++) ds[32 * (4 * kk + b)] = da[kk][b];      // ds_tile's order
            }
            fence_registers<HD / 2>(dv);
            fence_registers<HD / 2>(dk);
            named_barrier_sync(1 + g, 256);
            wgmma_fence();
            issue_products(dv, pa, dya);
            issue_products(dk, da, qa);
            wgmma_commit();
            named_barrier_arrive(1 + (g + 1) % k.W, 256);
            wgmma_wait<0>();
            fence_registers<HD / 2>(dv);
            fence_registers<HD / 2>(dk);
            if (t == 0) mbarrier_arrive(&k.empty[s]);    // this warpgroup is done with the stage
        }
        if (t == 0) mbarrier_arrive(k.kv_empty);         // and with the unit's key tiles
        unsigned short* out = dqkv16 + (long)w.b * k.T * stride;
        store_key_rows(out + (k.Hq + w.kvh) * HD, stride, dk, scale, row0, k.T);      // rope_backward rotates dk
        store_key_rows(out + (k.Hq + k.Hkv + w.kvh) * HD, stride, dv, 1.0f, row0, k.T);
    }
}

// dk and dv into dqkv16 and ds into ds16 as attention_backward_dkv_bf16<64> writes them. The work is split as
// DkvUnit says: a block is 1 + W warpgroups (W = 2): warpgroup 0 the producer (setmaxnreg lowers its registers to
// 24; one thread issues every copy), warpgroups 1 .. W the consumers (setmaxnreg raises theirs to 240), consumer g
// owning key tile W x + g of the unit, its dk and dv (32 + 32 registers) in registers to the unit's end. Each
// step, in each consumer: st and dpt (64 keys x 64 queries, fp32) by 4 + 4 wgmma m64n64k16 from shared memory, pt
// and dst in the accumulator layout (lse and delta of its queries read from the stage), then dv += pt dy and dk
// += dst q by 4 + 4 wgmma m64n64k16, pt and dst from registers (bf16: wgmma's register a), dy and q MN-major.
// No atomics, no block-wide barrier a step. grid = the number of SMs (or the units, if fewer): persistent blocks,
// each walking units gridDim.x apart. Dynamic shared memory: (2 W + 2 DKV_STAGES) 8192 (K, V, q, dy) + 768
// DKV_STAGES (lse, delta) + 8 (2 DKV_STAGES + 2) (the mbarriers) + 1024 (to align the tiles)
__device__ void attention_backward_dkv_tma(unsigned short* dqkv16, unsigned short* ds16, const TensorMap* map_qkv,
                                           const TensorMap* map_dy, const TensorMap* map_lse,
                                           const TensorMap* map_delta, int B, int T, int Hq, int Hkv, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    DkvBlock k(smem + (1024 - shared_address(smem) % 1024) % 1024, B, T, Hq, Hkv);
    int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < DKV_STAGES; s++) mbarrier_init(&k.full[s], 1), mbarrier_init(&k.empty[s], k.W);
        mbarrier_init(k.kv_full, 1), mbarrier_init(k.kv_empty, k.W);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<DKV_PRODUCER_REGS>();
        if (threadIdx.x == 0) produce_dkv(k, map_qkv, map_dy, map_lse, map_delta);
        return;
    }
    setmaxnreg_inc<DKV_CONSUMER_REGS>();
    consume_dkv(k, wg - 1, dqkv16, ds16, scale);
}

#endif

// -----------------------------------------------------------------------------
// the bf16 product on Hopper (sm_90a): c = a @ b.T by TMA and warpgroup MMA, and SwiGLU in its epilogue
//
// c (M, N) bf16 = a (M, K) @ b (N, K).T, every array row-major bf16, summed in fp32: the bf16 forward's products
// x @ W.T (nanoeuler_cuda's matmul runs them here on compute capability 9.0; cuBLAS elsewhere and for the rest).
// A copy of dev/variants/wgmma_probe.cu's wgmma_tma_persistent_store_bn256 (the same names), which an H100 timed at
// cuBLAS's rate or past it on the big model's four products at batch 64 (dev/LOG.md, 2026-12-07), with one change:
// any M, N and K (rows 16-byte aligned: N and K multiples of 8), since TMA fills what lies past a tensor's end with
// zeros (a ragged tile's rows and columns, a ragged step's k: all add 0) and does not store what lies past it.
//
// The work: c in tiles of 128 x 256, tile t in row block t / columns and column block t % columns, so that the
// blocks at work at once share a's rows (read from memory once; b, a weight of 6 MB at most here, stays in L2).
// Persistent blocks, one an SM, each walking tiles blockIdx.x, + gridDim.x, ... A block is 3 warpgroups:
// - warpgroup 0 the producer (its registers lowered by setmaxnreg): one thread copies, for each k-step of 64, a's
//   128 x 64 and b's 256 x 64 into one of 4 stages by TMA (the 128-byte swizzle that wgmma reads), announcing the
//   bytes on the stage's full mbarrier after waiting on its empty one;
// - warpgroups 1 and 2 the consumers, rows 0 .. 63 and 64 .. 127 of the tile: 4 wgmma m64n256k16 a step, a step's
//   group kept in flight (wait_group 1) while the next is issued, the stage before freed (empty's arrival), the
//   last one after wait_group 0 at the tile's end. Steps are counted over the block's whole walk (stage it % 4,
//   round it / 4), so the next tile's copies run under this one's epilogue.
// - the epilogue: a consumer rounds its 64 x 256 to bf16 into 64 x 64 boxes of shared memory (128-byte swizzled:
//   conflict-free 4-byte writes) and TMA stores each; two box buffers a consumer, so that it writes one while the
//   other is stored; its first thread commits the stores and, before a buffer is written again, waits until the
//   store of two boxes ago has read it (cp.async.bulk.wait_group.read 1); the warpgroup meets at named barrier
//   1 + its number around the writes. Every element of c is summed by one thread in one order: the same bits
//   every run.
// SwiGLU (matmul_swiglu_forward_tma_kernel): gu = a @ w_gate_up.T and s = silu(gate) * up in one pass. A tile's
// 256 columns of b are two boxes of 128 rows of w_gate_up, rows 128 j .. (gate) and F + 128 j .. (up), so that
// the gate and the up of a feature sit in one thread's registers (i and i + 64); it stores gate and up to gu
// (layout unchanged: gate then up, (M, 2F), through two maps of F columns a row of 2F, so that a ragged last tile
// stops at F) and s = swiglu_forward_kernel's math on the same bf16-rounded gate and up (the same bits).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)   // sm_90a, or the CPU emulator

#define PRODUCT_BK 64                 // k a step: a 128-byte row of bf16 (the swizzle's width)
#define PRODUCT_BM 128                // rows of a tile: two consumers of 64 (wgmma's M)
#define PRODUCT_BN 256                // columns of a tile: wgmma's largest N
#define PRODUCT_STAGES 4              // stages of a (128 x 64) and b (256 x 64): 48 KB each; 4 and the boxes fit 227 KB
#define PRODUCT_BOX 4096              // bf16 of a 64 x 64 box of c (8 KB), 2 a consumer
#define PRODUCT_PRODUCER_REGS 40      // setmaxnreg: 40 128 + 232 256 = 64512 of the SM's 65536
#define PRODUCT_CONSUMER_REGS 232

// make this thread's plain (generic proxy) writes to shared memory visible to the async proxy (a TMA store)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// global <- shared: the box of the tensor map at element (x, y) from src (laid out as tma_load_2d lays it; what
// lies past the tensor is not written), one of this thread's bulk copies (closed into a group by bulk_commit)
__device__ __forceinline__ void tma_store_2d(const void* map, const void* src, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
                 "r"(shared_address(src)), "r"(x), "r"(y) : "memory");
}

// close the group of the bulk copies this thread issued since the last commit
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int N>   // wait until at most N of this thread's bulk groups are still reading shared memory
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// x as bf16 holds it (rounded to nearest even), as the next kernel reads it back
__device__ __forceinline__ float bf16_rounded(float x) { return __uint_as_float(pack_bf16(x, 0.0f) << 16); }

// box j of a consumer's 64 x 256 (registers 32 j .. 32 j + 31 of d: columns 64 j ..; or, SILU, silu(gate) * up of
// registers 32 j .. (gate) and 64 + 32 j .. (up), rounded to bf16 first, as swiglu_forward_kernel reads them from
// gu) into its buffer, then a TMA store of it at element (x, y) of map, unless the box lies wholly past the
// tensor's end (inside false: its commit group stays, empty, so that the waits count as before; TMA would write none
// of it, but the hardware's handling of such a box was never exercised here). Register i of a thread holds row 16 w + g
// (+ 8 for i % 4 >= 2), column 8 (i / 4) + 2 q + i % 2 (wgmma's accumulator layout); row r's 16-byte chunk c
// goes to 128 r + 16 (c ^ r % 8), the 128-byte swizzle, as a TMA load would lay the box
template <bool SILU>
__device__ __forceinline__ void store_box(unsigned char* box, const float* d, int j, const TensorMap* map, int x,
                                          int y, bool inside, int wg) {
    int w = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, lead = threadIdx.x % 128 == 0;
    if (lead) bulk_wait_read<1>();                                // the store of two boxes ago has read it
    named_barrier_sync(1 + wg, 128);                              // before any thread writes it again
#pragma unroll
    for (int i = 32 * j; i < 32 * j + 32; i += 2) {
        int row = 16 * w + g + 8 * (i / 2 % 2), chunk = i / 4 % 8;
        float lo = d[i], hi = d[i + 1];
        if constexpr (SILU) {                                     // kernels.cu's swiglu_forward_kernel, to the bit
            float g0 = bf16_rounded(lo), g1 = bf16_rounded(hi), u0 = bf16_rounded(d[i + 64]),
                  u1 = bf16_rounded(d[i + 65]);
            lo = g0 / (1.0f + expf(-g0)) * u0, hi = g1 / (1.0f + expf(-g1)) * u1;
        }
        *(unsigned*)(box + row * 128 + (chunk ^ row % 8) * 16 + 4 * q) = pack_bf16(lo, hi);
    }
    fence_proxy_async();                                          // the writes, visible to the TMA store
    named_barrier_sync(1 + wg, 128);
    if (lead && inside) tma_store_2d(map, box, x, y);
    if (lead) bulk_commit();
}

// a product block's dynamic shared memory, aligned to the swizzle's 1024-byte pattern: PRODUCT_STAGES stages (a's
// 128 rows, then b's 256, 64 k each), 4 boxes of c (2 a consumer), then the stages' full and empty mbarriers, which
// thread 0 sets up before the block's first barrier
constexpr int PRODUCT_STAGE = (PRODUCT_BM + PRODUCT_BN) * PRODUCT_BK;
struct ProductShared {
    unsigned short *stages, *boxes;
    unsigned long long *full, *empty;
};

__device__ ProductShared product_shared() {
    extern __shared__ __align__(16) unsigned char smem[];
    ProductShared p;
    p.stages = (unsigned short*)(smem + (1024 - shared_address(smem) % 1024) % 1024);
    p.boxes = p.stages + PRODUCT_STAGES * PRODUCT_STAGE;
    p.full = (unsigned long long*)(p.boxes + 4 * PRODUCT_BOX);
    p.empty = p.full + PRODUCT_STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < PRODUCT_STAGES; s++) {
            mbarrier_init(&p.full[s], 1);                         // the producer's arrival, and the bytes
            mbarrier_init(&p.empty[s], 2);                        // a thread of each consumer, done with the stage
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    return p;
}

// c = a @ b.T (SWIGLU: gu and s), as the section's header says. map_a: a's, boxes of 64 k x 128 rows; map_b: b's,
// 64 k x 256 rows (SWIGLU: w_gate_up's, 64 k x 128 rows); map_c: c's (SWIGLU: gu's gate half), boxes of 64 x 64;
// SWIGLU: map_up gu's up half, map_s s's, the same boxes. N: columns of c (SWIGLU: F, of s)
template <bool SWIGLU>
__device__ void matmul_forward_tma(const TensorMap* map_a, const TensorMap* map_b, const TensorMap* map_c,
                                   const TensorMap* map_up, const TensorMap* map_s, int M, int N, int K) {
    ProductShared p = product_shared();
    unsigned short *stages = p.stages, *boxes = p.boxes;
    unsigned long long *full = p.full, *empty = p.empty;
    constexpr int TILE_N = SWIGLU ? PRODUCT_BN / 2 : PRODUCT_BN;      // columns of c (SWIGLU: of s) a tile
    int wg = threadIdx.x / 128, steps = (K + PRODUCT_BK - 1) / PRODUCT_BK, columns = (N + TILE_N - 1) / TILE_N;
    int tiles = (M + PRODUCT_BM - 1) / PRODUCT_BM * columns;
    if (wg == 0) {                                                // the producer
        setmaxnreg_dec<PRODUCT_PRODUCER_REGS>();
        if (threadIdx.x == 0)
            for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x)
                for (int kt = 0; kt < steps; kt++, it++) {
                    int s = it % PRODUCT_STAGES, k0 = kt * PRODUCT_BK, n0 = tile % columns * TILE_N;
                    unsigned short* stage = stages + s * PRODUCT_STAGE;
                    mbarrier_wait(&empty[s], (it / PRODUCT_STAGES + 1) % 2);
                    mbarrier_arrive_expect_tx(&full[s], PRODUCT_STAGE * 2); // whole boxes: TMA counts the zeros too
                    tma_load_2d(stage, map_a, k0, tile / columns * PRODUCT_BM, &full[s]);
                    tma_load_2d(stage + PRODUCT_BM * PRODUCT_BK, map_b, k0, n0, &full[s]);
                    if (SWIGLU)                                   // the up rows of the same features, F rows on
                        tma_load_2d(stage + (PRODUCT_BM + TILE_N) * PRODUCT_BK, map_b, k0, N + n0, &full[s]);
                }
        return;
    }
    setmaxnreg_inc<PRODUCT_CONSUMER_REGS>();
    float d[PRODUCT_BN / 2];
    int lead = threadIdx.x % 128 == 0;
    for (int n = 0, tile = blockIdx.x; tile < tiles; n++, tile += gridDim.x) {
        for (int kt = 0, it = n * steps; kt < steps; kt++, it++) {
            int s = it % PRODUCT_STAGES;
            mbarrier_wait(&full[s], it / PRODUCT_STAGES % 2);
            unsigned as = shared_address(stages + s * PRODUCT_STAGE + (wg - 1) * 64 * PRODUCT_BK);
            unsigned bs = shared_address(stages + s * PRODUCT_STAGE + PRODUCT_BM * PRODUCT_BK);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < PRODUCT_BK / 16; kk++)        // 16 k at byte 32 kk of each 128-byte row
                wgmma_bf16<PRODUCT_BN, 0, 0>(d, sw128_descriptor(as + 32 * kk, 16), sw128_descriptor(bs + 32 * kk, 16),
                                             kt > 0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>();                                      // the step before is done: its stage is free
            if (kt > 0 && lead) mbarrier_arrive(&empty[(it - 1) % PRODUCT_STAGES]);
        }
        wgmma_wait<0>();
        fence_registers<PRODUCT_BN / 2>(d);
        if (lead) mbarrier_arrive(&empty[((n + 1) * steps - 1) % PRODUCT_STAGES]);   // the tile's last stage
        int y = tile / columns * PRODUCT_BM + 64 * (wg - 1), x = tile % columns * TILE_N;   // this consumer's part
        unsigned char* mine = (unsigned char*)(boxes + 2 * (wg - 1) * PRODUCT_BOX);
#pragma unroll
        for (int j = 0; j < 4; j++)                               // SWIGLU: gate 0, 1 then up 0, 1 (columns 128 on)
            store_box<false>(mine + j % 2 * 2 * PRODUCT_BOX, d, j, SWIGLU && j >= 2 ? map_up : map_c,
                             x + 64 * (SWIGLU ? j % 2 : j), y, x + 64 * (SWIGLU ? j % 2 : j) < N && y < M, wg);
        if constexpr (SWIGLU)
#pragma unroll
            for (int j = 0; j < 2; j++)
                store_box<true>(mine + j * 2 * PRODUCT_BOX, d, j, map_s, x + 64 * j, y, x + 64 * j < N && y < M, wg);
    }
    if (lead) bulk_wait_read<0>();                                // the boxes are read before the block ends
}

// c (M, N) = a @ b.T: grid = min(SMs, tiles), 384 threads, dynamic shared memory 4 48 KB of stages + 32 KB of boxes
// + 1024 (to align them) + 64 (mbarriers); the maps as matmul_forward_tma says (nanoeuler_cuda's matmul_tma_maps)
extern "C" __global__ void __launch_bounds__(384, 1) matmul_forward_tma_kernel(
    const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    matmul_forward_tma<false>(&map_a, &map_b, &map_c, &map_c, &map_c, M, N, K);
}

// gu (M, 2F) = a @ w_gate_up.T and s (M, F) = silu(gate) * up: the same geometry, tiles of 128 features
extern "C" __global__ void __launch_bounds__(384, 1) matmul_swiglu_forward_tma_kernel(
    const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_w,
    const __grid_constant__ TensorMap map_gate, const __grid_constant__ TensorMap map_up,
    const __grid_constant__ TensorMap map_s, int M, int F, int K) {
    matmul_forward_tma<true>(&map_a, &map_w, &map_gate, &map_up, &map_s, M, F, K);
}

// -----------------------------------------------------------------------------
// the backward's data gradients on Hopper (sm_90a): c = a @ b, b row-major, and swiglu_backward in w_down's epilogue
//
// c (M, N) bf16 = a (M, K) @ b (K, N), b row-major (a weight W (K, N): dx = dy @ W, cuBLAS's "NN"), summed in fp32,
// no accumulate: the bf16 backward's five data-gradient products (nanoeuler_cuda's matmul runs them here on compute
// capability 9.0 when PRODUCT_TMA_BACKWARD is on). dev/variants/wgmma_probe.cu's wgmma_tma_persistent_store_nn_bn256
// (1.02-1.10x cuBLAS's rate on the big model's four at batch 64, H100, dev/LOG.md), with the forward's one change:
// any M, N, K with 16-byte-aligned rows (TMA's zeros past a tensor's end, its stores clipped there).
//
// The work: as the forward's product above (tiles of 128 x 256, persistent blocks, a producer warpgroup and two
// consumers of 64 x 256, 4 stages, c through 64 x 64 TMA-stored boxes); only b's stage differs: b is read along its
// rows, so a stage holds b's 256 columns as 4 TMA boxes of 64 columns x 64 k (a box row is 128 bytes of one k, the
// most the 128-byte swizzle allows), each 8 KB, one after the other: wgmma's N-major layout (LBO 8 KB between the
// groups of 64 columns, SBO 1024 between groups of 8 k, the 16 k of step kk at byte 2048 kk), read with its
// transpose-b bit set. A box wholly past N is not loaded (its bytes not announced): the columns it would feed are
// never stored, and no TMA then meets a box with no element inside the tensor.
// swiglu_backward in the epilogue (matmul_swiglu_backward_tma_kernel): ds = dx @ w_down (N = F), and instead of ds,
// dgu (M, 2F) = (d gate, d up) of the tile's 256 features: for each 64 columns a consumer loads the gate and up of
// its elements from gu (the forward's (M, 2F), 4 bytes a thread a pair, straight from global memory: there is no
// shared memory left for them) while it writes the 64 columns before, and writes d gate and d up into its two box
// buffers with swiglu_backward_kernel's expression on the bf16-rounded ds (as that pass reads ds from memory), the
// same compile options: the same bits as matmul + swiglu_backward (check and the tests compare them bit for bit).
// 8 boxes a consumer a tile instead of 4; ds itself is not written (nothing else reads it).

// gu's gate and up (bf16 pairs) of the elements of box j of a consumer's 64 x 256 of ds (registers 32 j ..:
// columns 64 j ..), register i's pair at (i - 32 j) / 2; rows past M and features past F as 0 (never stored)
__device__ __forceinline__ void load_gate_up(unsigned* gate, unsigned* up, int j, const unsigned short* gu, int x,
                                             int y, int M, int F) {
    int w = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
#pragma unroll
    for (int i = 32 * j; i < 32 * j + 32; i += 2) {
        int row = y + 16 * w + g + 8 * (i / 2 % 2), col = x + 8 * (i / 4) + 2 * q;   // F % 8 == 0: a pair is in or out
        const unsigned short* p = gu + (long)row * 2 * F + col;
        bool in = row < M && col < F;
        gate[i / 2 % 16] = in ? *(const unsigned*)p : 0u, up[i / 2 % 16] = in ? *(const unsigned*)(p + F) : 0u;
    }
}

// box j of a consumer's 64 x 256 of ds as d gate and d up into its two box buffers (gate: mine, up: mine + 8 KB),
// from load_gate_up's gate and up, stored at (x + 64 j, y) through map_gate and map_up (dgu's halves), the buffers
// written once both stores of the box before have read them (cp.async.bulk.wait_group.read 0)
__device__ __forceinline__ void store_dgu_box(unsigned char* mine, const float* d, int j, const unsigned* gate,
                                              const unsigned* up, const TensorMap* map_gate, const TensorMap* map_up,
                                              int x, int y, int M, int F, int wg) {
    int w = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, lead = threadIdx.x % 128 == 0;
    if (lead) bulk_wait_read<0>();                                // both stores of the box before have read them
    named_barrier_sync(1 + wg, 128);
#pragma unroll
    for (int i = 32 * j; i < 32 * j + 32; i += 2) {
        int row = 16 * w + g + 8 * (i / 2 % 2), chunk = i / 4 % 8, at = row * 128 + (chunk ^ row % 8) * 16 + 4 * q;
        float dgate[2], dup[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {                             // kernels.cu's swiglu_backward_kernel, to the bit
            unsigned gb = gate[i / 2 % 16], ub = up[i / 2 % 16];
            float gt = __uint_as_float(h ? gb & 0xFFFF0000u : gb << 16);
            float u = __uint_as_float(h ? ub & 0xFFFF0000u : ub << 16), ds = bf16_rounded(d[i + h]);
            float sig = 1.0f / (1.0f + expf(-gt)), silu = gt * sig;
            dgate[h] = ds * u * (sig + silu * (1.0f - sig));      // d silu / d gate
            dup[h] = ds * silu;                                   // forward was: s = silu * up
        }
        *(unsigned*)(mine + at) = pack_bf16(dgate[0], dgate[1]);
        *(unsigned*)(mine + 2 * PRODUCT_BOX + at) = pack_bf16(dup[0], dup[1]);
    }
    fence_proxy_async();                                          // the writes, visible to the TMA stores
    named_barrier_sync(1 + wg, 128);
    if (lead && x + 64 * j < F && y < M)
        tma_store_2d(map_gate, mine, x + 64 * j, y), tma_store_2d(map_up, mine + 2 * PRODUCT_BOX, x + 64 * j, y);
    if (lead) bulk_commit();
}

// c = a @ b (SWIGLU: dgu from ds = a @ b), as the section's header says. map_a: a's, boxes of 64 k x 128 rows;
// map_b: b's (K rows of N), boxes of 64 columns x 64 k; map_c: c's (SWIGLU: dgu's gate half), boxes of 64 x 64;
// SWIGLU: map_up dgu's up half, gu the forward's gate and up (M, 2F). N: columns of c (SWIGLU: F, of ds)
template <bool SWIGLU>
__device__ void matmul_backward_tma(const TensorMap* map_a, const TensorMap* map_b, const TensorMap* map_c,
                                    const TensorMap* map_up, const unsigned short* gu, int M, int N, int K) {
    ProductShared p = product_shared();
    unsigned short *stages = p.stages, *boxes = p.boxes;
    unsigned long long *full = p.full, *empty = p.empty;
    int wg = threadIdx.x / 128, steps = (K + PRODUCT_BK - 1) / PRODUCT_BK, columns = (N + PRODUCT_BN - 1) / PRODUCT_BN;
    int tiles = (M + PRODUCT_BM - 1) / PRODUCT_BM * columns;
    if (wg == 0) {                                                // the producer
        setmaxnreg_dec<PRODUCT_PRODUCER_REGS>();
        if (threadIdx.x == 0)
            for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x)
                for (int kt = 0; kt < steps; kt++, it++) {
                    int s = it % PRODUCT_STAGES, k0 = kt * PRODUCT_BK, n0 = tile % columns * PRODUCT_BN;
                    int nb = min(PRODUCT_BN / 64, (N - n0 + 63) / 64);   // b's boxes with a column inside N
                    unsigned short* stage = stages + s * PRODUCT_STAGE;
                    mbarrier_wait(&empty[s], (it / PRODUCT_STAGES + 1) % 2);
                    mbarrier_arrive_expect_tx(&full[s], (PRODUCT_BM + 64 * nb) * PRODUCT_BK * 2);   // zeros counted
                    tma_load_2d(stage, map_a, k0, tile / columns * PRODUCT_BM, &full[s]);
                    for (int j = 0; j < nb; j++)                  // box j: columns 64 j .. of the tile, 64 k
                        tma_load_2d(stage + (PRODUCT_BM + 64 * j) * PRODUCT_BK, map_b, n0 + 64 * j, k0, &full[s]);
                }
        return;
    }
    setmaxnreg_inc<PRODUCT_CONSUMER_REGS>();
    float d[PRODUCT_BN / 2];
    int lead = threadIdx.x % 128 == 0;
    for (int n = 0, tile = blockIdx.x; tile < tiles; n++, tile += gridDim.x) {
        for (int kt = 0, it = n * steps; kt < steps; kt++, it++) {
            int s = it % PRODUCT_STAGES;
            mbarrier_wait(&full[s], it / PRODUCT_STAGES % 2);
            unsigned as = shared_address(stages + s * PRODUCT_STAGE + (wg - 1) * 64 * PRODUCT_BK);
            unsigned bs = shared_address(stages + s * PRODUCT_STAGE + PRODUCT_BM * PRODUCT_BK);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < PRODUCT_BK / 16; kk++)        // a: 16 k at byte 32 kk of a row; b: 16 k rows on
                wgmma_bf16<PRODUCT_BN, 0, 1>(d, sw128_descriptor(as + 32 * kk, 16),
                                             sw128_descriptor(bs + 2048 * kk, 8192), kt > 0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>();                                      // the step before is done: its stage is free
            if (kt > 0 && lead) mbarrier_arrive(&empty[(it - 1) % PRODUCT_STAGES]);
        }
        wgmma_wait<0>();
        fence_registers<PRODUCT_BN / 2>(d);
        if (lead) mbarrier_arrive(&empty[((n + 1) * steps - 1) % PRODUCT_STAGES]);   // the tile's last stage
        int y = tile / columns * PRODUCT_BM + 64 * (wg - 1), x = tile % columns * PRODUCT_BN;   // this consumer's part
        unsigned char* mine = (unsigned char*)(boxes + 2 * (wg - 1) * PRODUCT_BOX);
        if constexpr (SWIGLU) {                                   // box j + 1's gate and up loaded under box j
            unsigned gate[2][16], up[2][16];
            load_gate_up(gate[0], up[0], 0, gu, x, y, M, N);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (j < 3) load_gate_up(gate[(j + 1) % 2], up[(j + 1) % 2], j + 1, gu, x, y, M, N);
                store_dgu_box(mine, d, j, gate[j % 2], up[j % 2], map_c, map_up, x, y, M, N, wg);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                store_box<false>(mine + j % 2 * 2 * PRODUCT_BOX, d, j, map_c, x + 64 * j, y, x + 64 * j < N && y < M,
                                 wg);
        }
    }
    if (lead) bulk_wait_read<0>();                                // the boxes are read before the block ends
}

// c (M, N) = a (M, K) @ b (K, N): grid = min(SMs, tiles), 384 threads, the forward's dynamic shared memory; the maps
// as matmul_backward_tma says (nanoeuler_cuda's matmul_backward_tma)
extern "C" __global__ void __launch_bounds__(384, 1) matmul_backward_tma_kernel(
    const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    matmul_backward_tma<false>(&map_a, &map_b, &map_c, &map_c, nullptr, M, N, K);
}

// dgu (M, 2F) = swiglu_backward(ds = dx (M, K) @ w_down (K, F), gu): the same geometry, tiles of 256 features
extern "C" __global__ void __launch_bounds__(384, 1) matmul_swiglu_backward_tma_kernel(
    const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_w,
    const __grid_constant__ TensorMap map_gate, const __grid_constant__ TensorMap map_up, const unsigned short* gu,
    int M, int F, int K) {
    matmul_backward_tma<true>(&map_a, &map_w, &map_gate, &map_up, gu, M, F, K);
}

#endif

// -----------------------------------------------------------------------------
// entry points: the CUDA-core (fp32), tf32 and bf16 passes for D = 16, 32 and 64;
// nanoeuler_cuda.py picks one by --precision and D

extern "C" __global__ void attention_backward_delta_kernel(float* delta, const float* dy, const float* y, int B,
                                                           int T, int Hq, int D) {
    attention_backward_delta(delta, dy, y, B, T, Hq, D);
}

extern "C" __global__ void attention_backward_delta_bf16_kernel(float* delta, const unsigned short* dy16,
                                                                const unsigned short* y16, int B, int T, int Hq,
                                                                int D) {
    attention_backward_delta(delta, dy16, y16, B, T, Hq, D);
}

extern "C" __global__ void __launch_bounds__(BR) attention_forward_kernel_16(
    float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {
    attention_forward<16>(y, lse, qkv, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(DKV_THREADS) attention_backward_dkv_kernel_16(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dkv<16>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(BR) attention_backward_dq_kernel_16(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq<16>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(BR) attention_forward_kernel_32(
    float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {
    attention_forward<32>(y, lse, qkv, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(DKV_THREADS) attention_backward_dkv_kernel_32(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dkv<32>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(BR) attention_backward_dq_kernel_32(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq<32>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(BR) attention_forward_kernel_64(
    float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {
    attention_forward<64>(y, lse, qkv, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(DKV_THREADS) attention_backward_dkv_kernel_64(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dkv<64>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(BR) attention_backward_dq_kernel_64(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq<64>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_forward_tf32_kernel_16(
    float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {
    attention_forward_tf32<16>(y, lse, qkv, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dkv_tf32_kernel_16(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dkv_tf32<16>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dq_tf32_kernel_16(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq_tf32<16>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_forward_tf32_kernel_32(
    float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {
    attention_forward_tf32<32>(y, lse, qkv, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dkv_tf32_kernel_32(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dkv_tf32<32>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dq_tf32_kernel_32(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq_tf32<32>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_forward_tf32_kernel_64(
    float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {
    attention_forward_tf32<64>(y, lse, qkv, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dkv_tf32_kernel_64(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dkv_tf32<64>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dq_tf32_kernel_64(
    float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq_tf32<64>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);
}

// the bf16 passes for D = 16, 32 and 64; the forward at D = 16 and 32 one m-tile a warp, all of a key tile at once
extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_forward_bf16_kernel_16(
    unsigned short* y16, float* lse, const unsigned short* qkv16, int T, int Hq, int Hkv, float scale) {
    attention_forward_bf16<16, 1, TILE>(y16, lse, qkv16, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3) attention_backward_dkv_bf16_kernel_16(
    unsigned short* dqkv16, unsigned short* ds16, const unsigned short* qkv16, const unsigned short* dy16,
    const float* lse, const float* delta, int T, int Hq, int Hkv, float scale) {
    attention_backward_dkv_bf16<16>(dqkv16, ds16, qkv16, dy16, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dq_bf16_kernel_16(
    unsigned short* dqkv16, const unsigned short* qkv16, const unsigned short* ds16, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq_bf16<16>(dqkv16, qkv16, ds16, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_forward_bf16_kernel_32(
    unsigned short* y16, float* lse, const unsigned short* qkv16, int T, int Hq, int Hkv, float scale) {
    attention_forward_bf16<32, 1, TILE>(y16, lse, qkv16, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3) attention_backward_dkv_bf16_kernel_32(
    unsigned short* dqkv16, unsigned short* ds16, const unsigned short* qkv16, const unsigned short* dy16,
    const float* lse, const float* delta, int T, int Hq, int Hkv, float scale) {
    attention_backward_dkv_bf16<32>(dqkv16, ds16, qkv16, dy16, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dq_bf16_kernel_32(
    unsigned short* dqkv16, const unsigned short* qkv16, const unsigned short* ds16, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq_bf16<32>(dqkv16, qkv16, ds16, T, Hq, Hkv, scale);
}

// D = 64: two m-tiles a warp (128 query rows a block, each K and V fragment read from shared memory
// serving 32 rows), the scores 32 keys at a time so that 168 registers do and 3 blocks fit an SM: a
// layer's forward at B = 64 on an H200 163 us, against 174 with one m-tile and 178 with 16 keys at a
// time (dev/logs/h200_forward_mt2/); nanoeuler_cuda.FORWARD_MT
extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3) attention_forward_bf16_kernel_64(
    unsigned short* y16, float* lse, const unsigned short* qkv16, int T, int Hq, int Hkv, float scale) {
    attention_forward_bf16<64, 2, 32>(y16, lse, qkv16, T, Hq, Hkv, scale);
}

// 168 registers instead of 177, so that 3 blocks fit an SM: 3% faster at B = 16, 14% at 64 (with no
// spills then; since it stores ds, 12 bytes spill)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3) attention_backward_dkv_bf16_kernel_64(
    unsigned short* dqkv16, unsigned short* ds16, const unsigned short* qkv16, const unsigned short* dy16,
    const float* lse, const float* delta, int T, int Hq, int Hkv, float scale) {
    attention_backward_dkv_bf16<64>(dqkv16, ds16, qkv16, dy16, lse, delta, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_backward_dq_bf16_kernel_64(
    unsigned short* dqkv16, const unsigned short* qkv16, const unsigned short* ds16, int T, int Hq, int Hkv,
    float scale) {
    attention_backward_dq_bf16<64>(dqkv16, qkv16, ds16, T, Hq, Hkv, scale);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)   // sm_90a, or the CPU emulator
// the bf16 forward at D = 64 fed by TMA, on an H100 or H200 (nanoeuler_cuda's attention_forward picks it there):
// grid = the number of SMs, 128 (W + 1) threads, dynamic shared memory and tensor maps as attention_forward_tma says
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_kernel_64(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the bf16 backward's dk/dv pass at D = 64 fed by TMA, on an H100 or H200 (nanoeuler_cuda's attention_backward picks
// it there; the dq pass is attention_backward_dq_bf16_kernel_64 on its ds): grid = the number of SMs, 384 threads,
// dynamic shared memory and tensor maps as attention_backward_dkv_tma says
extern "C" __global__ void __launch_bounds__(384, 1) attention_backward_dkv_tma_kernel_64(
    unsigned short* dqkv16, unsigned short* ds16, const __grid_constant__ TensorMap map_qkv,
    const __grid_constant__ TensorMap map_dy, const __grid_constant__ TensorMap map_lse,
    const __grid_constant__ TensorMap map_delta, int B, int T, int Hq, int Hkv, float scale) {
    attention_backward_dkv_tma(dqkv16, ds16, &map_qkv, &map_dy, &map_lse, &map_delta, B, T, Hq, Hkv, scale);
}
#endif
