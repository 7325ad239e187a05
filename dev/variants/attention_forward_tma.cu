/*
A FlashAttention-3-style bf16 attention forward at D = 64 (issue 36; its `_pipelined_turns_128` is in the product,
as flash_attn.cu's attention_forward_tma_kernel_64, pared to that one version and the same SASS byte for byte;
the others are here alone): warpgroup MMA fed by TMA through mbarriers, one producer warpgroup
and one consumer warpgroup per query head, no block-wide barrier per step. The same math as flash_attn.cu's
attention_forward_bf16 and attention_forward_wgmma.cu: causal grouped-query attention, scores s = q.k of the
bf16 inputs summed in fp32, an online softmax in base 2 with the scale folded into one fma, p rounded to bf16
on its way into p v, y = o / l rounded to bf16, lse = m scale + log(l) in fp32 for the backward. The same
layouts: qkv16 (B, T, (Hq + 2 Hkv) 64) (q heads, k heads, v heads), y16 (B, T, Hq 64), lse (B, Hq, T).

How the work is split: a unit is 64-row query tiles nq - 1 - p and p (nq = ceil(T / 64)) of W query heads
that read the same kv head (W a divisor of Hq / Hkv: 3 for the big model) of one batch row, as in
attention_forward_wgmma.cu: both tiles together take about the same number of key steps whatever p. A block
is 1 + W warpgroups: warpgroup 0 the producer (setmaxnreg lowers its registers to 32; one thread issues every
copy), warpgroups 1 .. W the consumers, one per query head (setmaxnreg raises theirs to 160). grid = the units
(a block each), or fewer ("persistent": the number of SMs), each block walking units gridDim.x apart. Every
thread of a block walks the same units, tiles and key steps (struct Work), so producer and consumers agree on
which step uses which stage without telling each other.

The copies: TMA (cp.async.bulk.tensor.2d) through two tensor maps over qkv16 seen as a 2D tensor (rows B T,
columns (Hq + 2 Hkv) 64), boxes of 64 columns (a head) by 64 rows (map_q) or BN rows (map_kv), with the 128-byte
swizzle that wgmma reads (row r's 16-byte chunk c at 128 r + 16 (c ^ r % 8)). Rows past a batch row's T are the
next batch row's (or zeros past B T): keys there fall on the diagonal step, past every query row, and are masked;
query rows there are never stored.
  q: two buffers of W tiles (a tile's q heads), each with mbarriers q_full (the producer's expect_tx, the bytes)
     and q_empty (W arrivals: each consumer once its last scores of the tile are done)
  K, V: STAGES stages of BN keys (64 or 128), each with full_k and full_v (so the scores may start before V is
     in) and empty (W arrivals: each consumer once its p v of the step is done)
Step n of a block uses stage n % STAGES in round n / STAGES: consumers wait for full's phase of parity
(n / STAGES) % 2, the producer for empty's of the round before (the first round's counts as complete).

Each key step, in each consumer warpgroup (its 64 query rows of its head):
  s (64 x BN, fp32) = q k.T   4 wgmma m64nBNk16, q and k both from shared memory (K-major, 128-byte rows)
  online softmax on s in the accumulator layout (thread t: rows 16 (t / 32 % 4) + t % 32 / 4 and 8 below it,
                              columns 8 j + 2 (t % 4) + 0, 1); the causal mask on the diagonal step alone (with
                              BN 128 and an even query tile its last 64 keys are all masked: computed, wasted)
  o (64 x 64, fp32) += p v    BN / 16 wgmma m64n64k16, p from registers (s's layout rounded to bf16 in pairs is
                              wgmma's register a fragment), v from shared memory (MN-major)
The entry points (at the bottom):
- attention_forward_tma_64 and _128 (BN): each wgmma waited for at once; the other consumers' wgmma run while
  one does its softmax.
- attention_forward_tma_overlap_64: FlashAttention-3's intra-warpgroup pipelining, as attention_forward_wgmma.cu's
  overlapped version: the next step's scores are issued before this step's softmax, and this step's p v runs
  during the next step's softmax (two score accumulators: 64 keys a step, within 160 registers).
- attention_forward_tma_pipelined_64 and _128: FlashAttention-3's own order (its IntraWGOverlap): the next step's
  scores and this step's p v issued back to back, the next step's softmax done while the p v runs; p is packed
  to bf16 before the scores are issued into the same accumulator, so one score accumulator is enough for 128
  keys a step.
- attention_forward_tma_pipelined_qr_64: the same with q read into registers at a tile's start (s = q k.T by
  RS-wgmma): per 64 keys a warpgroup's wgmma then read 16 KB of shared memory instead of 24, with 3 warpgroups
  and the copies' writes near the 128 bytes a cycle it gives.
- attention_forward_tma_pipelined_turns_128, _turns_64 and _qr_turns_64: the consumers take turns to issue their
  wgmma (FlashAttention-3's warp scheduler barrier, named barriers 1 .. W), so that one's softmax runs while the
  others' wgmma do. On an H100 (dev/LOG.md), _turns_128 persistent took 96.1 us at B 64 T 512 against the
  product's 143.7 (0.67x), 27.7 against 41.7 at B 16.
- attention_forward_tma_pipelined_turns_half_128: the same, an even tile's diagonal step's p v on its first 64 keys
  alone (the other 64 are after all its rows).
- attention_forward_tma_pipelined_turns_poly_128: the same, a quarter of the exponentials computed on the FMA
  units (exp2_fma) instead of MUFU, whose 16 a cycle an SM take as long as the tensor cores a step.
- attention_forward_tma_probe_*: timing probes of what bounds it (wrong results): no softmax; copies alone; no
  wgmma.
ptxas (NVRTC 13, sm_90a): 128 registers at launch (512 threads, one block an SM); the consumers use up to 98 and
139 (simple _64, _128), 147 (overlapped), 103, 154 and 123 (pipelined _64, _128, _qr_64; the same taking turns)
of their 160 (nvdisasm); no spills, no stack frame, no wgmma serialized (test_attention_tma).
Checked against float64 on the CPU emulator (test_attention_tma.py); `python dev/variants/attention_forward_tma.py`
checks and times it on an H100/H200.
*/

