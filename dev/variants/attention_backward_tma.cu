/*
The dk/dv pass of the bf16 attention backward at D = 64 with warpgroup MMA fed by TMA (issue 36; this file is not
part of the product: nanoeuler_cuda.MODULES does not list it; its `_turns_64`, run persistent, is, as flash_attn.cu's
attention_backward_dkv_tma_kernel_64, lse and delta read through one-row maps), in the design of
attention_forward_tma.cu: one producer
warpgroup whose one thread issues every copy, W consumer warpgroups, mbarriers between them, no block-wide
barrier a step. The same math and layouts as flash_attn.cu's attention_backward_dkv_bf16, so that its dq pass
(attention_backward_dq_bf16_kernel_64) runs on what this one stores:
  keys are the rows: st = k q.T, pt = exp(scale st - lse) (0 for a query before the key or past T),
  dpt = v dy.T, dst = pt (dpt - delta); dv = sum pt dy, dk = scale sum dst q over the G query heads that read
  the kv head and every query tile from the keys' own on; dst rounded to bf16 and stored for the dq pass in the
  product's order (flash_attn.cu's ds_tile, each 64 x 64 tile in mma.sync's C order, which is wgmma's too).
Layouts: qkv16 (B, T, (Hq + 2 Hkv) 64), dy16 (B, T, Hq 64), lse and delta (B, Hq, T) fp32; dk and dv written
into dqkv16 (B, T, (Hq + 2 Hkv) 64) at the k and v heads' columns (dk before rope_backward rotates it).

How the work is split: a unit is W key tiles of 64 keys (W = 2: keys 128 x .. 128 x + 127) of one kv head of one
batch row, the units with the first key tiles (most queries) first (struct Unit). grid = the units (a block each),
or fewer ("persistent": the number of SMs), each block walking units gridDim.x apart. Warpgroup 0 is the producer
(setmaxnreg 24), warpgroups 1 .. W the consumers (setmaxnreg 240), consumer g owning key tile W x + g. Every thread
walks the same units and steps: step j of a unit is query head kvh G + j / m and query tile W x + j % m (m = nq -
W x query tiles from the unit's first key tile on); a consumer whose key tile is after the step's query tile
computes it all masked (p = 0: nothing added) and stores no ds, so that no wgmma is under a branch.
  K, V: the unit's W key tiles of each (kv_full; kv_empty: W arrivals, each consumer at the unit's end)
  q, dy, lse, delta: STAGES stages, each a 64-row tile of q and of dy (the 128-byte swizzle that wgmma reads,
     K-major for st and dpt, MN-major for dk and dv) and 64 floats of lse and of delta, with mbarriers full (the
     producer's expect_tx) and empty (W arrivals, each consumer once its dk and dv products of the step are done)
Each step, in each consumer (its 64 keys):
  st, dpt (64 x 64 fp32)  4 + 4 wgmma m64n64k16, k or v and q or dy from shared memory (32 + 32 registers)
  pt, dst                  in the accumulator layout (thread t: keys 16 (t / 32 % 4) + t % 32 / 4 and 8 below, queries
                           8 j + 2 (t % 4) + 0, 1), lse and delta of those queries read from the stage
  dv += pt dy, dk += dst q 4 + 4 wgmma m64n64k16, pt and dst from registers (rounded to bf16 in pairs: wgmma's register
                           a), dy and q MN-major
dk and dv (32 + 32 registers) stay in registers to the end. The dq pass (attention_backward_dq_tma_64, at the
bottom) reads those ds tiles: dq = scale ds k, W query heads of a GQA group a block sharing each key tile, in the
same design. ptxas (NVRTC 13, sm_90a): no spills, no wgmma serialized (test_attention_backward_tma); FA3's order
in the dk/dv pass (the next step's st and dpt issued before this step's gradients: two of each, 64 registers
more) needed more than the consumers' 240 registers (ptxas serialized its wgmma, C7512): not built.
`python dev/variants/attention_backward_tma.py` checks both passes against float64 and times them beside the
product's on an H100/H200.
*/

#define HD 64                 // head dim
#define ROWS 64               // keys of a consumer, queries of a step (wgmma's M and N)
#define TILE_BYTES 8192       // a 64 x 64 bf16 tile
#define PRODUCER_REGS 24      // setmaxnreg: 24 128 + 240 256 = 64512 of the SM's 65536, for W = 2
#define CONSUMER_REGS 240
#define LOG2E 1.4426950408889634f

