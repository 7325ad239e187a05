/*
NanoEuler's elementwise and reduction kernels, the GPU twins of the numpy layers
in nanoeuler.py (same names: rmsnorm_forward there, rmsnorm_forward_kernel here,
rmsnorm_forward the launcher in nanoeuler_cuda.py). Matrix products are not here:
they go through cuBLAS. Attention is in flash_attn.cu.

Compiled at run time by nanoeuler_cuda.py with NVRTC to a CUBIN for the device
(-std=c++17 --use_fast_math), cached on disk by source hash. Everything is fp32.
For the bf16 matmuls, a kernel whose output feeds one also writes that output
rounded to bf16 into an out16 twin (nullptr: none, in fp32 and tf32 modes), so no
pass of its own re-reads it; where only matmuls read the output (rmsnorm_forward,
swiglu both ways, the cross entropy), it writes the twin alone. to_bf16_kernel
rounds the weights.
All kernels are extern "C" so their names survive compilation unmangled.

Gradient rule: parameter gradients +=, activation gradients =, except where a
kernel adds into the residual stream's gradient, which it says (+=).
Launch geometry is written above each kernel.
*/

// NVRTC compiles without the C headers, so infinity is spelled out in its bits
#define INFINITY __int_as_float(0x7f800000)

// -----------------------------------------------------------------------------
// helpers

// float32 -> bfloat16 bits, rounded to nearest even
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned int bits = __float_as_uint(x);
    return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
    return v;
}

// every thread of the block gets the total; blockDim.x a multiple of 32, at most 1024
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();                      // partial may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
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

// -----------------------------------------------------------------------------
// embedding

// one thread per output element; grid = ceil(N*C / block)
extern "C" __global__ void embedding_forward_kernel(float* x, const int* idx, const float* tok_emb, int N, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * C) return;
    int n = i / C, c = i % C;
    x[i] = tok_emb[(long)idx[n] * C + c];
}

// one block per distinct token u: the rows where it occurs, order[starts[u]] ..
// order[starts[u+1]-1] (nanoeuler_cuda.token_rows lists them), added up in that
// order. No atomics, so the sum has the same bits every run.
extern "C" __global__ void embedding_backward_kernel(float* dtok_emb, const int* idx, const int* order,
                                                     const int* starts, const float* dx, int C) {
    int first = starts[blockIdx.x], last = starts[blockIdx.x + 1];
    long token = idx[order[first]];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int j = first; j < last; j++) sum += dx[(long)order[j] * C + c];
        dtok_emb[token * C + c] += sum;
    }
}

// -----------------------------------------------------------------------------
// rmsnorm

// one warp per row; grid = ceil(N / warps per block)
extern "C" __global__ void rmsnorm_forward_kernel(float* out, unsigned short* out16, float* rstd, const float* x,
                                                  const float* w, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const float* xr = x + (long)row * C;
    float ss = 0.0f;
    for (int c = lane; c < C; c += 32) ss += xr[c] * xr[c];
    float r = 1.0f / sqrtf(warp_sum(ss) / C + 1e-5f);
    for (int c = lane; c < C; c += 32) {
        float o = xr[c] * r * w[c];
        if (out16) out16[(long)row * C + c] = bf16_bits(o);        // only matmuls read it
        else out[(long)row * C + c] = o;
    }
    if (lane == 0) rstd[row] = r;
}

