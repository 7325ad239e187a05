/*
A probe of Hopper's warpgroup MMA for NanoEuler (issue 36's first step; not part of the
product: nanoeuler_cuda.MODULES does not list it). One warpgroup (4 warps, 128 threads) computes

    c (64, N) fp32 = a (64, K) @ b (K, N),   a and b bf16, summed in fp32

with K / 16 wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16, both operands read from shared
memory through matrix descriptors (or a from registers), N = 64 or 128. wgmma exists on sm_90a
alone (the 'a' target: Hopper's own instructions), so dev/variants/wgmma_probe.py compiles this
file with NVRTC for "90a" itself; the CPU emulator (tools/emulate_cuda.py, WGMMA_HELPERS) runs it too, and
test_wgmma.py compares the emulator with numpy.

Below the probe, two products of many tiles for a first timing against cuBLAS: wgmma_gemm_bn* fed by cp.async
with a block barrier each step, and wgmma_tma_gemm_bn* fed by TMA through mbarriers (a producer warpgroup, two
consumers, setmaxnreg, a named barrier), each opening with what it computes and how the work is split. The product
holds a copy of `wgmma_tma_persistent_store_bn256` (flash_attn.cu's matmul_forward_tma_kernel, any M, N and K, and
matmul_swiglu_forward_tma_kernel with SwiGLU in its epilogue): a change here is not a change there.

How the work is split: the 128 threads copy a and b into shared memory, 16 bytes at a time, in
one of wgmma's layouts (tile_offset below); then each wgmma is the warpgroup's: every thread
issues it with the same descriptors, and thread t receives N / 2 accumulators of c: rows
16 (t / 32) + t % 32 / 4 and 8 below it, columns 8 j + 2 (t % 4) and the next, j = 0 .. N / 8 - 1
(register i: row + 8 for i % 4 >= 2, column 8 (i / 4) + 2 (t % 4) + i % 2; mma.sync's m16n8
fragment, one per 8 columns, a warp per 16 rows).

The global arrays are row-major:
  a: (64, K), "K-major" (A_MN = 0), or (K, 64), "M-major" (A_MN = 1; then c = a.T @ b), or
     (64, K) read into registers as mma.sync's a fragments (A_MN = 2; wgmma's other form, a from
     registers: what FlashAttention-3 does for p v, p being in registers already)
  b: (N, K), "K-major" (B_MN = 0; then c = a @ b.T), or (K, N), "N-major" (B_MN = 1)
In attention, s = q k.T has both operands K-major and o = p v has v N-major.

The async rules (PTX ISA, wgmma): plain stores to shared memory are made visible to wgmma's
(async proxy) reads by fence.proxy.async and a barrier; wgmma.fence comes before the first wgmma
and after any other access to its registers; commit_group closes a group of wgmma, wait_group N
waits until N groups at most are in flight. The accumulators are not to be touched in between.
*/

// -----------------------------------------------------------------------------
// helpers (inline PTX; the emulator defines each in C++)

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// make this thread's plain (generic proxy) writes to shared memory visible to wgmma's reads (async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// order the registers' accesses before it against the wgmma after it (the warpgroup runs it together)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// d (64 x N fp32, N / 2 registers a thread) = a (64 x 16) b (16 x N) + (scale_d ? d : 0), a and b bf16 in
// shared memory by their descriptors; A_MN, B_MN: a is M-major, b N-major (else both K-major)
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
    else if constexpr (N == 256)
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
    else
        static_assert(N == 64 || N == 128 || N == 256, "wgmma_bf16: N is 64, 128 or 256 here");
#undef D8
}

// the same with a from registers: a[0..3] this thread's part of a (64 x 16) as mma.sync's m16n8k16 a fragment
// (in each warp's 16 rows: register j holds row t % 32 / 4 (+ 8 for odd j), k 2 (t % 4) and the next (+ 8 for
// j >= 2), the lower k in the lower half); not to be written until the wgmma is waited for
template <int N, int B_MN>
__device__ __forceinline__ void wgmma_bf16_rs(float* d, const unsigned* a, unsigned long long b, int scale_d) {
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
              "+f"(d[i + 6]), "+f"(d[i + 7])
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(B_MN));
    else if constexpr (N == 128)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                     "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                     : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(B_MN));
    else
        static_assert(N == 64 || N == 128, "wgmma_bf16_rs: N is 64 or 128 here");
#undef D8
}

// close the group of the wgmma this thread issued since the last commit
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int N>   // wait until at most N groups of wgmma are still in flight
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// -----------------------------------------------------------------------------
// layouts and descriptors (plain C++: the emulator runs them as they are)

// keep the compiler from moving accesses to the n accumulators across the wgmma fence or wait
// around it (CUTLASS's warpgroup_fence_operand): each register passes through an empty asm
template <int n>
__device__ __forceinline__ void fence_registers(float* d) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// where element (mn, k) of a bf16 operand tile of `rows` (mn) x K sits, in bytes from the tile's
// start (a multiple of 1024), before the swizzle; the canonical layouts of the PTX ISA:
// - SWIZZLE 0, "interleave": 8 x 8 core matrices, each 8 rows of 16 bytes one after the other.
//   K-major: a core row is 8 k of one mn; core matrix (mn / 8, k / 8) at (mn / 8 * K / 8 + k / 8) 128:
//   the next along k 128 bytes on (LBO), the next along mn 16 K (SBO).
//   MN-major: a core row is 8 mn of one k; core matrix at (k / 8 * rows / 8 + mn / 8) 128: the next
//   along mn 128 bytes on (SBO), the next along k 16 rows (LBO).
// - SWIZZLE 32, 64 or 128: rows of SWIZZLE bytes (E = SWIZZLE / 2 bf16), 8 rows a pattern.
//   K-major: a row is E k of one mn; column of rows k / E after column, each `rows` rows: 8 rows
//   8 SWIZZLE bytes on (SBO; LBO unused). MN-major: a row is E mn of one k; the next 8 k 8 SWIZZLE bytes
//   on (SBO), the next E mn K SWIZZLE bytes on (LBO).
template <int SWIZZLE, int MN_MAJOR>
__device__ __forceinline__ unsigned tile_offset(int mn, int k, int rows, int K) {
    constexpr int E = SWIZZLE / 2;
    if constexpr (SWIZZLE == 0)
        return MN_MAJOR ? (k / 8 * (rows / 8) + mn / 8) * 128 + k % 8 * 16 + mn % 8 * 2
                        : (mn / 8 * (K / 8) + k / 8) * 128 + mn % 8 * 16 + k % 8 * 2;
    else
        return MN_MAJOR ? mn / E * K * SWIZZLE + k * SWIZZLE + mn % E * 2
                        : k / E * rows * SWIZZLE + mn * SWIZZLE + k % E * 2;
}