// -----------------------------------------------------------------------------
// helpers (inline PTX; the emulator defines each in C++: tools/emulate_cuda.py, WGMMA_HELPERS and TMA_HELPERS);
// as attention_forward_tma.cu has them

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// order the registers' accesses before it against the wgmma after it (the warpgroup runs it together)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// d (64 x 64 fp32) = a (64 x 16) b (16 x 64) + (scale_d ? d : 0), a and b bf16 in shared memory by their
// descriptors; A_MN, B_MN: a M-major, b N-major (else K-major)
template <int N, int A_MN, int B_MN>
__device__ __forceinline__ void wgmma_bf16(float* d, unsigned long long a, unsigned long long b, int scale_d) {
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
              "+f"(d[i + 6]), "+f"(d[i + 7])
    static_assert(N == 64, "wgmma_bf16: N is 64 here");
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

// four 8 x 8 bf16 matrices from shared memory, transposed, into r[0..3] as mma.sync's fragments: lane l gives the
// address of row l % 8 of matrix l / 8
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const unsigned short* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
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

// a shared-memory matrix descriptor of a 128-byte-swizzled operand: bits 0-13 the start address >> 4, 16-29
// the leading byte offset >> 4, 32-45 the stride byte offset >> 4 (8 rows of 128 bytes: 1024), 62-63 1
__device__ __forceinline__ unsigned long long sw128_descriptor(unsigned address, unsigned lbo) {
    return (address & 0x3FFFF) >> 4 | (unsigned long long)(lbo >> 4 & 0x3FFF) << 16 |
           (unsigned long long)(1024 >> 4) << 32 | 1ull << 62;
}

// d = a b.T (64 x 64): 4 wgmma of 16 dims, a (64 rows) and b (64 rows) K-major (the 16 dims from kk at byte 32 kk
// of each 128-byte row): st = k q.T, dpt = v dy.T
__device__ __forceinline__ void issue_products_t(float* d, unsigned a, unsigned b) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        wgmma_bf16<64, 0, 0>(d, sw128_descriptor(a + 32 * kk, 16), sw128_descriptor(b + 32 * kk, 16), kk > 0);
}

// the same with a from registers (af[kk]: this thread's part of a's 16 dims from 16 kk, as wgmma's register a)
__device__ __forceinline__ void issue_products_t_rs(float* d, const unsigned (*af)[4], unsigned b) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) wgmma_bf16_rs<64, 0>(d, af[kk], sw128_descriptor(b + 32 * kk, 16), kk > 0);
}

// this thread's register a of a 64 x 64 tile in shared memory (the 128-byte swizzle): register j of k-step kk
// holds row 16 (t / 32 % 4) + t % 32 / 4 (+ 8 for odd j), dims 16 kk + 2 (t % 4), + 1 (+ 8 for j >= 2)
__device__ __forceinline__ void load_fragments(unsigned (*af)[4], const unsigned char* tile) {
    int t = threadIdx.x % 128, row = 16 * (t / 32) + t % 32 / 4;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = row + 8 * (j % 2), d = 16 * kk + 2 * (t % 4) + 8 * (j / 2);
            af[kk][j] = *(const unsigned*)(tile + r * 128 + (d / 8 ^ r % 8) * 16 + d % 8 * 2);
        }
}

// d += a b: 4 wgmma of 16 queries, a[kk] from registers, b (64 query rows of 64 dims) N-major (queries 16 kk .. at
// byte 2048 kk): dv += pt dy, dk += dst q
__device__ __forceinline__ void issue_products(float* d, const unsigned (*a)[4], unsigned b) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; kk++) wgmma_bf16_rs<HD, 1>(d, a[kk], sw128_descriptor(b + 2048 * kk, 8192), 1);
}

// x (fp32, accumulator layout) -> bf16 pairs in wgmma's register a layout, 16 queries a k-step: register j of
// k-step kk holds row g (+ 8 for odd j), queries 16 kk + 2 (t % 4), +1 (+ 8 for j >= 2): x[8 kk + 2 j], + 1
__device__ __forceinline__ void pack_a(unsigned (*a)[4], const float* x) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) a[kk][j] = pack_bf16(x[8 * kk + 2 * j], x[8 * kk + 2 * j + 1]);
}