// one warp per row, rows in a grid-stride loop. dw: each warp adds up its rows'
// share in a row of shared memory of its own (warps x C floats, dynamic), the
// block adds its warps in order into partial[block], and rmsnorm_backward_dw_kernel
// adds the blocks in order: no atomics, so dw has the same bits every run.
// dx += : the residual stream's gradient takes both paths.
extern "C" __global__ void rmsnorm_backward_kernel(float* dx, unsigned short* dx16, float* partial,
                                                   const float* dout, const float* x, const float* w,
                                                   const float* rstd, int N, int C) {
    extern __shared__ float dw_warp[];
    int warps = blockDim.x / 32, lane = threadIdx.x % 32;
    float* dw_mine = dw_warp + (threadIdx.x / 32) * C;
    for (int c = lane; c < C; c += 32) dw_mine[c] = 0.0f;
    for (int row = blockIdx.x * warps + threadIdx.x / 32; row < N; row += gridDim.x * warps) {
        const float* xr = x + (long)row * C;
        const float* dr = dout + (long)row * C;
        float r = rstd[row], dot = 0.0f;
        for (int c = lane; c < C; c += 32) dot += dr[c] * w[c] * xr[c] * r;   // sum of g * xhat
        dot = warp_sum(dot) / C;
        for (int c = lane; c < C; c += 32) {
            float xhat = xr[c] * r;
            float d = dx[(long)row * C + c] + r * (dr[c] * w[c] - xhat * dot);
            dx[(long)row * C + c] = d;
            if (dx16) dx16[(long)row * C + c] = bf16_bits(d);
            dw_mine[c] += dr[c] * xhat;
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += dw_warp[k * C + c];
        partial[(long)blockIdx.x * C + c] = sum;
    }
}

// dw[c] += the blocks' partial sums, in block order; one thread per c
extern "C" __global__ void rmsnorm_backward_dw_kernel(float* dw, const float* partial, int blocks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sum = 0.0f;
    for (int b = 0; b < blocks; b++) sum += partial[(long)b * C + c];
    dw[c] += sum;
}

// -----------------------------------------------------------------------------
// rope

// rotate-half RoPE in place on the first n_heads heads of each row of qkv (the q
// and k heads); cos/sin tables (positions, D/2) come from nanoeuler.rope_table.
// The backward is the rotation by the opposite angle: the same code with -sin.
// With qkv16 (bf16 mode) it writes the bf16 copy of the rotated heads too, and
// of the n_copied heads after them as they are (the forward's v heads, so that
// attention's bf16 passes find all of q, k, v rounded without a pass of their own).
// one thread per (row, head, pair); grid = ceil(N*(n_heads+n_copied)*D/2 / block)
__device__ void rope(float* qkv, unsigned short* qkv16, const float* cos, const float* sin, int N, int T,
                     int n_heads, int n_copied, int D, int stride, int pos, float sign) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int half = D / 2, heads = n_heads + n_copied;
    if (i >= (long)N * heads * half) return;
    int p = i % half, h = (i / half) % heads;
    long n = i / ((long)half * heads);
    long e = n * stride + h * D + p;
    float a = qkv[e], b = qkv[e + half];
    if (h < n_heads) {
        int t = pos + n % T;
        float c = cos[t * half + p], s = sign * sin[t * half + p];
        float ra = a * c - b * s, rb = b * c + a * s;
        qkv[e] = a = ra;
        qkv[e + half] = b = rb;
    }
    if (qkv16) {
        qkv16[e] = bf16_bits(a);
        qkv16[e + half] = bf16_bits(b);
    }
}

extern "C" __global__ void rope_forward_kernel(float* qkv, unsigned short* qkv16, const float* cos, const float* sin,
                                               int N, int T, int n_heads, int n_copied, int D, int stride, int pos) {
    rope(qkv, qkv16, cos, sin, N, T, n_heads, n_copied, D, stride, pos, 1.0f);
}

// and, in bf16 mode, the bf16 copy of the rotated dq and dk (attention's dk/dv kernel writes dv's)
extern "C" __global__ void rope_backward_kernel(float* dqkv, unsigned short* dqkv16, const float* cos, const float* sin,
                                                int N, int T, int n_heads, int D, int stride, int pos) {
    rope(dqkv, dqkv16, cos, sin, N, T, n_heads, 0, D, stride, pos, -1.0f);
}

// -----------------------------------------------------------------------------
// swiglu

// gu (N, 2F) holds gate then up; one thread per output; grid = ceil(N*F / block)
extern "C" __global__ void swiglu_forward_kernel(float* out, unsigned short* out16, const float* gu, int N, int F) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * F) return;
    long n = i / F, f = i % F;
    float gate = gu[n * 2 * F + f], up = gu[n * 2 * F + F + f];
    float o = gate / (1.0f + expf(-gate)) * up;
    if (out16) out16[i] = bf16_bits(o);                            // only matmuls read it
    else out[i] = o;
}