#define HD 64                 // head dim (wgmma's K of q k.T, its N of p v)
#define ROWS 64               // query rows of a warpgroup (wgmma's M)
#define TILE_BYTES 8192       // a 64 x 64 bf16 tile
#define PRODUCER_REGS 32      // setmaxnreg: 32 128 + 160 384 = 65536, the SM's registers, for W = 3
#define CONSUMER_REGS 160
#define LOG2E 1.4426950408889634f
#define INFINITY __int_as_float(0x7f800000)

// -----------------------------------------------------------------------------
// helpers (inline PTX; the emulator defines each in C++: tools/emulate_cuda.py, WGMMA_HELPERS and TMA_HELPERS);
// as dev/variants/wgmma_probe.cu has them

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// order the registers' accesses before it against the wgmma after it (the warpgroup runs it together)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// d (64 x N fp32) = a (64 x 16) b (16 x N) + (scale_d ? d : 0), a and b bf16 in shared memory by their
// descriptors, both K-major (A_MN = B_MN = 0) here
template <int N, int A_MN, int B_MN>
__device__ __forceinline__ void wgmma_bf16(float* d, unsigned long long a, unsigned long long b, int scale_d) {
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
              "+f"(d[i + 6]), "+f"(d[i + 7])
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "%32, %33, p, 1, 1, %35, %36;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24)
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
        static_assert(N == 64 || N == 128, "wgmma_bf16: N is 64 or 128 here");
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

// s = q k.T: 4 wgmma of 16 dims, q (64 rows) and k (BN keys) K-major (the 16 dims from kk at byte 32 kk of each
// 128-byte row)
template <int BN>
__device__ __forceinline__ void issue_scores(float* s, unsigned q, unsigned k) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        wgmma_bf16<BN, 0, 0>(s, sw128_descriptor(q + 32 * kk, 16), sw128_descriptor(k + 32 * kk, 16), kk > 0);
    wgmma_commit();
}

// the same with q from registers (QR, 64 keys): qf[kk] this thread's part of q's 16 dims from 16 kk, as wgmma's
// register a; k alone read from shared memory
__device__ __forceinline__ void issue_scores_rs(float* s, const unsigned (*qf)[4], unsigned k) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) wgmma_bf16_rs<64, 0>(s, qf[kk], sw128_descriptor(k + 32 * kk, 16), kk > 0);
    wgmma_commit();
}

// this thread's register a of q from its q tile in shared memory (the 128-byte swizzle): register j of k-step kk
// holds row 16 (t / 32 % 4) + t % 32 / 4 (+ 8 for odd j), dims 16 kk + 2 (t % 4), + 1 (+ 8 for j >= 2)
__device__ __forceinline__ void load_q_fragments(unsigned (*qf)[4], const unsigned char* tile) {
    int t = threadIdx.x % 128, row = 16 * (t / 32) + t % 32 / 4;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = row + 8 * (j % 2), d = 16 * kk + 2 * (t % 4) + 8 * (j / 2);
            qf[kk][j] = *(const unsigned*)(tile + r * 128 + (d / 8 ^ r % 8) * 16 + d % 8 * 2);
        }
}

// s = q k.T with q from shared memory, or (QR, 64 keys only) from registers: a wgmma m64n64k16 with both operands
// in shared memory reads 4 KB in its 32 cycles, all of the 128 bytes a cycle that shared memory gives
template <int BN, bool QR>
__device__ __forceinline__ void scores(float* s, const unsigned (*qf)[4], unsigned q, unsigned k) {
    if constexpr (QR) {
        static_assert(BN == 64, "scores: q from registers at 64 keys a step only");
        issue_scores_rs(s, qf, k);
    } else {
        issue_scores<BN>(s, q, k);
    }
}

// o += p v: BN / 16 wgmma of 16 keys, p[kk] from registers, v N-major (keys 16 kk .. at byte 2048 kk; the 64 dims
// of a key one row, so the leading byte offset, between groups of 64 dims, is never used)
template <int BN>
__device__ __forceinline__ void issue_weighted_sum(float* o, const unsigned (*p)[4], unsigned v) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wgmma_bf16_rs<HD, 1>(o, p[kk], sw128_descriptor(v + 2048 * kk, 8192), 1);
    wgmma_commit();
}

