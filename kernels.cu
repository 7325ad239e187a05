/*
NanoEuler's elementwise and reduction kernels, the GPU twins of the numpy layers
in nanoeuler.py (same names: rmsnorm_forward there, rmsnorm_forward_kernel here,
rmsnorm_forward the launcher in nanoeuler_cuda.py), and decoding's kernels (the
last section). Training's matrix products are not here: they go through cuBLAS
(the bf16 forward's on an H100 or H200 through flash_attn.cu's TMA product);
decoding's matrix-vector products and its attention over the KV cache are.
Training's attention is in flash_attn.cu.

Compiled at run time by nanoeuler_cuda.py with NVRTC to a CUBIN for the device
(-std=c++17 --use_fast_math), cached on disk by source hash, and twice: as it
stands, where floatX is float (--precision fp32 and tf32), and with
-DFLOATX=bfloat16 (--precision bf16). floatX is the type of the activations and
of their gradients, as llm.c's: whatever one kernel (or cuBLAS) writes for the
next to read is floatX, so in bf16 every activation moves half the bytes of
fp32, and no activation has a second copy in another type. What stays fp32 in
both builds, and why:
  - the master weights, their gradients and AdamW's moments: an update is a
    small change of a weight, which bf16's 8 bits would round away, and a
    weight's gradient is a sum over the whole batch (cuBLAS adds each product
    into it in fp32); the matmuls read a bf16 copy of the weights that
    adamw_update_kernel writes as it updates them;
  - per-row statistics and sums: rmsnorm's rstd, attention's lse and delta,
    the losses and their sums, the gradient norm: few numbers, which the
    backward and the NaN stop need exact;
  - every value inside a kernel: a kernel reads floatX, computes in fp32 and
    rounds once, as it writes (a kernel that writes a value and also uses it
    uses the rounded value, as the next kernel will).
The residual stream and its gradient are floatX too, as in llm.c: they are the
biggest thing the norm kernels move (in fp32 they would cost about 2.5 GB of
traffic a step of the big model at batch 16), and an add rounds to 2^-9 of the
stream, without bias. PyTorch's autocast keeps them fp32; `check` compares the
whole model with a float64 reference that rounds where these kernels round,
so its bar measures the kernels, not bf16 (nanoeuler_cuda.check_model).
Element counts along rows (C, F, D/2, the qkv stride) are multiples of 8, so
that PACK elements move in one 16-byte load or store (nanoeuler_cuda.check_sizes
and decode_check_sizes refuse other models).
All kernels are extern "C" so their names survive compilation unmangled.

Gradient rule: parameter gradients +=, activation gradients =, except where a
kernel adds into the residual stream's gradient, which it says (+=).
Launch geometry is written above each kernel.
*/

// NVRTC compiles without the C headers, so infinity is spelled out in its bits
#define INFINITY __int_as_float(0x7f800000)

// -----------------------------------------------------------------------------
// helpers

// float32 -> bfloat16 bits, rounded to nearest even. The conversion instruction keeps a
// NaN a NaN (adding 0x7FFF to the bits would carry the GPU's NaN, 0x7FFFFFFF, into -0)
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// two floats -> one word of two bfloat16, lo in the lower half (the one at the lower address)
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// bfloat16 in memory: the upper half of a float32 (8 exponent bits, 7 mantissa bits)
struct bfloat16 {
    unsigned short bits;
};

#ifndef FLOATX
#define FLOATX float
#endif
typedef FLOATX floatX;          // the activations' type: float, or bfloat16 with -DFLOATX=bfloat16

// a float or bfloat16 as a float; a float written as *p's type holds it (bf16: rounded)
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bfloat16 x) { return __uint_as_float((unsigned)x.bits << 16); }
__device__ __forceinline__ void write_x(float* p, float x) { *p = x; }
__device__ __forceinline__ void write_x(bfloat16* p, float x) { p->bits = bf16_bits(x); }

// x as a floatX holds it: rounded to bf16 in the bf16 build, itself in the float build
__device__ __forceinline__ float round_x(float x) {
    floatX r;
    write_x(&r, x);
    return to_float(r);
}

// PACK floatX in 16 bytes (4 float or 8 bfloat16), moved by one load or store; p 16-byte aligned
constexpr int PACK = 16 / sizeof(floatX);

// a pack's 16 bytes as they lie in memory, whatever the type: how a kernel holds a row in
// registers before it uses it (unpack, below, reads them)
__device__ __forceinline__ uint4 load_bits(const void* p) { return *(const uint4*)p; }

// the floats in a pack's 16 bytes, read as the type p points to (p only names it)
__device__ __forceinline__ void unpack(float* f, uint4 v, const float*) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
}

__device__ __forceinline__ void unpack(float* f, uint4 v, const bfloat16*) {
    unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
    }
}

// PACK elements from p (16-byte aligned) as floats
template <typename T>
__device__ __forceinline__ void load_pack(float* f, const T* p) { unpack(f, load_bits(p), p); }

__device__ __forceinline__ void store_pack(float* p, const float* f) {
    *(float4*)p = make_float4(f[0], f[1], f[2], f[3]);
}

__device__ __forceinline__ void store_pack(bfloat16* p, const float* f) {
    *(uint4*)p = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

__device__ __forceinline__ double warp_sum(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
    return v;
}

// every thread of the block gets the total, summed in the same order every run;
// blockDim.x a multiple of 32, at most 1024
template <typename T>
__device__ T block_sum(T v) {
    __shared__ T partial[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();                      // partial may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? partial[lane] : (T)0;
    return warp_sum(v);
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? partial[lane] : -INFINITY;
    return warp_max(v);
}

// neither infinite nor NaN, read from the exponent bits (whatever fast math assumes)
__device__ __forceinline__ bool is_finite(double x) {
    return (__double_as_longlong(x) & 0x7FF0000000000000LL) != 0x7FF0000000000000LL;
}

// -----------------------------------------------------------------------------
// embedding

// x[n] = tok_emb[idx[n]]: each position's row of its token, written as floatX.
// one thread per output element; grid = ceil(N*C / block)
extern "C" __global__ void embedding_forward_kernel(floatX* x, const int* idx, const float* tok_emb, int N, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * C) return;
    int n = i / C, c = i % C;
    write_x(&x[i], tok_emb[(long)idx[n] * C + c]);
}

// dtok_emb[v] += the dx rows of the positions n where idx[n] == v, added in increasing n: no
// atomics and no sort on the host, and the same bits every run. One block per vocabulary
// entry v walks idx 256 positions at a time: each warp votes on its 32 (ballot), the
// matches are listed in order in shared memory, then each thread adds their elements in its
// columns (c0 + thread + 256 j, EMB_COLS of them in registers; wider rows take more slices).
// block 256, grid = V
#define EMB_COLS 4

extern "C" __global__ void __launch_bounds__(256) embedding_backward_kernel(float* dtok_emb, const int* idx,
                                                                            const floatX* dx, int N, int C) {
    __shared__ int rows[256], counts[8];
    int v = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int c0 = 0; c0 < C; c0 += 256 * EMB_COLS) {
        float sum[EMB_COLS] = {};
        for (int n0 = 0; n0 < N; n0 += 256) {
            int n = n0 + threadIdx.x;
            bool hit = n < N && idx[n] == v;
            unsigned votes = __ballot_sync(0xffffffff, hit);
            if (lane == 0) counts[warp] = __popc(votes);
            __syncthreads();
            int before = 0, total = 0;                             // matches in the warps before this one
            for (int w = 0; w < 8; w++) {
                before += w < warp ? counts[w] : 0;
                total += counts[w];
            }
            if (hit) rows[before + __popc(votes & ((1u << lane) - 1))] = n;
            __syncthreads();
            for (int j = 0; j < total; j++) {
                const floatX* r = dx + (long)rows[j] * C + c0;
#pragma unroll
                for (int k = 0; k < EMB_COLS; k++)
                    if (c0 + threadIdx.x + 256 * k < C) sum[k] += to_float(r[threadIdx.x + 256 * k]);
            }
            __syncthreads();                                       // rows, counts: rewritten next
        }
#pragma unroll
        for (int k = 0; k < EMB_COLS; k++) {
            int c = c0 + threadIdx.x + 256 * k;
            if (c < C) dtok_emb[(long)v * C + c] += sum[k];
        }
    }
}

// -----------------------------------------------------------------------------
// rmsnorm

// the widest row the norm kernels take (nanoeuler_cuda.check_sizes), and so the packs of a
// row one lane holds in registers: 6 in bf16, 12 in fp32 (48 floats' worth either way)
constexpr int MAX_C = 1536, ROW_PACKS = MAX_C / (32 * PACK);

// one row per warp: out = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps), where x is
// x_in, or with a given, x_in + a (the residual add, fused in), rounded as floatX holds it,
// which is written to x_out too and normalised as written. Lane l takes the packs at
// columns (32 j + l) PACK; its share of the row stays in registers between the sum and
// the output, so the row is read from memory once, all its loads issued together.
__device__ void rmsnorm_rows(floatX* out, float* rstd, floatX* x_out, const floatX* x_in, const floatX* a,
                             const float* w, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    long r0 = (long)row * C;
    uint4 x_bits[ROW_PACKS], a_bits[ROW_PACKS];
#pragma unroll
    for (int j = 0; j < ROW_PACKS; j++) {
        int c = (32 * j + lane) * PACK;
        if (c < C) x_bits[j] = load_bits(x_in + r0 + c);
        if (c < C && a) a_bits[j] = load_bits(a + r0 + c);
    }
    float x[ROW_PACKS][PACK], ss = 0.0f;
#pragma unroll
    for (int j = 0; j < ROW_PACKS; j++) {
        if ((32 * j + lane) * PACK >= C) continue;
        unpack(x[j], x_bits[j], x_in);
        if (a) {
            float y[PACK];
            unpack(y, a_bits[j], a);
#pragma unroll
            for (int i = 0; i < PACK; i++) x[j][i] = round_x(x[j][i] + y[i]);
        }
#pragma unroll
        for (int i = 0; i < PACK; i++) ss += x[j][i] * x[j][i];
    }
    float r = 1.0f / sqrtf(warp_sum(ss) / C + 1e-5f);
#pragma unroll
    for (int j = 0; j < ROW_PACKS; j++) {
        int c = (32 * j + lane) * PACK;
        if (c >= C) continue;
        if (x_out) store_pack(x_out + r0 + c, x[j]);
        float o[PACK];
#pragma unroll
        for (int i = 0; i < PACK; i++) o[i] = x[j][i] * r * w[c + i];
        store_pack(out + r0 + c, o);
    }
    if (lane == 0) rstd[row] = r;
}