extern "C" __global__ void swiglu_backward_kernel(float* dgu, unsigned short* dgu16, const float* dout, const float* gu,
                                                  int N, int F) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * F) return;
    long n = i / F, f = i % F;
    float gate = gu[n * 2 * F + f], up = gu[n * 2 * F + F + f];
    float sig = 1.0f / (1.0f + expf(-gate)), silu = gate * sig;
    float dgate = dout[i] * up * (sig + silu * (1.0f - sig)), dup = dout[i] * silu;   // d silu / d gate
    if (dgu16) {                                                   // only matmuls read it
        dgu16[n * 2 * F + f] = bf16_bits(dgate);
        dgu16[n * 2 * F + F + f] = bf16_bits(dup);
    } else {
        dgu[n * 2 * F + f] = dgate;
        dgu[n * 2 * F + F + f] = dup;
    }
}

// -----------------------------------------------------------------------------
// residual

// out = x + a; one thread per element; grid = ceil(n / block)
extern "C" __global__ void residual_forward_kernel(float* out, const float* x, const float* a, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + a[i];
}

// -----------------------------------------------------------------------------
// cross entropy over the K heads

// Fused softmax + loss + gradient, in place: logits (K, N, V) come in, and
// d loss / d logits go out in the same memory (or, when dlogits16 is given, only
// to it, in bf16: the backward's matmuls read nothing else), so the
// probabilities are never stored. targets (N, K), -1 = ignored; dscale[k] = weight of head k / its count
// of kept targets (SPEC: loss = CE_0 + mtp_weight * mean(CE_1..CE_K-1)).
// losses (K, N): -log p(target) per row, 0 where ignored.
// one block of 256 threads per (row, head); grid = N*K
extern "C" __global__ void cross_entropy_forward_kernel(float* logits, unsigned short* dlogits16, float* losses,
                                                        const int* targets, const float* dscale, int N, int V,
                                                        int K) {
    int n = blockIdx.x % N, k = blockIdx.x / N;
    float* row = logits + ((long)k * N + n) * V;
    int t = targets[n * K + k];
    float m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, row[v]);
    m = block_max(m);
    float sum = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) sum += expf(row[v] - m);
    float lse = m + logf(block_sum(sum));
    float target_logit = t >= 0 ? row[t] : 0.0f;
    __syncthreads();                      // everyone has read row[t] before it is overwritten
    if (threadIdx.x == 0) losses[(long)k * N + n] = t >= 0 ? lse - target_logit : 0.0f;
    float scale = t >= 0 ? dscale[k] : 0.0f;
    unsigned short* row16 = dlogits16 ? dlogits16 + ((long)k * N + n) * V : nullptr;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float d = (expf(row[v] - lse) - (v == t ? 1.0f : 0.0f)) * scale;
        if (row16) row16[v] = bf16_bits(d);
        else row[v] = d;
    }
}

// -----------------------------------------------------------------------------
// bf16

// float32 -> bfloat16, rounded to nearest even: the inputs of the bf16 matmuls
// (cuBLAS multiplies them on tensor cores and accumulates in fp32) that no
// kernel wrote in bf16 itself: the weights after each update
// four elements per thread (a quarter of the threads, the same bytes); grid = ceil(n / (4 block))
extern "C" __global__ void to_bf16_kernel(unsigned short* out, const float* in, long n) {
    long i = 4 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    for (long j = i; j < i + 4 && j < n; j++) out[j] = bf16_bits(in[j]);
}

// -----------------------------------------------------------------------------
// adamw

