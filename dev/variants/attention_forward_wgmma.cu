/*
A variant of flash_attn.cu's bf16 attention forward at D = 64 with Hopper's warpgroup MMA (issue 36; not
part of the product: nanoeuler_cuda.MODULES does not list it). The same math as attention_forward_bf16:
causal grouped-query attention, scores s = q.k of the bf16 inputs summed in fp32, an online softmax in
base 2 with the scale folded into one fma, p rounded to bf16 on its way into p v, y = o / l rounded to
bf16, lse = m scale + log(l) in fp32 for the backward. The same layouts: qkv16 (B, T, (Hq + 2 Hkv) 64)
(q heads, k heads, v heads), y16 (B, T, Hq 64), lse (B, Hq, T).

How the work is split: a block has W warpgroups (128 threads each), one for each of W query heads that read
the same kv head (W a divisor of Hq / Hkv: 3 for the big model), and works through units: 64-row query tiles
nq - 1 - p and p of its W heads of one batch row (nq = ceil(T / 64) tiles; a tile i takes 64 i / KEYS + 1 steps
of KEYS keys, so both together nq + 1 steps of 64 keys, or (nq even) nq / 2 + 1 of 128: units weigh the same).
The W warpgroups walk the same key tiles up to the same diagonal, so the block copies each K and V tile once
for 64 W query rows. grid = the units (a block each), or fewer blocks ("persistent": the number of SMs), each
walking units gridDim.x apart with its copies running ahead across tiles and units; block = 128 W threads;
dynamic shared memory 3 W 8 KB (three q tiles a warpgroup) + STAGES 256 KEYS bytes (a K and a V tile of KEYS
keys each) + 1 KB (to align the tiles to 1024 bytes).

Each step of KEYS keys (64, or 128 as FlashAttention-3 takes at D = 64), in each warpgroup:
  s (64 x KEYS, fp32) = q k.T 4 wgmma m64nKEYSk16, q and k both from shared memory ("K-major": a row of
                              64 bf16 = 128 bytes, the 128-byte swizzle; s is KEYS / 2 registers a thread)
  online softmax on s in the accumulator layout: thread t holds rows 16 (t / 32 % 4) + t % 32 / 4 and
                              8 below it (columns 8 j + 2 (t % 4) + 0, 1): a row's max and sum over the 4
                              threads of a quad (two shuffles); the causal mask on a tile's last step alone
  o (64 x 64, fp32) += p v    KEYS / 16 wgmma m64n64k16 with p from registers (the accumulator layout of s,
                              rounded to bf16 in pairs, is wgmma's register a fragment) and v from shared
                              memory ("MN-major": a key's 64 bf16 one 128-byte row, the same swizzle)
With 128 keys a step the fixed cost of a step (the block's barrier, the copies' bookkeeping, the softmax's
reductions and waits) is spread over twice the keys; a tile i of even i wastes half its last step on keys that
its mask takes out (11% more products at T 512).
Q, K and V tiles are all copied the same way (row r's 16-byte chunk c at 128 r + 16 (c ^ r % 8)), by
cp.async, every thread of the block taking part; no TMA, no producer warpgroup.

Three versions (the entry points at the bottom), each launched either way:
- simple (attention_forward_wgmma_64; _k128_64 with 128 keys a step): each wgmma waited for at once
  (wait_group 0), K/V copied 2 steps ahead through 3 stages: correct first.
- overlap (attention_forward_wgmma_overlap_64, 64 keys a step): intra-warpgroup pipelining with two score
  accumulators (64 registers). The scores of the next step are issued before this step's softmax, and this
  step's p v runs while the next step's softmax does: a warpgroup waits on its softmax chain with the tensor
  core busy on its own products. K/V copied 2 steps ahead through 4 stages (a V tile may still be read by
  the p v in flight when the next copy starts).
- pipelined (attention_forward_wgmma_pipelined_64, 64 keys a step): FlashAttention-3's own order, one score
  accumulator: the next step's s = q k.T, then this step's o += p v, issued together; the next step's softmax
  while this p v runs; then o rescaled and the next p packed. K/V copied 3 steps ahead through 4 stages (every
  p v of a step is done before the block's next barrier).
Either with q read by s = q k.T from shared memory, or from registers (the _qr_ entry points: 16 registers
more, loaded from the q tile at a tile's start): a wgmma m64n64k16 with both operands in shared memory reads
4 KB in its 32 cycles, all of the 128 bytes a cycle shared memory gives, and the copies write there too.
ptxas (NVRTC 13, sm_90a), no spills, no wgmma serialized (test_attention_wgmma), 384 threads a block, one block
an SM; registers at 64 keys: 132 simple, 149 with q in registers, 166 overlapped, 134 pipelined, 155 with q in
registers; at 128 keys: 166 simple, 166 with q in registers. Not built, for want of registers (168 at most with
384 threads): overlapped with q in registers (built in rounds 1 and 2; 36 bytes of spills with the copies'
cursor below), pipelined at 128 keys (round 2; 4 bytes with NVRTC 13.5's ptxas) and with q in registers too.
`python dev/variants/attention_forward_wgmma.py` checks every version against float64 and times it beside the
product on an H100/H200; the figures are in dev/LOG.md (issue 36).
*/