// out = x / rms(x) * w for each of the N rows of x (N, C), and rstd = 1 / rms per row
// for the backward: rmsnorm_rows above, a warp per row.
// block 256 (8 rows), grid = ceil(N / 8)
extern "C" __global__ void rmsnorm_forward_kernel(floatX* out, float* rstd, const floatX* x, const float* w, int N,
                                                  int C) {
    rmsnorm_rows(out, rstd, nullptr, x, nullptr, w, N, C);
}

// x = x_in + a (the residual add: a is the product that adds into the stream), then
// out = rmsnorm(x) * w: one pass where residual_forward and rmsnorm_forward take two
// block 256 (8 rows), grid = ceil(N / 8)
extern "C" __global__ void residual_rmsnorm_forward_kernel(floatX* x, floatX* out, float* rstd, const floatX* x_in,
                                                           const floatX* a, const float* w, int N, int C) {
    rmsnorm_rows(out, rstd, x, x_in, a, w, N, C);
}

// one row per warp, rows in a grid-stride loop, lanes over the row as in rmsnorm_rows:
// dx = (accumulate ? dx : 0) + rstd * (g - xhat * mean(g * xhat)), g = dout * w, xhat = x * rstd.
// accumulate: the residual stream's gradient takes both paths (+=); the final norm's starts it.
// The lane's share of the row's dout and x (and dx, when added to) is loaded at once and stays
// in registers from the first sum to dx, so each is read once. A lane always holds the same
// columns, so its share of w and of dw stays in registers across its rows too: reading w
// again for each row and adding dw in shared memory took 95.6 us against 67.8 at the big
// model's batch 64 (H200, dev/variants/). To keep those registers few the kernel comes in
// the widths of row it takes (WIDTH, a multiple of 32 PACK: rmsnorm_backward_kernel_768
// holds 3 packs a lane in bf16, 6 in fp32; the fp32 build's widest spills 52 bytes); the host
// picks the narrowest that fits C.
// dw: each warp writes its sums into a row of shared memory of its own (warps x C floats,
// dynamic), the block adds its warps in order into partial[block], and
// rmsnorm_backward_dw_kernel adds the blocks in order: no atomics, so dw has the same bits
// every run. block 256, grid = min(ceil(N / 8), two per SM)
template <int WIDTH>
__device__ void rmsnorm_backward(floatX* dx, float* partial, const floatX* dout, const floatX* x, const float* w,
                                 const float* rstd, int N, int C, int accumulate) {
    constexpr int PACKS = WIDTH / (32 * PACK);
    extern __shared__ float dw_warp[];
    int warps = blockDim.x / 32, lane = threadIdx.x % 32;
    float w_mine[PACKS][PACK], dw_mine[PACKS][PACK];          // the lane's columns of w and dw
#pragma unroll
    for (int j = 0; j < PACKS; j++)
#pragma unroll
        for (int i = 0; i < PACK; i++) {
            int c = (32 * j + lane) * PACK + i;
            w_mine[j][i] = c < C ? w[c] : 0.0f;
            dw_mine[j][i] = 0.0f;
        }
    for (int row = blockIdx.x * warps + threadIdx.x / 32; row < N; row += gridDim.x * warps) {
        long r0 = (long)row * C;
        uint4 d_bits[PACKS], x_bits[PACKS], dx_bits[PACKS];
#pragma unroll
        for (int j = 0; j < PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (c < C) d_bits[j] = load_bits(dout + r0 + c), x_bits[j] = load_bits(x + r0 + c);
            if (c < C && accumulate) dx_bits[j] = load_bits(dx + r0 + c);
        }
        float r = rstd[row], dot = 0.0f;
#pragma unroll
        for (int j = 0; j < PACKS; j++) {
            if ((32 * j + lane) * PACK >= C) continue;
            float d[PACK], xv[PACK];
            unpack(d, d_bits[j], dout);
            unpack(xv, x_bits[j], x);
#pragma unroll
            for (int i = 0; i < PACK; i++) dot += d[i] * w_mine[j][i] * xv[i] * r;   // sum of g * xhat
        }
        dot = warp_sum(dot) / C;
#pragma unroll
        for (int j = 0; j < PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (c >= C) continue;
            float d[PACK], xv[PACK], g[PACK];
            unpack(d, d_bits[j], dout);
            unpack(xv, x_bits[j], x);
            if (accumulate) unpack(g, dx_bits[j], dx);
#pragma unroll
            for (int i = 0; i < PACK; i++) {
                float xhat = xv[i] * r;
                g[i] = (accumulate ? g[i] : 0.0f) + r * (d[i] * w_mine[j][i] - xhat * dot);
                dw_mine[j][i] += d[i] * xhat;
            }
            store_pack(dx + r0 + c, g);
        }
    }
    float* dw_row = dw_warp + (threadIdx.x / 32) * C;
#pragma unroll
    for (int j = 0; j < PACKS; j++)
#pragma unroll
        for (int i = 0; i < PACK; i++) {
            int c = (32 * j + lane) * PACK + i;
            if (c < C) dw_row[c] = dw_mine[j][i];
        }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += dw_warp[k * C + c];
        partial[(long)blockIdx.x * C + c] = sum;
    }
}

// the entry points, one per WIDTH, written out: the host picks the narrowest that fits C
extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_kernel_256(floatX* dx, float* partial,
        const floatX* dout, const floatX* x, const float* w, const float* rstd, int N, int C, int accumulate) {
    rmsnorm_backward<256>(dx, partial, dout, x, w, rstd, N, C, accumulate);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_kernel_768(floatX* dx, float* partial,
        const floatX* dout, const floatX* x, const float* w, const float* rstd, int N, int C, int accumulate) {
    rmsnorm_backward<768>(dx, partial, dout, x, w, rstd, N, C, accumulate);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_kernel_1536(floatX* dx, float* partial,
        const floatX* dout, const floatX* x, const float* w, const float* rstd, int N, int C, int accumulate) {
    rmsnorm_backward<1536>(dx, partial, dout, x, w, rstd, N, C, accumulate);   // MAX_C
}

// dw[c] += the blocks' partial sums, in block order: lane l of warp j adds the partials of
// column 32 block + l from blocks j, j + 8, ..., then warp 0 adds the 8 warps' in order
// block 256, grid = ceil(C / 32)
extern "C" __global__ void rmsnorm_backward_dw_kernel(float* dw, const float* partial, int blocks, int C) {
    __shared__ float part[8][32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, c = blockIdx.x * 32 + lane;
    float sum = 0.0f;
    if (c < C)
        for (int b = warp; b < blocks; b += 8) sum += partial[(long)b * C + c];
    part[warp][lane] = sum;
    __syncthreads();
    if (warp != 0 || c >= C) return;
    sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += part[j][lane];
    dw[c] += sum;
}

// -----------------------------------------------------------------------------
// rope

// rotate-half RoPE in place on the first n_heads heads of each row of qkv (the q and k
// heads): the pair (a, b) = (x[p], x[p + D/2]) of the row's position t becomes
// (a cos - b sin, b cos + a sin); cos/sin tables (positions, D/2) come from
// nanoeuler.rope_table. The backward is the rotation by the opposite angle: the same
// code with -sin. Each thread rotates PACK pairs (D/2 a multiple of PACK).
// grid = ceil(N * n_heads * D/2 / PACK / block)
__device__ void rope(floatX* qkv, const float* cos, const float* sin, int N, int T, int n_heads, int D, int stride,
                     int pos, float sign) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int half = D / 2, packs = half / PACK;
    if (i >= (long)N * n_heads * packs) return;
    int p = i % packs * PACK, h = (i / packs) % n_heads;
    long n = i / ((long)packs * n_heads);
    floatX* e = qkv + n * stride + h * D + p;
    const float *c = cos + (pos + n % T) * half + p, *s = sin + (pos + n % T) * half + p;
    float a[PACK], b[PACK];
    load_pack(a, e);
    load_pack(b, e + half);
#pragma unroll
    for (int j = 0; j < PACK; j++) {
        float ra = a[j] * c[j] - b[j] * sign * s[j], rb = b[j] * c[j] + a[j] * sign * s[j];
        a[j] = ra;
        b[j] = rb;
    }
    store_pack(e, a);
    store_pack(e + half, b);
}

// the entry points: rope above, the forward (sign +1) and the backward (sign -1: the opposite angle)
extern "C" __global__ void rope_forward_kernel(floatX* qkv, const float* cos, const float* sin, int N, int T,
                                               int n_heads, int D, int stride, int pos) {
    rope(qkv, cos, sin, N, T, n_heads, D, stride, pos, 1.0f);
}

extern "C" __global__ void rope_backward_kernel(floatX* dqkv, const float* cos, const float* sin, int N, int T,
                                                int n_heads, int D, int stride, int pos) {
    rope(dqkv, cos, sin, N, T, n_heads, D, stride, pos, -1.0f);
}

// -----------------------------------------------------------------------------
// swiglu

// gu (N, 2F) holds gate then up: out (N, F) = silu(gate) * up. PACK outputs per thread
// (F a multiple of PACK); grid = ceil(N*F / PACK / block)
extern "C" __global__ void swiglu_forward_kernel(floatX* out, const floatX* gu, int N, int F) {
    long i = PACK * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (long)N * F) return;
    long n = i / F, f = i % F;
    float gate[PACK], up[PACK], o[PACK];
    load_pack(gate, gu + n * 2 * F + f);
    load_pack(up, gu + n * 2 * F + F + f);
#pragma unroll
    for (int j = 0; j < PACK; j++) o[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    store_pack(out + i, o);
}

// dgu (N, 2F) = d gate then d up; as the forward, PACK outputs of it per thread
extern "C" __global__ void swiglu_backward_kernel(floatX* dgu, const floatX* dout, const floatX* gu, int N, int F) {
    long i = PACK * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (long)N * F) return;
    long n = i / F, f = i % F;
    float gate[PACK], up[PACK], d[PACK], dgate[PACK], dup[PACK];
    load_pack(gate, gu + n * 2 * F + f);
    load_pack(up, gu + n * 2 * F + F + f);
    load_pack(d, dout + i);
#pragma unroll
    for (int j = 0; j < PACK; j++) {
        float sig = 1.0f / (1.0f + expf(-gate[j])), silu = gate[j] * sig;
        dgate[j] = d[j] * up[j] * (sig + silu * (1.0f - sig));    // d silu / d gate
        dup[j] = d[j] * silu;                                      // forward was: out = silu * up
    }
    store_pack(dgu + n * 2 * F + f, dgate);
    store_pack(dgu + n * 2 * F + F + f, dup);
}

// -----------------------------------------------------------------------------
// residual

// out = x + a; one thread per element; grid = ceil(n / block). Training fuses the add into
// residual_rmsnorm_forward_kernel; decoding's prefill uses this one.
extern "C" __global__ void residual_forward_kernel(floatX* out, const floatX* x, const floatX* a, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) write_x(&out[i], to_float(x[i]) + to_float(a[i]));
}

