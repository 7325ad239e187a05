// Variants of rmsnorm_backward_kernel and residual_rmsnorm_forward_kernel, appended to
// kernels.cu by docs/variants/rmsnorm_variants.py and timed against them on a GPU at the
// big model's batch-64 shape. Not part of NanoEuler.

// (v0) rmsnorm_backward_kernel before the variants (kernels.cu at ca6a65e)
// where column c of a warp's dw row lies in shared memory: lane l's PACK columns
// l PACK .. l PACK + PACK-1 land in PACK different rows of C / PACK words, at word l, so
// the 32 lanes of an update hit 32 different banks
__device__ __forceinline__ int dw_slot(int c, int C) { return (c % PACK) * (C / PACK) + c / PACK; }

// one row per warp, rows in a grid-stride loop, lanes over the row as in rmsnorm_rows:
// dx = (accumulate ? dx : 0) + rstd * (g - xhat * mean(g * xhat)), g = dout * w, xhat = x * rstd.
// accumulate: the residual stream's gradient takes both paths (+=); the final norm's starts it.
// The lane's share of the row's dout and x (and dx, when added to) is loaded at once and stays
// in registers from the first sum to dx, so each is read once. dw: each warp adds up its rows' dout * xhat in a row of shared memory of
// its own (warps x C floats, dynamic), the block adds its warps in order into partial[block],
// and rmsnorm_backward_dw_kernel adds the blocks in order: no atomics, so dw has the same bits
// every run. block 256, grid = min(ceil(N / 8), two per SM)
extern "C" __global__ void v0_rmsnorm_backward_kernel(floatX* dx, float* partial, const floatX* dout, const floatX* x,
                                                   const float* w, const float* rstd, int N, int C, int accumulate) {
    extern __shared__ float dw_warp[];
    int warps = blockDim.x / 32, lane = threadIdx.x % 32;
    float* dw_mine = dw_warp + (threadIdx.x / 32) * C;
    for (int c = lane; c < C; c += 32) dw_mine[c] = 0.0f;
    __syncwarp();                         // zeroed by one lane, added to by another (dw_slot)
    for (int row = blockIdx.x * warps + threadIdx.x / 32; row < N; row += gridDim.x * warps) {
        long r0 = (long)row * C;
        uint4 d_bits[ROW_PACKS], x_bits[ROW_PACKS], dx_bits[ROW_PACKS];
#pragma unroll
        for (int j = 0; j < ROW_PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (c < C) d_bits[j] = load_bits(dout + r0 + c), x_bits[j] = load_bits(x + r0 + c);
            if (c < C && accumulate) dx_bits[j] = load_bits(dx + r0 + c);
        }
        float r = rstd[row], dot = 0.0f;
#pragma unroll
        for (int j = 0; j < ROW_PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (c >= C) continue;
            float d[PACK], xv[PACK];
            unpack(d, d_bits[j], dout);
            unpack(xv, x_bits[j], x);
#pragma unroll
            for (int i = 0; i < PACK; i++) dot += d[i] * w[c + i] * xv[i] * r;   // sum of g * xhat
        }
        dot = warp_sum(dot) / C;
#pragma unroll
        for (int j = 0; j < ROW_PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (c >= C) continue;
            float d[PACK], xv[PACK], g[PACK];
            unpack(d, d_bits[j], dout);
            unpack(xv, x_bits[j], x);
            if (accumulate) unpack(g, dx_bits[j], dx);
#pragma unroll
            for (int i = 0; i < PACK; i++) {
                float xhat = xv[i] * r;
                g[i] = (accumulate ? g[i] : 0.0f) + r * (d[i] * w[c + i] - xhat * dot);
                dw_mine[dw_slot(c + i, C)] += d[i] * xhat;
            }
            store_pack(dx + r0 + c, g);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += dw_warp[k * C + dw_slot(c, C)];
        partial[(long)blockIdx.x * C + c] = sum;
    }
}

// (v1) as rmsnorm_backward_kernel, the lane's packs sized for the row (PACKS), not MAX_C
// (v2) v1 with dw in registers (each lane always holds the same columns), shared memory at the end only
// (v3) v2 with w in registers too: kernels.cu's rmsnorm_backward<768>, as kept
template <int PACKS, bool DW_REGS>
__device__ void rmsnorm_backward_packs(floatX* dx, float* partial, const floatX* dout, const floatX* x,
                                       const float* w, const float* rstd, int N, int C, int accumulate) {
    extern __shared__ float dw_warp[];
    int warps = blockDim.x / 32, lane = threadIdx.x % 32;
    float* dw_mine = dw_warp + (threadIdx.x / 32) * C;
    float dwr[PACKS][PACK];
#pragma unroll
    for (int j = 0; j < PACKS; j++)
#pragma unroll
        for (int i = 0; i < PACK; i++) dwr[j][i] = 0.0f;
    if (!DW_REGS) for (int c = lane; c < C; c += 32) dw_mine[c] = 0.0f;
    __syncwarp();
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
            int c = (32 * j + lane) * PACK;
            if (c >= C) continue;
            float d[PACK], xv[PACK];
            unpack(d, d_bits[j], dout);
            unpack(xv, x_bits[j], x);
#pragma unroll
            for (int i = 0; i < PACK; i++) dot += d[i] * w[c + i] * xv[i] * r;
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
                g[i] = (accumulate ? g[i] : 0.0f) + r * (d[i] * w[c + i] - xhat * dot);
                if (DW_REGS) dwr[j][i] += d[i] * xhat;
                else dw_mine[dw_slot(c + i, C)] += d[i] * xhat;
            }
            store_pack(dx + r0 + c, g);
        }
    }
    if (DW_REGS) {
#pragma unroll
        for (int j = 0; j < PACKS; j++)
#pragma unroll
            for (int i = 0; i < PACK; i++) {
                int c = (32 * j + lane) * PACK + i;
                if (c < C) dw_mine[dw_slot(c, C)] = dwr[j][i];
            }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += dw_warp[k * C + dw_slot(c, C)];
        partial[(long)blockIdx.x * C + c] = sum;
    }
}