#define HD 64                 // head dim (wgmma's K of q k.T, its N of p v)
#define ROWS 64               // query rows of a warpgroup (wgmma's M); keys a step: KEYS, 64 or 128
#define TILE_BYTES 8192       // a 64 x 64 bf16 tile (q's; K's and V's are KEYS x 64)
#define LOG2E 1.4426950408889634f
#define INFINITY __int_as_float(0x7f800000)

// -----------------------------------------------------------------------------
// helpers (inline PTX; the emulator defines each in C++: tools/emulate_cuda.py, WGMMA_HELPERS and
// TENSOR_CORE_HELPERS); as dev/variants/wgmma_probe.cu and flash_attn.cu have them

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// make this thread's generic-proxy writes to shared memory visible to wgmma's (async proxy) reads
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// order the registers' accesses before it against the wgmma after it (the warpgroup runs it together)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// d (64 x N fp32) = a (64 x 16) b (16 x N) + (scale_d ? d : 0), a and b bf16 in shared memory by their
// descriptors; A_MN, B_MN: a is M-major, b N-major (else both K-major)
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
              "+f"(d[i + 6]), "+f"(d[i + 7])
#define D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define D64 D32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
template <int N, int A_MN, int B_MN>
__device__ __forceinline__ void wgmma_bf16(float* d, unsigned long long a, unsigned long long b, int scale_d) {
    static_assert(N == 64 || N == 128, "wgmma_bf16: N is 64 or 128 here");
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24)
                     : "l"(a), "l"(b), "r"(scale_d), "n"(A_MN), "n"(B_MN));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " D64 "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
                     : "l"(a), "l"(b), "r"(scale_d), "n"(A_MN), "n"(B_MN));
}

// the same with a from registers: a[0..3] this thread's part of a (64 x 16) as mma.sync's m16n8k16 a fragment;
// not to be written until the wgmma is waited for
template <int N, int B_MN>
__device__ __forceinline__ void wgmma_bf16_rs(float* d, const unsigned* a, unsigned long long b, int scale_d) {
    static_assert(N == 64 || N == 128, "wgmma_bf16_rs: N is 64 or 128 here");
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 "}, "
                     "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(B_MN));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " D64 "}, "
                     "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(B_MN));
}

// close the group of the wgmma this thread issued since the last commit
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int N>   // wait until at most N groups of wgmma are still in flight
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// 16 bytes global -> shared without passing through registers; zeros when !valid
__device__ __forceinline__ void cp_async16(unsigned short* dst, const unsigned short* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>   // wait until at most N groups of copies are still in flight
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// -----------------------------------------------------------------------------
// plain C++ (the emulator runs it as it is)

// keep the compiler from moving accesses to the n accumulators across a wgmma fence or wait (CUTLASS's
// warpgroup_fence_operand): each register passes through an empty asm
template <int n>
__device__ __forceinline__ void fence_registers(float* d) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// two floats -> one register of two bf16, rounded to nearest even; lo in the lower half
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float quad_max(float v) {          // over the 4 threads of a row
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffff, v, 1);
    return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// a shared-memory matrix descriptor of a 128-byte-swizzled operand: bits 0-13 the start address >> 4, 16-29
// the leading byte offset >> 4, 32-45 the stride byte offset >> 4 (8 rows of 128 bytes: 1024), 62-63 1
__device__ __forceinline__ unsigned long long sw128_descriptor(unsigned address, unsigned lbo) {
    return (address & 0x3FFFF) >> 4 | (unsigned long long)(lbo >> 4 & 0x3FFF) << 16 |
           (unsigned long long)(1024 >> 4) << 32 | 1ull << 62;
}

// start copying rows r0 .. r0 + rows - 1 of a row-major bf16 matrix (row stride ld, m at the head's first column;
// zeros past T) into a rows x 64 tile: row r's 16-byte chunk c at 128 r + 16 (c ^ r % 8), the 128-byte swizzle
// of both of wgmma's layouts here; thread `first` of `threads` (of the block, a multiple of 128) takes every
// threads-th chunk: chunk first % 8 of rows first / 8, + threads / 8, ..., all alike mod 8, so its chunk's swizzled
// place moves by whole rows (a pointer add a chunk, where indices worked out afresh took some 35 instructions)
__device__ __forceinline__ void load_tile(unsigned short* tile, const unsigned short* m, long ld, int r0, int T,
                                          int first, int threads, int rows) {
    int r = first / 8, ch = first % 8, step = threads / 8;
    unsigned short* dst = tile + r * 64 + (ch ^ r % 8) * 8;
    const unsigned short* src = m + (long)(r0 + r) * ld + ch * 8;
    for (; r < rows; r += step, dst += step * 64, src += step * ld) {
        bool valid = r0 + r < T;
        cp_async16(dst, valid ? src : m, valid);
    }
}

// s = q k.T (64 x KEYS): 4 wgmma of 16 dims, q and k K-major (the 16 dims from kk at byte 32 kk of each 128-byte
// row)
template <int KEYS>
__device__ __forceinline__ void issue_scores(float* s, unsigned q, unsigned k) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        wgmma_bf16<KEYS, 0, 0>(s, sw128_descriptor(q + 32 * kk, 16), sw128_descriptor(k + 32 * kk, 16), kk > 0);
    wgmma_commit();
}