// flash_attn.cu's ds_tile: where the 64 x 64 ds tile of query tile qi and key tile kj of (b, h) starts
__device__ __forceinline__ long ds_tile(int b, int h, int Hq, int T, int qi, int kj) {
    int tiles = (T - 1) / ROWS + 1;
    return (((long)b * Hq + h) * (tiles * (tiles + 1) / 2) + qi * (qi + 1) / 2 + kj) * ROWS * ROWS;
}

// rows row0 and row0 + 8 of x (accumulator layout) times f, rounded to bf16, into a row-major bf16 matrix (row
// stride ld) from out; rows past T skipped
__device__ __forceinline__ void store_rows(unsigned short* out, long ld, const float* x, float f, int row0, int T) {
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

// -----------------------------------------------------------------------------
// the kernel (the header says how the work is split)

// A unit is W key tiles of 64 keys (keys 64 W x .. 64 W x + 64 W - 1) of one kv head of one batch row, the units
// ordered by x first, so that the heaviest (the first key tiles: the most queries) come first: unit u has x = u /
// (B Hkv), kv head u % (B Hkv) % Hkv, batch row u % (B Hkv) / Hkv. Its steps: n = 0 .. G m - 1 (m = nq - W x),
// step n is query head kvh G + n / m and query tile W x + n % m. A block walks units blockIdx.x, + gridDim.x, ...
// (grid: the units, a block each; or the SMs, persistent), and its steps are counted over all its units, so the
// stages' ring and their parities run on from one unit to the next.
struct Unit {
    int x, kvh, b, m, steps;
};

// what the warpgroups share: the unit's key tiles (K of consumer g at g 8192 bytes, V at (W + g) 8192), the stages
// (stage s: q at 2 W 8192 + 2 s 8192, dy 8192 after it; lse and delta, 256 bytes each, after every tile), the
// mbarriers (kv_full, kv_empty: the key tiles of the block's i-th unit, phase i), the work
template <int STAGES>
struct Block {
    unsigned char* tiles;
    float* stats;                                   // lse of stage s at 128 s, delta at 128 s + 64
    unsigned long long *full, *empty, *kv_full, *kv_empty;
    int W, B, T, Hq, Hkv, G, nq, units;
    __device__ Block(unsigned char* tiles_, int B_, int T_, int Hq_, int Hkv_) : tiles(tiles_) {
        W = blockDim.x / 128 - 1, B = B_, T = T_, Hq = Hq_, Hkv = Hkv_, G = Hq / Hkv;
        nq = (T + ROWS - 1) / ROWS, units = (nq + W - 1) / W * B * Hkv;
        stats = (float*)(tiles + (2 * W + 2 * STAGES) * TILE_BYTES);
        full = (unsigned long long*)(stats + 128 * STAGES);
        empty = full + STAGES, kv_full = empty + STAGES, kv_empty = kv_full + 1;
    }
    __device__ Unit unit(int u) const {
        int x = u / (B * Hkv), m = nq - W * x;
        return {x, u % (B * Hkv) % Hkv, u % (B * Hkv) / Hkv, m, G * m};
    }
    __device__ unsigned char* k_bytes(int g) const { return tiles + g * TILE_BYTES; }
    __device__ unsigned char* v_bytes(int g) const { return tiles + (W + g) * TILE_BYTES; }
    __device__ unsigned char* q_bytes(int n) const { return tiles + (2 * W + 2 * (n % STAGES)) * TILE_BYTES; }
    __device__ unsigned char* dy_bytes(int n) const { return q_bytes(n) + TILE_BYTES; }
    __device__ float* lse_s(int n) const { return stats + 128 * (n % STAGES); }
    __device__ float* delta_s(int n) const { return stats + 128 * (n % STAGES) + 64; }
};

// the producer: one thread issues, unit by unit, its K and V tiles (once every consumer is done with the unit
// before), then step by step the stage's q, dy, lse and delta (into stage n % STAGES once every consumer has
// freed it; n counts the block's steps)
template <int STAGES>
__device__ void produce(const Block<STAGES>& k, const TensorMap* map_qkv, const TensorMap* map_dy,
                        const TensorMap* map_lse, const TensorMap* map_delta) {
    int n = 0, i = 0;
    for (int u = blockIdx.x; u < k.units; u += gridDim.x, i++) {
        Unit w = k.unit(u);
        int row = w.b * k.T;
        mbarrier_wait(k.kv_empty, (i + 1) % 2);
        mbarrier_arrive_expect_tx(k.kv_full, 2 * k.W * TILE_BYTES);
        for (int g = 0; g < k.W; g++) {
            int r = row + (k.W * w.x + g) * ROWS;
            tma_load_2d(k.k_bytes(g), map_qkv, (k.Hq + w.kvh) * HD, r, k.kv_full);
            tma_load_2d(k.v_bytes(g), map_qkv, (k.Hq + k.Hkv + w.kvh) * HD, r, k.kv_full);
        }
        for (int j = 0; j < w.steps; j++, n++) {
            int s = n % STAGES, h = w.kvh * k.G + j / w.m, q0 = (k.W * w.x + j % w.m) * ROWS;
            mbarrier_wait(&k.empty[s], (n / STAGES + 1) % 2);
            mbarrier_arrive_expect_tx(&k.full[s], 2 * TILE_BYTES + 2 * ROWS * 4);
            tma_load_2d(k.q_bytes(n), map_qkv, h * HD, row + q0, &k.full[s]);
            tma_load_2d(k.dy_bytes(n), map_dy, h * HD, row + q0, &k.full[s]);
            tma_load_2d(k.lse_s(n), map_lse, q0, w.b * k.Hq + h, &k.full[s]);
            tma_load_2d(k.delta_s(n), map_delta, q0, w.b * k.Hq + h, &k.full[s]);
        }
    }
}

// a consumer (warpgroup g of the consumers, key tile W x + g of each unit): every step's products waited for at once.
// KVR: k and v from registers in st = k q.T and dpt = v dy.T (read from their tiles at a unit's start: 32 registers
// more), so that those wgmma read only q and dy from shared memory. SCHED: the consumers take turns to issue
// (FlashAttention-3's warp scheduler barrier, named barriers 1 .. W, as attention_forward_tma.cu's): each issues its
// st and dpt, then its dk and dv products, in its turn, so that one's gradients run while the other's wgmma do
template <int STAGES, bool KVR, bool SCHED>
__device__ void consume(const Block<STAGES>& k, int g, unsigned short* dqkv16, unsigned short* ds16, float scale) {
    const float scale2 = scale * LOG2E;
    int t = threadIdx.x % 128, q = t % 4, n = 0, i = 0;
    unsigned ka = shared_address(k.k_bytes(g)), va = shared_address(k.v_bytes(g));
    float dk[HD / 2], dv[HD / 2], st[ROWS / 2], dpt[ROWS / 2];
    unsigned pa[ROWS / 16][4], da[ROWS / 16][4], kf[HD / 16][4], vf[HD / 16][4];
    long stride = (long)(k.Hq + 2 * k.Hkv) * HD;
    if (SCHED && g == 0) named_barrier_arrive(1, 256);             // the first turn is consumer 0's
    for (int u = blockIdx.x; u < k.units; u += gridDim.x, i++) {
        Unit w = k.unit(u);
        int kt = k.W * w.x + g, row0 = kt * ROWS + 16 * (t / 32) + t % 32 / 4;
#pragma unroll
        for (int a = 0; a < HD / 2; a++) dk[a] = dv[a] = 0.0f;
        mbarrier_wait(k.kv_full, i % 2);
        if (KVR) {
            load_fragments(kf, k.k_bytes(g));
            load_fragments(vf, k.v_bytes(g));
            if (t == 0) mbarrier_arrive(k.kv_empty);     // the unit's key tiles are read for the last time
        }
        for (int j = 0; j < w.steps; j++, n++) {
            int s = n % STAGES, h = w.kvh * k.G + j / w.m, qt = k.W * w.x + j % w.m, q0 = qt * ROWS;
            mbarrier_wait(&k.full[s], n / STAGES % 2);
            unsigned qa = shared_address(k.q_bytes(n)), dya = shared_address(k.dy_bytes(n));
            fence_registers<ROWS / 2>(st);
            fence_registers<ROWS / 2>(dpt);
            if constexpr (SCHED) named_barrier_sync(1 + g, 256);    // this consumer's turn to issue
            wgmma_fence();
            if constexpr (KVR) {
                issue_products_t_rs(st, kf, qa);
                issue_products_t_rs(dpt, vf, dya);
            } else {
                issue_products_t(st, ka, qa);
                issue_products_t(dpt, va, dya);
            }
            wgmma_commit();
            if constexpr (SCHED) named_barrier_arrive(1 + (g + 1) % k.W, 256);     // the next consumer's turn
            wgmma_wait<0>();
            fence_registers<ROWS / 2>(st);
            fence_registers<ROWS / 2>(dpt);
            // pt and dst in place of st and dpt; keys after a query, or queries past T, are masked (p = 0)
            const float *lse = k.lse_s(n), *delta = k.delta_s(n);
            bool edge = q0 < kt * ROWS + ROWS || q0 + ROWS > k.T;
#pragma unroll
            for (int a = 0; a < ROWS / 2; a++) {
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
                for (int kk = 0; kk < ROWS / 16; kk++)
#pragma unroll
                    for (int b = 0; b < 4; b++) ds[32 * (4 * kk + b)] = da[kk][b];      // flash_attn.cu's order
            }
            fence_registers<HD / 2>(dv);
            fence_registers<HD / 2>(dk);
            if constexpr (SCHED) named_barrier_sync(1 + g, 256);
            wgmma_fence();
            issue_products(dv, pa, dya);
            issue_products(dk, da, qa);
            wgmma_commit();
            if constexpr (SCHED) named_barrier_arrive(1 + (g + 1) % k.W, 256);
            wgmma_wait<0>();
            fence_registers<HD / 2>(dv);
            fence_registers<HD / 2>(dk);
            if (t == 0) mbarrier_arrive(&k.empty[s]);    // this warpgroup is done with the stage
        }
        if (!KVR && t == 0) mbarrier_arrive(k.kv_empty); // and with the unit's key tiles
        unsigned short* out = dqkv16 + (long)w.b * k.T * stride;
        store_rows(out + (k.Hq + w.kvh) * HD, stride, dk, scale, row0, k.T);        // rope_backward rotates dk
        store_rows(out + (k.Hq + k.Hkv + w.kvh) * HD, stride, dv, 1.0f, row0, k.T);
    }
}

template <int STAGES, bool KVR, bool SCHED>
__device__ void attention_backward_dkv_tma(unsigned short* dqkv16, unsigned short* ds16, const TensorMap* map_qkv,
                                           const TensorMap* map_dy, const TensorMap* map_lse,
                                           const TensorMap* map_delta, int B, int T, int Hq, int Hkv, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    Block<STAGES> k(smem + (1024 - shared_address(smem) % 1024) % 1024, B, T, Hq, Hkv);
    int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbarrier_init(&k.full[s], 1), mbarrier_init(&k.empty[s], k.W);
        mbarrier_init(k.kv_full, 1), mbarrier_init(k.kv_empty, k.W);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) produce(k, map_qkv, map_dy, map_lse, map_delta);
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
    consume<STAGES, KVR, SCHED>(k, wg - 1, dqkv16, ds16, scale);
}