// AdamW on the flat buffers, as nanoeuler.adamw_update; decay is 1 for matrices,
// 0 for norm weights; grad_scale applies the grad-norm clip.
// one thread per parameter; grid = ceil(n / block)
extern "C" __global__ void adamw_update_kernel(float* params, const float* grads, float* m, float* v, const float* decay,
                                        long n, float lr, float beta1, float beta2, float bias1, float bias2,
                                        float eps, float weight_decay, float grad_scale) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = grads[i] * grad_scale;
    float mi = beta1 * m[i] + (1.0f - beta1) * g;
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float p = params[i] * (1.0f - lr * weight_decay * decay[i]);       // decoupled weight decay
    params[i] = p - lr / bias1 * mi / (sqrtf(vi / bias2) + eps);
}

// sum of squares of the gradients, one partial sum per block (the host adds the
// partials: deterministic, and the step syncs for the loss anyway)
// grid-stride loop; grid = a few blocks per SM
extern "C" __global__ void grad_norm_kernel(float* partial, const float* grads, long n) {
    float s = 0.0f;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        s += grads[i] * grads[i];
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
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
// Programmatic dependent launch (nanoeuler_cuda.DECODE_PDL, sm_90 on, off by
// default): a kernel launched with it may start while the kernel before it still
// runs. Each decode kernel first lets the next one start (decode_launch_next), reads
// what no kernel of the step writes (the weights; the cache before *pos), then waits
// for the kernels before it (decode_wait) before it reads their outputs or writes
// anything. Launched without it, and before sm_90, both are no-ops.

#define DECODE_MAX_ROWS 8       // R at most; nanoeuler_cuda.DECODE_MAX_ROWS
#define DECODE_LOADS 4          // 16-byte weight loads in flight per lane; nanoeuler_cuda.DECODE_LOADS
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

__device__ __forceinline__ float4 load4(const float* p) { return *(const float4*)p; }

// what decode_matvec builds from `in` (R rows) as it multiplies
#define IN_PLAIN 0              // in (R, In) itself
#define IN_RMSNORM 1            // rmsnorm(in) * norm_w, in (R, In): the norm fused into the next product
#define IN_SWIGLU 2             // silu(gate) * up, in (R, 2 In) holding gate then up: swiglu fused too

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
// (the norm's 1/rms multiplies the whole sum at the end) or silu(gate) * up. 16-byte loads:
// In a multiple of 8, the rows and norm_w 16-byte aligned.
template <int MODE, int E>
__device__ __forceinline__ void matvec_input(float* v, const float* in, const float* norm_w, int In, int r, int c) {
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
                float4 n = load4(norm_w + c * E + e);
                v[e] *= n.x, v[e + 1] *= n.y, v[e + 2] *= n.z, v[e + 3] *= n.w;
            }
        }
    }
}

// 1 / rms of row r of in (R, In), summed by one warp in a fixed order
__device__ __forceinline__ float matvec_rstd(const float* in, int In, int r, int lane) {
    float ss = 0.0f;
#pragma unroll 8
    for (int i = 4 * lane; i < In; i += 128) {                    // the loads of 8 iterations in flight
        float4 x = load4(in + (long)r * In + i);
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
    }
    return 1.0f / sqrtf(warp_sum(ss) / In + 1e-5f);
}