// the swizzle: the 16-byte chunk of a row (bits 4..) XOR the row in the pattern of 8 (bits 7..), as
// CUTLASS's Swizzle<log2(SWIZZLE / 16), 4, 3>; tiles start at multiples of 1024, so offsets swizzle
// as the shared addresses that wgmma swizzles
template <int SWIZZLE>
__device__ __forceinline__ unsigned swizzled(unsigned offset) {
    return SWIZZLE ? offset ^ (offset >> 7 & (SWIZZLE / 16 - 1)) << 4 : offset;
}

// a shared-memory matrix descriptor: bits 0-13 start address >> 4, 16-29 leading byte offset >> 4,
// 32-45 stride byte offset >> 4, 62-63 the swizzle (0 none, 1 128-byte, 2 64-byte, 3 32-byte); base offset 0
__device__ __forceinline__ unsigned long long matrix_descriptor(unsigned address, unsigned lbo, unsigned sbo,
                                                                int swizzle) {
    unsigned long long mode = swizzle == 128 ? 1 : swizzle == 64 ? 2 : swizzle == 32 ? 3 : 0;
    return (address & 0x3FFFF) >> 4 | (unsigned long long)(lbo >> 4 & 0x3FFF) << 16 |
           (unsigned long long)(sbo >> 4 & 0x3FFF) << 32 | mode << 62;
}

// the descriptor of the 16 k from k0 of a tile laid out by tile_offset
template <int SWIZZLE, int MN_MAJOR>
__device__ __forceinline__ unsigned long long operand_descriptor(const unsigned short* tile, int rows, int K,
                                                                 int k0) {
    unsigned start = shared_address(tile) + tile_offset<SWIZZLE, MN_MAJOR>(0, k0, rows, K);
    if (SWIZZLE == 0)
        return MN_MAJOR ? matrix_descriptor(start, 16 * rows, 128, 0) : matrix_descriptor(start, 128, 16 * K, 0);
    return MN_MAJOR ? matrix_descriptor(start, K * SWIZZLE, 8 * SWIZZLE, SWIZZLE)
                    : matrix_descriptor(start, 16, 8 * SWIZZLE, SWIZZLE);
}

// copy a row-major bf16 matrix g into a tile of `rows` x K in the layout, 16 bytes (8 neighbours
// along g's rows, which stay neighbours in the tile) a thread at a time: g is (rows, K) K-major,
// (K, rows) MN-major
template <int SWIZZLE, int MN_MAJOR>
__device__ void stage(unsigned short* tile, const unsigned short* g, int rows, int K) {
    for (int c = threadIdx.x; c < rows * K / 8; c += blockDim.x) {
        int mn = MN_MAJOR ? c % (rows / 8) * 8 : c / (K / 8), k = MN_MAJOR ? c / (rows / 8) : c % (K / 8) * 8;
        unsigned offset = swizzled<SWIZZLE>(tile_offset<SWIZZLE, MN_MAJOR>(mn, k, rows, K));
        *(uint4*)((char*)tile + offset) = *(const uint4*)(g + (MN_MAJOR ? k * rows + mn : mn * K + k));
    }
}

// -----------------------------------------------------------------------------
// the probe

// the accumulators of thread threadIdx.x (layout in the header) into c (64, N), or added to it
template <int N>
__device__ void store_accumulators(float* c, const float* d, bool add) {
    int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    for (int i = 0; i < N / 2; i++) {
        float* to = c + (16 * w + g + 8 * (i / 2 % 2)) * N + 8 * (i / 4) + 2 * q + i % 2;
        *to = add ? *to + d[i] : d[i];
    }
}

// the wgmma of the 16 k from k0: a from its tile, or (A_MN 2) from this thread's registers ra[k0 / 16]
template <int N, int SWIZZLE, int A_MN, int B_MN>
__device__ __forceinline__ void issue(float* d, const unsigned short* as, const unsigned (*ra)[4],
                                      const unsigned short* bs, int K, int k0, int scale_d) {
    unsigned long long b = operand_descriptor<SWIZZLE, B_MN>(bs, N, K, k0);
    if constexpr (A_MN == 2)
        wgmma_bf16_rs<N, B_MN>(d, ra[k0 / 16], b, scale_d);
    else
        wgmma_bf16<N, A_MN, B_MN>(d, operand_descriptor<SWIZZLE, A_MN>(as, 64, K, k0), b, scale_d);
}