// -----------------------------------------------------------------------------
// the dq pass: dq = scale ds k over the key tiles up to the diagonal, with ds as the dk/dv pass stores it

// A unit of the dq pass is query tile qi of W query heads of one GQA group (x) of one batch row, the last query
// tiles (most key tiles) first: unit u has qi = nq - 1 - u / (B groups), x = u % (B groups) % groups, b = u % (B
// groups) / groups; its steps are the key tiles kj = 0 .. qi. Per step the producer copies the key tile (MN-major:
// wgmma's b) and the W heads' ds tiles (8 KB each, as stored) into a stage; consumer g (head x W + g, its 64 query
// rows) reads its ds tile transposed by ldmatrix into wgmma's register a (as flash_attn.cu's dq pass does into
// mma.sync's), and dq += ds k by 4 wgmma m64n64k16 of 16 keys.
struct QUnit {
    int qi, x, b;
};

// stage s: the key tile at (1 + W) 8192 s, then the W ds tiles; full (the producer's expect_tx), empty (W
// arrivals)
template <int STAGES>
struct QBlock {
    unsigned char* tiles;
    unsigned long long *full, *empty;
    int W, B, T, Hq, Hkv, groups, nq, units;
    __device__ QBlock(unsigned char* tiles_, int B_, int T_, int Hq_, int Hkv_) : tiles(tiles_) {
        W = blockDim.x / 128 - 1, B = B_, T = T_, Hq = Hq_, Hkv = Hkv_, groups = Hq / W;
        nq = (T + ROWS - 1) / ROWS, units = nq * B * groups;
        full = (unsigned long long*)(tiles + STAGES * (1 + W) * TILE_BYTES);
        empty = full + STAGES;
    }
    __device__ QUnit unit(int u) const {
        int r = u % (B * groups);
        return {nq - 1 - u / (B * groups), r % groups, r / groups};
    }
    __device__ unsigned char* k_bytes(int n) const { return tiles + n % STAGES * (1 + W) * TILE_BYTES; }
    __device__ unsigned char* ds_bytes(int n, int g) const { return k_bytes(n) + (1 + g) * TILE_BYTES; }
};

