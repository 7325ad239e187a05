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