// c (64, N) = a @ b as the header says; one block of 128 threads; K a multiple of 16 (of SWIZZLE / 2 when
// an operand is K-major and swizzled); dynamic shared memory (64 + N) 2 K bytes + 1024 (to align the tiles).
// GROUPS 2: the first half of K into d and the second into e, a group of wgmma each, d read once
// wait_group 1 has let the first group finish, e after wait_group 0 (as a pipelined loop waits).
// A_MN 2: a (64, K) K-major, K <= 64, read from global memory into registers, not staged
template <int N, int SWIZZLE, int A_MN, int B_MN, int GROUPS>
__device__ void wgmma_probe(float* c, const unsigned short* a, const unsigned short* b, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* tiles = smem + (1024 - shared_address(smem) % 1024) % 1024;
    unsigned short* as = (unsigned short*)tiles;                  // 64 x K
    unsigned short* bs = (unsigned short*)(tiles + 128 * K);      // N x K, a multiple of 1024 bytes on
    if constexpr (A_MN != 2) stage<SWIZZLE, A_MN>(as, a, 64, K);
    stage<SWIZZLE, B_MN>(bs, b, N, K);
    fence_proxy_async();
    __syncthreads();

    unsigned ra[4][4];                                            // A_MN 2: a's fragments, 16 k each
    if constexpr (A_MN == 2)
        for (int k0 = 0; k0 < K; k0 += 16)
            for (int j = 0; j < 4; j++) {
                int row = 16 * (threadIdx.x / 32) + threadIdx.x % 32 / 4 + 8 * (j % 2);
                int k = k0 + 2 * (threadIdx.x % 4) + 8 * (j / 2);
                ra[k0 / 16][j] = a[row * K + k] | (unsigned)a[row * K + k + 1] << 16;
            }
    float d[N / 2], e[N / 2];
    for (int i = 0; i < N / 2; i++)                               // NaN: the first wgmma must not add it
        d[i] = e[i] = __int_as_float(0x7fc00000);
    fence_registers<N / 2>(d);
    if constexpr (GROUPS == 2) fence_registers<N / 2>(e);
    wgmma_fence();
    int half = GROUPS == 2 ? K / 2 : K;
    for (int k0 = 0; k0 < half; k0 += 16) issue<N, SWIZZLE, A_MN, B_MN>(d, as, ra, bs, K, k0, k0 > 0);
    wgmma_commit();
    if constexpr (GROUPS == 2) {
        for (int k0 = half; k0 < K; k0 += 16) issue<N, SWIZZLE, A_MN, B_MN>(e, as, ra, bs, K, k0, k0 > half);
        wgmma_commit();
        wgmma_wait<1>();
        fence_registers<N / 2>(d);
        store_accumulators<N>(c, d, false);
    }
    wgmma_wait<0>();
    fence_registers<N / 2>(d);
    if constexpr (GROUPS == 2) fence_registers<N / 2>(e);
    store_accumulators<N>(c, GROUPS == 2 ? e : d, GROUPS == 2);
}