template <int STAGES>
__device__ void produce_dq(const QBlock<STAGES>& k, const TensorMap* map_qkv, const TensorMap* map_ds) {
    int n = 0;
    for (int u = blockIdx.x; u < k.units; u += gridDim.x) {
        QUnit w = k.unit(u);
        int kvh = w.x * k.W / (k.Hq / k.Hkv);
        for (int kj = 0; kj <= w.qi; kj++, n++) {
            int s = n % STAGES;
            mbarrier_wait(&k.empty[s], (n / STAGES + 1) % 2);
            mbarrier_arrive_expect_tx(&k.full[s], (1 + k.W) * TILE_BYTES);
            tma_load_2d(k.k_bytes(n), map_qkv, (k.Hq + kvh) * HD, w.b * k.T + kj * ROWS, &k.full[s]);
            for (int g = 0; g < k.W; g++)
                tma_load_2d(k.ds_bytes(n, g), map_ds, 0, (int)(ds_tile(w.b, w.x * k.W + g, k.Hq, k.T, w.qi, kj) / 64),
                            &k.full[s]);
        }
    }
}

template <int STAGES>
__device__ void consume_dq(const QBlock<STAGES>& k, int g, unsigned short* dqkv16, float scale) {
    int t = threadIdx.x % 128, lane = t % 32, warp = t / 32, n = 0;
    int m = lane >> 3, r = 2 * (2 * warp + (m & 1)) + (m >> 1);   // this lane's row of the ldmatrix (the product's)
    long stride = (long)(k.Hq + 2 * k.Hkv) * HD;
    float dq[HD / 2];
    unsigned a[ROWS / 16][4];
    for (int u = blockIdx.x; u < k.units; u += gridDim.x) {
        QUnit w = k.unit(u);
#pragma unroll
        for (int i = 0; i < HD / 2; i++) dq[i] = 0.0f;
        for (int kj = 0; kj <= w.qi; kj++, n++) {
            int s = n % STAGES;
            mbarrier_wait(&k.full[s], n / STAGES % 2);
            // a (16 queries x 16 keys of k-step kk) = the ds tile's keys 16 kk.. x queries 16 warp.., transposed
            const unsigned short* dss = (const unsigned short*)k.ds_bytes(n, g);
#pragma unroll
            for (int kk = 0; kk < ROWS / 16; kk++) ldmatrix_x4_trans(a[kk], dss + 1024 * kk + 64 * r + 8 * (lane & 7));
            fence_registers<HD / 2>(dq);
            wgmma_fence();
            issue_products(dq, a, shared_address(k.k_bytes(n)));
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers<HD / 2>(dq);
            if (t == 0) mbarrier_arrive(&k.empty[s]);
        }
        int row0 = w.qi * ROWS + 16 * warp + lane / 4;
        store_rows(dqkv16 + (long)w.b * k.T * stride + (w.x * k.W + g) * HD, stride, dq, scale, row0, k.T);
    }
}