// x[0] = the max of x[0 .. 2 W - 1], as a tree (a template: NVRTC leaves a loop of 4 levels rolled, x in local memory)
template <int W>
__device__ __forceinline__ void tree_max(float* x) {
#pragma unroll
    for (int a = 0; a < W; a++) x[a] = fmaxf(x[a], x[a + W]);
    if constexpr (W > 1) tree_max<W / 2>(x);
}

// 2^x for x <= 0 on the FMA units instead of MUFU.EX2 (FlashAttention-4's trick, for a share of a step's
// exponentials when MUFU's 16 a cycle an SM bound it): n = x rounded to an integer in t's low bits (1.5 2^23 added),
// 2^(x - n) by a cubic on [-0.5, 0.5] (relative error 7.5e-5, below p's bf16 rounding, 2^-9), n added to its
// exponent bits (t's bits << 23 are n << 23 mod 2^32). x is clamped at -126 (-inf, a masked key: 2^-126, nothing
// beside a row's largest p of 1)
__device__ __forceinline__ float exp2_fma(float x) {
    x = fmaxf(x, -126.0f);
    float t = x + 12582912.0f, f = x - (t - 12582912.0f);
    float p = fmaf(fmaf(fmaf(0.05517167f, f, 0.24261112f), f, 0.69326099f), f, 0.99992807f);
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
}

// the online softmax of one step on this thread's scores s (accumulator layout, rows row0 and row0 + 8, BN keys
// from k0): mask keys after the query on the diagonal step, update the running max m and sum l, s <- p =
// exp2(s scale2 - m scale2) in fp32 (POLY: every POLY-th by exp2_fma); -> correction[r], what o's row r is to be
// multiplied by
template <int BN, int POLY = 0>
__device__ __forceinline__ void softmax_step(float* s, float* m, float* l, float* correction, int k0, int row0,
                                             bool diagonal, float scale2) {
    int q = threadIdx.x % 4;
    if (diagonal)
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            if (k0 + 8 * (i / 4) + 2 * q + i % 2 > row0 + 8 * (i / 2 % 2)) s[i] = -INFINITY;
    // a row's BN / 4 scores here (registers 4 a + 2 r, + 1) reduced as a tree and summed 4 ways: short chains, as
    // a warp's softmax waits on its own latency
    constexpr int A = BN / 8;
    float mx[2][A], sum[2][4], ms[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
#pragma unroll
        for (int a = 0; a < A; a++) mx[r][a] = fmaxf(s[4 * a + 2 * r], s[4 * a + 2 * r + 1]);
        tree_max<A / 2>(mx[r]);
        mx[r][0] = quad_max(fmaxf(m[r], mx[r][0]));               // a step's first key is at or before each row
        correction[r] = exp2f((m[r] - mx[r][0]) * scale2);        // rescale what came before
        m[r] = mx[r][0];
        ms[r] = mx[r][0] * scale2;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        if (POLY && i % POLY == POLY - 1) s[i] = exp2_fma(fmaf(s[i], scale2, -ms[i / 2 % 2]));
        else s[i] = exp2f(fmaf(s[i], scale2, -ms[i / 2 % 2]));
        if (i < 8) sum[i / 2 % 2][i / 4 * 2 + i % 2] = s[i];
        else sum[i / 2 % 2][i / 4 % 2 * 2 + i % 2] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; r++) l[r] = l[r] * correction[r] + ((sum[r][0] + sum[r][1]) + (sum[r][2] + sum[r][3]));
}