// the variants test_wgmma.py and wgmma_probe.py run, by name: N, the swizzle (interleave: none), a and b
// K-major (ak, bk) or MN-major (am, bn), a from registers (ar); written out, as the emulator finds its entry
// points in the text
extern "C" __global__ void __launch_bounds__(128) wgmma_n64_interleave_ak_bk(float* c, const unsigned short* a,
                                                                             const unsigned short* b, int K) {
    wgmma_probe<64, 0, 0, 0, 1>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n64_interleave_ak_bn(float* c, const unsigned short* a,
                                                                             const unsigned short* b, int K) {
    wgmma_probe<64, 0, 0, 1, 1>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n128_interleave_am_bn(float* c, const unsigned short* a,
                                                                              const unsigned short* b, int K) {
    wgmma_probe<128, 0, 1, 1, 1>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n128_sw128_ak_bk(float* c, const unsigned short* a,
                                                                         const unsigned short* b, int K) {
    wgmma_probe<128, 128, 0, 0, 1>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n128_sw128_ak_bn(float* c, const unsigned short* a,
                                                                         const unsigned short* b, int K) {
    wgmma_probe<128, 128, 0, 1, 1>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n64_sw64_am_bk(float* c, const unsigned short* a,
                                                                       const unsigned short* b, int K) {
    wgmma_probe<64, 64, 1, 0, 1>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n128_sw32_am_bn(float* c, const unsigned short* a,
                                                                        const unsigned short* b, int K) {
    wgmma_probe<128, 32, 1, 1, 1>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n64_interleave_ak_bk_two_groups(float* c,
                                                                                       const unsigned short* a,
                                                                                       const unsigned short* b,
                                                                                       int K) {
    wgmma_probe<64, 0, 0, 0, 2>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n64_sw128_ar_bn(float* c, const unsigned short* a,
                                                                        const unsigned short* b, int K) {
    wgmma_probe<64, 128, 2, 1, 1>(c, a, b, K);
}

// a from registers in two groups, the first waited for while the second is in flight (as a p v of attention
// runs on beside the next scores)
extern "C" __global__ void __launch_bounds__(128) wgmma_n64_sw128_ar_bn_two_groups(float* c, const unsigned short* a,
                                                                                   const unsigned short* b, int K) {
    wgmma_probe<64, 128, 2, 1, 2>(c, a, b, K);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_n128_interleave_ar_bk(float* c, const unsigned short* a,
                                                                              const unsigned short* b, int K) {
    wgmma_probe<128, 0, 2, 0, 1>(c, a, b, K);
}

// -----------------------------------------------------------------------------
// a product of many tiles, for a first timing against cuBLAS (not a tuned kernel)
//
// c (M, N) bf16 = a (M, K) @ b.T, a (M, K) and b (N, K) bf16 row-major (x @ w.T, as the model's forward
// products), M a multiple of 128, N of BN (128 or 256), K of 64. A block of 2 warpgroups (256 threads) owns a
// 128 x BN tile of c, warpgroup w its rows 64 w .. 64 w + 63, one m64nBNk16 accumulator (BN / 2 registers a
// thread). K is walked 64 at a time through GEMM_STAGES shared-memory stages of a (128 x 64) and b (BN x 64),
// K-major with the 128-byte swizzle, which all 256 threads fill by cp.async two steps ahead; a step's 4 wgmma
// are a group, and wait_group 1 keeps it in flight while the next step starts. Without TMA, a producer
// warpgroup, setmaxnreg or persistent blocks: what a kernel at cuBLAS's rate adds.

#define GEMM_STAGES 4
#define GEMM_BK 64

// 16 bytes global -> shared without passing through registers (the emulator: copied at once)
__device__ __forceinline__ void cp_async16(unsigned short* dst, const unsigned short* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>   // wait until at most N groups of copies are still in flight
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// two floats -> one register of two bf16, rounded to nearest even; lo in the lower half
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// start copying k0 .. k0 + 63 of a's rows m0 .. m0 + 127 and b's rows n0 .. n0 + BN - 1 into a stage: row r of
// a tile is 128 bytes, its 16-byte chunk ch at (ch ^ r % 8) (tile_offset and swizzled for K-major, 128 bytes)
template <int BN>
__device__ void gemm_load_stage(unsigned short* stage, const unsigned short* a, const unsigned short* b, int K,
                                int m0, int n0, int k0) {
    for (int i = threadIdx.x; i < (128 + BN) * 8; i += 256) {
        int r = i / 8, ch = i % 8;
        const unsigned short* src = r < 128 ? a + (long)(m0 + r) * K : b + (long)(n0 + r - 128) * K;
        cp_async16(stage + r * 64 + (ch ^ r % 8) * 8, src + k0 + 8 * ch, true);
    }
}

template <int BN>
__device__ void wgmma_gemm(unsigned short* c, const unsigned short* a, const unsigned short* b, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* stages = (unsigned short*)(smem + (1024 - shared_address(smem) % 1024) % 1024);
    constexpr int STAGE = (128 + BN) * GEMM_BK;                   // bf16 a stage: a's 128 rows, then b's BN
    int m0 = blockIdx.y * 128, n0 = blockIdx.x * BN, wg = threadIdx.x / 128, steps = K / GEMM_BK;
    for (int s = 0; s < GEMM_STAGES - 2; s++) {
        if (s < steps) gemm_load_stage<BN>(stages + s * STAGE, a, b, K, m0, n0, s * GEMM_BK);
        cp_async_commit();
    }
    float d[BN / 2];
    for (int kt = 0; kt < steps; kt++) {
        cp_async_wait<GEMM_STAGES - 3>();                         // this thread's copies of step kt are in
        fence_proxy_async();
        __syncthreads();          // everyone's are; and both warpgroups' wgmma of step kt - 2 are done
        int next = kt + GEMM_STAGES - 2;                          // into the stage step kt - 2 read
        if (next < steps) gemm_load_stage<BN>(stages + next % GEMM_STAGES * STAGE, a, b, K, m0, n0, next * GEMM_BK);
        cp_async_commit();
        const unsigned short* as = stages + kt % GEMM_STAGES * STAGE + wg * 64 * GEMM_BK;
        const unsigned short* bs = stages + kt % GEMM_STAGES * STAGE + 128 * GEMM_BK;
        wgmma_fence();
        for (int kk = 0; kk < GEMM_BK; kk += 16)
            wgmma_bf16<BN, 0, 0>(d, operand_descriptor<128, 0>(as, 64, GEMM_BK, kk),
                                 operand_descriptor<128, 0>(bs, BN, GEMM_BK, kk), kt > 0 || kk > 0);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_registers<BN / 2>(d);
    int w = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    for (int i = 0; i < BN / 2; i += 2) {
        long row = m0 + 64 * wg + 16 * w + g + 8 * (i / 2 % 2), col = n0 + 8 * (i / 4) + 2 * q;
        *(unsigned*)(c + row * N + col) = pack_bf16(d[i], d[i + 1]);
    }
}

// grid (N / BN, M / 128), 256 threads, dynamic shared memory GEMM_STAGES (128 + BN) 128 bytes + 1024
extern "C" __global__ void __launch_bounds__(256) wgmma_gemm_bn128(unsigned short* c, const unsigned short* a,
                                                                   const unsigned short* b, int N, int K) {
    wgmma_gemm<128>(c, a, b, N, K);
}

extern "C" __global__ void __launch_bounds__(256) wgmma_gemm_bn256(unsigned short* c, const unsigned short* a,
                                                                   const unsigned short* b, int N, int K) {
    wgmma_gemm<256>(c, a, b, N, K);
}

// -----------------------------------------------------------------------------
// the same product fed by TMA through mbarriers, as the field's Hopper kernels are (CUTLASS's warp-specialized
// GEMM, "fast.cu"): c (M, N) bf16 = a (M, K) @ b.T, a (M, K) and b (N, K) bf16 row-major, M a multiple of 128, N
// of BN (128 or 256), K of 64. A block of 3 warpgroups (384 threads) owns a 128 x BN tile of c: warpgroup 0 is
// the producer (its registers lowered by setmaxnreg; one thread issues the copies), warpgroups 1 and 2 the
// consumers, rows 0 .. 63 and 64 .. 127 (setmaxnreg raises theirs). K is walked 64 at a time through STAGES (4;
// 6 for _s6) of a (128 x 64) and b (BN x 64), each written by two TMA copies (cp.async.bulk.tensor.2d, the 128-byte
// swizzle applied by the copy itself: the tiles wgmma reads K-major). Each stage has two mbarriers: full (1
// arrival, by the producer's arrive.expect_tx of the stage's bytes, and the copies' bytes) and empty (2 arrivals,
// a thread of each consumer warpgroup once its wgmma on the stage are done). Step kt uses stage kt % STAGES in its
// kt / STAGES-th round: consumers wait for full's phase of that round's parity, the producer for empty's phase of
// the round before (for the first round, the phase "before" phase 0, which counts as
// complete). A consumer keeps a step's group of 4 wgmma in flight (wait_group 1) and frees the stage before it.
// The consumers meet at a named barrier (bar.sync 1, 256) before they store c, without the producer.

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

// bytes that copies will complete on the current phase, without arriving
__device__ __forceinline__ void mbarrier_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
                 : "memory");
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

template <int BN, int STAGES>
__device__ void wgmma_tma_gemm(unsigned short* c, const TensorMap* map_a, const TensorMap* map_b, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* base = smem + (1024 - shared_address(smem) % 1024) % 1024;
    unsigned short* stages = (unsigned short*)base;
    constexpr int STAGE = (128 + BN) * GEMM_BK;                   // bf16 a stage: a's 128 rows, then b's BN
    unsigned long long* full = (unsigned long long*)(base + STAGES * STAGE * 2);
    unsigned long long* empty = full + STAGES;
    int m0 = blockIdx.y * 128, n0 = blockIdx.x * BN, wg = threadIdx.x / 128, steps = K / GEMM_BK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], 2);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {                                                // the producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0)
            for (int kt = 0; kt < steps; kt++) {
                int s = kt % STAGES;
                mbarrier_wait(&empty[s], (kt / STAGES + 1) % 2);
                unsigned short* stage = stages + s * STAGE;
                mbarrier_arrive_expect_tx(&full[s], STAGE * 2);
                tma_load_2d(stage, map_a, kt * GEMM_BK, m0, &full[s]);
                tma_load_2d(stage + 128 * GEMM_BK, map_b, kt * GEMM_BK, n0, &full[s]);
            }
        return;
    }
    setmaxnreg_inc<232>();
    float d[BN / 2];
    for (int kt = 0; kt < steps; kt++) {
        int s = kt % STAGES;
        mbarrier_wait(&full[s], kt / STAGES % 2);
        const unsigned short* as = stages + s * STAGE + (wg - 1) * 64 * GEMM_BK;
        const unsigned short* bs = stages + s * STAGE + 128 * GEMM_BK;
        wgmma_fence();
        for (int kk = 0; kk < GEMM_BK; kk += 16)
            wgmma_bf16<BN, 0, 0>(d, operand_descriptor<128, 0>(as, 64, GEMM_BK, kk),
                                 operand_descriptor<128, 0>(bs, BN, GEMM_BK, kk), kt > 0 || kk > 0);
        wgmma_commit();
        wgmma_wait<1>();                                          // step kt - 1's wgmma are done: its stage is free
        if (kt > 0 && threadIdx.x % 128 == 0) mbarrier_arrive(&empty[(kt - 1) % STAGES]);
    }
    wgmma_wait<0>();
    fence_registers<BN / 2>(d);
    named_barrier_sync(1, 256);                                   // (both consumers' wgmma are done)
    int w = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    for (int i = 0; i < BN / 2; i += 2) {
        long row = m0 + 64 * (wg - 1) + 16 * w + g + 8 * (i / 2 % 2), col = n0 + 8 * (i / 4) + 2 * q;
        *(unsigned*)(c + row * N + col) = pack_bf16(d[i], d[i + 1]);
    }
}

// grid (N / BN, M / 128), 384 threads, dynamic shared memory STAGES (128 + BN) 128 bytes + 1024 (to align the
// tiles) + 16 STAGES (the mbarriers); map_a: a's tensor map, box 64 x 128, map_b: b's, box 64 x BN, both bf16 with
// the 128-byte swizzle
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_gemm_bn128(unsigned short* c,
                                                                          const __grid_constant__ TensorMap map_a,
                                                                          const __grid_constant__ TensorMap map_b,
                                                                          int N, int K) {
    wgmma_tma_gemm<128, GEMM_STAGES>(c, &map_a, &map_b, N, K);
}

extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_gemm_bn256(unsigned short* c,
                                                                          const __grid_constant__ TensorMap map_a,
                                                                          const __grid_constant__ TensorMap map_b,
                                                                          int N, int K) {
    wgmma_tma_gemm<256, GEMM_STAGES>(c, &map_a, &map_b, N, K);
}

// more stages where shared memory allows: 6 of 32 KB at 128 x 128 (at 128 x 256 a stage is 48 KB: 4 is the most)
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_gemm_bn128_s6(unsigned short* c,
                                                                             const __grid_constant__ TensorMap map_a,
                                                                             const __grid_constant__ TensorMap map_b,
                                                                             int N, int K) {
    wgmma_tma_gemm<128, 6>(c, &map_a, &map_b, N, K);
}

// -----------------------------------------------------------------------------
// the TMA-fed product made persistent (CUTLASS's warp-specialized persistent cooperative kernel): the same c (M, N)
// bf16 = a @ b.T, the same block of a producer and two consumers on 128 x BN tiles, but grid = the SMs (at most the
// tiles), each block walking tiles blockIdx.x, + gridDim.x, ... Tile t is row block t / (N / BN), column block
// t % (N / BN): the blocks at work at once share a's rows (read from memory once; b, the weights, 6 MB at most here,
// stays in L2). The producer and the consumers count their steps over the block's whole walk (it: stage it %
// STAGES, round it / STAGES), so the producer copies the next tile's first stages while the consumers store this
// one. A consumer frees a tile's last stage after wait_group 0 (the only wait 0, at a tile's end), then stores its
// 64 x BN of c: EPILOGUE 0 from registers (4 bytes a thread: a warp's store is 8 rows of 16 bytes), EPILOGUE 1
// through shared memory, 64 x 64 boxes laid out (128-byte swizzle) as a TMA load lays them, then a TMA store of
// each, two box buffers a consumer so that it writes a box while the one before is stored; its first thread
// commits the stores and waits for a buffer's last store to have read it (cp.async.bulk.wait_group.read), the
// warpgroup meets at named barrier 1 + its number around the writes. For the timings alone, not c: EPILOGUE 2
// stores nothing (the main loop's time), EPILOGUE 3 neither multiplies (the copies' time).
// B_MN 1, the backward's data gradient (dx = dy @ w, cuBLAS's "NN"): c (M, N) = a (M, K) @ b (K, N), b row-major
// (K, N), read along its rows: a stage's b is BN / 64 TMA boxes of 64 n x 64 k (a box row is 128 bytes of one k,
// the most the 128-byte swizzle allows), one after the other, each 8 KB: the MN-major layout of tile_offset (LBO
// 64 k x 128 bytes between 64-column groups, SBO 1024 between groups of 8 k) that wgmma reads with its
// transpose-b bit set.

// global <- shared: the box of the tensor map at element (x, y) from src (laid out as tma_load_2d lays it), one of
// this thread's bulk copies (closed into a group by bulk_commit)
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

template <int BN, int STAGES, int EPILOGUE, int SPLIT = 0, int PINGPONG = 0, int B_MN = 0>
__device__ void wgmma_tma_persistent(unsigned short* c, const TensorMap* map_a, const TensorMap* map_b,
                                     const TensorMap* map_c, int M, int N, int K) {
    // a consumer's part of a tile: 64 x BN, or (SPLIT) 128 x BN / 2, or (PINGPONG) all 128 x BN of its own tiles,
    // 128 rows as two m64nCNk16 back to back (ROWS2); CN / 2 (ROWS2) or BN / 2 accumulators a thread either way
    constexpr bool ROWS2 = SPLIT || PINGPONG;
    constexpr int CN = SPLIT ? BN / 2 : BN, REGS = ROWS2 ? CN : BN / 2;
    static_assert(!ROWS2 || EPILOGUE == 1, "a consumer of 128 rows stores through shared memory");
    static_assert(!B_MN || !ROWS2, "b N-major: consumers of 64 x BN only (not written for the others)");
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* base = smem + (1024 - shared_address(smem) % 1024) % 1024;
    constexpr int STAGE = (128 + BN) * GEMM_BK, BOX = 64 * 64;   // bf16 a stage (a's 128 rows, b's BN); a c box
    unsigned short* stages = (unsigned short*)base;
    unsigned short* boxes = stages + STAGES * STAGE;              // EPILOGUE 1: 2 a consumer
    unsigned long long* full = (unsigned long long*)(boxes + (EPILOGUE == 1 ? 4 * BOX : 0));
    unsigned long long* empty = full + STAGES;
    int wg = threadIdx.x / 128, steps = K / GEMM_BK, columns = N / BN, tiles = M / 128 * columns;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(&full[s], 1);                           // the producer's arrival, and the bytes
            mbarrier_init(&empty[s], PINGPONG ? 1 : 2);           // a thread of each consumer using the stage
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {                                                // the producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0)
            for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x)
                for (int kt = 0; kt < steps; kt++, it++) {
                    int s = it % STAGES;
                    mbarrier_wait(&empty[s], (it / STAGES + 1) % 2);
                    mbarrier_arrive_expect_tx(&full[s], STAGE * sizeof(unsigned short));
                    tma_load_2d(stages + s * STAGE, map_a, kt * GEMM_BK, tile / columns * 128, &full[s]);
                    if constexpr (B_MN)                           // b (K, N): box j is columns 64 j .. of BN
                        for (int j = 0; j < BN / 64; j++)
                            tma_load_2d(stages + s * STAGE + (128 + 64 * j) * GEMM_BK, map_b,
                                        tile % columns * BN + 64 * j, kt * GEMM_BK, &full[s]);
                    else
                        tma_load_2d(stages + s * STAGE + 128 * GEMM_BK, map_b, kt * GEMM_BK, tile % columns * BN,
                                    &full[s]);
                }
        return;
    }
    setmaxnreg_inc<232>();
    float d[REGS];
    int w = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, lead = threadIdx.x % 128 == 0;
    // the block's walk, tile n of it at blockIdx.x + n gridDim.x with steps n steps ..: PINGPONG, consumer wg takes
    // the tiles n = wg - 1, wg + 1, ..., so that one stores while the other multiplies
    for (int n = PINGPONG ? wg - 1 : 0, tile = blockIdx.x + n * gridDim.x; tile < tiles;
         n += 1 + PINGPONG, tile += (1 + PINGPONG) * gridDim.x) {
        // PINGPONG: a consumer starts its tile's waits once the other has passed its own of the tile before, so that
        // no full barrier is waited on more than a round ahead of its copies (a parity names a phase only so far)
        if (PINGPONG && n > 0) named_barrier_sync(3 + wg, 256);
        for (int kt = 0, it = n * steps; kt < steps; kt++, it++) {
            int s = it % STAGES;
            mbarrier_wait(&full[s], it / STAGES % 2);
            if constexpr (EPILOGUE == 3) {                        // copies alone: the stage freed at once
                if (lead) mbarrier_arrive(&empty[s]);
                continue;
            }
            const unsigned short* as = stages + s * STAGE + (ROWS2 ? 0 : (wg - 1) * 64 * GEMM_BK);
            const unsigned short* bs = stages + s * STAGE + 128 * GEMM_BK + (SPLIT ? (wg - 1) * BN / 2 * GEMM_BK : 0);
            wgmma_fence();
            for (int kk = 0; kk < GEMM_BK; kk += 16)
                if constexpr (ROWS2)                              // rows 0 .. 63 into d, 64 .. 127 into d + CN / 2
                    for (int h = 0; h < 2; h++)
                        wgmma_bf16<CN, 0, 0>(d + CN / 2 * h,
                                             operand_descriptor<128, 0>(as + h * 64 * GEMM_BK, 64, GEMM_BK, kk),
                                             operand_descriptor<128, 0>(bs, CN, GEMM_BK, kk), kt > 0 || kk > 0);
                else
                    wgmma_bf16<BN, 0, B_MN>(d, operand_descriptor<128, 0>(as, 64, GEMM_BK, kk),
                                            operand_descriptor<128, B_MN>(bs, BN, GEMM_BK, kk), kt > 0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>();                                      // the step before is done: its stage is free
            if (kt > 0 && lead) mbarrier_arrive(&empty[(it - 1) % STAGES]);
        }
        if (PINGPONG && tile + gridDim.x < tiles) named_barrier_arrive(6 - wg, 256);   // the other's turn
        if constexpr (EPILOGUE == 3) continue;
        wgmma_wait<0>();
        fence_registers<REGS>(d);
        if (lead) mbarrier_arrive(&empty[((n + 1) * steps - 1) % STAGES]);   // the tile's last stage
        int m0 = tile / columns * 128 + (ROWS2 ? 0 : 64 * (wg - 1));          // this consumer's part of c
        int n0 = tile % columns * BN + (SPLIT ? (wg - 1) * BN / 2 : 0);
        if constexpr (EPILOGUE == 0)
            for (int i = 0; i < BN / 2; i += 2) {
                long row = m0 + 16 * w + g + 8 * (i / 2 % 2), col = n0 + 8 * (i / 4) + 2 * q;
                *(unsigned*)(c + row * N + col) = pack_bf16(d[i], d[i + 1]);
            }
        else if constexpr (EPILOGUE == 1)
            for (int j = 0; j < 2 * REGS / 64; j++) {             // box j: registers 32 j .., columns 64 j ..
                unsigned char* box = (unsigned char*)(boxes + (2 * (wg - 1) + j % 2) * BOX);   // (ROWS2: rows
                int x = n0 + 64 * (ROWS2 ? j % (CN / 64) : j), y = m0 + (ROWS2 ? 64 * (j / (CN / 64)) : 0);   // 64
                                                                  // (j / (CN / 64)), columns 64 (j % (CN / 64)))
                if (lead) bulk_wait_read<1>();                    // the store of two boxes ago has read it
                named_barrier_sync(1 + wg, 128);                  // before any thread writes it again
                for (int i = 32 * j; i < 32 * j + 32; i += 2) {
                    int row = 16 * w + g + 8 * (i / 2 % 2), chunk = i / 4 % 8;     // a 16-byte chunk: 8 columns
                    *(unsigned*)(box + row * 128 + (chunk ^ row % 8) * 16 + 4 * q) = pack_bf16(d[i], d[i + 1]);
                }
                fence_proxy_async();                              // the writes, visible to the TMA store
                named_barrier_sync(1 + wg, 128);
                if (lead) tma_store_2d(map_c, box, x, y), bulk_commit();
            }
    }
    if (EPILOGUE == 1 && lead) bulk_wait_read<0>();               // the boxes are read before the block ends
}

// grid (min(SMs, tiles), 1), 384 threads, dynamic shared memory STAGES (128 + BN) 128 bytes (+ 32 KB for EPILOGUE
// 1's boxes) + 1024 + 16 STAGES; map_a, map_b as wgmma_tma_gemm's, map_c: c's, box 64 x 64, 128-byte swizzle
// (written out: the emulator finds its entry points in the text)
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_bn256(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<256, 4, 0>(c, &map_a, &map_b, &map_c, M, N, K);
}

extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_bn128_s6(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<128, 6, 0>(c, &map_a, &map_b, &map_c, M, N, K);
}

// the epilogue through shared memory and TMA stores (4 stages of 48 KB or 6 of 32 KB, and the 32 KB of boxes)
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_store_bn256(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<256, 4, 1>(c, &map_a, &map_b, &map_c, M, N, K);
}

extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_store_bn128_s6(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<128, 6, 1>(c, &map_a, &map_b, &map_c, M, N, K);
}

// for the timings alone (c is not written): the main loop without the epilogue, the copies without the main loop
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_bn256_no_store(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<256, 4, 2>(c, &map_a, &map_b, &map_c, M, N, K);
}

extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_bn256_copies_only(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<256, 4, 3>(c, &map_a, &map_b, &map_c, M, N, K);
}

// two consumers of 128 x 128 each (two m64n128k16 back to back, rows 0 .. 63 and 64 .. 127 of one half of b)
// instead of 64 x 256: a step reads a's 128 rows twice and each half of b twice from shared memory (96 KB) where
// 64 x 256 reads a once and b twice (80 KB)
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_store_bn256_split(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<256, 4, 1, 1>(c, &map_a, &map_b, &map_c, M, N, K);
}

// CUTLASS's ping-pong schedule: each consumer multiplies its own 128 x 128 tiles (two m64n128k16 back to back),
// every other tile of the block's walk, taking turns (named barriers 4, 5) so that one's epilogue runs while the
// other multiplies (6 stages of 32 KB)
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_pingpong_bn128_s6(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<128, 6, 1, 0, 1>(c, &map_a, &map_b, &map_c, M, N, K);
}

// the backward's data gradient, cuBLAS's "NN": c (M, N) bf16 = a (M, K) @ b (K, N), b row-major (K, N) (dx = dy @
// w, w (N_out, C) as the model keeps it); as _store_bn256 otherwise; map_b: b's, box 64 x 64 (64 columns of 64 rows)
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_persistent_store_nn_bn256(
    unsigned short* c, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
    const __grid_constant__ TensorMap map_c, int M, int N, int K) {
    wgmma_tma_persistent<256, 4, 1, 0, 0, 1>(c, &map_a, &map_b, &map_c, M, N, K);
}

// -----------------------------------------------------------------------------
// the backward's weight gradient, cuBLAS's "TN": c (M, N) fp32 += a.T @ b, a (K, M) and b (K, N) bf16 row-major,
// the sum over K = the batch's tokens (dw = dy.T @ x: dy (tokens, N_out), x (tokens, C), the gradient fp32 and
// accumulated, as Cublas.gemm's beta 1 does). Both operands are MN-major for wgmma (a row of a is one k): a stage
// holds a's 128 columns as 2 TMA boxes of 64 m x 64 k and b's BN as BN / 64 boxes of 64 n x 64 k, each 8 KB, the
// layout of the NN product's b above, read with both transpose bits set. c is small (768 x 768 to 4096 x 768: 18
// to 96 tiles of 128 x 256 for 132 SMs) and K long (32768), so K is split: unit u of tiles x splits is tile u %
// tiles, k-steps of split u / tiles (splits consecutive ranges of the K / 64 steps, as even as integer division
// makes them). The blocks are persistent over the units (the same producer, consumers and stage count across
// units as wgmma_tma_persistent), so the units at work at once are the tiles of one or two splits: they read the
// same rows of a and b, from memory once. A unit writes its fp32 partial (128 x BN) from registers to partials
// [split] (M, N) (8 bytes a thread: a warp writes 8 rows of 32 bytes); then splitk_reduce_add adds the splits'
// partials into c, summed in split order. No atomics: c's bits are the same every run (what an atomicAdd of
// the partials would not give).
template <int BN, int STAGES>
__device__ void wgmma_tma_splitk_tn(float* partials, const TensorMap* map_a, const TensorMap* map_b, int M, int N,
                                    int K, int splits) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* base = smem + (1024 - shared_address(smem) % 1024) % 1024;
    constexpr int STAGE = (128 + BN) * GEMM_BK, BOX = 64 * GEMM_BK;   // bf16 a stage (a's 128 columns, b's BN); a box
    unsigned short* stages = (unsigned short*)base;
    unsigned long long* full = (unsigned long long*)(stages + STAGES * STAGE);
    unsigned long long* empty = full + STAGES;
    int wg = threadIdx.x / 128, steps = K / GEMM_BK, columns = N / BN, tiles = M / 128 * columns;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(&full[s], 1);                           // the producer's arrival, and the bytes
            mbarrier_init(&empty[s], 2);                          // a thread of each consumer
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {                                                // the producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0)
            for (int u = blockIdx.x, it = 0; u < tiles * splits; u += gridDim.x) {
                int tile = u % tiles, split = u / tiles, m0 = tile / columns * 128, n0 = tile % columns * BN;
                for (int kt = split * steps / splits; kt < (split + 1) * steps / splits; kt++, it++) {
                    int s = it % STAGES;
                    mbarrier_wait(&empty[s], (it / STAGES + 1) % 2);
                    mbarrier_arrive_expect_tx(&full[s], STAGE * sizeof(unsigned short));
                    for (int j = 0; j < 2; j++)                   // a (K, M): columns m0 + 64 j .., rows kt 64 ..
                        tma_load_2d(stages + s * STAGE + j * BOX, map_a, m0 + 64 * j, kt * GEMM_BK, &full[s]);
                    for (int j = 0; j < BN / 64; j++)
                        tma_load_2d(stages + s * STAGE + (2 + j) * BOX, map_b, n0 + 64 * j, kt * GEMM_BK, &full[s]);
                }
            }
        return;
    }
    setmaxnreg_inc<232>();
    float d[BN / 2];
    int w = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, lead = threadIdx.x % 128 == 0;
    for (int u = blockIdx.x, it = 0; u < tiles * splits; u += gridDim.x) {
        int tile = u % tiles, split = u / tiles, k0 = split * steps / splits, k1 = (split + 1) * steps / splits;
        for (int kt = k0; kt < k1; kt++, it++) {
            int s = it % STAGES;
            mbarrier_wait(&full[s], it / STAGES % 2);
            const unsigned short* as = stages + s * STAGE + (wg - 1) * BOX;   // this consumer's 64 columns of a
            const unsigned short* bs = stages + s * STAGE + 2 * BOX;
            wgmma_fence();
            for (int kk = 0; kk < GEMM_BK; kk += 16)
                wgmma_bf16<BN, 1, 1>(d, operand_descriptor<128, 1>(as, 64, GEMM_BK, kk),
                                     operand_descriptor<128, 1>(bs, BN, GEMM_BK, kk), kt > k0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>();                                      // the step before is done: its stage is free
            if (kt > k0 && lead) mbarrier_arrive(&empty[(it - 1) % STAGES]);
        }
        wgmma_wait<0>();
        fence_registers<BN / 2>(d);
        if (lead) mbarrier_arrive(&empty[(it - 1) % STAGES]);   // the unit's last stage
        float* p = partials + (long)split * M * N;
        int m0 = tile / columns * 128 + 64 * (wg - 1), n0 = tile % columns * BN;
        for (int i = 0; i < BN / 2; i += 2) {
            long row = m0 + 16 * w + g + 8 * (i / 2 % 2), col = n0 + 8 * (i / 4) + 2 * q;
            *(float2*)(p + row * N + col) = make_float2(d[i], d[i + 1]);
        }
    }
}

// grid (min(SMs, tiles x splits), 1), 384 threads, dynamic shared memory STAGES (128 + BN) 128 bytes + 1024 + 16
// STAGES; map_a: a's (K, M), map_b: b's (K, N), both boxes of 64 columns x 64 rows with the 128-byte swizzle;
// partials: splits x M x N fp32; 1 <= splits <= K / 64
extern "C" __global__ void __launch_bounds__(384, 1) wgmma_tma_splitk_tn_bn256(
    float* partials, const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, int M, int N,
    int K, int splits) {
    wgmma_tma_splitk_tn<256, 4>(partials, &map_a, &map_b, M, N, K, splits);
}

// c (n) += partials[0] + partials[1] + ... + partials[splits - 1] (each n fp32, one after the other), summed in that
// order whatever the grid; one thread 4 elements; grid ceil(n / 1024), 256 threads; n a multiple of 4
extern "C" __global__ void __launch_bounds__(256) splitk_reduce_add(float* c, const float* partials, int n,
                                                                   int splits) {
    long i = 4 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    float4 sum = *(const float4*)(partials + i);
    for (int s = 1; s < splits; s++) {
        float4 p = *(const float4*)(partials + (long)s * n + i);
        sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
    }
    float4 out = *(float4*)(c + i);
    out.x += sum.x, out.y += sum.y, out.z += sum.z, out.w += sum.w;
    *(float4*)(c + i) = out;
}