// -----------------------------------------------------------------------------
// cross entropy over the K heads

// Fused softmax + loss + gradient, in place: logits (N, K, V) come in (the K heads side
// by side, as their one matmul writes them), and d loss / d logits go out in the same
// memory, so the probabilities are never stored. targets (N, K), -1 = ignored; dscale[k]
// = weight of head k / its count of kept targets (SPEC: loss = CE_0 + mtp_weight *
// mean(CE_1..CE_K-1)). losses (K, N): -log p(target) per row, 0 where ignored.
// The row is read twice: once for its max and sum together (an online softmax: each
// thread keeps its running max m and its sum of exp(x - m), rescaled when m grows, and
// the block combines them), and once, from the cache, to write the gradient. When V is a
// multiple of PACK the reads and writes move PACK elements at a time.
// one block of 256 threads per (row, head): block n K + k; grid = N*K
extern "C" __global__ void cross_entropy_forward_kernel(floatX* logits, float* losses, const int* targets,
                                                        const float* dscale, int N, int V, int K) {
    int n = blockIdx.x / K, k = blockIdx.x % K;
    floatX* row = logits + (long)blockIdx.x * V;
    int t = targets[blockIdx.x], packs = V % PACK == 0 ? V / PACK : 0;
    float m = -INFINITY, sum = 0.0f;
    for (int j = threadIdx.x; j < packs; j += blockDim.x) {
        float x[PACK], m_new = m;
        load_pack(x, row + j * PACK);
#pragma unroll
        for (int i = 0; i < PACK; i++) m_new = fmaxf(m_new, x[i]);
        sum *= expf(m - m_new);
#pragma unroll
        for (int i = 0; i < PACK; i++) sum += expf(x[i] - m_new);
        m = m_new;
    }
    for (int v = packs * PACK + threadIdx.x; v < V; v += blockDim.x) {     // V not a multiple of PACK
        float x = to_float(row[v]), m_new = fmaxf(m, x);
        sum = sum * expf(m - m_new) + expf(x - m_new);
        m = m_new;
    }
    float row_max = block_max(m);
    float lse = row_max + logf(block_sum(sum * expf(m - row_max)));        // a thread with no element adds 0
    float target_logit = t >= 0 ? to_float(row[t]) : 0.0f;
    __syncthreads();                      // everyone has read row[t] before it is overwritten
    if (threadIdx.x == 0) losses[(long)k * N + n] = t >= 0 ? lse - target_logit : 0.0f;
    float scale = t >= 0 ? dscale[k] : 0.0f;
    for (int j = threadIdx.x; j < packs; j += blockDim.x) {
        float x[PACK];
        load_pack(x, row + j * PACK);
#pragma unroll
        for (int i = 0; i < PACK; i++) x[i] = (expf(x[i] - lse) - (j * PACK + i == t ? 1.0f : 0.0f)) * scale;
        store_pack(row + j * PACK, x);
    }
    for (int v = packs * PACK + threadIdx.x; v < V; v += blockDim.x)
        write_x(&row[v], (expf(to_float(row[v]) - lse) - (v == t ? 1.0f : 0.0f)) * scale);
}

// sums[k] = the sum of head k's N losses, in double and in the same order every run (each
// thread its strided share, then a tree): what the host reads as the loss, and what
// clip_grad_norm_kernel checks before the update
// one block of 256 per head; grid = K
extern "C" __global__ void cross_entropy_sum_kernel(double* sums, const float* losses, int N) {
    double s = 0.0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) s += losses[(long)blockIdx.x * N + n];
    s = block_sum(s);
    if (threadIdx.x == 0) sums[blockIdx.x] = s;
}

// -----------------------------------------------------------------------------
// bf16

// float32 -> bfloat16, rounded to nearest even: the weights' bf16 copy once (adamw_update
// keeps it up to date after that), and decoding's
// four elements per thread (a quarter of the threads, the same bytes); grid = ceil(n / (4 block))
extern "C" __global__ void to_bf16_kernel(unsigned short* out, const float* in, long n) {
    long i = 4 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    for (long j = i; j < i + 4 && j < n; j++) out[j] = bf16_bits(in[j]);
}

// -----------------------------------------------------------------------------
// adamw

// sum of squares of the gradients, one partial sum per block, which
// clip_grad_norm_kernel adds up in block order (deterministic)
// grid-stride loop; grid = a few blocks per SM
extern "C" __global__ void grad_norm_kernel(float* partial, const float* grads, long n) {
    float s = 0.0f;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        s += grads[i] * grads[i];
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// The gradient norm, and what the update does with it (nanoeuler.clip_grad_norm and
// train_loop's NaN stop, on the GPU so that a step needs no host in the middle):
// norm = sqrt(the partial sums, added in double in block order) -> results[K], beside
// the K loss sums in results[0..K-1] (the host reads them together); clip[0] = max_norm
// / norm when max_norm > 0 and norm > max_norm, else 1; clip[1] = 1 when the norm and
// the loss sums are finite, else 0, and then adamw_update_kernel changes nothing.
// one warp; grid = 1
extern "C" __global__ void clip_grad_norm_kernel(double* results, float* clip, const float* partial, int blocks,
                                                 int K, float max_norm) {
    double s = 0.0;
    for (int b = threadIdx.x; b < blocks; b += 32) s += partial[b];
    s = warp_sum(s);
    if (threadIdx.x != 0) return;
    double norm = sqrt(s);
    bool ok = is_finite(norm);
    for (int k = 0; k < K; k++) ok = ok && is_finite(results[k]);
    results[K] = norm;
    clip[0] = max_norm > 0.0f && norm > max_norm ? (float)(max_norm / norm) : 1.0f;
    clip[1] = ok ? 1.0f : 0.0f;
}

// AdamW on the flat buffers, as nanoeuler.adamw_update; decay (a byte each) is 1 for
// matrices, 0 for norm weights. The step's numbers are read from GPU memory, so that a
// captured step replays with the next step's: hyper = (lr, 1 - beta1^step, 1 - beta2^step),
// uploaded before the step, and clip = (grad scale, apply) from clip_grad_norm_kernel;
// with apply = 0 nothing changes (the host then stops: no non-finite weight is ever
// applied or saved). With params16 (bf16 mode) the updated weights are also written
// rounded to bf16, the copy the matmuls read, in the same pass.
// Four parameters per thread at a time (the buffers 16-byte aligned), in a grid-stride loop:
// a thread reads hyper and clip once, and then its loads of the five streams are all it
// waits on (one block a thread's four, as this kernel was first, ran at 1.7 TB/s on an
// H200: each block's first wait was on clip). grid = a few blocks per SM
extern "C" __global__ void adamw_update_kernel(float* params, bfloat16* params16, const float* grads, float* m,
                                               float* v, const unsigned char* decay, long n, const float* hyper,
                                               const float* clip, float beta1, float beta2, float eps,
                                               float weight_decay) {
    if (clip[1] == 0.0f) return;
    float lr = hyper[0], bias1 = hyper[1], bias2 = hyper[2], grad_scale = clip[0];
    for (long i0 = 4 * ((long)blockIdx.x * blockDim.x + threadIdx.x); i0 < n; i0 += 4L * gridDim.x * blockDim.x) {
        int k = n - i0 < 4 ? n - i0 : 4;                            // the last four may be fewer
        float p[4] = {}, g[4] = {}, mi[4] = {}, vi[4] = {}, d[4] = {};
        if (k == 4) {
            float4 a = *(const float4*)(params + i0), b = *(const float4*)(grads + i0);
            float4 c = *(const float4*)(m + i0), e = *(const float4*)(v + i0);
            uchar4 f = *(const uchar4*)(decay + i0);
            p[0] = a.x, p[1] = a.y, p[2] = a.z, p[3] = a.w, g[0] = b.x, g[1] = b.y, g[2] = b.z, g[3] = b.w;
            mi[0] = c.x, mi[1] = c.y, mi[2] = c.z, mi[3] = c.w, vi[0] = e.x, vi[1] = e.y, vi[2] = e.z, vi[3] = e.w;
            d[0] = f.x, d[1] = f.y, d[2] = f.z, d[3] = f.w;
        } else {
            for (int j = 0; j < k; j++)
                p[j] = params[i0 + j], g[j] = grads[i0 + j], mi[j] = m[i0 + j], vi[j] = v[i0 + j], d[j] = decay[i0 + j];
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float gj = g[j] * grad_scale;
            mi[j] = beta1 * mi[j] + (1.0f - beta1) * gj;
            vi[j] = beta2 * vi[j] + (1.0f - beta2) * gj * gj;
            float pj = p[j] * (1.0f - lr * weight_decay * d[j]);    // decoupled weight decay
            p[j] = pj - lr / bias1 * mi[j] / (sqrtf(vi[j] / bias2) + eps);
        }
        if (k == 4) {
            *(float4*)(params + i0) = make_float4(p[0], p[1], p[2], p[3]);
            *(float4*)(m + i0) = make_float4(mi[0], mi[1], mi[2], mi[3]);
            *(float4*)(v + i0) = make_float4(vi[0], vi[1], vi[2], vi[3]);
            if (params16) *(uint2*)(params16 + i0) = make_uint2(pack_bf16(p[0], p[1]), pack_bf16(p[2], p[3]));
        } else {
            for (int j = 0; j < k; j++) {
                params[i0 + j] = p[j], m[i0 + j] = mi[j], v[i0 + j] = vi[j];
                if (params16) write_x(&params16[i0 + j], p[j]);
            }
        }
    }
}

// -----------------------------------------------------------------------------
// decoding (nanoeuler.py's generation section; nanoeuler_cuda.py's GPUDecoder)
//
// One decoding step feeds R rows: the last token, and in speculative decoding the
// drafts after it, at positions *pos .. *pos+R-1. pos, the token ids and a step
// counter live in GPU memory and the kernels update them, so one captured CUDA
// graph per R replays every step and only the chosen ids go to the host.
// Each row is computed the same way whatever R is (no sum runs across rows, and the
// order of every sum is fixed by the model's shapes and the row's own position), so
// a verifying pass over several rows gives the bits of one-row steps: speculative
// greedy output equals plain greedy output in every precision.
// The weights are fp32 or bf16 (W), the activations and the KV cache fp32.
//
// At batch 1 a step reads every weight once (233 MB in bf16, about 50 us at the
// H200's 4.8 TB/s) and does little arithmetic, so what it costs is latency: each
// kernel's launch and its chain of dependent memory reads. So each kernel issues
// all the loads a thread needs before it uses the first (one trip to memory where
// the old kernels made several), and spreads over all the SMs.
//
// Programmatic dependent launch (nanoeuler_cuda.DECODE_PDL, sm_90 on, on by
// default): a kernel launched with it may start while the kernel before it still
// runs. Each decode kernel first lets the next one start (decode_launch_next), reads
// what no kernel of the step writes (the weights; the cache before *pos), then waits
// for the kernels before it (decode_wait) before it reads their outputs or writes
// anything. Launched without it, and before sm_90, both are no-ops.

#define DECODE_MAX_ROWS 4       // R at most; nanoeuler_cuda.DECODE_MAX_ROWS
#define DECODE_OUTS 4           // outputs a warp of decode_matvec; nanoeuler_cuda.DECODE_OUTS
#define DECODE_LOADS 2          // 16-byte loads in flight a weight row per lane (8 in all); nanoeuler_cuda.DECODE_LOADS
#define DECODE_CHUNK 64         // keys per block of attention_decode_split; nanoeuler_cuda.DECODE_CHUNK
#define DECODE_HEADS 4          // query heads per block of attention_decode_split; nanoeuler_cuda.DECODE_HEADS

__device__ __forceinline__ void decode_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void decode_launch_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// decode_layers' stages (below) meet through counters in global memory, one a stage: a block adds 1 to a stage's
// counter once its part of the stage is written (stage_arrive), and a block that reads a stage's output waits until
// its counter holds every block of the grid (stage_wait): cooperative groups' grid sync, a counter a stage, so none
// is reset within a pass. The __syncthreads before the release orders the block's writes before thread 0's; the
// acquire (relaxed loads until the count is there, then a fence), then __syncthreads, orders every thread's reads
// after the other blocks' writes (an acquire at gpu scope empties the SM's L1, CCTL.IVALL: once, not every poll).
// Every block of the grid must be resident at once: the host launches no more blocks than fit
// (cuOccupancyMaxActiveBlocksPerMultiprocessor). Both are called by every thread of the block.
__device__ __forceinline__ void stage_arrive(int* counter) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(counter) : "memory");
}