// the same with q from registers (qf[kk]: this thread's part of q's 16 dims from 16 kk, as wgmma's register a)
template <int KEYS>
__device__ __forceinline__ void issue_scores_rs(float* s, const unsigned (*qf)[4], unsigned k) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) wgmma_bf16_rs<KEYS, 0>(s, qf[kk], sw128_descriptor(k + 32 * kk, 16), kk > 0);
    wgmma_commit();
}

// this thread's register a of q (QR) from its q tile in shared memory (load_tile's layout): register j of
// k-step kk holds row 16 (t / 32 % 4) + t % 32 / 4 (+ 8 for odd j), dims 16 kk + 2 (t % 4), + 1 (+ 8 for j >= 2)
__device__ __forceinline__ void load_q_fragments(unsigned (*qf)[4], const unsigned short* tile) {
    int t = threadIdx.x % 128, row = 16 * (t / 32) + t % 32 / 4;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = row + 8 * (j % 2), d = 16 * kk + 2 * (t % 4) + 8 * (j / 2);
            qf[kk][j] = *(const unsigned*)((const char*)tile + r * 128 + (d / 8 ^ r % 8) * 16 + d % 8 * 2);
        }
}

// s = q k.T with q from shared memory, or (QR) from registers: half the shared-memory reads of a wgmma
// m64n64k16 (whose two operands from shared memory take all of its 128 bytes a cycle)
template <int KEYS, bool QR>
__device__ __forceinline__ void scores(float* s, const unsigned (*qf)[4], const unsigned short* q, unsigned k) {
    if constexpr (QR) issue_scores_rs<KEYS>(s, qf, k);
    else issue_scores<KEYS>(s, shared_address(q), k);
}

// o += p v: KEYS / 16 wgmma of 16 keys, p[kk] from registers, v N-major (keys 16 kk .. at byte 2048 kk; the 64
// dims of a key one row, so the leading byte offset, between groups of 64 dims, is never used)
template <int KEYS>
__device__ __forceinline__ void issue_weighted_sum(float* o, const unsigned (*p)[4], unsigned v) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; kk++) wgmma_bf16_rs<HD, 1>(o, p[kk], sw128_descriptor(v + 2048 * kk, 8192), 1);
    wgmma_commit();
}

// the online softmax of one step on this thread's scores s (accumulator layout, rows row0 and row0 + 8):
// mask keys after the query on a tile's last step (keys k0 .. k0 + KEYS - 1), update the running max m and sum
// l, s <- p = exp2(s scale2 - m scale2) in fp32; -> correction[r], what o's row r is to be multiplied by
template <int KEYS>
__device__ __forceinline__ void softmax_step(float* s, float* m, float* l, float* correction, int k0, int row0,
                                             bool diagonal, float scale2) {
    int q = threadIdx.x % 4;
    if (diagonal)
#pragma unroll
        for (int i = 0; i < KEYS / 2; i++)
            if (k0 + 8 * (i / 4) + 2 * q + i % 2 > row0 + 8 * (i / 2 % 2)) s[i] = -INFINITY;
    // a row's KEYS / 4 scores here (registers 4 a + 2 r, + 1) reduced 8 ways then as a tree, and summed 4 ways:
    // short chains, as a warp's softmax waits on its own latency
    float mx[2][8], sum[2][4], ms[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
#pragma unroll
        for (int a = 0; a < KEYS / 8; a++) {
            float x = fmaxf(s[4 * a + 2 * r], s[4 * a + 2 * r + 1]);
            mx[r][a % 8] = a < 8 ? x : fmaxf(mx[r][a % 8], x);
        }
#pragma unroll
        for (int w = 4; w > 0; w /= 2)
#pragma unroll
            for (int a = 0; a < w; a++) mx[r][a] = fmaxf(mx[r][a], mx[r][a + w]);
        mx[r][0] = quad_max(fmaxf(m[r], mx[r][0]));               // key 0 is in the first step: finite
        correction[r] = exp2f((m[r] - mx[r][0]) * scale2);        // rescale what came before
        m[r] = mx[r][0];
        ms[r] = mx[r][0] * scale2;
    }
#pragma unroll
    for (int i = 0; i < KEYS / 2; i++) {
        s[i] = exp2f(fmaf(s[i], scale2, -ms[i / 2 % 2]));
        if (i < 8) sum[i / 2 % 2][i / 4 * 2 + i % 2] = s[i];
        else sum[i / 2 % 2][i / 4 % 2 * 2 + i % 2] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; r++) l[r] = l[r] * correction[r] + ((sum[r][0] + sum[r][1]) + (sum[r][2] + sum[r][3]));
}