// Asks L2 for `bytes` bytes from p, spread over the grid's threads, 128 bytes each: the
// weights of the next product (nanoeuler_cuda.DECODE_PREFETCH), so that they stream in from
// memory while this kernel finishes and the next one launches. A hint: no result depends on it.
__device__ __forceinline__ void prefetch_l2(const char* p, long bytes) {
    long threads = (long)gridDim.x * gridDim.y * gridDim.z * blockDim.x;
    long i = ((long)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    for (i *= 128; i < bytes; i += threads * 128) {
#ifdef __CUDA_ARCH__
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
#endif
    }
}

// one round of a lane's weight loads: chunks c, c+32, .. (DECODE_LOADS of them) below c1
__device__ __forceinline__ void matvec_load(uint4* raw, const uint4* row, int c, int c1) {
#pragma unroll
    for (int u = 0; u < DECODE_LOADS; u++)
        if (c + 32 * u < c1) raw[u] = row[c + 32 * u];
}

// out (R, ld_out) [+]= in' @ w.T for the R rows, w (Out, In) row-major, in' built from in
// as MODE says; accumulate: out += (the residual add fused in).
// At batch 1 this streams the weights, each used R times: its time is the trip to
// memory and how many bytes are in flight, not arithmetic. The block's 8 warps take
// 8 / splits outputs, `splits` warps to an output, each warp a contiguous part of the
// weight row: each lane loads its 16-byte chunks of the part (at most DECODE_LOADS a
// round, all issued before the first is used) and the matching elements of each row's
// input. The host picks splits from the matrix's shape (nanoeuler_cuda.matvec_splits):
// enough that a lane's chunks fit in one round, and that even a 768-row matrix makes two
// blocks per SM, so every SM has requests in flight (one warp per output left 36 of the
// H200's 132 SMs idle on the 768-row products). The parts' sums meet in shared memory and
// are added in part order: each row's sum runs in an order fixed by In and splits,
// whatever R. The norm's 1/rms of row r is summed by warp r of every block over the whole
// row while the weights are on their way (the same order in every block; kept out of the
// main loop, whose registers it would take). No kernel writes a weight, so with
// programmatic launch the first round's loads go out before the wait for the kernel that
// wrote `in`. next: the next product's weights (next_bytes of them) to prefetch into L2 once
// this warp's own have come, or nullptr.
// block 256 (8 warps, R <= 8), grid = ceil(Out / (8 / splits)); splits 1, 2, 4 or 8
template <typename W, int MODE>
__device__ void decode_matvec(float* out, const float* in, const W* w, const float* norm_w, int R, int In, int Out,
                              int ld_out, int accumulate, int splits, const char* next, long next_bytes) {
    __shared__ float part_sum[8][DECODE_MAX_ROWS], rstd[DECODE_MAX_ROWS];
    const int E = 16 / sizeof(W);                                  // weights per 16-byte load
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, outputs = 8 / splits;
    int o = blockIdx.x * outputs + warp / splits, part = warp % splits;
    int chunks = In / E, per_part = (chunks + splits - 1) / splits;
    int c0 = part * per_part, c1 = o < Out ? min(chunks, c0 + per_part) : c0;   // c1 <= c0: no work
    const uint4* row = (const uint4*)(w + (long)min(o, Out - 1) * In);
    uint4 raw[DECODE_LOADS];
    decode_launch_next();
    matvec_load(raw, row, c0 + lane, c1);
    decode_wait();
    if (MODE == IN_RMSNORM && warp < R) {
        float rs = matvec_rstd(in, In, warp, lane);
        if (lane == 0) rstd[warp] = rs;
    }
    float acc[DECODE_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < DECODE_MAX_ROWS; r++) acc[r] = 0.0f;
    for (int base = c0; base < c1; base += 32 * DECODE_LOADS) {
        if (base > c0) matvec_load(raw, row, base + lane, c1);     // rows longer than one round
#pragma unroll
        for (int u = 0; u < DECODE_LOADS; u++) {
            int c = base + lane + 32 * u;
            if (c >= c1) break;
            float wf[8], v[8];
            unpack16(raw[u], wf, w);
#pragma unroll
            for (int r = 0; r < DECODE_MAX_ROWS; r++) {
                if (r >= R) break;
                matvec_input<MODE, E>(v, in, norm_w, In, r, c);
#pragma unroll
                for (int e = 0; e < E; e++) acc[r] += wf[e] * v[e];
            }
        }
    }
    if (next) prefetch_l2(next, next_bytes);
#pragma unroll
    for (int r = 0; r < DECODE_MAX_ROWS; r++) {
        if (r >= R) break;
        float a = warp_sum(acc[r]);
        if (lane == 0) part_sum[warp][r] = a;
    }
    __syncthreads();
    int t = threadIdx.x, r = t % R, first = (t / R) * splits;      // thread t: output t / R of the block, row r
    o = blockIdx.x * outputs + t / R;
    if (t >= outputs * R || o >= Out) return;
    float s = 0.0f;
    for (int k = 0; k < splits; k++) s += part_sum[first + k][r];
    if (MODE == IN_RMSNORM) s *= rstd[r];
    float* dst = out + (long)r * ld_out + o;
    *dst = (accumulate ? *dst : 0.0f) + s;
}

// the six entry points: {plain, rmsnorm, swiglu} input x {fp32, bf16} weights, written out
extern "C" __global__ void __launch_bounds__(256, 4) decode_matvec_plain_f32_kernel(
    float* out, const float* in, const float* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits, const char* next, long next_bytes) {
    decode_matvec<float, IN_PLAIN>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, next, next_bytes);
}
extern "C" __global__ void __launch_bounds__(256, 4) decode_matvec_rmsnorm_f32_kernel(
    float* out, const float* in, const float* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits, const char* next, long next_bytes) {
    decode_matvec<float, IN_RMSNORM>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, next, next_bytes);
}
extern "C" __global__ void __launch_bounds__(256, 4) decode_matvec_swiglu_f32_kernel(
    float* out, const float* in, const float* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits, const char* next, long next_bytes) {
    decode_matvec<float, IN_SWIGLU>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, next, next_bytes);
}
extern "C" __global__ void __launch_bounds__(256, 4) decode_matvec_plain_bf16_kernel(
    float* out, const float* in, const unsigned short* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits, const char* next, long next_bytes) {
    decode_matvec<unsigned short, IN_PLAIN>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, next, next_bytes);
}
extern "C" __global__ void __launch_bounds__(256, 4) decode_matvec_rmsnorm_bf16_kernel(
    float* out, const float* in, const unsigned short* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits, const char* next, long next_bytes) {
    decode_matvec<unsigned short, IN_RMSNORM>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, next, next_bytes);
}
extern "C" __global__ void __launch_bounds__(256, 4) decode_matvec_swiglu_bf16_kernel(
    float* out, const float* in, const unsigned short* w, const float* norm_w, int R, int In, int Out, int ld_out,
    int accumulate, int splits, const char* next, long next_bytes) {
    decode_matvec<unsigned short, IN_SWIGLU>(out, in, w, norm_w, R, In, Out, ld_out, accumulate, splits, next, next_bytes);
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
// The scores' D-long sums meet in shuffles over the key's D/4 lanes, the chunk's max and
// sum of exp and its p-weighted values in shared memory, added in warp order. A row that
// sees one chunk writes y directly. A row that sees several writes the chunk's (m, l, acc)
// to `partial`; the last of its blocks to finish (counted in `count`, which it resets to 0
// for the next launch) combines them in chunk order: y = sum_c e^(m_c - M) acc_c /
// sum_c e^(m_c - M) l_c. Keys before *pos come from the cache, read before the wait for the
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
// count: rows * gridDim.x ints, 0 before the first launch
template <int D>
__device__ void attention_decode_split(float* y, float* partial, int* count, float* k_cache, float* v_cache,
                                       const float* qkv, const float* cos, const float* sin, const int* pos, int row0,
                                       int Hq, int Hkv, float scale) {
    constexpr int S = D / 4, HALF = D / 2, KEYS = 256 / S, SWEEPS = (DECODE_CHUNK + KEYS - 1) / KEYS;
    constexpr int REC = DECODE_HEADS * (D + 2);                    // a record: acc (heads x D), m, l (heads)
    __shared__ float sh_m[8][DECODE_HEADS], sh_l[8][DECODE_HEADS];
    __shared__ __align__(16) float sh_acc[8][DECODE_HEADS][D];     // written as float4
    __shared__ int sh_last;
    int G = Hq / Hkv, groups = (G + DECODE_HEADS - 1) / DECODE_HEADS, group = blockIdx.x % groups;
    int kvh = blockIdx.x / groups, h0 = kvh * G + group * DECODE_HEADS, nh = min(DECODE_HEADS, G - group * DECODE_HEADS);
    int b = blockIdx.y, r = row0 + b, first = blockIdx.z * DECODE_CHUNK, H = Hq + 2 * Hkv;   // b: row in the launch
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, s = tid % S, jj = tid / S;
    bool lo = s < S / 2;                                           // elements 4s.. are in the first half
    int other = 4 * (s ^ (S / 2)), pair = 4 * (s % (S / 2));       // the other half's 4; rope's pair index
    decode_launch_next();
    int p0 = *pos, t_row = p0 + r, n = t_row + 1;                  // n: keys this row sees
    if (first >= n) {                                              // a chunk after the row's keys
        decode_wait();
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
    decode_wait();
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
    float sc[SWEEPS][DECODE_HEADS], m[DECODE_HEADS];               // scores; the chunk's max
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
    float l[DECODE_HEADS], acc[DECODE_HEADS][4];
#pragma unroll
    for (int g = 0; g < DECODE_HEADS; g++) {
        m[g] = sh_m[0][g];                                         // finite: key `first` is seen
        for (int w = 1; w < 8; w++) m[g] = fmaxf(m[g], sh_m[w][g]);
        l[g] = acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < SWEEPS; i++)
#pragma unroll
        for (int g = 0; g < DECODE_HEADS; g++) {
            float p = expf(sc[i][g] - m[g]);                       // 0 for keys the row does not see
            l[g] += p;
            acc[g][0] += p * v[i].x;
            acc[g][1] += p * v[i].y;
            acc[g][2] += p * v[i].z;
            acc[g][3] += p * v[i].w;
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
    float* rec = partial + (((long)b * gridDim.x + blockIdx.x) * gridDim.z + blockIdx.z) * REC;
    for (int e = tid; e < nh * D; e += blockDim.x) {               // over the warps, in order
        int g = e / D, d = e % D;
        float a = 0.0f, den = 0.0f, mg = sh_m[0][g];
        for (int w = 0; w < 8; w++) a += sh_acc[w][g][d], den += sh_l[w][g];
        for (int w = 1; w < 8; w++) mg = fmaxf(mg, sh_m[w][g]);
        if (chunks == 1) {
            y[((long)r * Hq + h0 + g) * D + d] = a / den;
        } else {
            rec[g * D + d] = a;
            if (d == 0) rec[DECODE_HEADS * D + g] = mg, rec[DECODE_HEADS * (D + 1) + g] = den;
        }
    }
    if (chunks == 1) return;
    __threadfence();                                               // the record, before the count
    __syncthreads();
    if (tid == 0) {
        sh_last = atomicAdd(count + b * gridDim.x + blockIdx.x, 1) == chunks - 1;
        __threadfence();                                           // the count, before the records
    }
    __syncthreads();
    if (!sh_last) return;
    if (tid == 0) count[b * gridDim.x + blockIdx.x] = 0;
    const float* recs = partial + ((long)b * gridDim.x + blockIdx.x) * gridDim.z * REC;
    for (int e = tid; e < nh * D; e += blockDim.x) {               // the chunks, in order (__ldcg: from L2)
        int g = e / D, d = e % D;
        float M = -INFINITY, num = 0.0f, den = 0.0f;
        for (int ch = 0; ch < chunks; ch++) M = fmaxf(M, __ldcg(recs + ch * REC + DECODE_HEADS * D + g));
        for (int ch = 0; ch < chunks; ch++) {
            const float* rc = recs + ch * REC;
            float f = expf(__ldcg(rc + DECODE_HEADS * D + g) - M);
            num += f * __ldcg(rc + g * D + d);
            den += f * __ldcg(rc + DECODE_HEADS * (D + 1) + g);
        }
        y[((long)r * Hq + h0 + g) * D + d] = num / den;
    }
}

// the entry points, one per head dim, written out
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_8(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale) {
    attention_decode_split<8>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale);
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_16(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale) {
    attention_decode_split<16>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale);
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_32(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale) {
    attention_decode_split<32>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale);
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_64(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale) {
    attention_decode_split<64>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale);
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_split_kernel_128(
    float* y, float* partial, int* count, float* k_cache, float* v_cache, const float* qkv, const float* cos,
    const float* sin, const int* pos, int row0, int Hq, int Hkv, float scale) {
    attention_decode_split<128>(y, partial, count, k_cache, v_cache, qkv, cos, sin, pos, row0, Hq, Hkv, scale);
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