// The pass's last stage: thread 0 adds 1 and reads what was there (acquire and release: after every other
// block's arrival, which followed its last read of any counter); the block that brings the count to the grid's
// size, when every block is past every wait, zeroes the n counters for the next pass (stream order shows them).
__device__ __forceinline__ void stage_arrive_last(int* counters, int n) {
    __syncthreads();
    if (threadIdx.x == 0) {
        int before;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(counters + n - 1) : "memory");
        if (before == gridDim.x - 1)
            for (int i = 0; i < n; i++) counters[i] = 0;
    }
}

__device__ __forceinline__ void stage_wait(const int* counter, int target) {
    if (threadIdx.x == 0) {
        int seen;
        do asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        while (seen < target);
        asm volatile("fence.acq_rel.gpu;" ::: "memory");          // the acquire, once: each one empties the L1
    }
    __syncthreads();
}

// how a decode function waits for what it reads: a kernel launched on its own waits for the kernel before it
// (decode_wait; `ready` null), a stage of decode_layers for `ready` (the stage before's counter) to reach `blocks`
struct DecodeSync {
    const int* ready;
    int blocks;
    __device__ __forceinline__ void launch_next() const { if (!ready) decode_launch_next(); }
    __device__ __forceinline__ void wait() const { if (!ready) decode_wait(); else stage_wait(ready, blocks); }
};

__device__ __forceinline__ float4 load4(const float* p) { return *(const float4*)p; }

// elements d0 .. d0+N-1 (N = 1 or 4) of query head slot g of one row's attention, from the `chunks`
// records the split attention wrote for the row and its block of heads (recs: the first; a record:
// acc (DECODE_HEADS x D), m, l (DECODE_HEADS)): y = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c,
// added in chunk order, M the chunks' max. Up to 8 chunks (T <= 512) are one trip to L2: every load
// is issued before the first is used (past 8, the maxima first). The same function wherever a row is
// combined, so its bits depend on the records alone.
template <int N>
__device__ __forceinline__ void chunk_records(float& m, float& l, float* a, const float* rc, int D, int g, int d0) {
    m = __ldcg(rc + DECODE_HEADS * D + g), l = __ldcg(rc + DECODE_HEADS * (D + 1) + g);
    if (N == 4) {
        float4 v = __ldcg((const float4*)(rc + g * D + d0));
        a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
    } else {
        a[0] = __ldcg(rc + g * D + d0);
    }
}

template <int N>
__device__ __forceinline__ void combine_chunks(float* out, const float* recs, int chunks, int D, int g, int d0) {
    const int REC = DECODE_HEADS * (D + 2);
    float m[8], l[8], a[8][N], M = -INFINITY, num[N], den = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {                                  // chunks 0..7, at once
        m[i] = -INFINITY;
        if (i < chunks) chunk_records<N>(m[i], l[i], a[i], recs + i * REC, D, g, d0);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) M = fmaxf(M, m[i]);
    for (int c = 8; c < chunks; c++) M = fmaxf(M, __ldcg(recs + c * REC + DECODE_HEADS * D + g));
#pragma unroll
    for (int e = 0; e < N; e++) num[e] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (i >= chunks) break;
        float f = expf(m[i] - M);
#pragma unroll
        for (int e = 0; e < N; e++) num[e] = fmaf(f, a[i][e], num[e]);
        den = fmaf(f, l[i], den);
    }
    for (int c = 8; c < chunks; c++) {
        float mc, lc, ac[N];
        chunk_records<N>(mc, lc, ac, recs + c * REC, D, g, d0);
        float f = expf(mc - M);
#pragma unroll
        for (int e = 0; e < N; e++) num[e] = fmaf(f, ac[e], num[e]);
        den = fmaf(f, lc, den);
    }
#pragma unroll
    for (int e = 0; e < N; e++) out[e] = num[e] / den;
}

// where item i of combine_rows is: row r, elements e..e+3 of it (query head h), so its records (recs: the
// row's first of its block of heads), its head slot g and elements d0.. in a record, the row's chunks and
// its place in y; and the head dim D. Five integer divisions by runtime values, about 200 instructions
struct CombineItem { const float* recs; int D, y, chunks, g, d0; };

__device__ __forceinline__ CombineItem combine_item(int i, const float* partial, int In, int p0, int Hq, int Hkv,
                                                    int gz) {
    int D = In / Hq, G = Hq / Hkv, groups = (G + DECODE_HEADS - 1) / DECODE_HEADS;
    int r = i / (In / 4), e = 4 * (i % (In / 4)), h = e / D, within = h % G;
    int block = h / G * groups + within / DECODE_HEADS, chunks = (p0 + r + DECODE_CHUNK) / DECODE_CHUNK;
    const float* recs = partial + ((long)r * Hkv * groups + block) * gz * DECODE_HEADS * (D + 2);
    return {recs, D, r * In + e, chunks, within % DECODE_HEADS, e % D};
}

// the R rows of attention's output (R x In, In = Hq * D) into y (shared memory) from a step's
// records (above): thread t combines 4 neighbouring elements of one head of a row at a time, items
// t, t + blockDim.x, ..; item t's place comes worked out (`first`, see decode_matvec)
__device__ __forceinline__ void combine_rows(float* y, const CombineItem& first, const float* partial, int R, int In,
                                             int p0, int Hq, int Hkv, int gz) {
    for (int i = threadIdx.x; i < R * In / 4; i += blockDim.x) {
        CombineItem item = i == threadIdx.x ? first : combine_item(i, partial, In, p0, Hq, Hkv, gz);
        combine_chunks<4>(y + item.y, item.recs, item.chunks, item.D, item.g, item.d0);
    }
}

// what decode_matvec builds from `in` (R rows) as it multiplies
#define IN_PLAIN 0              // in (R, In) itself
#define IN_RMSNORM 1            // rmsnorm(in) * norm_w, in (R, In): the norm fused into the next product
#define IN_SWIGLU 2             // silu(gate) * up, in (R, 2 In) holding gate then up: swiglu fused too
#define IN_ATTENTION 3          // attention's output, combined from a step's split attention records in `in`