// p (fp32, accumulator layout) -> bf16 pairs in wgmma's register a layout, 16 keys a k-step: register j of
// k-step kk holds row g (+ 8 for odd j), keys 16 kk + 2 (t % 4), +1 (+ 8 for j >= 2): s[8 kk + 2 j], + 1
template <int KEYS>
__device__ __forceinline__ void pack_p(unsigned (*p)[4], const float* s) {
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; kk++)
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
        float sum = quad_sum(l[r]);
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

// -----------------------------------------------------------------------------
// the work: units of two query tiles

// A unit is query tiles nq - 1 - p and p of W query heads of one batch row (nq = ceil(T / 64) tiles of 64 rows,
// p < ceil(nq / 2); one tile when the two are the same): a tile i takes 64 i / KEYS + 1 steps of KEYS keys (its
// last step the diagonal), so a unit nq + 1 steps of 64 keys whichever p, or nq / 2 + 1 of 128 (nq even: one of
// the two tiles is odd), and the units weigh the same. Unit u: p = u % pairs, the group of W heads x = u / pairs
// % groups, the batch row b = u / pairs / groups. A block walks units blockIdx.x, + gridDim.x, ... (grid: the
// units, one a block; or the SMs, persistent), tile by tile and step by step, with two cursors: the copies AHEAD
// steps in front of the products, across tiles and units, so a tile's q and first keys are in before its first
// step. A cursor keeps the unit's batch row and kv head, which the copies need at every step (divisions by
// numbers known at run time only, some 20 instructions each, once a unit, in one register: registers are short
// in the overlapped version); the query heads are worked out once a tile.
struct Cursor {
    int u, jq, bk;                       // the unit; 65536 qi + j: step (key tile) j of query tile qi; 65536 b + the
                                         // kv head, b the unit's batch row
    __device__ int j() const { return jq & 0xFFFF; }
    __device__ int qi() const { return jq >> 16; }
};

template <int KEYS>
struct Work {
    int nq, pairs, groups, units, W, G;
    __device__ Work(int B, int T, int Hq, int Hkv, int W_) {
        W = W_, G = Hq / Hkv;
        nq = (T + ROWS - 1) / ROWS, pairs = (nq + 1) / 2, groups = Hq / W, units = B * groups * pairs;
    }
    __device__ int last(int tile) const { return tile * ROWS / KEYS; }          // a tile's last step (diagonal)
    __device__ bool valid(const Cursor& c) const { return c.u < units; }
    __device__ bool diagonal(const Cursor& c) const { return c.j() == last(c.qi()); }
    // query head h0 + w of unit u for warpgroup w, and the batch row
    __device__ int h0(int u) const { return u / pairs % groups * W; }
    __device__ int batch(int u) const { return u / pairs / groups; }
    // the cursor at the first step of unit u's first tile (nq - 1 - p)
    __device__ Cursor start(int u) const { return {u, (nq - 1 - u % pairs) << 16, batch(u) << 16 | h0(u) / G}; }
    __device__ void advance(Cursor& c) const {
        if (!diagonal(c)) {
            c.jq++;
        } else if (2 * c.qi() > nq - 1) {                         // the first tile of two: on to tile p
            c.jq = (nq - 1 - c.qi()) << 16;
        } else {
            c = start(c.u + gridDim.x);
        }
    }
    // the steps of unit u: both tiles' (one when they are the same)
    __device__ int steps(int u) const {
        int p = u % pairs;
        return last(nq - 1 - p) + 1 + (2 * p == nq - 1 ? 0 : last(p) + 1);
    }
};

// -----------------------------------------------------------------------------
// the kernel (the header says how the work is split)