#define BWD_ARGS floatX* dx, float* partial, const floatX* dout, const floatX* x, const float* w, \
    const float* rstd, int N, int C, int accumulate
#define BWD_PASS dx, partial, dout, x, w, rstd, N, C, accumulate
extern "C" __global__ void __launch_bounds__(256) v1_rmsnorm_backward_kernel(BWD_ARGS) {
    rmsnorm_backward_packs<768 / (32 * PACK), false>(BWD_PASS);
}
extern "C" __global__ void __launch_bounds__(256) v2_rmsnorm_backward_kernel(BWD_ARGS) {
    rmsnorm_backward_packs<768 / (32 * PACK), true>(BWD_PASS);
}
extern "C" __global__ void __launch_bounds__(256) v3_rmsnorm_backward_kernel(BWD_ARGS) {
    rmsnorm_backward<768>(BWD_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 3) v2b_rmsnorm_backward_kernel(BWD_ARGS) {
    rmsnorm_backward_packs<768 / (32 * PACK), true>(BWD_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 4) v1b_rmsnorm_backward_kernel(BWD_ARGS) {
    rmsnorm_backward_packs<768 / (32 * PACK), false>(BWD_PASS);
}

// (f1) residual_rmsnorm_forward with the lane's packs sized for the row
template <int PACKS>
__device__ void rmsnorm_rows_packs(floatX* out, float* rstd, floatX* x_out, const floatX* x_in, const floatX* a,
                                   const float* w, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    long r0 = (long)row * C;
    uint4 x_bits[PACKS], a_bits[PACKS];
#pragma unroll
    for (int j = 0; j < PACKS; j++) {
        int c = (32 * j + lane) * PACK;
        if (c < C) x_bits[j] = load_bits(x_in + r0 + c);
        if (c < C && a) a_bits[j] = load_bits(a + r0 + c);
    }
    float x[PACKS][PACK], ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PACKS; j++) {
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
    for (int j = 0; j < PACKS; j++) {
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

extern "C" __global__ void __launch_bounds__(256) f1_residual_rmsnorm_forward_kernel(floatX* x, floatX* out,
        float* rstd, const floatX* x_in, const floatX* a, const float* w, int N, int C) {
    rmsnorm_rows_packs<768 / (32 * PACK)>(out, rstd, x, x_in, a, w, N, C);
}

// (v5) v3 with the next row's loads issued before this row is worked on (two rows in flight a warp)
template <int PACKS>
__device__ void rmsnorm_backward_ahead(floatX* dx, float* partial, const floatX* dout, const floatX* x,
                                       const float* w, const float* rstd, int N, int C, int accumulate) {
    extern __shared__ float dw_warp[];
    int warps = blockDim.x / 32, lane = threadIdx.x % 32;
    float* dw_mine = dw_warp + (threadIdx.x / 32) * C;
    float dwr[PACKS][PACK], wr[PACKS][PACK];
#pragma unroll
    for (int j = 0; j < PACKS; j++)
#pragma unroll
        for (int i = 0; i < PACK; i++) {
            dwr[j][i] = 0.0f;
            int c = (32 * j + lane) * PACK;
            wr[j][i] = c < C ? w[c + i] : 0.0f;
        }
    uint4 d_bits[PACKS], x_bits[PACKS], dx_bits[PACKS];
    int row = blockIdx.x * warps + threadIdx.x / 32, stride = gridDim.x * warps;
    auto load = [&](int rw, uint4* db, uint4* xb, uint4* gb) {
#pragma unroll
        for (int j = 0; j < PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (rw < N && c < C) db[j] = load_bits(dout + (long)rw * C + c), xb[j] = load_bits(x + (long)rw * C + c);
            if (rw < N && c < C && accumulate) gb[j] = load_bits(dx + (long)rw * C + c);
        }
    };
    load(row, d_bits, x_bits, dx_bits);
    for (; row < N; row += stride) {
        long r0 = (long)row * C;
        uint4 d_cur[PACKS], x_cur[PACKS], dx_cur[PACKS];
#pragma unroll
        for (int j = 0; j < PACKS; j++) d_cur[j] = d_bits[j], x_cur[j] = x_bits[j], dx_cur[j] = dx_bits[j];
        load(row + stride, d_bits, x_bits, dx_bits);
        float r = rstd[row], dot = 0.0f;
#pragma unroll
        for (int j = 0; j < PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (c >= C) continue;
            float d[PACK], xv[PACK];
            unpack(d, d_cur[j], dout);
            unpack(xv, x_cur[j], x);
#pragma unroll
            for (int i = 0; i < PACK; i++) dot += d[i] * wr[j][i] * xv[i] * r;
        }
        dot = warp_sum(dot) / C;
#pragma unroll
        for (int j = 0; j < PACKS; j++) {
            int c = (32 * j + lane) * PACK;
            if (c >= C) continue;
            float d[PACK], xv[PACK], g[PACK];
            unpack(d, d_cur[j], dout);
            unpack(xv, x_cur[j], x);
            if (accumulate) unpack(g, dx_cur[j], dx);
#pragma unroll
            for (int i = 0; i < PACK; i++) {
                float xhat = xv[i] * r;
                g[i] = (accumulate ? g[i] : 0.0f) + r * (d[i] * wr[j][i] - xhat * dot);
                dwr[j][i] += d[i] * xhat;
            }
            store_pack(dx + r0 + c, g);
        }
    }
#pragma unroll
    for (int j = 0; j < PACKS; j++)
#pragma unroll
        for (int i = 0; i < PACK; i++) {
            int c = (32 * j + lane) * PACK + i;
            if (c < C) dw_mine[dw_slot(c, C)] = dwr[j][i];
        }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += dw_warp[k * C + dw_slot(c, C)];
        partial[(long)blockIdx.x * C + c] = sum;
    }
}
extern "C" __global__ void __launch_bounds__(256) v5_rmsnorm_backward_kernel(BWD_ARGS) {
    rmsnorm_backward_ahead<768 / (32 * PACK)>(BWD_PASS);
}
// (v6) v3 in blocks of 4 warps
extern "C" __global__ void __launch_bounds__(128) v6_rmsnorm_backward_kernel(BWD_ARGS) {
    rmsnorm_backward<768>(BWD_PASS);
}

// (f2) f1 with w in registers, loaded with the row
template <int PACKS>
__device__ void rmsnorm_rows_wregs(floatX* out, float* rstd, floatX* x_out, const floatX* x_in, const floatX* a,
                                   const float* w, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    long r0 = (long)row * C;
    uint4 x_bits[PACKS], a_bits[PACKS];
    float4 w_bits[PACKS][PACK / 4];
#pragma unroll
    for (int j = 0; j < PACKS; j++) {
        int c = (32 * j + lane) * PACK;
        if (c < C) x_bits[j] = load_bits(x_in + r0 + c);
        if (c < C && a) a_bits[j] = load_bits(a + r0 + c);
#pragma unroll
        for (int i = 0; i < PACK / 4; i++) if (c < C) w_bits[j][i] = *(const float4*)(w + c + 4 * i);
    }
    float x[PACKS][PACK], ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PACKS; j++) {
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
    for (int j = 0; j < PACKS; j++) {
        int c = (32 * j + lane) * PACK;
        if (c >= C) continue;
        if (x_out) store_pack(x_out + r0 + c, x[j]);
        const float* wj = (const float*)w_bits[j];
        float o[PACK];
#pragma unroll
        for (int i = 0; i < PACK; i++) o[i] = x[j][i] * r * wj[i];
        store_pack(out + r0 + c, o);
    }
    if (lane == 0) rstd[row] = r;
}
extern "C" __global__ void __launch_bounds__(256) f2_residual_rmsnorm_forward_kernel(floatX* x, floatX* out,
        float* rstd, const floatX* x_in, const floatX* a, const float* w, int N, int C) {
    rmsnorm_rows_wregs<768 / (32 * PACK)>(out, rstd, x, x_in, a, w, N, C);
}