__device__ __forceinline__ void unpack16(uint4 raw, float* w, const float*) {        // 4 fp32
    w[0] = __uint_as_float(raw.x); w[1] = __uint_as_float(raw.y);
    w[2] = __uint_as_float(raw.z); w[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ void unpack16(uint4 raw, float* w, const unsigned short*) {   // 8 bf16
    unsigned int u[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int i = 0; i < 4; i++) {
        w[2 * i] = __uint_as_float(u[i] << 16);
        w[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
    }
}

// the E inputs of chunk c (elements c*E ..) of row r as MODE builds them: in itself, in * norm_w
// (the norm's 1/rms multiplies the whole sum at the end; ss gains the squares of the chunk's
// elements of in, which it is made of) or silu(gate) * up. 16-byte loads: In a multiple of 8, the
// rows and norm_w 16-byte aligned.
template <int MODE, int E>
__device__ __forceinline__ void matvec_input(float* v, float& ss, const float* in, const float* norm_w, int In, int r,
                                             int c) {
#pragma unroll
    for (int e = 0; e < E; e += 4) {
        if (MODE == IN_SWIGLU) {
            const float* gu = in + (long)r * 2 * In + c * E + e;
            float4 g = load4(gu), u = load4(gu + In);
            v[e] = g.x / (1.0f + expf(-g.x)) * u.x;
            v[e + 1] = g.y / (1.0f + expf(-g.y)) * u.y;
            v[e + 2] = g.z / (1.0f + expf(-g.z)) * u.z;
            v[e + 3] = g.w / (1.0f + expf(-g.w)) * u.w;
        } else {
            float4 x = load4(in + (long)r * In + c * E + e);
            v[e] = x.x, v[e + 1] = x.y, v[e + 2] = x.z, v[e + 3] = x.w;
            if (MODE == IN_RMSNORM) {
                ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
                float4 n = load4(norm_w + c * E + e);
                v[e] *= n.x, v[e + 1] *= n.y, v[e + 2] *= n.z, v[e + 3] *= n.w;
            }
        }
    }
}

// one round of a lane's weight loads: chunks c, c+32, .. (DECODE_LOADS of them) below c1.
// Evict-first loads (ld.global.cs): a pass reads each weight once, about 200 MB through the
// H200's 50 MB L2, which would otherwise push out what the next kernels read again (the
// activations, the KV cache): a one-row pass 219.7 -> 214.8 us of GPU time on an H200
__device__ __forceinline__ void matvec_load(uint4* raw, const uint4* row, int c, int c1) {
#pragma unroll
    for (int u = 0; u < DECODE_LOADS; u++)
        if (c + 32 * u < c1) raw[u] = __ldcs(row + c + 32 * u);
}

// one level of a reduce-scatter over groups of LANES lanes (warp_sums': 32): n values of N left, partner
// lane ^ (LANES / 2 * n / N): keep a half, send the other
template <int N, int n, int LANES = 32>
__device__ __forceinline__ void scatter_level(float* v, int lane, int& index) {
    if constexpr (n > 1) {
        constexpr int OFFSET = LANES / 2 * n / N;
        bool upper = lane & OFFSET;
#pragma unroll
        for (int i = 0; i < n / 2; i++) {
            float keep = upper ? v[n / 2 + i] : v[i], send = upper ? v[i] : v[n / 2 + i];
            v[i] = keep + __shfl_xor_sync(0xffffffff, send, OFFSET);
        }
        index += upper ? n / 2 : 0;
        scatter_level<N, n / 2, LANES>(v, lane, index);
    }
}

// the warp's sums of its DECODE_OUTS x R products (and, NORM, R sums of squares) into
// part_sum[j][r] (part_ss[r]), each value the sum over the 32 lanes. One warp_sum a value
// would take 5 shuffles each, 20-25 a row; a reduce-scatter halves the values a lane holds
// at each of the first levels (half of them sent to the partner lane, the other half kept
// and added to), so N values take N - 1 + 5 - log2(N) shuffles. Each value meets its
// partners at offsets 16, 8, .., 1 as in warp_sum, own + partner's: warp_sum's bits.
// Shuffles are issued one warp a clock an SM, and they were part of what a pass's extra rows cost:
// a pass over 2 / 4 rows 255.0 -> 249.8 / 350.2 -> 323.5 us on an H100, one row unchanged.
template <int RR, bool NORM>
__device__ __forceinline__ void warp_sums(float (*part_sum)[DECODE_MAX_ROWS], float* part_ss,
                                          const float (&acc)[DECODE_OUTS][DECODE_MAX_ROWS],
                                          const float (&ss)[DECODE_MAX_ROWS], int lane) {
    constexpr int USED = DECODE_OUTS * RR + (NORM ? RR : 0);
    constexpr int N = USED <= 4 ? 4 : USED <= 8 ? 8 : USED <= 16 ? 16 : 32;   // a power of 2, at most 32
    float v[N];
#pragma unroll
    for (int i = 0; i < N; i++)                                     // value i: output i % OUTS of row i / OUTS
        v[i] = i < DECODE_OUTS * RR ? acc[i % DECODE_OUTS][i / DECODE_OUTS]
             : i < USED ? ss[i - DECODE_OUTS * RR] : 0.0f;
    int index = 0;                                                  // of the value this lane ends with
    scatter_level<N, N>(v, lane, index);
#pragma unroll
    for (int offset = 16 / N; offset > 0; offset /= 2)              // 32 / N lanes share the value now
        v[0] += __shfl_xor_sync(0xffffffff, v[0], offset);
    if (lane % (32 / N) == 0 && index < USED) {
        if (index < DECODE_OUTS * RR) part_sum[index % DECODE_OUTS][index / DECODE_OUTS] = v[0];
        else part_ss[index - DECODE_OUTS * RR] = v[0];
    }
}

// out (R, ld_out) [+]= in' @ w.T for the R rows, w (Out, In) row-major, in' built from in
// as MODE says; accumulate: out += (the residual add fused in).
// At batch 1 this streams the weights, each used R times: its time is the trip to
// memory and how many bytes are in flight, not arithmetic. A warp takes DECODE_OUTS
// neighbouring outputs (weight rows) and `splits` warps share them, each warp a contiguous
// part of the rows: each lane loads its 16-byte chunks of the part of every one of its rows
// (at most DECODE_LOADS a row a round, all issued before the first is used) and the
// matching elements of each pass row's input, which it then uses for all DECODE_OUTS
// outputs. (With one output a warp, every warp read the whole input and norm_w again for
// each pass row, and SwiGLU's exp for each output: per SM about 190 KB from L1 a row for
// the gate/up product. A row of a pass still costs about a fifth of a one-row pass, now
// mostly each warp's trip to memory for that row's input.) The host
// picks splits from the matrix's shape (nanoeuler_cuda.matvec_splits): enough that a lane's
// chunks fit in one round, and more while there are fewer warps than 8 an SM and each lane
// keeps a chunk. The parts' sums meet in shared memory and are added in part order: each
// row's sum runs in an order fixed by In and splits, whatever R. The norm's 1/rms of row r
// comes from the same loads of the inputs: each warp sums the squares of its part of the row,
// and the parts meet beside the products' sums, in part order (the same bits in every group
// and block). (Summed apart by warp r, it put a second trip to L2 on warp r's chain before its
// products.) No kernel writes a weight, so with programmatic launch the first round's loads go
// out before the wait for the kernel that wrote `in`.
// block 256 (8 warps, R <= DECODE_MAX_ROWS), grid = ceil(Out / (8 * DECODE_OUTS / splits)); splits 1, 2, 4
// or 8; launch bounds (256, 2): at most 128 registers, which the bf16 norm and SwiGLU builds use, unspilled (at 8
// rows they spilled 12-16 bytes: the accumulators are DECODE_OUTS x DECODE_MAX_ROWS registers whatever R)
template <typename W, int MODE>
__device__ void decode_matvec(float* out, const float* in, const W* w, const float* norm_w, int R, int In, int Out,
                              int ld_out, int accumulate, int splits, int block, DecodeSync sync,
                              const int* pos = nullptr, int Hq = 0, int Hkv = 0, int gz = 0) {
    __shared__ float part_sum[8][DECODE_OUTS][DECODE_MAX_ROWS], part_ss[8][DECODE_MAX_ROWS];
    const int E = 16 / sizeof(W);                                  // weights per 16-byte load
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, groups = 8 / splits;   // groups of outputs a block
    int o0 = (block * groups + warp / splits) * DECODE_OUTS, part = warp % splits;
    int chunks = In / E, per_part = (chunks + splits - 1) / splits;
    int c0 = part * per_part, c1 = o0 < Out ? min(chunks, c0 + per_part) : c0;   // c1 <= c0: no work
    const uint4* rows[DECODE_OUTS];
    uint4 raw[DECODE_OUTS][DECODE_LOADS];
#pragma unroll
    for (int j = 0; j < DECODE_OUTS; j++) rows[j] = (const uint4*)(w + (long)min(o0 + j, Out - 1) * In);
    sync.launch_next();
#pragma unroll
    for (int j = 0; j < DECODE_OUTS; j++) matvec_load(raw[j], rows[j], c0 + lane, c1);
    int p0 = MODE == IN_ATTENTION ? *pos : 0;                      // no kernel of a pass writes *pos
    // thread t: output k = t / R of the block (output j of group g), row r; the residual's old
    // value loaded as soon as its writer is done, not after the sums: one trip less on the chain
    // (a one-row pass 213.1 -> 211.0 us, a 4-row pass 356.2 -> 348.6 us on an H200); both before the
    // combine (after it, the division t % R and this load waited for the combine and its barrier)
    int t = threadIdx.x, r = t % R, k = t / R, g = k / DECODE_OUTS, j = k % DECODE_OUTS;
    int o = (block * groups + g) * DECODE_OUTS + j;
    bool writes = k < groups * DECODE_OUTS && o < Out;
    // combine_rows' first item a thread (at one row its only one, In <= 1024): its place worked out now, from
    // the launch's arguments and *pos, and kept in shared memory: ptxas moves arithmetic past the wait as it
    // likes (it put these 200 instructions between the wait and the records' loads), but not a store
    __shared__ CombineItem first[256];                             // block 256
    if (MODE == IN_ATTENTION && t < R * In / 4) first[t] = combine_item(t, in, In, p0, Hq, Hkv, gz);
    sync.wait();
    float old = accumulate && writes ? out[(long)r * ld_out + o] : 0.0f;
    if (MODE == IN_ATTENTION) {                                    // the input, combined once a block
        extern __shared__ __align__(16) float attention_rows[];    // R x In floats, read 16 bytes at a time
        combine_rows(attention_rows, first[t], in, R, In, p0, Hq, Hkv, gz);
        __syncthreads();
        in = attention_rows;
    }
    float acc[DECODE_OUTS][DECODE_MAX_ROWS], ss[DECODE_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < DECODE_MAX_ROWS; r++) {
        ss[r] = 0.0f;
#pragma unroll
        for (int j = 0; j < DECODE_OUTS; j++) acc[j][r] = 0.0f;
    }
    for (int base = c0; base < c1; base += 32 * DECODE_LOADS) {
        if (base > c0)                                             // rows longer than one round
#pragma unroll
            for (int j = 0; j < DECODE_OUTS; j++) matvec_load(raw[j], rows[j], base + lane, c1);
#pragma unroll
        for (int u = 0; u < DECODE_LOADS; u++) {
            int c = base + lane + 32 * u;
            if (c >= c1) break;
#pragma unroll
            for (int r = 0; r < DECODE_MAX_ROWS; r++) {
                if (r >= R) break;
                float v[8];
                matvec_input<MODE, E>(v, ss[r], in, norm_w, In, r, c);
#pragma unroll
                for (int j = 0; j < DECODE_OUTS; j++) {
                    float wf[8];
                    unpack16(raw[j][u], wf, w);
#pragma unroll
                    for (int e = 0; e < E; e++) acc[j][r] += wf[e] * v[e];
                }
            }
        }
    }
    if (R == 1) warp_sums<1, MODE == IN_RMSNORM>(part_sum[warp], part_ss[warp], acc, ss, lane);
    else if (R == 2) warp_sums<2, MODE == IN_RMSNORM>(part_sum[warp], part_ss[warp], acc, ss, lane);
    else warp_sums<DECODE_MAX_ROWS, MODE == IN_RMSNORM>(part_sum[warp], part_ss[warp], acc, ss, lane);
    __syncthreads();
    if (!writes) return;
    float s = 0.0f;
    for (int p = 0; p < splits; p++) s += part_sum[g * splits + p][j][r];
    if (MODE == IN_RMSNORM) {                                     // the norm's 1/rms of row r
        float sq = 0.0f;
        for (int p = 0; p < splits; p++) sq += part_ss[g * splits + p][r];
        s *= 1.0f / sqrtf(sq / In + 1e-5f);
    }
    out[(long)r * ld_out + o] = old + s;
}

// the entry points: {plain, rmsnorm, swiglu} input x {fp32, bf16} weights, written out
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_plain_f32_kernel(
    float* out, const float* in, const float* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits) {
    decode_matvec<float, IN_PLAIN>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, blockIdx.x, {});
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_rmsnorm_f32_kernel(
    float* out, const float* in, const float* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits) {
    decode_matvec<float, IN_RMSNORM>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, blockIdx.x, {});
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_swiglu_f32_kernel(
    float* out, const float* in, const float* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits) {
    decode_matvec<float, IN_SWIGLU>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, blockIdx.x, {});
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_plain_bf16_kernel(
    float* out, const float* in, const unsigned short* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits) {
    decode_matvec<unsigned short, IN_PLAIN>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, blockIdx.x,
                                            {});
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_rmsnorm_bf16_kernel(
    float* out, const float* in, const unsigned short* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits) {
    decode_matvec<unsigned short, IN_RMSNORM>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, blockIdx.x,
                                              {});
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_swiglu_bf16_kernel(
    float* out, const float* in, const unsigned short* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits) {
    decode_matvec<unsigned short, IN_SWIGLU>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, blockIdx.x,
                                             {});
}

// and attention's output combined on the way in (the wo product of a step), written out too
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_attention_f32_kernel(
    float* out, const float* in, const float* w, const int* pos, int R, int In, int Out, int ld_out, int accumulate,
    int splits, int Hq, int Hkv, int gz) {
    decode_matvec<float, IN_ATTENTION>(out, in, w, nullptr, R, In, Out, ld_out, accumulate, splits, blockIdx.x, {},
                                       pos, Hq, Hkv, gz);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_matvec_attention_bf16_kernel(
    float* out, const float* in, const unsigned short* w, const int* pos, int R, int In, int Out, int ld_out,
    int accumulate, int splits, int Hq, int Hkv, int gz) {
    decode_matvec<unsigned short, IN_ATTENTION>(out, in, w, nullptr, R, In, Out, ld_out, accumulate, splits,
                                                blockIdx.x, {}, pos, Hq, Hkv, gz);
}

// rope's rotation of one pair (a, b) = (x[i], x[i + D/2]) by the angle with cosine c and sine s,
// each operation rounded on its own (no fused multiply-add), so a key rotated here while
// it is still in qkv has the bits of the same key rotated when it was written to the cache
__device__ __forceinline__ void rope_pair(float& a, float& b, float c, float s) {
    float a2 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    float b2 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    a = a2;
    b = b2;
}

// rope_pair for 4 elements of one half of a head vector: own = x[i..i+3], other = the
// same 4 of the other half, c and s at pairs i..i+3 (i mod D/2); first: own is in the
// first half (own plays a in rope_pair, else b): the same operations, so the same bits
__device__ __forceinline__ float4 rope4(float4 own, float4 other, float4 c, float4 s, bool first) {
    float4 r;
    if (first) {
        r.x = __fsub_rn(__fmul_rn(own.x, c.x), __fmul_rn(other.x, s.x));
        r.y = __fsub_rn(__fmul_rn(own.y, c.y), __fmul_rn(other.y, s.y));
        r.z = __fsub_rn(__fmul_rn(own.z, c.z), __fmul_rn(other.z, s.z));
        r.w = __fsub_rn(__fmul_rn(own.w, c.w), __fmul_rn(other.w, s.w));
    } else {
        r.x = __fadd_rn(__fmul_rn(own.x, c.x), __fmul_rn(other.x, s.x));
        r.y = __fadd_rn(__fmul_rn(own.y, c.y), __fmul_rn(other.y, s.y));
        r.z = __fadd_rn(__fmul_rn(own.z, c.z), __fmul_rn(other.z, s.z));
        r.w = __fadd_rn(__fmul_rn(own.w, c.w), __fmul_rn(other.w, s.w));
    }
    return r;
}

// Attention of one query row over the cache, causal, grouped-query, with rope and the cache
// write fused in: y[r, h] = softmax(q k.T / sqrt(D)) v over the keys at positions 0 .. *pos + r
// of kv head h / (Hq/Hkv), q being head h of row r of qkv (R, (Hq+2Hkv)*D) as the product
// left it, rotated here for position *pos + r. Keys before *pos come from k_cache and
// v_cache (T, Hkv, D); keys from *pos on are this pass's rows of qkv, rotated as they are
// read; the first query head of each kv head writes row r's rotated k, and v, into the cache
// at *pos + r (no block reads the cache there in this pass). A prefill is a pass with *pos = 0.
// The warps take the keys 32 at a time (a lane per key for the scores, then the lanes over D
// for the values), with an online softmax (running max and sum); their partial results are
// added in warp order at the end. No sum depends on R, so rows computed in one pass have the
// bits of rows computed one pass each.
// one block of 256 threads per (query head, row); grid = (Hq, R); D a multiple of 8, at most
// 128; shared memory (D + 2 * 8 + 8 * D) floats
extern "C" __global__ void attention_decode_kernel(float* y, float* k_cache, float* v_cache, const float* qkv,
                                                   const float* cos, const float* sin, const int* pos, int Hq,
                                                   int Hkv, int D, float scale) {
    extern __shared__ float sh[];
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *q = sh, *warp_m = sh + D, *warp_l = warp_m + warps, *warp_acc = warp_l + warps;
    int h = blockIdx.x, r = blockIdx.y, G = Hq / Hkv, kvh = h / G, H = Hq + 2 * Hkv, half = D / 2;
    int p0 = *pos, t_row = p0 + r, n = t_row + 1;                  // n: keys this row sees
    const float* row = qkv + (long)r * H * D;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a = row[h * D + i], b = row[h * D + half + i];
        rope_pair(a, b, cos[t_row * half + i], sin[t_row * half + i]);
        q[i] = a * scale;
        q[half + i] = b * scale;
    }
    if (h % G == 0) {
        long e = ((long)t_row * Hkv + kvh) * D;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float a = row[(Hq + kvh) * D + i], b = row[(Hq + kvh) * D + half + i];
            rope_pair(a, b, cos[t_row * half + i], sin[t_row * half + i]);
            k_cache[e + i] = a;
            k_cache[e + half + i] = b;
            v_cache[e + i] = row[(Hq + Hkv + kvh) * D + i];
            v_cache[e + half + i] = row[(Hq + Hkv + kvh) * D + half + i];
        }
    }
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};   // lane's d: lane + 32 k
    for (int t0 = warp * 32; t0 < n; t0 += warps * 32) {
        int t = t0 + lane;
        float s = -INFINITY;
        if (t < n) {
            bool fresh = t >= p0;
            const float* k = fresh ? qkv + (long)(t - p0) * H * D + (Hq + kvh) * D : k_cache + ((long)t * Hkv + kvh) * D;
            float dot = 0.0f;
#pragma unroll 8
            for (int i = 0; i < half; i += 4) {                    // the loads of 8 iterations in flight
                float4 a = *(const float4*)(k + i), b = *(const float4*)(k + half + i);
                if (fresh) {
                    float4 c = *(const float4*)(cos + t * half + i), sn = *(const float4*)(sin + t * half + i);
                    rope_pair(a.x, b.x, c.x, sn.x);
                    rope_pair(a.y, b.y, c.y, sn.y);
                    rope_pair(a.z, b.z, c.z, sn.z);
                    rope_pair(a.w, b.w, c.w, sn.w);
                }
                dot += q[i] * a.x + q[i + 1] * a.y + q[i + 2] * a.z + q[i + 3] * a.w;
                dot += q[half + i] * b.x + q[half + i + 1] * b.y + q[half + i + 2] * b.z + q[half + i + 3] * b.w;
            }
            s = dot;
        }
        float m_new = fmaxf(m, warp_max(s));                       // finite: key t0 < n is in the chunk
        float corr = expf(m - m_new);                              // 0 at the first chunk
        float p = t < n ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int k = 0; k < 4; k++) acc[k] *= corr;
        int last = min(32, n - t0);
#pragma unroll 8
        for (int j = 0; j < last; j++) {
            float pj = __shfl_sync(0xffffffff, p, j);
            int tj = t0 + j;
            const float* v = tj >= p0 ? qkv + (long)(tj - p0) * H * D + (Hq + Hkv + kvh) * D
                                      : v_cache + ((long)tj * Hkv + kvh) * D;
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (lane + 32 * k < D) acc[k] += pj * v[lane + 32 * k];
        }
        m = m_new;
    }
    if (lane == 0) warp_m[warp] = m, warp_l[warp] = l;