// what the steps share: the shared tiles (q buffer i of warpgroup g at (i W + g) 4096 bf16: three, as a tile's q
// is copied up to AHEAD steps before it starts while the tile before it may still be in use; K/V stage i at
// qs + 3 W 4096 + 2 KEYS 64 i, v KEYS 64 after k), the work, the layouts (as few registers as will do: the
// versions at 128 keys are at ptxas's 168)
template <int KEYS>
struct Block {
    unsigned short* qs;
    Work<KEYS> work;
    int wg, t, T, Hq, Hkv;
    int stride;                          // of a row of qkv16: (Hq + 2 Hkv) 64
    const unsigned short* qkv16;
    __device__ Block(unsigned char* tiles, const unsigned short* qkv16_, int B, int T_, int Hq_, int Hkv_)
        : work(B, T_, Hq_, Hkv_, blockDim.x / 128), qkv16(qkv16_) {
        wg = threadIdx.x / 128, t = threadIdx.x % 128;
        T = T_, Hq = Hq_, Hkv = Hkv_, stride = (Hq + 2 * Hkv) * HD;
        qs = (unsigned short*)tiles;
    }
    __device__ unsigned short* q_tile(int i) const { return qs + (i % 3 * work.W + wg) * ROWS * HD; }
    __device__ unsigned short* stage(int n, int stages) const {
        return qs + (3 * work.W + n % stages * 2 * KEYS / ROWS) * ROWS * HD;
    }
    __device__ unsigned k_tile(int n, int stages) const { return shared_address(stage(n, stages)); }
    __device__ unsigned v_tile(int n, int stages) const { return shared_address(stage(n, stages) + KEYS * HD); }
    // this warpgroup's query head at c
    __device__ int head(const Cursor& c) const { return work.h0(c.u) + wg; }
    // this thread's first row (of its two) in query tile qi
    __device__ int row0(int qi) const { return qi * ROWS + 16 * (t / 32) + t % 32 / 4; }
    // start copying what the step at c needs (the n-th of the block) into stage n: its keys and values, and at the
    // first step of a tile (the block's tiles-th), each warpgroup its q; then c moves on. One commit group, empty
    // past the last step
    __device__ void load(Cursor& c, int n, int stages, int& tiles) const {
        if (work.valid(c)) {
            const unsigned short* base = qkv16 + (long)(c.bk >> 16) * T * stride;
            int kvh = c.bk & 0xFFFF;
            if (c.j() == 0) load_tile(q_tile(tiles++), base + head(c) * HD, stride, c.qi() * ROWS, T, t, 128, ROWS);
            unsigned short* st = stage(n, stages);
            load_tile(st, base + (Hq + kvh) * HD, stride, c.j() * KEYS, T, threadIdx.x, blockDim.x, KEYS);
            load_tile(st + KEYS * HD, base + (Hq + Hkv + kvh) * HD, stride, c.j() * KEYS, T, threadIdx.x, blockDim.x,
                      KEYS);
            work.advance(c);
        }
        cp_async_commit();
    }
    // the steps of this block, over all its units
    __device__ int steps() const {
        int n = 0;
        for (int u = blockIdx.x; u < work.units; u += gridDim.x) n += work.steps(u);
        return n;
    }
};

// the running state of a warpgroup's tile: o, the running max m and sum l of its two rows a thread
struct Rows {
    float o[HD / 2], m[2], l[2];
    __device__ void reset() {
#pragma unroll
        for (int i = 0; i < HD / 2; i++) o[i] = 0.0f;
        m[0] = m[1] = -INFINITY, l[0] = l[1] = 0.0f;
    }
};

// a tile's rows whose o is still to be stored once its last p v is done (the overlapped version)
struct Pending {
    int u, qi;                           // its unit and query tile; u < 0: none
    float inv[2];                        // 1 / l (lse is stored at once)
};

// the simple version: each step's s = q k.T and o += p v waited for at once; K/V copied STAGES - 1 steps ahead
template <int KEYS, int STAGES, bool QR>
__device__ void simple_steps(const Block<KEYS>& k, unsigned short* y16, float* lse, float scale, float scale2) {
    constexpr int AHEAD = STAGES - 1;                              // steps copied ahead of the products
    Cursor cs = k.work.start(blockIdx.x), ld = cs;                 // the products' step, the copies'
    int loaded = 0, done = 0;                                      // tiles whose q was copied, tiles stored
    for (int i = 0; i < AHEAD; i++) k.load(ld, i, STAGES, loaded);
    Rows r;
    r.reset();
    // subtle: qf is written before its first use (every tile's first step), but not on every path the compiler
    // sees (the loop entered at a step past a tile's first); so written here too: ptxas (CUDA 13.0) treats the
    // registers of a wgmma's a that are undefined on one path into the loop as free after the wgmma, and gave
    // them to p, which the simple version's s = q k.T then read as q at every step but a tile's first (y 0.41
    // off on an H100, 2026-12-07; test_wgmma.py's PTX check refuses such a register)
    unsigned p[KEYS / 16][4], qf[HD / 16][4] = {};
    float s[KEYS / 2];
    for (int n = 0; k.work.valid(cs); n++) {
        cp_async_wait<AHEAD - 1>();                                // this thread's copies of step n
        fence_proxy_async();
        __syncthreads();                  // everyone's; and every warpgroup is done with step n - 1's stage
        k.load(ld, n + AHEAD, STAGES, loaded);
        int qi = cs.qi(), row0 = k.row0(qi);
        float correction[2];
        if (QR && cs.j() == 0) load_q_fragments(qf, k.q_tile(done));
        scores<KEYS, QR>(s, qf, k.q_tile(done), k.k_tile(n, STAGES));
        wgmma_wait<0>();
        fence_registers<KEYS / 2>(s);
        softmax_step<KEYS>(s, r.m, r.l, correction, cs.j() * KEYS, row0, k.work.diagonal(cs), scale2);
        pack_p<KEYS>(p, s);
        scale_o(r.o, correction);
        fence_registers<HD / 2>(r.o);
        issue_weighted_sum<KEYS>(r.o, p, k.v_tile(n, STAGES));
        wgmma_wait<0>();
        fence_registers<HD / 2>(r.o);
        if (k.work.diagonal(cs)) {
            float inv[2];
            store_lse(lse, r.m, r.l, inv, k.work.batch(cs.u), k.head(cs), row0, k.T, k.Hq, scale);
            store_y(y16, r.o, inv, k.work.batch(cs.u), k.head(cs), row0, k.T, k.Hq);
            r.reset();
            done++;
        }
        k.work.advance(cs);
    }
}

