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
            atomics and no repeated k/v; another owns query rows and sums dq.

Layout: qkv is (B, T, (Hq + 2 Hkv) D) row-major, as the wqkv matmul writes it:
q heads, then k heads, then v heads. y is (B, T, Hq D); lse and delta (B, Hq, T).
Everything is fp32 on CUDA cores (no tensor cores yet). In the forward and the
dq kernel one thread owns one query row, its accumulators in registers. In
the dk/dv kernel two threads share a key row, each owning every other one of
its D dims (the pair reads neighbouring words of shared memory: different
banks), so that k, v, dk and dv fit in registers; the halves of each dot
product meet in one shuffle. That layout made dk/dv 1.6x faster on an H200,
but the forward and dq 1.1-1.3x slower, so they keep one thread per row.
D is a template parameter, instantiated for 16, 32 and 64 at the bottom (128
would need more than the 48 KB of shared memory a block gets without opting in).

Tiles: 64 query rows per block; keys loaded 32 at a time into shared memory,
2 x 32 x D floats = 16 KB at D = 64, and 32 scores per row in registers.
*/

#define BR 64   // query rows per block (= threads per block in the forward and dq)
#define BC 32   // key rows per shared-memory tile

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
    for (int d = 0; d < D; d++) y[((long)b * T + i) * Hq * D + h * D + d] = o[d] / l;
    lse[((long)b * Hq + h) * T + i] = m + logf(l);
}

// -----------------------------------------------------------------------------
// backward

// delta = rowsum(dy * y), the softmax backward's correction term
// one thread per (b, h, query row); grid = ceil(B*Hq*T / block)
__device__ void attention_backward_delta(float* delta, const float* dy, const float* y, int B, int T, int Hq,
                                         int D) {
    long e = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long)B * Hq * T) return;
    int i = e % T, h = (e / T) % Hq;
    long b = e / ((long)T * Hq);
    const float* dyr = dy + (b * T + i) * Hq * D + h * D;
    const float* yr = y + (b * T + i) * Hq * D + h * D;
    float s = 0.0f;
    for (int d = 0; d < D; d++) s += dyr[d] * yr[d];
    delta[e] = s;
}

// dk and dv for 64 keys of one kv head, summed over its G query heads and every
// query at or after each key. Two threads share a key row, each owning every
// other one of its D dims (so that the pair reads neighbouring words of a
// shared-memory row: different banks); k, v, dk and dv stay in registers, and
// the two halves of each dot product meet in one shuffle. Query tiles of BC
// rows are loaded into shared memory and read by every thread.
// grid = (ceil(T / 64), Hkv, B); block = 128 threads, two per key row
template <int D>
__device__ void attention_backward_dkv(float* dqkv, const float* qkv, const float* dy, const float* lse,
                                       const float* delta, int T, int Hq, int Hkv, float scale) {
    constexpr int KEYS = 64, HALF = D / 2;
    __shared__ float qs[BC][D], dys[BC][D], lse_s[BC], delta_s[BC];
    int b = blockIdx.z, kvh = blockIdx.y, G = Hq / Hkv;
    int half = threadIdx.x & 1;
    int j = blockIdx.x * KEYS + threadIdx.x / 2;
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
        for (int q0 = blockIdx.x * KEYS; q0 < T; q0 += BC) {          // causal: queries from the first key on
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
    float* out = dqkv + ((long)b * T + j) * stride;
    for (int e = 0; e < HALF; e++) {
        out[(Hq + kvh) * D + 2 * e + half] = dk[e];
        out[(Hq + Hkv + kvh) * D + 2 * e + half] = dv[e];
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
// entry points, one set per head dimension D

extern "C" __global__ void attention_backward_delta_kernel(float* delta, const float* dy, const float* y, int B,
                                                           int T, int Hq, int D) {
    attention_backward_delta(delta, dy, y, B, T, Hq, D);
}

#define INSTANTIATE(D)                                                                                          \
    extern "C" __global__ void __launch_bounds__(BR) attention_forward_kernel_##D(                             \
        float* y, float* lse, const float* qkv, int T, int Hq, int Hkv, float scale) {                          \
        attention_forward<D>(y, lse, qkv, T, Hq, Hkv, scale);                                                   \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dkv_kernel_##D(                        \
        float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq,    \
        int Hkv, float scale) {                                                                                 \
        attention_backward_dkv<D>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);                                \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(BR) attention_backward_dq_kernel_##D(                         \
        float* dqkv, const float* qkv, const float* dy, const float* lse, const float* delta, int T, int Hq,    \
        int Hkv, float scale) {                                                                                 \
        attention_backward_dq<D>(dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale);                                 \
    }

INSTANTIATE(16)
INSTANTIATE(32)
INSTANTIATE(64)