#pragma unroll
    for (int k = 0; k < 4; k++)
        if (lane + 32 * k < D) warp_acc[warp * D + lane + 32 * k] = acc[k];
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float M = -INFINITY, num = 0.0f, den = 0.0f;
        for (int w = 0; w < warps; w++) M = fmaxf(M, warp_m[w]);
        for (int w = 0; w < warps; w++) {                          // warps without keys: m = -inf, weight 0
            float f = expf(warp_m[w] - M);
            num += f * warp_acc[w * D + d];
            den += f * warp_l[w];
        }
        y[(long)r * Hq * D + h * D + d] = num / den;
    }
}


// The same attention, split over the keys ("flash decoding"): y[r, h] = softmax(q k.T /
// sqrt(D)) v over the keys at positions 0 .. *pos + r of kv head h / G (G = Hq / Hkv),
// with rope and the cache write fused in as above (the same bits in the cache).
// Why: the kernel above gives a whole row's keys to one block per query head, 12 blocks
// for the big model on 132 SMs; each lane reads a whole key (lanes 1 KB apart) and the
// warps walk the keys with a shuffle per key, and the G query heads of a kv head each
// read the same keys: a long chain of dependent reads that grows with the position.
// Here a block takes one chunk of DECODE_CHUNK keys (chunk c: keys 64c .. 64c+63, fixed in
// absolute positions) of one kv head for one row, and scores all its query heads (up to
// DECODE_HEADS; more make more blocks) from one read of each key and value. Thread (j, s)
// of the block holds elements 4s .. 4s+3 (a 16-byte load; the D/4 threads of a key read
// its D floats in one stretch) of keys j, j + 256/(D/4), .. of the chunk, and the same of
// their values: every load of the block is issued before any is used, one trip to memory.
// The scores' D-long sums meet in shuffles over the key's D/4 lanes (a reduce-scatter that
// leaves each lane one (sweep, head) score and its exp, below), the chunk's max and
// sum of exp and its p-weighted values in shared memory, added in warp order. A row that
// sees one chunk writes y directly. A row that sees several writes the chunk's (m, l, acc)
// to `partial`; the last of its blocks to finish (counted in `count`, which it resets to 0
// for the next launch) combines them in chunk order: y = sum_c e^(m_c - M) acc_c /
// sum_c e^(m_c - M) l_c (combine_chunks). In a step (combine = 0) every row writes its records
// and nothing more: the wo product combines them as it reads its input (decode_matvec's
// IN_ATTENTION), which takes the count, the fences and the last block off the pass's chain
// (each wo warp combines the few chunks its own part of the input needs, from L2).
// Keys before *pos come from the cache, read before the wait for the
// kernel that wrote qkv (programmatic launch; no kernel of the pass writes there); this
// pass's own keys come from qkv, rotated as they are read, and the thread that reads key
// *pos + r in row r's block writes it and its value into the cache (no block reads the
// cache there in this pass). Every sum runs in an order fixed by D, G, the row's position
// and the chunk: rows computed in one pass have the bits of rows computed one pass each.
// A prefill is a pass of all its rows with *pos = 0, launched over slices of its rows: the
// launch takes rows row0 .. row0 + gridDim.y - 1 of the pass (row0 = 0 in a step).
// block 256; grid = (Hkv * ceil(G / DECODE_HEADS), rows, at least ceil((*pos + row0 + rows) /
// DECODE_CHUNK) (blocks past a row's keys return)); D = 8, 16, 32, 64 or 128 (the entry
// points); partial: rows * gridDim.x * gridDim.z records of DECODE_HEADS * (D + 2) floats;
// count: rows * gridDim.x ints, 0 before the first launch. (bx, by, bz) is the block, gx and gz
// the grid's x and z (in decode_layers, a block of this grid that a block of its own grid takes)
template <int D>
__device__ void attention_decode_split(float* y, float* partial, int* count, float* k_cache, float* v_cache,
                                       const float* qkv, const float* cos, const float* sin, const int* pos, int row0,
                                       int Hq, int Hkv, float scale, int combine, int bx, int by, int bz, int gx,
                                       int gz, DecodeSync sync) {
    constexpr int S = D / 4, HALF = D / 2, KEYS = 256 / S, SWEEPS = (DECODE_CHUNK + KEYS - 1) / KEYS;
    constexpr int REC = DECODE_HEADS * (D + 2);                    // a record: acc (heads x D), m, l (heads)
    __shared__ float sh_m[8][DECODE_HEADS], sh_l[8][DECODE_HEADS];
    __shared__ __align__(16) float sh_acc[8][DECODE_HEADS][D];     // written as float4
    __shared__ int sh_last;
    int G = Hq / Hkv, groups = (G + DECODE_HEADS - 1) / DECODE_HEADS, group = bx % groups;
    int kvh = bx / groups, h0 = kvh * G + group * DECODE_HEADS, nh = min(DECODE_HEADS, G - group * DECODE_HEADS);
    int b = by, r = row0 + b, first = bz * DECODE_CHUNK, H = Hq + 2 * Hkv;   // b: row in the launch
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, s = tid % S, jj = tid / S;
    bool lo = s < S / 2;                                           // elements 4s.. are in the first half
    int other = 4 * (s ^ (S / 2)), pair = 4 * (s % (S / 2));       // the other half's 4; rope's pair index
    sync.launch_next();
    int p0 = *pos, t_row = p0 + r, n = t_row + 1;                  // n: keys this row sees
    if (first >= n) {                                              // a chunk after the row's keys
        sync.wait();
        return;
    }
    int chunks = (n + DECODE_CHUNK - 1) / DECODE_CHUNK;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 k[SWEEPS], v[SWEEPS];
#pragma unroll
    for (int i = 0; i < SWEEPS; i++) {                             // the cache's keys
        int j = first + jj + KEYS * i;
        k[i] = v[i] = zero;
        if (jj + KEYS * i < DECODE_CHUNK && j < n && j < p0) {
            long e = ((long)j * Hkv + kvh) * D + 4 * s;
            k[i] = load4(k_cache + e);
            v[i] = load4(v_cache + e);
        }
    }
    sync.wait();
#pragma unroll
    for (int i = 0; i < SWEEPS; i++) {                             // this pass's keys
        int j = first + jj + KEYS * i;
        if (jj + KEYS * i < DECODE_CHUNK && j < n && j >= p0) {
            const float* kr = qkv + (long)(j - p0) * H * D + (Hq + kvh) * D;
            k[i] = rope4(load4(kr + 4 * s), load4(kr + other), load4(cos + j * HALF + pair),
                         load4(sin + j * HALF + pair), lo);
            v[i] = load4(kr + Hkv * D + 4 * s);
            if (j == t_row && group == 0) {
                long e = ((long)j * Hkv + kvh) * D + 4 * s;
                *(float4*)(k_cache + e) = k[i];
                *(float4*)(v_cache + e) = v[i];
            }
        }
    }
    float4 q[DECODE_HEADS];                                        // row r's query heads, rotated, scaled
    const float* qr = qkv + (long)r * H * D;
    float4 c = load4(cos + t_row * HALF + pair), sn = load4(sin + t_row * HALF + pair);
#pragma unroll
    for (int g = 0; g < DECODE_HEADS; g++) {
        q[g] = zero;
        if (g < nh) {
            const float* qh = qr + (h0 + g) * D;
            float4 a = rope4(load4(qh + 4 * s), load4(qh + other), c, sn, lo);
            q[g] = make_float4(a.x * scale, a.y * scale, a.z * scale, a.w * scale);
        }
    }
    // p = e^(score - the chunk's max) for each key and (sweep i, head g): a lane holds its 4
    // elements' part of all SWEEPS x DECODE_HEADS dot products of its key, and the key's S lanes
    // sum them. With S >= DECODE_HEADS there are S of them: a reduce-scatter over the S lanes
    // (warp_sums' scatter_level: S - 1 shuffles, a shuffle tree's bits) leaves lane s with pair
    // s alone, whose max and exp it takes; the key's lanes then read every p from its owner (S
    // shuffles). A shuffle tree a pair, a max tree a head and an exp a pair in every lane took
    // 5 S shuffles and S exps a lane. (D = 8 has 2 lanes a key for 4 pairs: the trees.)
    float p[SWEEPS][DECODE_HEADS], l[DECODE_HEADS], acc[DECODE_HEADS][4];
    if constexpr (S >= DECODE_HEADS) {
        float d[S];
        int own = 0;                                               // the pair this lane ends with: s
#pragma unroll
        for (int i = 0; i < SWEEPS; i++)
#pragma unroll
            for (int g = 0; g < DECODE_HEADS; g++)
                d[i * DECODE_HEADS + g] = q[g].x * k[i].x + q[g].y * k[i].y + q[g].z * k[i].z + q[g].w * k[i].w;
        scatter_level<S, S, S>(d, lane, own);
        int i0 = own / DECODE_HEADS, g0 = own % DECODE_HEADS;
        float sc = jj + KEYS * i0 < DECODE_CHUNK && first + jj + KEYS * i0 < n ? d[0] : -INFINITY;
        float wm = sc;                                             // over the warp's lanes of head g0
#pragma unroll
        for (int off = DECODE_HEADS; off < 32; off *= 2) wm = fmaxf(wm, __shfl_xor_sync(0xffffffff, wm, off));
        if (lane < DECODE_HEADS) sh_m[warp][lane] = wm;
        __syncthreads();
        float mg = sh_m[0][g0];                                    // finite: key `first` is seen
        for (int w = 1; w < 8; w++) mg = fmaxf(mg, sh_m[w][g0]);
        float pown = expf(sc - mg);                                // 0 for keys the row does not see
#pragma unroll
        for (int i = 0; i < SWEEPS; i++)
#pragma unroll
            for (int g = 0; g < DECODE_HEADS; g++)
                p[i][g] = __shfl_sync(0xffffffff, pown, lane - s + i * DECODE_HEADS + g);
    } else {
        float sc[SWEEPS][DECODE_HEADS], m[DECODE_HEADS];
#pragma unroll
        for (int g = 0; g < DECODE_HEADS; g++) m[g] = -INFINITY;
#pragma unroll
        for (int i = 0; i < SWEEPS; i++) {
            bool seen = jj + KEYS * i < DECODE_CHUNK && first + jj + KEYS * i < n;
#pragma unroll
            for (int g = 0; g < DECODE_HEADS; g++) {
                float d = q[g].x * k[i].x + q[g].y * k[i].y + q[g].z * k[i].z + q[g].w * k[i].w;
#pragma unroll
                for (int off = S / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffff, d, off);
                sc[i][g] = seen ? d : -INFINITY;
                m[g] = fmaxf(m[g], sc[i][g]);
            }
        }
#pragma unroll
        for (int g = 0; g < DECODE_HEADS; g++) {
            float wm = warp_max(m[g]);
            if (lane == 0) sh_m[warp][g] = wm;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < DECODE_HEADS; g++) {
            m[g] = sh_m[0][g];
            for (int w = 1; w < 8; w++) m[g] = fmaxf(m[g], sh_m[w][g]);
#pragma unroll
            for (int i = 0; i < SWEEPS; i++) p[i][g] = expf(sc[i][g] - m[g]);
        }
    }
#pragma unroll
    for (int g = 0; g < DECODE_HEADS; g++) l[g] = acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < SWEEPS; i++)