// one step of the overlapped version on the step at cs (its scores in sc, done; the n-th of the block): with NEXT
// (not the block's last step), first issue the next step's scores into sn; the softmax; wait for the previous
// p v (leaving the next scores in flight) and store the tile before if that was its last; o rescaled (to zero
// at a tile's first step, where m was -inf), p packed, this p v issued; with NEXT wait for the next scores,
// leaving this p v in flight through the next step's softmax (without, for everything). At a tile's last step
// its lse is stored, 1 / l goes to `pending` and m, l start afresh. The waits are the same whatever the step,
// so that ptxas can follow the groups in flight (a wait_group chosen at run time, or a wgmma under a branch, and
// it serializes them)
template <int STAGES, bool NEXT>
__device__ __forceinline__ void overlapped_step(const Block<64>& k, Cursor& cs, Cursor& ld, int n, int& loaded,
                                                int& done, float* sc, float* sn, Rows& r, Pending& pending,
                                                unsigned (*p)[4], unsigned short* y16,
                                                float* lse, float scale, float scale2) {
    constexpr int AHEAD = STAGES - 2;
    // step n + 1's tiles in (copied during step n - 1), and every warpgroup's p v of step n - 2 done (waited for
    // in step n - 1), so step n + AHEAD may go into its stage
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    k.load(ld, n + AHEAD, STAGES, loaded);
    int qi = cs.qi(), row0 = k.row0(qi);
    bool last = k.work.diagonal(cs);                               // the tile's last step
    float correction[2];
    if constexpr (NEXT) {
        fence_registers<ROWS / 2>(sn);
        issue_scores<64>(sn, shared_address(k.q_tile(done + last)), k.k_tile(n + 1, STAGES));
        fence_registers<ROWS / 2>(sn);
    }
    softmax_step<64>(sc, r.m, r.l, correction, cs.j() * 64, row0, last, scale2);
    if constexpr (NEXT) wgmma_wait<1>(); else wgmma_wait<0>();    // the previous p v: o and p are free
    fence_registers<HD / 2>(r.o);
    if (pending.u >= 0) {
        store_y(y16, r.o, pending.inv, k.work.batch(pending.u), k.work.h0(pending.u) + k.wg,
                row0 - (qi - pending.qi) * ROWS, k.T, k.Hq);
        pending.u = -1;
    }
    pack_p<64>(p, sc);
    scale_o(r.o, correction);
    fence_registers<HD / 2>(r.o);
    issue_weighted_sum<64>(r.o, p, k.v_tile(n, STAGES));
    fence_registers<HD / 2>(r.o);
    if constexpr (NEXT) wgmma_wait<1>(); else wgmma_wait<0>();    // the next scores (or everything)
    if constexpr (NEXT) fence_registers<ROWS / 2>(sn);
    if (last) {
        store_lse(lse, r.m, r.l, pending.inv, k.work.batch(cs.u), k.head(cs), row0, k.T, k.Hq, scale);
        pending.u = cs.u, pending.qi = qi;
        r.m[0] = r.m[1] = -INFINITY, r.l[0] = r.l[1] = 0.0f;
        done++;
    }
    k.work.advance(cs);
}

