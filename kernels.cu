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