template <int STAGES>
__device__ void attention_backward_dq_tma(unsigned short* dqkv16, const TensorMap* map_qkv, const TensorMap* map_ds,
                                          int B, int T, int Hq, int Hkv, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    QBlock<STAGES> k(smem + (1024 - shared_address(smem) % 1024) % 1024, B, T, Hq, Hkv);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbarrier_init(&k.full[s], 1), mbarrier_init(&k.empty[s], k.W);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x / 128 == 0) {
        if (threadIdx.x == 0) produce_dq(k, map_qkv, map_ds);
        return;
    }
    consume_dq(k, threadIdx.x / 128 - 1, dqkv16, scale);
}

// -----------------------------------------------------------------------------
// entry points: grid (the units, ceil(nk / W) B Hkv, or fewer: the number of SMs), 128 (W + 1) threads (W = 2),
// dynamic shared memory (2 W + 2 STAGES) 8192 + 512 STAGES (lse and delta) + 16 STAGES + 16 (the mbarriers) + 1024
// (to align the tiles) bytes; map_qkv: qkv16's tensor map, map_dy: dy16's, boxes of 64 x 64 with the 128-byte
// swizzle; map_lse, map_delta: lse's and delta's as (B Hq, T) fp32, boxes of 64 x 1

extern "C" __global__ void __launch_bounds__(384, 1)
attention_backward_dkv_tma_64(unsigned short* dqkv16, unsigned short* ds16, const __grid_constant__ TensorMap map_qkv,
                              const __grid_constant__ TensorMap map_dy, const __grid_constant__ TensorMap map_lse,
                              const __grid_constant__ TensorMap map_delta, int B, int T, int Hq, int Hkv,
                              float scale) {
    attention_backward_dkv_tma<4, false, false>(dqkv16, ds16, &map_qkv, &map_dy, &map_lse, &map_delta, B, T, Hq, Hkv,
                                         scale);
}