template <int STAGES>
__device__ void overlapped_steps(const Block<64>& k, unsigned short* y16, float* lse, float scale, float scale2) {
    constexpr int AHEAD = STAGES - 2;                              // steps copied ahead of the products
    Cursor cs = k.work.start(blockIdx.x), ld = cs;                 // the products' step, the copies'
    int loaded = 0, done = 0;                                      // tiles whose q was copied, tiles stored
    for (int i = 0; i < AHEAD; i++) k.load(ld, i, STAGES, loaded);
    Rows r;
    r.reset();
    unsigned p[ROWS / 16][4];
    float s0[ROWS / 2], s1[ROWS / 2];
    if (!k.work.valid(cs)) return;
    cp_async_wait<AHEAD - 1>();                                    // step 0's q and tiles
    fence_proxy_async();
    __syncthreads();
    fence_registers<ROWS / 2>(s0);
    issue_scores<64>(s0, shared_address(k.q_tile(0)), k.k_tile(0, STAGES));
    wgmma_wait<0>();
    fence_registers<ROWS / 2>(s0);
    Pending pending = {-1, 0};
    int n = 0, steps = k.steps();
    for (; n + 2 < steps; n += 2) {                                // two steps: the score buffers swap
        overlapped_step<STAGES, true>(k, cs, ld, n, loaded, done, s0, s1, r, pending, p, y16, lse, scale,
                                          scale2);
        overlapped_step<STAGES, true>(k, cs, ld, n + 1, loaded, done, s1, s0, r, pending, p, y16, lse,
                                          scale, scale2);
    }
    if (n + 1 < steps) {
        overlapped_step<STAGES, true>(k, cs, ld, n, loaded, done, s0, s1, r, pending, p, y16, lse, scale,
                                          scale2);
        overlapped_step<STAGES, false>(k, cs, ld, n + 1, loaded, done, s1, s0, r, pending, p, y16, lse,
                                           scale, scale2);
    } else {
        overlapped_step<STAGES, false>(k, cs, ld, n, loaded, done, s0, s1, r, pending, p, y16, lse, scale,
                                           scale2);
    }
    wgmma_wait<0>();                                               // (the last step waited for all)
    fence_registers<HD / 2>(r.o);
    store_y(y16, r.o, pending.inv, k.work.batch(pending.u), k.work.h0(pending.u) + k.wg, k.row0(pending.qi), k.T,
            k.Hq);
}

// one step of the pipelined version (FlashAttention-3's order) at cs, the n-th of the block, whose p is packed:
// with NEXT (not the block's last step) the next step's s = q k.T, then this step's o += p v, issued together;
// at a tile's last step its lse stored (its m and l final: its softmax ran a step ago) and m, l started afresh;
// with NEXT the next step's softmax while the p v runs; then, the p v done, at a tile's last step its y stored,
// o rescaled (to zero at a tile's first step, where m was -inf) and the next p packed. The waits are the same
// whatever the step (see overlapped_step). QR: at a tile's last step, the next tile's q into registers
template <int KEYS, int STAGES, bool QR, bool NEXT>
__device__ __forceinline__ void pipelined_step(const Block<KEYS>& k, Cursor& cs, Cursor& ld, int n, int& loaded,
                                               int& done, float* s, Rows& r, unsigned (*p)[4], unsigned (*qf)[4],
                                               unsigned short* y16, float* lse, float scale, float scale2) {
    // steps up to n + 1 in (of the STAGES - 1 ahead), and every warpgroup's p v of step n - 1 done (waited for in
    // step n - 1), so step n - 1 + STAGES may go into its stage
    cp_async_wait<STAGES - 3>();
    fence_proxy_async();
    __syncthreads();
    k.load(ld, n + STAGES - 1, STAGES, loaded);
    Cursor nx = cs;
    k.work.advance(nx);
    int qi = cs.qi(), row0 = k.row0(qi);
    bool last = k.work.diagonal(cs);
    if constexpr (NEXT) {
        fence_registers<KEYS / 2>(s);
        if (QR && last) load_q_fragments(qf, k.q_tile(done + 1));  // the next tile's (this one's scores are done)
        scores<KEYS, QR>(s, qf, k.q_tile(done + last), k.k_tile(n + 1, STAGES));
        fence_registers<KEYS / 2>(s);
    }
    fence_registers<HD / 2>(r.o);
    issue_weighted_sum<KEYS>(r.o, p, k.v_tile(n, STAGES));
    fence_registers<HD / 2>(r.o);
    float correction[2], inv[2];
    if (last) {
        store_lse(lse, r.m, r.l, inv, k.work.batch(cs.u), k.head(cs), row0, k.T, k.Hq, scale);
        r.m[0] = r.m[1] = -INFINITY, r.l[0] = r.l[1] = 0.0f;
    }
    if constexpr (NEXT) {
        wgmma_wait<1>();                                           // the next scores (this p v still in flight)
        fence_registers<KEYS / 2>(s);
        softmax_step<KEYS>(s, r.m, r.l, correction, nx.j() * KEYS, k.row0(nx.qi()), k.work.diagonal(nx),
                           scale2);
    }
    wgmma_wait<0>();                                               // this p v: o and p are free
    fence_registers<HD / 2>(r.o);
    if (last) {
        store_y(y16, r.o, inv, k.work.batch(cs.u), k.head(cs), row0, k.T, k.Hq);
        done++;
    }
    if constexpr (NEXT) {
        scale_o(r.o, correction);
        pack_p<KEYS>(p, s);
    }
    cs = nx;
}