// p (fp32, accumulator layout) -> bf16 pairs in wgmma's register a layout, 16 keys a k-step: register j of
// k-step kk holds row g (+ 8 for odd j), keys 16 kk + 2 (t % 4), +1 (+ 8 for j >= 2): s[8 kk + 2 j], + 1
template <int BN>
__device__ __forceinline__ void pack_p(unsigned (*p)[4], const float* s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
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
// the work: units of two query tiles, walked the same by every warpgroup

// A unit is query tiles nq - 1 - p and p of W query heads of one batch row (nq = ceil(T / 64) tiles of 64 rows,
// p < ceil(nq / 2); one tile when the two are the same). Unit u: p = u % pairs, the group of W heads x = u / pairs %
// groups, the batch row b = u / pairs / groups. A tile qi takes the key steps j = 0 .. (64 qi + 63) / BN, the last
// one the diagonal. A block walks units blockIdx.x, + gridDim.x, ..., tile by tile and step by step; the cursor
// keeps its tile, so that a step costs no division (u % pairs once a unit).
struct Cursor {
    int u, second, j, qi;                // the unit, its second tile (0 or 1), the key step of the tile, the tile
};

template <int BN>
struct Work {
    int nq, pairs, groups, units;
    __device__ Work(int B, int T, int Hq, int W) {
        nq = (T + ROWS - 1) / ROWS, pairs = (nq + 1) / 2, groups = Hq / W, units = B * groups * pairs;
    }
    __device__ Cursor first() const { return {(int)blockIdx.x, 0, 0, nq - 1 - (int)blockIdx.x % pairs}; }
    __device__ int tile(const Cursor& c) const { return c.qi; }
    __device__ int last(const Cursor& c) const { return (c.qi * ROWS + ROWS - 1) / BN; }   // the diagonal step
    // (BN 128) the diagonal step of an even tile, whose last 64 keys are all after its rows
    __device__ bool half(const Cursor& c) const { return BN == 128 && c.j == last(c) && tile(c) % 2 == 0; }
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

// what the warpgroups share: the tiles (q buffer i of consumer g at (i W + g) 8192 bytes; K/V stage i at kv + 2 BN
// 128 i bytes, v BN 128 bytes after k), the mbarriers, the work, the layouts
template <int BN, int STAGES>
struct Block {
    unsigned char *qs, *kv;
    unsigned long long *full_k, *full_v, *empty, *q_full, *q_empty;
    Work<BN> work;
    int W, T, Hq, Hkv;
    __device__ Block(unsigned char* tiles, int B, int T_, int Hq_, int Hkv_)
        : work(B, T_, Hq_, blockDim.x / 128 - 1) {
        W = blockDim.x / 128 - 1, T = T_, Hq = Hq_, Hkv = Hkv_;
        qs = tiles, kv = tiles + 2 * W * TILE_BYTES;
        full_k = (unsigned long long*)(kv + STAGES * 2 * BN * 128);
        full_v = full_k + STAGES, empty = full_v + STAGES, q_full = empty + STAGES, q_empty = q_full + 2;
    }
    __device__ unsigned q_tile(int i, int g) const { return shared_address(q_bytes(i, g)); }
    __device__ const unsigned char* q_bytes(int i, int g) const { return qs + (i % 2 * W + g) * TILE_BYTES; }
    __device__ unsigned k_tile(int n) const { return shared_address(kv + n % STAGES * 2 * BN * 128); }
    __device__ unsigned v_tile(int n) const { return k_tile(n) + BN * 128; }
    __device__ int batch(int u) const { return u / work.pairs / work.groups; }
    __device__ int head0(int u) const { return u / work.pairs % work.groups * W; }   // the unit's first q head
};

// the producer: one thread issues, step by step, the copies of the block's tiles of q (each tile's W heads at its
// first step) and K/V (into stage n % STAGES once every consumer has freed it)
template <int BN, int STAGES>
__device__ void produce(const Block<BN, STAGES>& k, const TensorMap* map_q, const TensorMap* map_kv) {
    int n = 0, tiles = 0;
    for (Cursor c = k.work.first(); k.work.valid(c); k.work.advance(c), n++) {
        int row = k.batch(c.u) * k.T, h = k.head0(c.u), kvh = h / (k.Hq / k.Hkv);
        if (c.j == 0) {
            int i = tiles % 2;
            mbarrier_wait(&k.q_empty[i], (tiles / 2 + 1) % 2);
            mbarrier_arrive_expect_tx(&k.q_full[i], k.W * TILE_BYTES);
            for (int g = 0; g < k.W; g++)
                tma_load_2d(k.qs + (i * k.W + g) * TILE_BYTES, map_q, (h + g) * HD, row + k.work.tile(c) * ROWS,
                            &k.q_full[i]);
            tiles++;
        }
        int s = n % STAGES;
        mbarrier_wait(&k.empty[s], (n / STAGES + 1) % 2);
        unsigned char* stage = k.kv + s * 2 * BN * 128;
        mbarrier_arrive_expect_tx(&k.full_k[s], BN * 128);
        tma_load_2d(stage, map_kv, (k.Hq + kvh) * HD, row + c.j * BN, &k.full_k[s]);
        mbarrier_arrive_expect_tx(&k.full_v[s], BN * 128);
        tma_load_2d(stage + BN * 128, map_kv, (k.Hq + k.Hkv + kvh) * HD, row + c.j * BN, &k.full_v[s]);
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

// a consumer (warpgroup g = 0 .. W - 1 of the consumers, query head head0 + g), each wgmma waited for at once
template <int BN, int STAGES>
__device__ void consume(const Block<BN, STAGES>& k, int g, unsigned short* y16, float* lse, float scale) {
    const float scale2 = scale * LOG2E;
    int t = threadIdx.x % 128, n = 0, tiles = 0;
    Rows r;
    r.reset();
    float s[BN / 2];
    unsigned p[BN / 16][4];
    for (Cursor c = k.work.first(); k.work.valid(c); k.work.advance(c), n++) {
        int qi = k.work.tile(c), row0 = qi * ROWS + 16 * (t / 32) + t % 32 / 4, i = tiles % 2;
        bool last = c.j == k.work.last(c);
        float correction[2];
        if (c.j == 0) mbarrier_wait(&k.q_full[i], tiles / 2 % 2);
        mbarrier_wait(&k.full_k[n % STAGES], n / STAGES % 2);
        fence_registers<BN / 2>(s);
        issue_scores<BN>(s, k.q_tile(i, g), k.k_tile(n));
        wgmma_wait<0>();
        fence_registers<BN / 2>(s);
        if (last && t == 0) mbarrier_arrive(&k.q_empty[i]);         // the tile's q is read for the last time
        softmax_step<BN>(s, r.m, r.l, correction, c.j * BN, row0, last, scale2);
        pack_p<BN>(p, s);
        scale_o(r.o, correction);
        mbarrier_wait(&k.full_v[n % STAGES], n / STAGES % 2);
        fence_registers<HD / 2>(r.o);
        issue_weighted_sum<BN>(r.o, p, k.v_tile(n));
        wgmma_wait<0>();
        fence_registers<HD / 2>(r.o);
        if (t == 0) mbarrier_arrive(&k.empty[n % STAGES]);          // this warpgroup is done with the stage
        if (last) {
            float inv[2];
            store_lse(lse, r.m, r.l, inv, k.batch(c.u), k.head0(c.u) + g, row0, k.T, k.Hq, scale);
            store_y(y16, r.o, inv, k.batch(c.u), k.head0(c.u) + g, row0, k.T, k.Hq);
            r.reset();
            tiles++;
        }
    }
}

// a tile's rows whose o is still to be stored once its last p v is done (the overlapped version)
struct Pending {
    int u, qi;                           // its unit and query tile; u < 0: none
    float inv[2];                        // 1 / l (lse is stored at once)
};

// one step of the overlapped consumer on the step at c (the n-th of the block; its scores in sc, done), as
// attention_forward_wgmma.cu's overlapped_step: with NEXT (not the block's last step), first issue the next step's
// scores into sn (its q the next tile's at this tile's last step); the softmax; wait for the previous p v (leaving
// the next scores in flight): its stage is free, and the tile before is stored if that was its last; o rescaled (to
// zero at a tile's first step, where m was -inf), p packed, this p v issued; with NEXT wait for the next scores
// (its tile's q is free if that is its last step), leaving this p v in flight through the next step's softmax
// (without, for everything). At a tile's last step its lse is stored, 1 / l goes to `pending`, m and l start
// afresh. The waits are the same whatever the step, so that ptxas can follow the groups in flight (a wait_group
// chosen at run time, or a wgmma under a branch, and it serializes them)
template <int STAGES, bool NEXT>
__device__ __forceinline__ void overlapped_step(const Block<64, STAGES>& k, int g, Cursor& c, int n, int& tiles,
                                                float* sc, float* sn, Rows& r, Pending& pending, unsigned (*p)[4],
                                                unsigned short* y16, float* lse, float scale, float scale2) {
    int t = threadIdx.x % 128, qi = k.work.tile(c), row0 = qi * ROWS + 16 * (t / 32) + t % 32 / 4;
    bool last = c.j == k.work.last(c);
    int next_q = (tiles + last) % 2;                                // the q buffer of the next step's tile
    Cursor nx = c;
    k.work.advance(nx);
    float correction[2];
    if constexpr (NEXT) {
        if (last) mbarrier_wait(&k.q_full[next_q], (tiles + 1) / 2 % 2);
        mbarrier_wait(&k.full_k[(n + 1) % STAGES], (n + 1) / STAGES % 2);
        fence_registers<ROWS / 2>(sn);
        issue_scores<64>(sn, k.q_tile(next_q, g), k.k_tile(n + 1));
        fence_registers<ROWS / 2>(sn);
    }
    softmax_step<64>(sc, r.m, r.l, correction, c.j * 64, row0, last, scale2);
    if constexpr (NEXT) wgmma_wait<1>(); else wgmma_wait<0>();    // the previous p v: o, p and its stage are free
    fence_registers<HD / 2>(r.o);
    if (n > 0 && t == 0) mbarrier_arrive(&k.empty[(n - 1) % STAGES]);
    if (pending.u >= 0) {
        store_y(y16, r.o, pending.inv, k.batch(pending.u), k.head0(pending.u) + g,
                pending.qi * ROWS + 16 * (t / 32) + t % 32 / 4, k.T, k.Hq);
        pending.u = -1;
    }
    pack_p<64>(p, sc);
    scale_o(r.o, correction);
    mbarrier_wait(&k.full_v[n % STAGES], n / STAGES % 2);
    fence_registers<HD / 2>(r.o);
    issue_weighted_sum<64>(r.o, p, k.v_tile(n));
    fence_registers<HD / 2>(r.o);
    if constexpr (NEXT) wgmma_wait<1>(); else wgmma_wait<0>();    // the next scores (or everything)
    if constexpr (NEXT) {
        fence_registers<ROWS / 2>(sn);
        if (nx.j == k.work.last(nx) && t == 0) mbarrier_arrive(&k.q_empty[next_q]);
    }
    if (last) {
        store_lse(lse, r.m, r.l, pending.inv, k.batch(c.u), k.head0(c.u) + g, row0, k.T, k.Hq, scale);
        pending.u = c.u, pending.qi = qi;
        r.m[0] = r.m[1] = -INFINITY, r.l[0] = r.l[1] = 0.0f;
        tiles++;
    }
    c = nx;
}

// the overlapped consumer: the first step's scores, then the steps two at a time (the score buffers swap), the
// last one without NEXT; the last tile's y stored at the end
template <int STAGES>
__device__ void consume_overlapped(const Block<64, STAGES>& k, int g, unsigned short* y16, float* lse,
                                   float scale) {
    const float scale2 = scale * LOG2E;
    int t = threadIdx.x % 128, n = 0, tiles = 0, steps = 0;
    Cursor c = k.work.first();
    for (Cursor x = c; k.work.valid(x); k.work.advance(x)) steps++;
    if (!steps) return;
    Rows r;
    r.reset();
    Pending pending = {-1, 0};
    float s0[ROWS / 2], s1[ROWS / 2];
    unsigned p[4][4];
    mbarrier_wait(&k.q_full[0], 0);
    mbarrier_wait(&k.full_k[0], 0);
    fence_registers<ROWS / 2>(s0);
    issue_scores<64>(s0, k.q_tile(0, g), k.k_tile(0));
    wgmma_wait<0>();
    fence_registers<ROWS / 2>(s0);
    if (c.j == k.work.last(c) && t == 0) mbarrier_arrive(&k.q_empty[0]);
    for (; n + 2 < steps; n += 2) {
        overlapped_step<STAGES, true>(k, g, c, n, tiles, s0, s1, r, pending, p, y16, lse, scale, scale2);
        overlapped_step<STAGES, true>(k, g, c, n + 1, tiles, s1, s0, r, pending, p, y16, lse, scale, scale2);
    }
    if (n + 1 < steps) {
        overlapped_step<STAGES, true>(k, g, c, n, tiles, s0, s1, r, pending, p, y16, lse, scale, scale2);
        overlapped_step<STAGES, false>(k, g, c, n + 1, tiles, s1, s0, r, pending, p, y16, lse, scale, scale2);
    } else {
        overlapped_step<STAGES, false>(k, g, c, n, tiles, s0, s1, r, pending, p, y16, lse, scale, scale2);
    }
    store_y(y16, r.o, pending.inv, k.batch(pending.u), k.head0(pending.u) + g,
            pending.qi * ROWS + 16 * (t / 32) + t % 32 / 4, k.T, k.Hq);
}

// (a timing probe without wgmma) keep p's registers computed, as a p v would read them
template <int KK>
__device__ __forceinline__ void sink(const unsigned (*p)[4]) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int kk = 0; kk < KK; kk++)
        asm volatile("" ::"r"(p[kk][0]), "r"(p[kk][1]), "r"(p[kk][2]), "r"(p[kk][3]));
#endif
}

// one step of the pipelined consumer (FlashAttention-3's order) on the step at c, the n-th of the block, whose p
// (softmax done, o rescaled for it) is in p: with NEXT (not the block's last step), issue the next step's scores
// into s (its q the next tile's at this tile's last step), then this step's p v; wait for the scores, leaving the
// p v in flight, and do the next step's softmax on them; wait for the p v: its stage is free, o is rescaled for the
// next step (or, at a tile's last step, the tile's lse and y stored and o zeroed), and the next p packed. A warpgroup
// keeps one score accumulator (BN / 2 registers), p (BN / 4) and o (32): 128 for BN 128
template <int BN, int STAGES, bool QR, bool SCHED, int PROBE, bool HALF, int POLY, bool NEXT>
__device__ __forceinline__ void pipelined_step(const Block<BN, STAGES>& k, int g, Cursor& c, int n, int& tiles,
                                               float* s, unsigned (*p)[4], unsigned (*qf)[4], Rows& r,
                                               unsigned short* y16, float* lse, float scale, float scale2) {
    int t = threadIdx.x % 128, qi = k.work.tile(c), row0 = qi * ROWS + 16 * (t / 32) + t % 32 / 4;
    bool last = c.j == k.work.last(c);
    int next_q = (tiles + last) % 2;                                // the q buffer of the next step's tile
    Cursor nx = c;
    k.work.advance(nx);
    float correction[2], m[2] = {r.m[0], r.m[1]}, l[2] = {r.l[0], r.l[1]};   // (the tile's, if it ends here)
    if constexpr (SCHED) named_barrier_sync(1 + g, 256);             // this warpgroup's turn to issue
    if constexpr (NEXT) {
        if (last) {
            mbarrier_wait(&k.q_full[next_q], (tiles + 1) / 2 % 2);
            if (QR) load_q_fragments(qf, k.q_bytes(next_q, g));     // (this tile's last scores are done)
        }
        mbarrier_wait(&k.full_k[(n + 1) % STAGES], (n + 1) / STAGES % 2);
        fence_registers<BN / 2>(s);
        if constexpr (PROBE != 3) scores<BN, QR>(s, qf, k.q_tile(next_q, g), k.k_tile(n + 1));
    }
    mbarrier_wait(&k.full_v[n % STAGES], n / STAGES % 2);
    fence_registers<HD / 2>(r.o);
    if (HALF && k.work.half(c)) issue_weighted_sum<64>(r.o, p, k.v_tile(n));
    else if constexpr (PROBE != 3) issue_weighted_sum<BN>(r.o, p, k.v_tile(n));
    else sink<BN / 16>(p);
    fence_registers<HD / 2>(r.o);
    if constexpr (SCHED) named_barrier_arrive(1 + (g + 1) % k.W, 256);  // the next warpgroup's turn
    if constexpr (NEXT) {
        wgmma_wait<1>();                                            // the next scores
        fence_registers<BN / 2>(s);
        bool next_last = nx.j == k.work.last(nx);
        if (next_last && t == 0) mbarrier_arrive(&k.q_empty[next_q]);
        if (last) r.m[0] = r.m[1] = -INFINITY, r.l[0] = r.l[1] = 0.0f;
        if constexpr (PROBE == 1) correction[0] = correction[1] = 1.0f;
        else softmax_step<BN, POLY>(s, r.m, r.l, correction, nx.j * BN,
                                    k.work.tile(nx) * ROWS + 16 * (t / 32) + t % 32 / 4, next_last, scale2);
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
    if constexpr (NEXT) pack_p<BN>(p, s);
    c = nx;
}

// the pipelined consumer: the first step's scores and softmax, then every step but the last with NEXT; QR: q read
// into registers at a tile's start (its q buffer is still freed after the tile's last scores: by then every thread
// of the warpgroup has its fragments, the wgmma having read them). SCHED: the consumers take turns to issue their
// wgmma, FlashAttention-3's warp scheduler barrier: consumer g waits at named barrier 1 + g (256 threads: its own
// and the consumer before it, which arrives once it has issued), so each one's softmax runs while the others'
// wgmma do; consumer 0 is given the first turn
template <int BN, int STAGES, bool QR, bool SCHED, int PROBE, bool HALF, int POLY>
__device__ void consume_pipelined(const Block<BN, STAGES>& k, int g, unsigned short* y16, float* lse,
                                  float scale) {
    const float scale2 = scale * LOG2E;
    int t = threadIdx.x % 128, tiles = 0, steps = 0;
    Cursor c = k.work.first();
    for (Cursor x = c; k.work.valid(x); k.work.advance(x)) steps++;
    if (!steps) return;
    Rows r;
    r.reset();
    float s[BN / 2], correction[2];
    unsigned p[BN / 16][4], qf[HD / 16][4];
    bool last = c.j == k.work.last(c);
    if (SCHED && g == 0) named_barrier_arrive(1, 256);
    mbarrier_wait(&k.q_full[0], 0);
    if (QR) load_q_fragments(qf, k.q_bytes(0, g));
    mbarrier_wait(&k.full_k[0], 0);
    if constexpr (SCHED) named_barrier_sync(1 + g, 256);
    fence_registers<BN / 2>(s);
    if constexpr (PROBE != 3) scores<BN, QR>(s, qf, k.q_tile(0, g), k.k_tile(0));
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        if (PROBE == 3) s[i] = 0.0f;
    if constexpr (SCHED) named_barrier_arrive(1 + (g + 1) % k.W, 256);
    wgmma_wait<0>();
    fence_registers<BN / 2>(s);
    if (last && t == 0) mbarrier_arrive(&k.q_empty[0]);
    if constexpr (PROBE != 1)
        softmax_step<BN, POLY>(s, r.m, r.l, correction, 0, k.work.tile(c) * ROWS + 16 * (t / 32) + t % 32 / 4, last,
                               scale2);
    pack_p<BN>(p, s);
    int n = 0;
    for (; n + 1 < steps; n++)
        pipelined_step<BN, STAGES, QR, SCHED, PROBE, HALF, POLY, true>(k, g, c, n, tiles, s, p, qf, r, y16, lse, scale,
                                                                       scale2);
    pipelined_step<BN, STAGES, QR, SCHED, PROBE, HALF, POLY, false>(k, g, c, n, tiles, s, p, qf, r, y16, lse, scale,
                                                                    scale2);
}

// a probe of the floor the copies and stores set: a consumer that waits for each step's tiles and frees them, and
// stores a tile's y and lse (of nothing computed), without a wgmma or a softmax
template <int BN, int STAGES>
__device__ void consume_copies(const Block<BN, STAGES>& k, int g, unsigned short* y16, float* lse, float scale) {
    int t = threadIdx.x % 128, n = 0, tiles = 0;
    Rows r;
    r.reset();
    r.m[0] = r.m[1] = 0.0f, r.l[0] = r.l[1] = 1.0f;
    for (Cursor c = k.work.first(); k.work.valid(c); k.work.advance(c), n++) {
        int qi = k.work.tile(c), row0 = qi * ROWS + 16 * (t / 32) + t % 32 / 4, i = tiles % 2;
        bool last = c.j == k.work.last(c);
        if (c.j == 0) mbarrier_wait(&k.q_full[i], tiles / 2 % 2);
        mbarrier_wait(&k.full_k[n % STAGES], n / STAGES % 2);
        mbarrier_wait(&k.full_v[n % STAGES], n / STAGES % 2);
        named_barrier_sync(1 + g, 128);                             // every thread of the warpgroup is past both
        if (t == 0) mbarrier_arrive(&k.empty[n % STAGES]);
        if (last && t == 0) mbarrier_arrive(&k.q_empty[i]);
        if (last) {
            float inv[2];
            store_lse(lse, r.m, r.l, inv, k.batch(c.u), k.head0(c.u) + g, row0, k.T, k.Hq, scale);
            store_y(y16, r.o, inv, k.batch(c.u), k.head0(c.u) + g, row0, k.T, k.Hq);
            tiles++;
        }
    }
}

// -----------------------------------------------------------------------------
// the kernel (the header says how the work is split)

// CONSUMER: 0 simple, 1 overlapped, 2 pipelined; QR (pipelined): q in registers; SCHED (pipelined): the consumers
// take turns to issue; PROBE (timing only, wrong results): 1 the pipelined consumer without its softmax, 2 the
// copies and stores alone, 3 without its wgmma; HALF (pipelined, BN 128): an even tile's diagonal step's p v on its
// first 64 keys alone (4 k-steps of wgmma, not 8), the other 64 being all after its rows (their p 0). Its scores and
// softmax stay 128 wide: a branch between two widths of either keeps more registers live than the 160 of a
// consumer, and ptxas serializes the wgmma (C7511); POLY (pipelined): every POLY-th exponential on the FMA units
template <int BN, int STAGES, int CONSUMER, bool QR = false, bool SCHED = false, int PROBE = 0, bool HALF = false,
          int POLY = 0>
__device__ void attention_forward_tma(unsigned short* y16, float* lse, const TensorMap* map_q,
                                      const TensorMap* map_kv, int B, int T, int Hq, int Hkv, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    Block<BN, STAGES> k(smem + (1024 - shared_address(smem) % 1024) % 1024, B, T, Hq, Hkv);
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
    if constexpr (CONSUMER == 1) consume_overlapped(k, wg - 1, y16, lse, scale);
    else if constexpr (PROBE == 2) consume_copies(k, wg - 1, y16, lse, scale);
    else if constexpr (CONSUMER == 2)
        consume_pipelined<BN, STAGES, QR, SCHED, PROBE, HALF, POLY>(k, wg - 1, y16, lse, scale);
    else consume(k, wg - 1, y16, lse, scale);
}

// -----------------------------------------------------------------------------
// entry points: grid (units, or fewer: the number of SMs, each block walking units gridDim.x apart), 128 (W + 1)
// threads (W a divisor of Hq / Hkv, at most 3), dynamic shared memory 2 W 8192 + STAGES 256 BN + 1024 (to align the
// tiles) + 8 (3 STAGES + 4) (the mbarriers) bytes; map_q: qkv16's tensor map with boxes of 64 x 64, map_kv: 64 x BN

extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_64(unsigned short* y16, float* lse,
                                                                            const __grid_constant__ TensorMap map_q,
                                                                            const __grid_constant__ TensorMap map_kv,
                                                                            int B, int T, int Hq, int Hkv,
                                                                            float scale) {
    attention_forward_tma<64, 6, 0>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_128(unsigned short* y16, float* lse,
                                                                             const __grid_constant__ TensorMap map_q,
                                                                             const __grid_constant__ TensorMap map_kv,
                                                                             int B, int T, int Hq, int Hkv,
                                                                             float scale) {
    attention_forward_tma<128, 4, 0>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the overlapped consumer (64 keys a step: two score accumulators)
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_overlap_64(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<64, 6, 1>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the pipelined consumer (FlashAttention-3's order: one score accumulator), 64 or 128 keys a step
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_64(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<64, 6, 2>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_128(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<128, 4, 2>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the pipelined consumer with q in registers (s = q k.T reads only k from shared memory), 64 keys a step
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_qr_64(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<64, 6, 2, true>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the pipelined consumers taking turns to issue their wgmma (FlashAttention-3's warp scheduler barrier): 128 keys a
// step, and 64 with q in registers
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_turns_128(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<128, 4, 2, false, true>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_qr_turns_64(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<64, 6, 2, true, true>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the same at 64 keys with q in shared memory
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_turns_64(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<64, 6, 2, false, true>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// probes of what bounds the fastest version (timing only: their y and lse are wrong): without the softmax (p = the
// scores as they are), the copies and stores alone, and without the wgmma (the softmax on the last step's p)
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_probe_no_softmax_128(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<128, 4, 2, false, true, 1>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_probe_copies_128(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<128, 4, 2, false, false, 2>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_probe_no_wgmma_128(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<128, 4, 2, false, true, 3>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the pipelined consumers taking turns at 128 keys, an even tile's diagonal step on its first 64 keys alone
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_turns_half_128(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<128, 4, 2, false, true, 0, true>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}

// the pipelined consumers taking turns at 128 keys, a quarter of the exponentials on the FMA units
extern "C" __global__ void __launch_bounds__(512, 1) attention_forward_tma_pipelined_turns_poly_128(
    unsigned short* y16, float* lse, const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_kv,
    int B, int T, int Hq, int Hkv, float scale) {
    attention_forward_tma<128, 4, 2, false, true, 0, false, 4>(y16, lse, &map_q, &map_kv, B, T, Hq, Hkv, scale);
}