#pragma unroll
        for (int g = 0; g < DECODE_HEADS; g++) {
            l[g] += p[i][g];
            acc[g][0] += p[i][g] * v[i].x;
            acc[g][1] += p[i][g] * v[i].y;
            acc[g][2] += p[i][g] * v[i].z;
            acc[g][3] += p[i][g] * v[i].w;
        }
#pragma unroll
    for (int g = 0; g < DECODE_HEADS; g++) {                       // over the warp's keys: lanes with the same s
#pragma unroll
        for (int off = 16; off >= S; off >>= 1) {
            l[g] += __shfl_xor_sync(0xffffffff, l[g], off);
#pragma unroll
            for (int e = 0; e < 4; e++) acc[g][e] += __shfl_xor_sync(0xffffffff, acc[g][e], off);
        }
        if (lane < S) *(float4*)&sh_acc[warp][g][4 * s] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        if (lane == 0) sh_l[warp][g] = l[g];
    }
    __syncthreads();
    float* rec = partial + (((long)b * gx + bx) * gz + bz) * REC;
    for (int e = tid; e < nh * D; e += blockDim.x) {               // over the warps, in order
        int g = e / D, d = e % D;
        float a = 0.0f, den = 0.0f, mg = sh_m[0][g];
        for (int w = 0; w < 8; w++) a += sh_acc[w][g][d], den += sh_l[w][g];
        for (int w = 1; w < 8; w++) mg = fmaxf(mg, sh_m[w][g]);
        if (chunks == 1 && combine) {
            y[((long)r * Hq + h0 + g) * D + d] = a / den;
        } else {
            rec[g * D + d] = a;
            if (d == 0) rec[DECODE_HEADS * D + g] = mg, rec[DECODE_HEADS * (D + 1) + g] = den;
        }
    }
    if (chunks == 1 || !combine) return;
    __threadfence();                                               // the record, before the count
    __syncthreads();
    if (tid == 0) {
        sh_last = atomicAdd(count + b * gx + bx, 1) == chunks - 1;
        __threadfence();                                           // the count, before the records
    }
    __syncthreads();
    if (!sh_last) return;
    if (tid == 0) count[b * gx + bx] = 0;
    const float* recs = partial + ((long)b * gx + bx) * gz * REC;
    for (int e = tid; e < nh * D; e += blockDim.x)                 // the chunks, in order (__ldcg: from L2)
        combine_chunks<1>(y + ((long)r * Hq + h0) * D + e, recs, chunks, D, e / D, e % D);
}