template <int KEYS, int STAGES, bool QR>
__device__ void pipelined_steps(const Block<KEYS>& k, unsigned short* y16, float* lse, float scale, float scale2) {
    Cursor cs = k.work.start(blockIdx.x), ld = cs;                 // the products' step, the copies'
    int loaded = 0, done = 0;                                      // tiles whose q was copied, tiles stored
    for (int i = 0; i < STAGES - 1; i++) k.load(ld, i, STAGES, loaded);
    if (!k.work.valid(cs)) return;
    Rows r;
    r.reset();
    unsigned p[KEYS / 16][4], qf[HD / 16][4];                      // (QR: q's written below, on every path)
    float s[KEYS / 2], correction[2];
    cp_async_wait<STAGES - 2>();                                   // step 0's q and tiles
    fence_proxy_async();
    __syncthreads();
    if (QR) load_q_fragments(qf, k.q_tile(0));
    scores<KEYS, QR>(s, qf, k.q_tile(0), k.k_tile(0, STAGES));
    wgmma_wait<0>();
    fence_registers<KEYS / 2>(s);
    softmax_step<KEYS>(s, r.m, r.l, correction, 0, k.row0(cs.qi()), k.work.diagonal(cs), scale2);
    pack_p<KEYS>(p, s);
    int n = 0, steps = k.steps();
    for (; n + 1 < steps; n++)
        pipelined_step<KEYS, STAGES, QR, true>(k, cs, ld, n, loaded, done, s, r, p, qf, y16, lse, scale, scale2);
    pipelined_step<KEYS, STAGES, QR, false>(k, cs, ld, n, loaded, done, s, r, p, qf, y16, lse, scale, scale2);
}

// MODE 0: simple, 1: overlapped (64 keys a step), 2: pipelined
template <int KEYS, int STAGES, int MODE, bool QR>
__device__ void attention_forward_wgmma(unsigned short* y16, float* lse, const unsigned short* qkv16, int B, int T,
                                        int Hq, int Hkv, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    Block<KEYS> k(smem + (1024 - shared_address(smem) % 1024) % 1024, qkv16, B, T, Hq, Hkv);
    const float scale2 = scale * LOG2E;
    if constexpr (MODE == 0) simple_steps<KEYS, STAGES, QR>(k, y16, lse, scale, scale2);
    else if constexpr (MODE == 1) overlapped_steps<STAGES>(k, y16, lse, scale, scale2);
    else pipelined_steps<KEYS, STAGES, QR>(k, y16, lse, scale, scale2);
}

// -----------------------------------------------------------------------------
// entry points: grid (units, or fewer: the number of SMs, each block walking units gridDim.x apart), 128 W threads
// (W a divisor of Hq / Hkv, at most 3), dynamic shared memory 3 W 8192 + STAGES 256 KEYS + 1024 bytes

extern "C" __global__ void __launch_bounds__(384)
attention_forward_wgmma_64(unsigned short* y16, float* lse, const unsigned short* qkv16,
                           int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_wgmma<64, 3, 0, false>(y16, lse, qkv16, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(384)
attention_forward_wgmma_overlap_64(unsigned short* y16, float* lse, const unsigned short* qkv16,
                                   int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_wgmma<64, 4, 1, false>(y16, lse, qkv16, B, T, Hq, Hkv, scale);
}

// q from registers (QR): s = q k.T reads only k from shared memory
extern "C" __global__ void __launch_bounds__(384)
attention_forward_wgmma_qr_64(unsigned short* y16, float* lse, const unsigned short* qkv16,
                              int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_wgmma<64, 3, 0, true>(y16, lse, qkv16, B, T, Hq, Hkv, scale);
}

// FlashAttention-3's order at 64 keys a step
extern "C" __global__ void __launch_bounds__(384)
attention_forward_wgmma_pipelined_64(unsigned short* y16, float* lse, const unsigned short* qkv16,
                                     int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_wgmma<64, 4, 2, false>(y16, lse, qkv16, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(384)
attention_forward_wgmma_pipelined_qr_64(unsigned short* y16, float* lse, const unsigned short* qkv16,
                                        int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_wgmma<64, 4, 2, true>(y16, lse, qkv16, B, T, Hq, Hkv, scale);
}

// 128 keys a step
extern "C" __global__ void __launch_bounds__(384)
attention_forward_wgmma_k128_64(unsigned short* y16, float* lse, const unsigned short* qkv16,
                                int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_wgmma<128, 3, 0, false>(y16, lse, qkv16, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(384)
attention_forward_wgmma_k128_qr_64(unsigned short* y16, float* lse, const unsigned short* qkv16,
                                   int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_wgmma<128, 3, 0, true>(y16, lse, qkv16, B, T, Hq, Hkv, scale);
}