// k and v from registers
extern "C" __global__ void __launch_bounds__(384, 1)
attention_backward_dkv_tma_kvr_64(unsigned short* dqkv16, unsigned short* ds16,
                                  const __grid_constant__ TensorMap map_qkv, const __grid_constant__ TensorMap map_dy,
                                  const __grid_constant__ TensorMap map_lse,
                                  const __grid_constant__ TensorMap map_delta, int B, int T, int Hq, int Hkv,
                                  float scale) {
    attention_backward_dkv_tma<4, true, false>(dqkv16, ds16, &map_qkv, &map_dy, &map_lse, &map_delta, B, T, Hq, Hkv,
                                        scale);
}

// the consumers taking turns to issue, k and v from shared memory or registers
extern "C" __global__ void __launch_bounds__(384, 1)
attention_backward_dkv_tma_turns_64(unsigned short* dqkv16, unsigned short* ds16,
                                    const __grid_constant__ TensorMap map_qkv, const __grid_constant__ TensorMap map_dy,
                                    const __grid_constant__ TensorMap map_lse,
                                    const __grid_constant__ TensorMap map_delta, int B, int T, int Hq, int Hkv,
                                    float scale) {
    attention_backward_dkv_tma<4, false, true>(dqkv16, ds16, &map_qkv, &map_dy, &map_lse, &map_delta, B, T, Hq, Hkv,
                                               scale);
}

extern "C" __global__ void __launch_bounds__(384, 1)
attention_backward_dkv_tma_kvr_turns_64(unsigned short* dqkv16, unsigned short* ds16,
                                        const __grid_constant__ TensorMap map_qkv,
                                        const __grid_constant__ TensorMap map_dy,
                                        const __grid_constant__ TensorMap map_lse,
                                        const __grid_constant__ TensorMap map_delta, int B, int T, int Hq, int Hkv,
                                        float scale) {
    attention_backward_dkv_tma<4, true, true>(dqkv16, ds16, &map_qkv, &map_dy, &map_lse, &map_delta, B, T, Hq, Hkv,
                                              scale);
}

// the dq pass: grid (the units, nq B Hq / W, or fewer), 128 (W + 1) threads (W a divisor of Hq / Hkv, at most 3),
// dynamic shared memory 4 (1 + W) 8192 + 64 + 1024 bytes; map_ds: ds16 as rows of 64 bf16, boxes of 64 x 64
extern "C" __global__ void __launch_bounds__(512, 1)
attention_backward_dq_tma_64(unsigned short* dqkv16, const __grid_constant__ TensorMap map_qkv,
                             const __grid_constant__ TensorMap map_ds, int B, int T, int Hq, int Hkv, float scale) {
    attention_backward_dq_tma<4>(dqkv16, &map_qkv, &map_ds, B, T, Hq, Hkv, scale);
}