// the entry points, one per head dim, written out
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_8(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale, int combine) {
    attention_decode_split<8>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale, combine,
                                blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.z, {});
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_16(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale, int combine) {
    attention_decode_split<16>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale, combine,
                                 blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.z, {});
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_32(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale, int combine) {
    attention_decode_split<32>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale, combine,
                                 blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.z, {});
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_64(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale, int combine) {
    attention_decode_split<64>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale, combine,
                                 blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.z, {});
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_128(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale, int combine) {
    attention_decode_split<128>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale, combine,
                                  blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.z, {});
}

// The layers of a decoding pass in one kernel (nanoeuler_cuda.DECODE_PERSISTENT), where a pass of kernels
// launched one by one spends about 1.6 us of each kernel's 2.4 starting and ending it (83 kernels a pass on an
// H100, dev/LOG.md): the same five stages a layer as those kernels, in the same order (wqkv's product with the
// norm, the split attention's records, wo's product combining them += into x, w_gate_up's product with the norm,
// w_down's with SwiGLU += into x), each stage's blocks (of the grid its kernel would have) taken in turn by this
// grid's blocks: block b takes b, b + gridDim.x, ... The stages meet at counters (stage_arrive, stage_wait), and
// a block issues its first weight loads of a stage before it waits for the stage before (decode_matvec loads
// before sync.wait): the weights stream while the grid meets. The same functions with the same sums: the bits of
// the kernels one by one. (Each block taken waits at stage_wait, a block barrier, before its threads write shared
// memory that another thread reads: the block taken before it is done with it.)
// block 256 (launch bounds (256, 2), as decode_matvec's); grid: no more blocks than are resident at once (the
// host's occupancy query); ready: 5 L counters, 0 when the pass starts (allocated so, and zeroed again by the
// pass's last block: stage_arrive_last; no memset node in the graph);
// dynamic shared memory R * Hq * D floats (wo's input, combined)
struct DecodeBuffers {                          // layer 0's weights and cache; layer l's lie l strides on
    float *x, *qkv, *gu, *partial;              // the step's: GPUDecoder's x, qkv, gu and split records
    const void *wqkv, *attn_norm, *wo, *w_gate_up, *mlp_norm, *w_down;    // the norms fp32, the rest W
    float *k_cache, *v_cache;
    const float *cos, *sin;
    const int* pos;
    int* ready;
};
struct DecodeShape {
    long long stride, cache_stride;             // elements from a layer's weights (cache) to the next layer's
    int R, C, F, L, Hq, Hkv, gz, splits[4];     // gz: chunks of keys, ceil(T / DECODE_CHUNK); splits: of wqkv's,
    float scale;                                // wo's, w_gate_up's and w_down's products (matvec_splits)
};

template <typename W, int D>
__device__ void decode_layers(const DecodeBuffers& a, const DecodeShape& s) {
    int G = gridDim.x, QKV = (s.Hq + 2 * s.Hkv) * D;
    int gx = s.Hkv * ((s.Hq / s.Hkv + DECODE_HEADS - 1) / DECODE_HEADS);      // the split attention's grid x
    auto blocks = [](int Out, int splits) { return (Out + 8 * DECODE_OUTS / splits - 1) / (8 * DECODE_OUTS / splits); };
    decode_wait();                                                 // for the embedding's x
    for (int k = 0; k < 5 * s.L; k++) {                            // stage k: layer k / 5, its part k % 5
        int i = k % 5;
        long long w0 = k / 5 * s.stride, c0 = k / 5 * s.cache_stride;
        DecodeSync sync{a.ready + (k ? k - 1 : 0), k ? G : 0};
        int n = i == 0 ? blocks(QKV, s.splits[0]) : i == 1 ? gx * s.R * s.gz : i == 2 ? blocks(s.C, s.splits[1])
              : i == 3 ? blocks(2 * s.F, s.splits[2]) : blocks(s.C, s.splits[3]);
        for (int b = blockIdx.x; b < n; b += G) {
            if (i == 0)
                decode_matvec<W, IN_RMSNORM>(a.qkv, a.x, (const W*)a.wqkv + w0, (const float*)a.attn_norm + w0, s.R,
                                             s.C, QKV, QKV, 0, s.splits[0], b, sync);
            else if (i == 1)
                attention_decode_split<D>(nullptr, a.partial, nullptr, a.k_cache + c0, a.v_cache + c0, a.qkv, a.cos,
                                          a.sin, a.pos, 0, s.Hq, s.Hkv, s.scale, 0, b % gx, b / gx % s.R,
                                          b / (gx * s.R), gx, s.gz, sync);
            else if (i == 2)
                decode_matvec<W, IN_ATTENTION>(a.x, a.partial, (const W*)a.wo + w0, nullptr, s.R, s.Hq * D, s.C, s.C,
                                               1, s.splits[1], b, sync, a.pos, s.Hq, s.Hkv, s.gz);
            else if (i == 3)
                decode_matvec<W, IN_RMSNORM>(a.gu, a.x, (const W*)a.w_gate_up + w0, (const float*)a.mlp_norm + w0,
                                             s.R, s.C, 2 * s.F, 2 * s.F, 0, s.splits[2], b, sync);
            else
                decode_matvec<W, IN_SWIGLU>(a.x, a.gu, (const W*)a.w_down + w0, nullptr, s.R, s.F, s.C, s.C, 1,
                                            s.splits[3], b, sync);
        }
        if (k < 5 * s.L - 1) stage_arrive(a.ready + k);
        else stage_arrive_last(a.ready, 5 * s.L);
    }
}

// the entry points: {fp32, bf16} weights x the split attention's head dims, written out
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_f32_8(DecodeBuffers a, DecodeShape s) {
    decode_layers<float, 8>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_f32_16(DecodeBuffers a, DecodeShape s) {
    decode_layers<float, 16>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_f32_32(DecodeBuffers a, DecodeShape s) {
    decode_layers<float, 32>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_f32_64(DecodeBuffers a, DecodeShape s) {
    decode_layers<float, 64>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_f32_128(DecodeBuffers a, DecodeShape s) {
    decode_layers<float, 128>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_bf16_8(DecodeBuffers a, DecodeShape s) {
    decode_layers<unsigned short, 8>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_bf16_16(DecodeBuffers a, DecodeShape s) {
    decode_layers<unsigned short, 16>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_bf16_32(DecodeBuffers a, DecodeShape s) {
    decode_layers<unsigned short, 32>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_bf16_64(DecodeBuffers a, DecodeShape s) {
    decode_layers<unsigned short, 64>(a, s);
}
extern "C" __global__ void __launch_bounds__(256, 2) decode_layers_bf16_128(DecodeBuffers a, DecodeShape s) {
    decode_layers<unsigned short, 128>(a, s);
}

// the argmax of every row of logits (R * n_heads, V) (the first index on ties, as np.argmax)
// into amax (R, n_heads): head 0's choice and the draft heads' guesses at each fed row;
// then nanoeuler.generate's acceptance rule over the R fed rows ids[0..R-1] (the last
// token, then the drafts): row j's choice is kept while the draft fed after it agreed, so
// j+1 tokens are emitted, into ring[*counter % ring_size] = (j+1, tokens...); the next
// feed is the last choice and the guesses made at its row, and pos moves by j+1.
// The rows are few and short, so the time is trips to memory: each thread loads 16 of a
// row's logits at once before comparing them (V = 4096: one round), the fed ids, pos and
// counter are read while the rows are searched, and the choices stay in shared memory
// for the acceptance rule.
// one block of 1024 threads: 4 groups of 256 take the rows 4 at a time; thread 0 accepts
extern "C" __global__ void __launch_bounds__(1024) argmax_accept_kernel(int* ids, int* pos, int* counter, int* ring,
                                                                        int* amax, const float* logits, int V, int R,
                                                                        int n_heads, int ring_size) {
    __shared__ float best_v[32];
    __shared__ int best_i[32], fed[DECODE_MAX_ROWS], chosen[DECODE_MAX_ROWS * DECODE_MAX_ROWS];
    int group = threadIdx.x / 256, t = threadIdx.x % 256, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int rows = R * n_heads, p = 0, step = 0;
    decode_launch_next();
    decode_wait();
    if (threadIdx.x < R) fed[threadIdx.x] = ids[threadIdx.x];     // read by thread 0 after a barrier below
    if (threadIdx.x == 0) p = *pos, step = *counter;
    for (int base = 0; base < rows; base += 4) {                   // the same trip count for every thread
        int row_i = base + group;
        float bv = -INFINITY;
        int bi = 0x7FFFFFFF;
        if (row_i < rows) {
            const float* row = logits + (long)row_i * V;
            for (int v0 = t; v0 < V; v0 += 256 * 16) {
                float x[16];
#pragma unroll
                for (int u = 0; u < 16; u++) x[u] = v0 + 256 * u < V ? row[v0 + 256 * u] : -INFINITY;
#pragma unroll
                for (int u = 0; u < 16; u++)
                    if (x[u] > bv) bv = x[u], bi = v0 + 256 * u;   // ascending: each thread's first best
            }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            float ov = __shfl_xor_sync(0xffffffff, bv, offset);
            int oi = __shfl_xor_sync(0xffffffff, bi, offset);
            if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
        }
        if (lane == 0) best_v[warp] = bv, best_i[warp] = bi;
        __syncthreads();
        if (t == 0 && row_i < rows) {
            for (int k = 1; k < 8; k++) {
                float ov = best_v[warp + k];
                int oi = best_i[warp + k];
                if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
            }
            chosen[row_i] = amax[row_i] = bi == 0x7FFFFFFF ? 0 : bi;   // all NaN: token 0
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    int j = 0;
    while (j < R - 1 && fed[1 + j] == chosen[j * n_heads]) j++;
    int* entry = ring + (step % ring_size) * (1 + DECODE_MAX_ROWS);
    entry[0] = j + 1;
    for (int i = 0; i <= j; i++) entry[1 + i] = chosen[i * n_heads];
    for (int k = 0; k < n_heads; k++) ids[k] = chosen[j * n_heads + k];
    *pos = p + j + 1;
    *counter = step + 1;
}
