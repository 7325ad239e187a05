"""
Runs kernels.cu and flash_attn.cu on the CPU, on a machine without a GPU.

It checks the kernels' logic (indices, masks, the order of sums, graph capture
bookkeeping). Not part of NanoEuler: nothing imports it but the tests.

    python tools/emulate_cuda.py               # training and decoding checks (see main)
    python tools/emulate_cuda.py kernels       # check_kernels (both builds) and check_optimizer
    python tools/emulate_cuda.py training      # those, attention, the model and steps (~40 s)
    python tools/emulate_cuda.py decoding      # nanoeuler_cuda.check_decoding, fp32 and bf16 (~5 min)
    python tools/emulate_cuda.py fast          # check_decode_logits on rows of up to 3 chunks (~5 s)
    python tools/emulate_cuda.py check         # `nanoeuler_cuda.py check`, all of it, as on a GPU (~6 min)
    python tools/emulate_cuda.py --late-copies --warps-ahead training    # (any of them) a harsher schedule:

--reverse runs blocks, and a block's threads between barriers, in reverse order;
--late-copies lands each cp.async at the cp.async.wait_group that covers it, not at
issue; --warps-ahead runs each warp of a block as far as it can before the next (up
to a barrier that waits for another warp), not a barrier at a time, so a missing
__syncthreads shows (a warp reads a tile others have still to copy, or overwrites
one they have still to read). install(nc, reverse=, warps_ahead=) sets two of them.

How: each module of nanoeuler_cuda.MODULES (kernels.cu as it stands and with
-DFLOATX=bfloat16, flash_attn.cu) is compiled as C++ with g++ against a small
header (EMULATOR below) in which every CUDA thread of a block is a fiber; blocks
run one after another, __syncthreads and each warp shuffle or ballot are
barriers the fibers meet at, __shared__ becomes static, and inline PTX becomes
C++: the conversions to bf16 and tf32 (PTX), and flash_attn.cu's tensor-core
helpers (TENSOR_CORE_HELPERS: mma.sync, whose fragments the warp's lanes trade
as the PTX ISA lays them out; ldmatrix; cp.async, done at once, or with
--late-copies at the wait that covers it; with --warps-ahead each warp runs as far as
it can before the next, where they take turns a barrier at a time), and Hopper's
warpgroup MMA for kernels to come (WGMMA_HELPERS: wgmma.mma_async reading
shared memory through matrix descriptors, every layout and swizzle, done at
wgmma.wait_group; dev/variants/wgmma_probe.cu, test_wgmma.py) and what feeds it
(TMA_HELPERS: mbarriers with phases, arrival counts and tx-counts; TMA copies
through a tensor map that the stand-in driver's cuTensorMapEncodeTiled makes,
swizzled as they land, done when every thread of the block waits; TMA stores
in bulk groups, done at the wait_group.read that lets them be; named
barriers; setmaxnreg, a no-op); a block whose threads all wait for what none of
them will do is a deadlock, named with what each waits at. A persistent kernel
(named as CONCURRENT says: decode_layers_...) has blocks that wait on each other
through kernels.cu's stage counters (KERNELS_HELPERS: stage_arrive, stage_wait,
stage_arrive_last), which one block after another would never get past (that fails at once, named):
each block of its grid runs in a process of its own (fork), all at once, device
memory shared (MAP_SHARED), the rest (fibers, shared memory) the block's own; a
block that faults or fails fails the launch and ends the others' waits, and a wait
that sees no block arrive anywhere for 60 s is a deadlock, named. install() then
puts a stand-in driver into nanoeuler_cuda (memory is host memory, filled with
NaN bits when allocated, after a guard of NaN bytes that is read after every
kernel and right before a page no one may touch, so a write before the start is
named, a read before it spreads NaN, and a read or write past the end fails the
launch with the kernel's name; a grid that waits on itself may have no more
blocks than fit at once, two an SM; a launch, a memset or a cuBLAS product runs at
once or, during stream capture, joins the graph that a graph launch replays;
what a capture may not do fails) and a GPU object with cuBLAS done by numpy,
so GPUModel, GPUEngine, GPUDecoder and the checks run unchanged.

What it cannot tell: speed, memory order (fences and atomics are x86's), and the
GPU's exact bits (expf is libm's, not --use_fast_math's), so it compares with
numpy at the same bars as `check` does and pins equalities between two runs of
the emulator (speculative == plain, graph == one by one), not GPU bits; a tensor
core's sums are in fp32 in k order here. Nor what ptxas makes of a kernel: a
fiber keeps every C++ variable, so wgmma_registers_not_always_written reads the
kernel's PTX for the one register hazard met so far (a wgmma's register a left
undefined on one path to it; test_wgmma.py runs it on every wgmma file). Needs g++
(C++20) and cuda-python (for the enums and launch structs; no driver).
"""

import argparse
import ctypes
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBC = ctypes.CDLL(None, use_errno=True)                  # mprotect
LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanoeuler", "emulator")

EMULATOR = r"""
// the fibers longjmp from one stack to another, which glibc's fortified longjmp takes for a
// smashed stack and aborts on; Ubuntu's g++ fortifies by default
#undef _FORTIFY_SOURCE
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <algorithm>
#include <setjmp.h>
#include <ucontext.h>
#include <signal.h>
#include <unistd.h>
#include <sched.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/wait.h>
using std::min;
using std::max;
// CUDA's min and max of an int and an unsigned compare as unsigned
static inline unsigned min(int a, unsigned b) { return std::min((unsigned)a, b); }
static inline unsigned min(unsigned a, int b) { return std::min(a, (unsigned)b); }
static inline unsigned max(int a, unsigned b) { return std::max((unsigned)a, b); }
static inline unsigned max(unsigned a, int b) { return std::max(a, (unsigned)b); }

struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct uchar4 { unsigned char x, y, z, w; };
struct dim3e { unsigned x, y, z; };
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
template <class T> static inline T __ldcs(const T* p) { return *p; }     // (a GPU's L2 evicts it first)
static dim3e threadIdx, blockIdx, gridDim, blockDim;       // threadIdx: the running fiber's

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
static inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// real atomics: the blocks of a concurrent grid (run_grid_concurrent) are processes sharing device memory
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }

// cvt.rn.bf16.f32 (what __float2bfloat16 does): round to nearest even, a NaN the canonical NaN
static inline unsigned short emu_bf16_bits(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Fiber { jmp_buf jb; ucontext_t uc; bool started, done; unsigned tid; };
static const size_t STACK = 64 * 1024;
static Fiber* fibers;
static char* stacks;
static jmp_buf scheduler;
static int cur, live, bar_arrived, warp_arrived[32], warp_live[32];
static unsigned bar_gen, warp_gen[32];
static unsigned long long warp_buf[32][32];
static void (*body)(void*);
static void* body_arg;
static char emu_dynamic_shared[227 * 1024];            // a block's, as much as an H100 gives one
static int wg_arrived[8];                                // warpgroups (4 warps) met at a wgmma.wait_group
static unsigned wg_gen[8];
static void emu_wgmma_block();                           // the wgmma state a block starts with
static void emu_wgmma_exit();                            // a thread leaves none in flight
static void emu_copies_block();                          // no cp.async in flight
static void emu_copies_exit();                           // a thread's copies in flight land
// a deadlock: each wait below counts an event when a thread arrives or goes on; a round of the scheduler in which
// no thread started and none counted one leaves every thread waiting for what no one will do (TMA copies aside)
static unsigned long long emu_events;
static int emu_wait_kind[1024];                          // what a thread waits at (EMU_WAITS), for the message
static unsigned emu_wait_at[1024], emu_wait_parity[1024];
static const char* EMU_WAITS[] = {"nothing", "__syncthreads", "a warp's shuffle, ballot or __syncwarp",
                                  "wgmma.wait_group", "an mbarrier's try_wait.parity", "a named barrier (bar.sync)"};
static void emu_fail(const char* what);                 // the process aborts, named
static bool emu_tma_pending();                          // TMA copies issued, not yet done
static void emu_tma_complete();                         // done, as the async proxy may do them at the latest
static void emu_async_exit();                           // a thread leaves no TMA store in flight
static void emu_deadlock();                             // named, with what each waits for

static void yield_fiber() {
    if (!_setjmp(fibers[cur].jb)) _longjmp(scheduler, 1);
    threadIdx = dim3e{fibers[cur].tid, 0, 0};
}
static void release_block() { if (bar_arrived > 0 && bar_arrived == live) bar_arrived = 0, bar_gen++; }
static void release_warp(int w) {
    if (warp_arrived[w] > 0 && warp_arrived[w] == warp_live[w]) warp_arrived[w] = 0, warp_gen[w]++;
}
static void __syncthreads() {
    unsigned g = bar_gen;
    bar_arrived++, emu_events++, emu_wait_kind[threadIdx.x] = 1;
    release_block();
    while (bar_gen == g) yield_fiber();
}
static void warp_barrier() {
    int w = threadIdx.x / 32;
    unsigned g = warp_gen[w];
    warp_arrived[w]++, emu_events++, emu_wait_kind[threadIdx.x] = 2;
    release_warp(w);
    while (warp_gen[w] == g) yield_fiber();
}
template <class T> static T shuffle(T v, int src) {       // 4- or 8-byte values
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    int w = threadIdx.x / 32;
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    warp_buf[w][threadIdx.x % 32] = bits;
    warp_barrier();
    bits = warp_buf[w][src & 31];
    warp_barrier();
    memcpy(&v, &bits, sizeof(T));
    return v;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int off) { return shuffle(v, (threadIdx.x % 32) ^ off); }
template <class T> static T __shfl_sync(unsigned, T v, int src) { return shuffle(v, src); }
// the lanes whose predicate is true; lanes that have exited count as false
static unsigned __ballot_sync(unsigned, int pred) {
    int w = threadIdx.x / 32;
    for (int l = 0; l < 32; l++) warp_buf[w][l] = 0;        // every live lane clears, then sets its own
    warp_barrier();
    warp_buf[w][threadIdx.x % 32] = pred != 0;
    warp_barrier();
    unsigned votes = 0;
    for (int l = 0; l < 32; l++) votes |= (unsigned)(warp_buf[w][l] != 0) << l;
    warp_barrier();
    return votes;
}
static void __syncwarp(unsigned = 0xffffffff) { warp_barrier(); }

static void fiber_main() {
    body(body_arg);
    emu_wgmma_exit();
    emu_async_exit();
    emu_copies_exit();
    Fiber& f = fibers[cur];
    f.done = true;
    live--, emu_events++;
    warp_live[f.tid / 32]--;
    release_block();
    release_warp(f.tid / 32);
    _longjmp(scheduler, 1);
}

// the order blocks, and a block's fibers between two barriers, run in: reversed, a kernel
// whose result depends on it (a missing barrier, a last block that sums in its own order) shows
static int emu_reverse;
extern "C" void emu_set_reverse(int r) { emu_reverse = r; }
// warps ahead: each warp in turn runs as far as it can (until its threads all wait for another warp's, at
// __syncthreads or the like) before the next warp runs. Taking turns a barrier at a time, the warps of a block keep
// together through their shuffles, ldmatrix and mma.sync (each a barrier of the warp), which hides a missing block
// barrier; this way a warp reads a shared tile before the other warps' copies into it landed (late copies), or
// overwrites one that they have still to read
static int emu_warps_ahead;
extern "C" void emu_set_warps_ahead(int ahead) { emu_warps_ahead = ahead; }

// the grid's shape and body, the fibers and their stacks allocated once (before any fork: no malloc in a child)
static void start_grid(dim3e grid, int block, void (*fn)(void*), void* arg) {
    if (block > 1024 || block % 32) { fprintf(stderr, "emulator: block of %d threads\n", block); abort(); }
    if (!fibers) fibers = new Fiber[1024], stacks = (char*)malloc(1024 * STACK);
    gridDim = grid, blockDim = dim3e{(unsigned)block, 1, 1}, body = fn, body_arg = arg;
}
// block b of the grid: body(arg) in each of its threads, as fibers
static void run_block(long b) {
    dim3e grid = gridDim;
    int block = blockDim.x;
    blockIdx = dim3e{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / grid.x / grid.y)};
    live = block, bar_arrived = 0;
    for (int w = 0; w < block / 32; w++) warp_live[w] = 32, warp_arrived[w] = 0;
    emu_wgmma_block();
    emu_copies_block();
    for (int t = 0; t < block; t++) {
        Fiber& f = fibers[t];
        f.started = f.done = false, f.tid = t;
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = stacks + (size_t)t * STACK;
        f.uc.uc_stack.ss_size = STACK;
        f.uc.uc_link = nullptr;
        makecontext(&f.uc, fiber_main, 0);
    }
    for (int running = block; running;) {
        running = 0;
        unsigned long long events = emu_events;
        bool started = false;
        unsigned long long warp_events = 0;                  // (warps ahead: when the warp's pass began)
        for (int k = 0; k < block; k++) {
            if (k % 32 == 0) warp_events = emu_events;
            int t = emu_reverse ? block - 1 - k : k;
            Fiber& f = fibers[t];
            if (!f.done) {
                cur = t, threadIdx = dim3e{f.tid, 0, 0};
                if (!_setjmp(scheduler)) {
                    if (!f.started) f.started = started = true, setcontext(&f.uc);
                    else _longjmp(f.jb, 1);
                }
            }
            // warps ahead: after the warp's last fiber, its fibers again while one of them got anywhere
            if (emu_warps_ahead && k % 32 == 31 && emu_events != warp_events) k -= 32;
        }
        for (int t = 0; t < block; t++) running += !fibers[t].done;
        if (running && !started && events == emu_events) {    // every live thread waits: for TMA copies, or
            if (!emu_tma_pending()) emu_deadlock();              // for what no one will do
            emu_tma_complete();
        }
    }
    if (emu_tma_pending()) emu_fail("a block ends with TMA copies in flight");
}
// body(arg) in every thread of every block of the grid, one block after another
static void run_grid(dim3e grid, int block, void (*fn)(void*), void* arg) {
    start_grid(grid, block, fn, arg);
    long blocks = (long)grid.x * grid.y * grid.z;
    for (long i = 0; i < blocks; i++) run_block(emu_reverse ? blocks - 1 - i : i);
}

// A concurrent grid (a kernel named as emulate_cuda.CONCURRENT says: its blocks wait on each other at stage_wait):
// each block runs in a process of its own, forked, all at once. Device memory is Driver.alloc's MAP_SHARED mmap,
// so they share it; each keeps its own copy of the rest (fibers, static and dynamic shared memory): a block's
// private state. A block that faults or fails (emu_fail) ends its process with a code (EMU_FAULTED, EMU_FAILED)
// and marks the grid failed, at which the blocks still waiting at stage_wait end too (EMU_ABANDONED).
static const int EMU_FAULTED = 70, EMU_FAILED = 71, EMU_ABANDONED = 72;
static void* const EMU_BLOCK_FAILED = (void*)-2;        // emu_run's answer when a block of such a grid failed
// what the grid's processes share (mmap MAP_SHARED, made before the fork): progress counts every stage_arrive and
// block that ends, for the deadlock at stage_wait; fault: each block's faulting address
struct EmuGridShared { unsigned long long progress; int failed; void* fault[]; };
static EmuGridShared* emu_grid;                           // in a block's process (null elsewhere)
static long emu_block_slot;                               // which block's, in fork order
static double emu_stall_seconds = 60;                     // no block arrived anywhere for this long: a deadlock
extern "C" void emu_set_stall_seconds(double seconds) { emu_stall_seconds = seconds; }
static void emu_grid_failed() { if (emu_grid) __atomic_store_n(&emu_grid->failed, 1, __ATOMIC_SEQ_CST); }
static void* run_grid_concurrent(dim3e grid, int block, void (*fn)(void*), void* arg) {
    start_grid(grid, block, fn, arg);
    long blocks = (long)grid.x * grid.y * grid.z;
    size_t bytes = sizeof(EmuGridShared) + blocks * sizeof(void*);
    void* shared = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) { perror("emulator: mmap"); abort(); }
    memset(shared, 0, bytes);
    EmuGridShared* g = (EmuGridShared*)shared;
    pid_t* pids = new pid_t[blocks];
    fflush(stdout), fflush(stderr);
    for (long i = 0; i < blocks; i++) {
        pids[i] = fork();
        if (pids[i] < 0) {                                // those forked already give up at their first wait
            perror("emulator: fork");
            __atomic_store_n(&g->failed, 1, __ATOMIC_SEQ_CST);
            blocks = i;
            break;
        }
        if (pids[i] == 0) {
            emu_grid = g, emu_block_slot = i;
            run_block(emu_reverse ? blocks - 1 - i : i);
            __atomic_fetch_add(&g->progress, 1, __ATOMIC_SEQ_CST);
            fflush(stdout);
            _exit(0);
        }
    }
    void* result = g->failed ? EMU_BLOCK_FAILED : nullptr;  // (a fork that failed)
    for (long left = blocks; left;) {                       // each child, as it ends; one that failed ends the rest
        bool reaped = false;
        for (long i = 0; i < blocks; i++) {
            int status;
            if (!pids[i] || waitpid(pids[i], &status, WNOHANG) != pids[i]) continue;
            pids[i] = 0, left--, reaped = true;
            if (WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == EMU_ABANDONED)) continue;
            __atomic_store_n(&g->failed, 1, __ATOMIC_SEQ_CST);      // (a signal, say, that did not mark it)
            if (!result || (result == EMU_BLOCK_FAILED && g->fault[i]))
                result = WIFEXITED(status) && WEXITSTATUS(status) == EMU_FAULTED && g->fault[i] ? g->fault[i]
                                                                                                 : EMU_BLOCK_FAILED;
        }
        if (left && !reaped) usleep(1000);
    }
    delete[] pids;
    munmap(shared, bytes);
    return result;
}

// decode_layers' stage counters (kernels.cu's stage_arrive, stage_arrive_last and stage_wait, KERNELS_HELPERS),
// each called by every thread of the block: arrive, the block's threads met, then thread 0 adds 1 (the last
// stage's arrival that completes the grid then zeroes the counters for the next pass); wait, thread 0 loads until the
// counter reaches the target, then the block's threads meet. One block after another, a target not met yet never
// is: that fails at once; in a concurrent grid a wait that sees no block arrive anywhere for emu_stall_seconds is a
// deadlock, named (it turns a hang into a failure; nothing passes on timing). A waiting thread 0 yields the CPU
// between its first 64 loads, then sleeps 200 us between loads: the blocks at work have the cores
static int emu_arrive(int* counter) {                            // -> the count before thread 0's 1 (0 elsewhere)
    __syncthreads();
    int before = 0;
    if (threadIdx.x == 0) {
        before = __atomic_fetch_add(counter, 1, __ATOMIC_SEQ_CST);
        if (emu_grid) __atomic_fetch_add(&emu_grid->progress, 1, __ATOMIC_SEQ_CST);
    }
    return before;
}
static void stage_arrive(int* counter) { emu_arrive(counter); }
static void stage_arrive_last(int* counters, int n) {             // the last arrival zeroes the counters
    if (emu_arrive(counters + n - 1) == (int)gridDim.x - 1 && threadIdx.x == 0)
        for (int i = 0; i < n; i++) __atomic_store_n(counters + i, 0, __ATOMIC_SEQ_CST);
}
static double emu_seconds() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static void stage_wait(const int* counter, int target) {
    if (threadIdx.x == 0) {
        int seen = __atomic_load_n(counter, __ATOMIC_ACQUIRE);
        char what[320];
        if (seen < target && !emu_grid) {
            snprintf(what, sizeof what, "a block waits at stage_wait for other blocks, which run one after another "
                     "here (counter at %d, waiting for %d): name the kernel as emulate_cuda.CONCURRENT says "
                     "(decode_layers_...) to run its blocks at once", seen, target);
            emu_fail(what);
        }
        unsigned long long progress = 0;
        double since = 0;
        for (int tries = 0; seen < target; tries++, seen = __atomic_load_n(counter, __ATOMIC_ACQUIRE)) {
            if (__atomic_load_n(&emu_grid->failed, __ATOMIC_SEQ_CST)) _exit(EMU_ABANDONED);  // another block failed
            unsigned long long now = __atomic_load_n(&emu_grid->progress, __ATOMIC_SEQ_CST);
            if (!tries || now != progress) progress = now, since = emu_seconds();
            else if (emu_seconds() - since > emu_stall_seconds) {
                if (__atomic_exchange_n(&emu_grid->failed, 1, __ATOMIC_SEQ_CST)) _exit(EMU_ABANDONED);   // told
                snprintf(what, sizeof what, "a deadlock at stage_wait: counter at %d, waiting for %d (no block of "
                         "the grid arrived anywhere for %g s)", seen, target, emu_stall_seconds);
                emu_fail(what);
            }
            if (tries < 64) sched_yield();
            else usleep(200);                               // (the blocks still at work get the CPUs)
        }
    }
    __syncthreads();
}

// ---- flash_attn.cu's tensor-core helpers (TENSOR_CORE_HELPERS), as the PTX ISA defines them
// cvt.rna.tf32.f32: 10 mantissa bits, to nearest, ties away from zero
static inline unsigned emu_tf32_bits(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) return u;
    return (u + 0x1000u) & 0xFFFFE000u;
}
static unsigned emu_frag[32][32][10];                     // a warp's mma fragments, by lane
static const unsigned short* emu_rows[32][32];            // a warp's ldmatrix row addresses, by lane
static inline float emu_lo(unsigned w) { return __uint_as_float(w << 16); }
static inline float emu_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }
// d (16x8) += a b over the warp: each lane holds its fragments (g = lane / 4, t = lane % 4), A(row, k)
// and B(k, col) read from the lanes that hold them, k summed in order in fp32
template <class FA, class FB>
static void emu_mma(float* d, int K, FA A, FB B) {
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    float out[4];
    for (int i = 0; i < 4; i++) {
        int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float s = d[i];
        for (int k = 0; k < K; k++) s += A(row, k) * B(k, col);
        out[i] = s;
    }
    warp_barrier();                                       // every lane has read the fragments
    for (int i = 0; i < 4; i++) d[i] = out[i];
}
// m16n8k16 bf16: a reg j: rows g (+8 for odd j), k 2t, 2t+1 (+8 for j >= 2); b reg j: k 2t, 2t+1 (+8 for j = 1), col g
static void mma_bf16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    int w = threadIdx.x / 32;
    unsigned* f = emu_frag[w][threadIdx.x % 32];
    f[0] = a[0], f[1] = a[1], f[2] = a[2], f[3] = a[3], f[4] = b0, f[5] = b1;
    warp_barrier();
    auto half = [](unsigned r, int k) { return k % 2 ? emu_hi(r) : emu_lo(r); };
    emu_mma(d, 16, [&](int row, int k) { return half(emu_frag[w][row % 8 * 4 + k % 8 / 2][row / 8 + 2 * (k / 8)], k); },
            [&](int k, int col) { return half(emu_frag[w][col * 4 + k % 8 / 2][4 + k / 8], k); });
}
// m16n8k8 tf32: a reg j: row g (+8 for odd j), k t (+4 for j >= 2); b reg j: k t (+4 for j = 1), col g
static void mma_tf32(float* d, const unsigned* a, const unsigned* b) {
    int w = threadIdx.x / 32;
    unsigned* f = emu_frag[w][threadIdx.x % 32];
    f[0] = a[0], f[1] = a[1], f[2] = a[2], f[3] = a[3], f[4] = b[0], f[5] = b[1];
    warp_barrier();
    auto tf = [](unsigned r) { return __uint_as_float(r & 0xFFFFE000u); };
    emu_mma(d, 8, [&](int row, int k) { return tf(emu_frag[w][row % 8 * 4 + k % 4][row / 8 + 2 * (k / 4)]); },
            [&](int k, int col) { return tf(emu_frag[w][col * 4 + k % 4][4 + k / 4]); });
}
// ldmatrix .x4: lane l gives row l % 8 of matrix l / 8 and receives row g, columns 2t, 2t+1 of each
// matrix (.trans: column g, rows 2t, 2t+1)
static void emu_ldmatrix(unsigned* r, const unsigned short* row, bool trans) {
    int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    emu_rows[w][threadIdx.x % 32] = row;
    warp_barrier();
    for (int i = 0; i < 4; i++) {
        unsigned short lo = trans ? emu_rows[w][8 * i + 2 * t][g] : emu_rows[w][8 * i + g][2 * t];
        unsigned short hi = trans ? emu_rows[w][8 * i + 2 * t + 1][g] : emu_rows[w][8 * i + g][2 * t + 1];
        r[i] = lo | (unsigned)hi << 16;
    }
    warp_barrier();
}
static void ldmatrix_x4(unsigned* r, const unsigned short* row) { emu_ldmatrix(r, row, false); }
static void ldmatrix_x4_trans(unsigned* r, const unsigned short* row) { emu_ldmatrix(r, row, true); }
// cp.async: copied at once (stricter than the GPU: a buffer still being read is overwritten now), or, with late
// copies (emu_set_late_copies), held until the thread's cp.async.wait_group lets its group land, the latest the
// PTX ISA allows (stricter the other way: a tile read before the wait that covers its copy is what was there)
static int emu_late_copies;
extern "C" void emu_set_late_copies(int late) { emu_late_copies = late; }
struct EmuCopy { void* dst; unsigned char bytes[16]; int n, group; };
static const int EMU_COPIES = 256;
static EmuCopy emu_copies[1024][EMU_COPIES];             // by thread: issued, not landed, in order
static int emu_copies_held[1024], emu_copy_groups[1024];  // how many; groups committed
static void emu_copies_block() {
    memset(emu_copies_held, 0, sizeof emu_copies_held);
    memset(emu_copy_groups, 0, sizeof emu_copy_groups);
}
static void emu_copy(void* dst, const void* src, int n, bool valid) {
    unsigned t = threadIdx.x;
    if (!emu_late_copies) {
        if (valid) memcpy(dst, src, n); else memset(dst, 0, n);
        return;
    }
    if (emu_copies_held[t] == EMU_COPIES) emu_fail("more cp.async in flight than the emulator keeps (256)");
    EmuCopy& c = emu_copies[t][emu_copies_held[t]++];
    c.dst = dst, c.n = n, c.group = emu_copy_groups[t];
    if (valid) memcpy(c.bytes, src, n); else memset(c.bytes, 0, n);
}
// the thread's copies of groups before `groups` land
static void emu_copies_land(int groups) {
    unsigned t = threadIdx.x;
    int kept = 0;
    for (int i = 0; i < emu_copies_held[t]; i++) {
        EmuCopy& c = emu_copies[t][i];
        if (c.group < groups) memcpy(c.dst, c.bytes, c.n);
        else emu_copies[t][kept++] = c;
    }
    emu_copies_held[t] = kept;
}
static void emu_copies_exit() { emu_copies_land(1 << 30); }
static void cp_async16(unsigned short* dst, const unsigned short* src, bool valid) { emu_copy(dst, src, 16, valid); }
static void cp_async4(float* dst, const float* src, bool valid) { emu_copy(dst, src, 4, valid); }
static void cp_async_commit() { emu_copy_groups[threadIdx.x]++; }
template <int N> static void cp_async_wait() { emu_copies_land(emu_copy_groups[threadIdx.x] - N); }

// ---- Hopper's warpgroup MMA (WGMMA_HELPERS: wgmma.mma_async from shared memory, sm_90a), as the PTX ISA defines it
// A warpgroup is 4 warps, threads 128 g .. 128 g + 127. wgmma_bf16<N> computes d (64 x N, fp32, spread over the
// warpgroup's registers) = a (64 x 16) b (16 x N) (+ d), bf16 a and b read from shared memory through matrix
// descriptors (wgmma_bf16_rs: a from registers). It is asynchronous: here each thread queues it, and it is done
// when wgmma.wait_group lets it be (the latest a GPU may finish it), by the last thread of the warpgroup to arrive
// there, for all 128: an operand overwritten, or an accumulator read, before the wait gives a wrong result. What
// a GPU leaves undefined fails, named: a wgmma with no wgmma.fence since the thread last waited, shapes or
// descriptors that differ between the warpgroup's threads, an operand outside dynamic shared memory, a thread
// that exits with a wgmma in flight.
static void emu_fail(const char* what) {
    fprintf(stderr, "emulator: %s (thread %u of block %u)\n", what, threadIdx.x, blockIdx.x);
    if (emu_grid) emu_grid_failed(), fflush(stdout), _exit(EMU_FAILED);     // a block of a concurrent grid
    abort();
}
// shared addresses: dynamic shared memory alone has them, from EMU_SHARED_START (16-byte aligned, not more: a
// kernel aligns its swizzled tiles itself, as on a GPU)
static const unsigned EMU_SHARED_START = 16;
static unsigned shared_address(const void* p) {
    const char* c = (const char*)p;
    if (c < emu_dynamic_shared || c >= emu_dynamic_shared + sizeof emu_dynamic_shared)
        emu_fail("the shared address of memory outside dynamic shared memory (only extern __shared__ has one here)");
    return (unsigned)(c - emu_dynamic_shared) + EMU_SHARED_START;
}
static float emu_shared_bf16(unsigned address) {
    if (address < EMU_SHARED_START || address + 2 > EMU_SHARED_START + sizeof emu_dynamic_shared)
        emu_fail("a wgmma operand outside dynamic shared memory");
    unsigned short bits;
    memcpy(&bits, emu_dynamic_shared + (address - EMU_SHARED_START), 2);
    return __uint_as_float((unsigned)bits << 16);
}
// element (mn, k) of a bf16 wgmma operand (mn: a row of a, a column of b) -> its shared address. The descriptor:
// bits 0-13 start address >> 4, 16-29 leading byte offset (LBO) >> 4, 32-45 stride byte offset (SBO) >> 4, 49-51
// base offset, 62-63 swizzle (0 none, 1 128-byte, 2 64-byte, 3 32-byte). The canonical layouts (PTX ISA, "shared
// memory matrix layout"; CUTLASS's make_gmma_desc), K-major (trans 0) or MN-major (trans 1):
// - no swizzle ("interleave"): 8 x 8 core matrices of 8 rows of 16 contiguous bytes (128 bytes together); K-major,
//   a row is 8 k of one mn, core matrices LBO apart along k and SBO along mn; MN-major, a row is 8 mn of one k,
//   core matrices SBO apart along mn and LBO along k.
// - swizzled, rows of S = 32, 64 or 128 bytes: K-major, a row holds S/2 k of one mn, groups of 8 rows SBO apart
//   (LBO unused); MN-major, a row holds S/2 mn of one k, groups of 8 k SBO apart, groups of S/2 mn LBO apart.
//   Then the address's 16-byte chunk (bits 4..) is XORed with its row in the 8 of a pattern (bits 7..):
//   Swizzle<log2(S/16), 4, 3> on the address itself, so a tile starts at a multiple of 8 S (its rows 0..7).
static unsigned emu_wgmma_address(unsigned long long desc, int mn, int k, bool mn_major) {
    unsigned start = (desc & 0x3FFF) << 4, lbo = (desc >> 16 & 0x3FFF) << 4, sbo = (desc >> 32 & 0x3FFF) << 4;
    int mode = desc >> 62, chunks = mode ? 16 >> mode : 1;          // 16-byte chunks a swizzled row: 8, 4, 2
    if (desc >> 49 & 7) emu_fail("a wgmma descriptor with a base offset (not emulated: start tiles at row 0 of 8)");
    if (start >> 7 & (chunks - 1))
        emu_fail("a swizzled wgmma operand starting inside its 8-row pattern (bits 7.. of the start address)");
    unsigned a;
    if (mode == 0)
        a = mn_major ? start + mn / 8 * sbo + k / 8 * lbo + k % 8 * 16 + mn % 8 * 2
                     : start + mn / 8 * sbo + k / 8 * lbo + mn % 8 * 16 + k % 8 * 2;
    else
        a = mn_major ? start + mn / (8 * chunks) * lbo + k / 8 * sbo + k % 8 * 16 * chunks + mn % (8 * chunks) * 2
                     : start + mn / 8 * sbo + mn % 8 * 16 * chunks + k * 2;
    return a ^ (a >> 7 & (chunks - 1)) << 4;
}
struct EmuWgmma { float* d; unsigned long long a, b; int n, scale_d, trans_a, trans_b; unsigned ra[4]; };
static const int EMU_WGMMA_QUEUE = 64;
static EmuWgmma emu_wgmma_ops[1024][EMU_WGMMA_QUEUE];    // by thread: issued, not yet done, in order
static int emu_wgmma_issued[1024], emu_wgmma_groups[1024], emu_wgmma_keep[1024];
static int emu_wgmma_group_end[1024][EMU_WGMMA_QUEUE];  // committed groups, each the end of its ops in the queue
static bool emu_wgmma_fenced[1024];
static void emu_async_block();                          // no mbarrier, TMA copy or named barrier yet
static void emu_wgmma_block() {
    emu_async_block();
    memset(wg_arrived, 0, sizeof wg_arrived);
    memset(emu_wgmma_issued, 0, sizeof emu_wgmma_issued), memset(emu_wgmma_groups, 0, sizeof emu_wgmma_groups);
    memset(emu_wgmma_fenced, 0, sizeof emu_wgmma_fenced);
}
static void emu_wgmma_exit() {
    unsigned t = threadIdx.x;
    if (emu_wgmma_issued[t] || emu_wgmma_groups[t]) emu_fail("a thread exits with a wgmma not waited for");
    if (wg_arrived[t / 128]) emu_fail("a thread exits while its warpgroup waits at wgmma.wait_group");
}
// element (row, k) of a: from shared memory, or (trans_a 2) from the registers of the warp's lanes, as mma.sync's
// m16n8k16 a fragment: register j of lane l holds row l / 4 (+ 8 for odd j), k 2 (l % 4), +1 (+ 8 for j >= 2)
static float emu_wgmma_a(int j, unsigned t, int row, int k) {
    const EmuWgmma& op = emu_wgmma_ops[t][j];
    if (op.trans_a != 2) return emu_shared_bf16(emu_wgmma_address(op.a, row, k, op.trans_a));
    unsigned r = emu_wgmma_ops[t - t % 32 + row % 8 * 4 + k % 8 / 2][j].ra[row % 16 / 8 + 2 * (k / 8)];
    return k % 2 ? emu_hi(r) : emu_lo(r);
}
// wgmma j of thread t. m64nNk16 accumulators: register i of thread t holds row 16 (warp in group) + t % 32 / 4
// (+ 8 for i % 4 >= 2), column 8 (i / 4) + 2 (t % 4) + i % 2 (mma.sync's m16n8 fragment, one per 8 columns, a
// warp per 16 rows)
static void emu_wgmma_run(int j, unsigned t) {
    const EmuWgmma& op = emu_wgmma_ops[t][j];
    int w = t % 128 / 32, g = t % 32 / 4, q = t % 4;
    for (int i = 0; i < op.n / 2; i++) {
        int row = 16 * w + g + 8 * (i / 2 % 2), col = 8 * (i / 4) + 2 * q + i % 2;
        float s = op.scale_d ? op.d[i] : 0.0f;
        for (int k = 0; k < 16; k++)
            s += emu_wgmma_a(j, t, row, k) * emu_shared_bf16(emu_wgmma_address(op.b, col, k, op.trans_b));
        op.d[i] = s;
    }
}
// warpgroup g's groups older than the newest `keep`, done for its 128 threads, which must agree on them
static void emu_wgmma_done(int g) {
    unsigned t0 = 128 * g;
    int keep = emu_wgmma_keep[t0], groups = emu_wgmma_groups[t0], issued = emu_wgmma_issued[t0];
    int finished = max(groups - keep, 0), ops = finished ? emu_wgmma_group_end[t0][finished - 1] : 0;
    for (unsigned t = t0; t < t0 + 128; t++) {
        bool same = emu_wgmma_keep[t] == keep && emu_wgmma_groups[t] == groups && emu_wgmma_issued[t] == issued;
        for (int j = 0; same && j < groups; j++) same = emu_wgmma_group_end[t][j] == emu_wgmma_group_end[t0][j];
        for (int j = 0; same && j < issued; j++) {
            const EmuWgmma &x = emu_wgmma_ops[t][j], &y = emu_wgmma_ops[t0][j];
            same = x.a == y.a && x.b == y.b && x.n == y.n && x.scale_d == y.scale_d && x.trans_a == y.trans_a &&
                   x.trans_b == y.trans_b;
        }
        if (!same) emu_fail("the threads of a warpgroup differ in their wgmma (descriptors, shapes, groups or waits)");
    }
    for (unsigned t = t0; t < t0 + 128; t++)                 // every thread's first: a register a is read from
        for (int j = 0; j < ops; j++) emu_wgmma_run(j, t);  // the other lanes' queues, at the same place in each
    for (unsigned t = t0; t < t0 + 128; t++) {
        for (int j = ops; j < issued; j++) emu_wgmma_ops[t][j - ops] = emu_wgmma_ops[t][j];
        for (int j = finished; j < groups; j++) emu_wgmma_group_end[t][j - finished] = emu_wgmma_group_end[t][j] - ops;
        emu_wgmma_issued[t] -= ops, emu_wgmma_groups[t] -= finished;
    }
}
static void emu_wgmma_check_group() {
    if (blockDim.x < threadIdx.x / 128 * 128 + 128)
        emu_fail("a wgmma instruction in a warpgroup of fewer than 128 threads");
}
static void fence_proxy_async() {}                       // memory order is not emulated
static void wgmma_fence() { emu_wgmma_fenced[threadIdx.x] = true; }
static void emu_wgmma_issue(const EmuWgmma& op) {
    unsigned t = threadIdx.x;
    emu_wgmma_check_group();
    if (!emu_wgmma_fenced[t]) emu_fail("a wgmma.mma_async with no wgmma.fence since the thread last waited");
    if (emu_wgmma_issued[t] == EMU_WGMMA_QUEUE) emu_fail("more wgmma in flight than the emulator keeps (64)");
    emu_wgmma_ops[t][emu_wgmma_issued[t]++] = op;
}
template <int N, int TRANS_A, int TRANS_B>
static void wgmma_bf16(float* d, unsigned long long a, unsigned long long b, int scale_d) {
    emu_wgmma_issue(EmuWgmma{d, a, b, N, scale_d, TRANS_A, TRANS_B, {}});
}
// a from the 4 registers of mma.sync's a fragment (their values taken at issue: the GPU's may be read later)
template <int N, int TRANS_B>
static void wgmma_bf16_rs(float* d, const unsigned* a, unsigned long long b, int scale_d) {
    emu_wgmma_issue(EmuWgmma{d, 0, b, N, scale_d, 2, TRANS_B, {a[0], a[1], a[2], a[3]}});
}
static void wgmma_commit() {
    unsigned t = threadIdx.x;
    if (emu_wgmma_groups[t] == EMU_WGMMA_QUEUE) emu_fail("more wgmma groups in flight than the emulator keeps (64)");
    emu_wgmma_group_end[t][emu_wgmma_groups[t]++] = emu_wgmma_issued[t];
}
// wgmma.wait_group N: a barrier of the warpgroup; the last to arrive does the groups older than the newest N
template <int N> static void wgmma_wait() {
    unsigned t = threadIdx.x, g = t / 128;
    emu_wgmma_check_group();
    for (int w = 4 * g; w < 4 * g + 4; w++)
        if (warp_live[w] != 32) emu_fail("a wgmma.wait_group in a warpgroup one of whose threads has exited");
    emu_wgmma_keep[t] = N;
    unsigned gen = wg_gen[g];
    emu_events++, emu_wait_kind[t] = 3;
    if (++wg_arrived[g] == 128) emu_wgmma_done(g), wg_arrived[g] = 0, wg_gen[g]++;
    while (wg_gen[g] == gen) yield_fiber();
    emu_wgmma_fenced[t] = false;
}

// ---- Hopper's mbarriers, TMA, named barriers and setmaxnreg (TMA_HELPERS), as the PTX ISA defines them
// An mbarrier is 8 bytes of shared memory (dynamic, 8-byte aligned, here). mbarrier.init sets its phase 0, its
// expected arrival count (its pending count too) and its tx-count 0; arrive takes one from the pending count,
// expect_tx adds to the tx-count, a TMA copy's complete_tx takes its bytes from it; when the pending count and the
// tx-count are both 0 the phase is complete: the next begins, with the pending count reset. try_wait.parity P is
// true when the phase of parity P has completed: the current phase's parity differs from P. Refused by name: an
// operation on 8 bytes mbarrier.init did not set up or that were written since (the emulator keeps its state
// aside and a tag in the 8 bytes), a copy whose bytes come after its phase completed or outrun expect_tx (a tx-count
// below 0 with no arrival pending), every thread waiting for what no one will do (a deadlock, named with what each
// waits for: a try_wait on a phase that never completes, expect_tx announcing more bytes than the copies bring).
struct EmuMbarrier { bool init; int count, pending; long long tx; unsigned phase; };
static EmuMbarrier emu_mbar[sizeof emu_dynamic_shared / 8];
static const unsigned long long EMU_MBAR_TAG = 0x6d62617272696572ull;   // "mbarrier"
static EmuMbarrier& emu_mbarrier(unsigned address) {
    if (address % 8) emu_fail("an mbarrier at a shared address that is not a multiple of 8");
    unsigned long long tag;
    memcpy(&tag, emu_dynamic_shared + (address - EMU_SHARED_START), 8);
    EmuMbarrier& m = emu_mbar[(address - EMU_SHARED_START) / 8];
    if (!m.init) emu_fail("an mbarrier operation on 8 bytes that mbarrier.init did not set up");
    if (tag != EMU_MBAR_TAG) emu_fail("an mbarrier whose 8 bytes were written since mbarrier.init");
    return m;
}
static void emu_mbarrier_complete(EmuMbarrier& m) {      // the phase completes when nothing is pending
    if (m.pending == 0 && m.tx < 0)
        emu_fail("an mbarrier's phase received more bytes (complete_tx) than expect_tx announced");
    if (m.pending == 0 && m.tx == 0) m.phase++, m.pending = m.count, emu_events++;
}
static void mbarrier_init(unsigned long long* bar, unsigned count) {
    unsigned address = shared_address(bar);
    if (address % 8) emu_fail("an mbarrier at a shared address that is not a multiple of 8");
    if (count < 1 || count > (1u << 20) - 1) emu_fail("mbarrier.init with a count outside 1 .. 2^20 - 1");
    emu_mbar[(address - EMU_SHARED_START) / 8] = EmuMbarrier{true, (int)count, (int)count, 0, 0};
    memcpy(bar, &EMU_MBAR_TAG, 8);
    emu_events++;
}
static void fence_mbarrier_init() {}                     // memory order is not emulated
static void mbarrier_expect_tx(unsigned long long* bar, unsigned bytes) {
    emu_mbarrier(shared_address(bar)).tx += bytes, emu_events++;
}
static void mbarrier_arrive(unsigned long long* bar) {
    EmuMbarrier& m = emu_mbarrier(shared_address(bar));
    m.pending--, emu_events++;
    emu_mbarrier_complete(m);
}
static void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    EmuMbarrier& m = emu_mbarrier(shared_address(bar));
    m.tx += bytes;                                        // expect-tx, then arrive-on
    m.pending--, emu_events++;
    emu_mbarrier_complete(m);
}
// try_wait: false after letting the other threads run once (a GPU's may wait a while first)
static bool mbarrier_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned address = shared_address(bar);
    if ((emu_mbarrier(address).phase & 1) != (parity & 1)) return true;
    emu_wait_kind[threadIdx.x] = 4, emu_wait_at[threadIdx.x] = address, emu_wait_parity[threadIdx.x] = parity;
    yield_fiber();
    return false;
}

// TMA: cp.async.bulk.tensor.2d global -> shared through a tensor map that the stand-in driver's
// cuTensorMapEncodeTiled writes in its own form (EmuTensorMap, 128 bytes as CUtensorMap). A copy is queued at
// issue and done when every thread of the block waits (the latest the async proxy may), then its bytes complete on
// its mbarrier: a read before the wait sees the old tile. The box lands as rows of box[0] elements one after
// the other, an element outside the tensor 0, the swizzle (32, 64, 128 bytes) XORing the address's 16-byte
// chunk (bits 4..) with bits 7.. as wgmma reads it back. Refused: a map the driver did not make, a destination
// not 128-byte aligned (1024 when swizzled: the pattern's start), a tile out of dynamic shared memory, a box whose
// first element is not 16-byte aligned (x times the element's bytes no multiple of 16: an H100 stops the kernel
// with CUDA_ERROR_ILLEGAL_INSTRUCTION, as the TMA dk/dv pass's lse copies at T 150 did; loads and stores).
struct EmuTensorMap { unsigned long long tag, address, element, rank, dim[2], stride, box[2], swizzle, pad[6]; };
static const unsigned long long EMU_TMAP_TAG = 0x656d752d746d6170ull;   // "emu-tmap"
struct EmuTma { EmuTensorMap map; unsigned dst, bar, phase; int x, y; };
static const int EMU_TMA_QUEUE = 256;
static EmuTma emu_tma[EMU_TMA_QUEUE];
static int emu_tma_count;
static bool emu_tma_pending() { return emu_tma_count > 0; }
static void tma_load_2d(void* dst, const void* map, int x, int y, unsigned long long* bar) {
    EmuTma op;
    memcpy(&op.map, map, sizeof op.map);
    if (op.map.tag != EMU_TMAP_TAG || op.map.rank != 2)
        emu_fail("cp.async.bulk.tensor.2d with a tensor map that cuTensorMapEncodeTiled did not make (rank 2)");
    op.dst = shared_address(dst), op.bar = shared_address(bar), op.x = x, op.y = y;
    op.phase = emu_mbarrier(op.bar).phase;
    if ((long long)x * (long long)op.map.element % 16)
        emu_fail("a TMA copy whose first element is not 16-byte aligned (x times the element's bytes no multiple of "
                 "16: CUDA_ERROR_ILLEGAL_INSTRUCTION on an H100)");
    if (op.dst % (op.map.swizzle ? 1024 : 128))
        emu_fail("a TMA destination not 128-byte aligned (1024 with a swizzle: not emulated)");
    unsigned long long bytes = op.map.box[0] * op.map.box[1] * op.map.element;
    if (op.dst - EMU_SHARED_START + bytes > sizeof emu_dynamic_shared)
        emu_fail("a TMA tile past dynamic shared memory");
    if (emu_tma_count == EMU_TMA_QUEUE) emu_fail("more TMA copies in flight than the emulator keeps (256)");
    emu_tma[emu_tma_count++] = op, emu_events++;
}
static void emu_tma_copy(const EmuTma& op) {
    const EmuTensorMap& m = op.map;
    unsigned row = m.box[0] * m.element;
    for (unsigned r = 0; r < m.box[1]; r++)
        for (unsigned e = 0; e < m.box[0]; e++) {
            long long gx = (long long)op.x + e, gy = (long long)op.y + r;
            unsigned a = op.dst + r * row + e * m.element;
            a ^= (m.swizzle ? a >> 7 & (m.swizzle / 16 - 1) : 0) << 4;
            char* to = emu_dynamic_shared + (a - EMU_SHARED_START);
            if (gx < 0 || gy < 0 || gx >= (long long)m.dim[0] || gy >= (long long)m.dim[1]) memset(to, 0, m.element);
            else memcpy(to, (const char*)m.address + gy * m.stride + gx * m.element, m.element);
        }
    EmuMbarrier& b = emu_mbarrier(op.bar);
    if (b.phase != op.phase)
        emu_fail("a TMA copy's bytes came after the mbarrier phase it was issued in completed (expect_tx too small?)");
    b.tx -= (long long)m.box[0] * m.box[1] * m.element;
    emu_mbarrier_complete(b);
}
static void emu_tma_complete() {
    int n = emu_tma_count;
    emu_tma_count = 0;
    for (int i = 0; i < n; i++) emu_tma_copy(emu_tma[emu_reverse ? n - 1 - i : i]);
    emu_events++;
}

// TMA stores: cp.async.bulk.tensor.2d global <- shared through a tensor map, the box read from shared memory as a
// load lays it (the swizzle too), elements outside the tensor not written. A store joins the issuing thread's open
// bulk group, which cp.async.bulk.commit_group closes; it is queued at issue and done when that thread's
// cp.async.bulk.wait_group.read N lets the thread past it (the latest a GPU may read the box): a box written
// again before its wait is stored with the new values. Refused: a source not 128-byte aligned (1024 when
// swizzled), a box past dynamic shared memory, a thread that exits with stores not waited for, a box whose first
// element is not 16-byte aligned (as loads).
struct EmuTmaStore { EmuTensorMap map; unsigned src, thread; int x, y, group; };     // group -1: not committed
static const int EMU_STORE_QUEUE = 256;
static EmuTmaStore emu_stores[EMU_STORE_QUEUE];
static int emu_store_count, emu_bulk_groups[1024];       // a thread's committed bulk groups so far
static void tma_store_2d(const void* map, const void* src, int x, int y) {
    EmuTmaStore op;
    memcpy(&op.map, map, sizeof op.map);
    if (op.map.tag != EMU_TMAP_TAG || op.map.rank != 2)
        emu_fail("a TMA store with a tensor map that cuTensorMapEncodeTiled did not make (rank 2)");
    op.src = shared_address(src), op.thread = threadIdx.x, op.x = x, op.y = y, op.group = -1;
    if ((long long)x * (long long)op.map.element % 16)
        emu_fail("a TMA store whose first element is not 16-byte aligned (x times the element's bytes no multiple "
                 "of 16: CUDA_ERROR_ILLEGAL_INSTRUCTION on an H100)");
    if (op.src % (op.map.swizzle ? 1024 : 128))
        emu_fail("a TMA store's source not 128-byte aligned (1024 with a swizzle: not emulated)");
    if (op.src - EMU_SHARED_START + op.map.box[0] * op.map.box[1] * op.map.element > sizeof emu_dynamic_shared)
        emu_fail("a TMA store's box past dynamic shared memory");
    if (emu_store_count == EMU_STORE_QUEUE) emu_fail("more TMA stores in flight than the emulator keeps (256)");
    emu_stores[emu_store_count++] = op, emu_events++;
}
static void bulk_commit() {
    for (int i = 0; i < emu_store_count; i++)
        if (emu_stores[i].thread == threadIdx.x && emu_stores[i].group < 0)
            emu_stores[i].group = emu_bulk_groups[threadIdx.x];
    emu_bulk_groups[threadIdx.x]++;
}
static void emu_tma_store(const EmuTmaStore& op) {
    const EmuTensorMap& m = op.map;
    for (unsigned r = 0; r < m.box[1]; r++)
        for (unsigned e = 0; e < m.box[0]; e++) {
            long long gx = (long long)op.x + e, gy = (long long)op.y + r;
            unsigned from = op.src + r * m.box[0] * m.element + e * m.element;
            from ^= (m.swizzle ? from >> 7 & (m.swizzle / 16 - 1) : 0) << 4;
            if (gx >= 0 && gy >= 0 && gx < (long long)m.dim[0] && gy < (long long)m.dim[1])
                memcpy((char*)m.address + gy * m.stride + gx * m.element,
                       emu_dynamic_shared + (from - EMU_SHARED_START), m.element);
        }
}
// this thread's stores of groups older than its newest N, done in issue order (reversed with emu_reverse)
template <int N> static void bulk_wait_read() {
    static EmuTmaStore ops[EMU_STORE_QUEUE];
    int n = 0, k = 0;
    for (int i = 0; i < emu_store_count; i++) {
        const EmuTmaStore& op = emu_stores[i];
        bool finished = op.thread == threadIdx.x && op.group >= 0 && op.group < emu_bulk_groups[threadIdx.x] - N;
        if (finished) ops[k++] = op;
        else emu_stores[n++] = op;
    }
    emu_store_count = n, emu_events++;
    for (int i = 0; i < k; i++) emu_tma_store(ops[emu_reverse ? k - 1 - i : i]);
}
static void emu_async_exit() {
    for (int i = 0; i < emu_store_count; i++)
        if (emu_stores[i].thread == threadIdx.x) emu_fail("a thread exits with a TMA store not waited for");
}

// named barriers 1 .. 15: bar.sync id, n waits until n threads (a multiple of 32) have arrived by bar.sync or
// bar.arrive (which does not wait); barrier 0 is __syncthreads's. Refused: an id outside 1 .. 15, a count not a
// multiple of 32 or that differs from the phase's first, more threads than the block has.
static int emu_named_arrived[16], emu_named_count[16];
static unsigned emu_named_gen[16];
static unsigned emu_named_arrive(int id, int n) {
    if (id < 1 || id > 15) emu_fail("a named barrier outside 1 .. 15 (0 is __syncthreads's)");
    if (n < 32 || n % 32 || n > (int)blockDim.x)
        emu_fail("a named barrier's thread count not a multiple of 32 of the block");
    if (emu_named_arrived[id] && emu_named_count[id] != n)
        emu_fail("threads arriving at a named barrier with different thread counts");
    unsigned gen = emu_named_gen[id];
    emu_named_count[id] = n, emu_events++;
    if (++emu_named_arrived[id] == n) emu_named_arrived[id] = 0, emu_named_gen[id]++;
    return gen;
}
static void named_barrier_sync(int id, int n) {
    unsigned gen = emu_named_arrive(id, n);
    emu_wait_kind[threadIdx.x] = 5, emu_wait_at[threadIdx.x] = id;
    while (emu_named_gen[id] == gen) yield_fiber();
}
static void named_barrier_arrive(int id, int n) { emu_named_arrive(id, n); }

// setmaxnreg.inc / .dec: a warpgroup's register budget, nothing to do here; N as the PTX ISA allows it
template <int N> static void setmaxnreg_inc() { static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg"); }
template <int N> static void setmaxnreg_dec() { static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg"); }

static void emu_async_block() {
    memset(emu_mbar, 0, sizeof emu_mbar), emu_tma_count = 0, emu_store_count = 0;
    memset(emu_bulk_groups, 0, sizeof emu_bulk_groups);
    memset(emu_named_arrived, 0, sizeof emu_named_arrived), memset(emu_wait_kind, 0, sizeof emu_wait_kind);
}
static void emu_deadlock() {                             // each different wait, with the threads at it
    int live_threads = 0, first = -1;
    for (int t = 0; t < (int)blockDim.x; t++)
        if (!fibers[t].done) live_threads++, first = first < 0 ? t : first;
    fprintf(stderr, "emulator: a deadlock: the block's %d live threads all wait, for what none of them will do:\n",
            live_threads);
    for (int t = 0; t < (int)blockDim.x; t++) {
        int k = emu_wait_kind[t], n = 0, seen = 0;
        if (fibers[t].done) continue;
        for (int u = 0; u < (int)blockDim.x; u++) {
            bool same = !fibers[u].done && emu_wait_kind[u] == k &&
                        (k < 4 || (emu_wait_at[u] == emu_wait_at[t] && emu_wait_parity[u] == emu_wait_parity[t]));
            n += same, seen += same && u < t;
        }
        if (seen) continue;                                // told with the first thread at the same wait
        char what[320];
        if (k == 4) {
            const EmuMbarrier& m = emu_mbar[(emu_wait_at[t] - EMU_SHARED_START) / 8];
            snprintf(what, sizeof what, "an mbarrier's try_wait.parity %u at shared address %u (its phase %u: %d of "
                     "%d arrivals pending, tx-count %lld bytes)", emu_wait_parity[t], emu_wait_at[t], m.phase,
                     m.pending, m.count, m.tx);
        } else if (k == 5)
            snprintf(what, sizeof what, "named barrier %u (%d of %d threads arrived)", emu_wait_at[t],
                     emu_named_arrived[emu_wait_at[t]], emu_named_count[emu_wait_at[t]]);
        else
            snprintf(what, sizeof what, "%s", EMU_WAITS[k]);
        fprintf(stderr, "  %d thread(s) from thread %d wait at %s\n", n, t, what);
    }
    threadIdx = dim3e{(unsigned)first, 0, 0};
    emu_fail("a deadlock");
}
#undef INFINITY
"""

API = r"""
struct Kernel { const char* name; int n; size_t sizes[16]; void (*thunk)(void**); bool concurrent; };
%(thunks)s
static Kernel table[] = {
%(table)s
};
struct Launch { int k; dim3e grid; int block; void* args[16]; alignas(64) char values[16][128]; };
extern "C" int emu_kernel(const char* name) {
    for (int i = 0; i < (int)(sizeof(table) / sizeof(table[0])); i++)
        if (!strcmp(table[i].name, name)) return i;
    return -1;
}
extern "C" void* emu_launch(int k, int gx, int gy, int gz, int block, void** params) {  // the values, copied
    Launch* l = new Launch;
    l->k = k, l->grid = dim3e{(unsigned)gx, (unsigned)gy, (unsigned)gz}, l->block = block;
    for (int i = 0; i < table[k].n; i++) memcpy(l->values[i], params[i], table[k].sizes[i]), l->args[i] = l->values[i];
    return l;
}
static void launch_body(void* p) { Launch* l = (Launch*)p; table[l->k].thunk(l->args); }
// A read or write past the end of an allocation meets the page after it, which no one may touch
// (Driver.alloc): the SIGSEGV jumps out of the kernel, and emu_run returns its address (the
// grid's fibers are set up afresh by the next launch); in a block's process of a concurrent grid
// it ends the process, the address left for run_grid_concurrent. A fault outside a kernel goes on
// to the handler that was there before.
static bool emu_running = false;
static void* emu_fault_address;
static sigjmp_buf emu_fault_jb;
static struct sigaction emu_before;
static void emu_fault(int sig, siginfo_t* info, void* context) {
    if (emu_running && emu_grid) {
        emu_grid->fault[emu_block_slot] = info->si_addr;
        emu_grid_failed();
        _exit(EMU_FAULTED);
    }
    if (emu_running) {
        emu_fault_address = info->si_addr;
        siglongjmp(emu_fault_jb, 1);
    }
    sigaction(SIGSEGV, &emu_before, nullptr);            // the faulting access, run again, reaches it
}
// -> nullptr, or the address a kernel may not touch, or EMU_BLOCK_FAILED (a block of a concurrent grid failed,
// its message on stderr)
extern "C" void* emu_run(void* p) {
    static bool installed = false;
    if (!installed) {
        struct sigaction act = {};
        act.sa_sigaction = emu_fault, act.sa_flags = SA_SIGINFO;
        sigaction(SIGSEGV, &act, &emu_before);
        installed = true;
    }
    Launch* l = (Launch*)p;
    emu_fault_address = nullptr;
    if (sigsetjmp(emu_fault_jb, 1)) {
        emu_running = false;
        return emu_fault_address ? emu_fault_address : (void*)-1;
    }
    emu_running = true;
    void* result = nullptr;
    if (table[l->k].concurrent) result = run_grid_concurrent(l->grid, l->block, launch_body, l);
    else run_grid(l->grid, l->block, launch_body, l);
    emu_running = false;
    return result;
}
extern "C" void emu_free(void* p) { delete (Launch*)p; }
"""


# the inline PTX that kernels.cu runs outside `#if __CUDA_ARCH__` blocks, as C++: the
# conversions to bf16 (one value, or two packed: the first operand into the upper half)
PTX = [(r'asm\("cvt\.rn\.bf16\.f32 %0, %1;" : "=h"\((\w+)\) : "f"\(([^()]+)\)\);', r"\1 = emu_bf16_bits(\2);"),
       (r'asm\("cvt\.rn\.bf16x2\.f32 %0, %1, %2;" : "=r"\((\w+)\) : "f"\(([^()]+)\), "f"\(([^()]+)\)\);',
        r"\1 = (unsigned)emu_bf16_bits(\2) << 16 | emu_bf16_bits(\3);"),
       (r'asm\("cvt\.rna\.tf32\.f32 %0, %1;" : "=r"\((\w+)\) : "f"\(([^()]+)\)\);', r"\1 = emu_tf32_bits(\2);")]


# kernels whose grid runs all at once (run_grid_concurrent: a block a process), by the start of their names: a
# persistent kernel's blocks wait on each other at stage_wait, which one block after another would never get past
CONCURRENT = ("decode_layers_",)


def emulator_source(kernels, defines=()):
    """a .cu file's text -> C++ for g++: the emulator, the defines (-DNAME=VALUE), the
    kernels, a table of entry points"""
    src = re.sub(r"extern __shared__ (?:__align__\(\d+\) )?(\w[\w ]*?) (\w+)\[\];",
                 r"\1* \2 = (\1*)emu_dynamic_shared;", kernels)
    src = src.replace("__shared__", "static")
    for pattern, replacement in PTX:
        src = re.sub(pattern, replacement, src)
    head = "".join("#define {} {}\n".format(*d[2:].split("=", 1)) for d in defines)
    entries = re.findall(r'extern "C" __global__ void\s*(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(([^)]*)\)', src)
    thunks, rows = [], []
    for i, (name, params) in enumerate(entries):
        types = [re.sub(r"\s*\b\w+$", "", " ".join(p.split())) for p in params.split(",")]
        args = ", ".join(f"*({t}*)a[{j}]" for j, t in enumerate(types))
        thunks.append(f"static void thunk_{i}(void** a) {{ {name}({args}); }}")
        rows.append(f'  {{"{name}", {len(types)}, {{{", ".join(f"sizeof({t})" for t in types)}}}, thunk_{i}, '
                    f'{str(name.startswith(CONCURRENT)).lower()}}}')
    return EMULATOR + head + src + API % {"thunks": "\n".join(thunks), "table": ",\n".join(rows)}


# flash_attn.cu's helpers whose inline PTX (mma.sync, ldmatrix, cp.async) the emulator's
# header defines in C++ instead
TENSOR_CORE_HELPERS = ("shared_address", "mma_tf32", "mma_bf16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async16",
                       "cp_async4", "cp_async_commit", "cp_async_wait")


def without_helpers(text, names=TENSOR_CORE_HELPERS):
    """text less the definitions of the __device__ functions `names` (one line, or up to the
    first line that is a lone closing brace; a template line before one goes too)"""
    lines, out, skip = text.split("\n"), [], False
    for i, line in enumerate(lines):
        if skip:
            skip = line != "}"
            continue
        m = re.match(r"__device__ __forceinline__ [\w ]+?\b(\w+)\(", line)
        if m and m.group(1) in names:
            if out and out[-1].startswith("template"):
                out.pop()
            skip = not line.rstrip().endswith("}")
            continue
        out.append(line)
    return "\n".join(out)


# the helpers of a kernel file that uses Hopper's warpgroup MMA (dev/variants/wgmma_probe.cu) whose inline PTX
# (wgmma, its fence, commit and wait, fence.proxy.async) the emulator's header defines in C++ instead
WGMMA_HELPERS = ("shared_address", "fence_proxy_async", "wgmma_fence", "wgmma_bf16", "wgmma_bf16_rs", "wgmma_commit",
                 "wgmma_wait")


# the helpers of a kernel file that feeds wgmma by TMA (dev/variants/wgmma_probe.cu's wgmma_tma_gemm): mbarriers,
# TMA, named barriers, setmaxnreg, whose inline PTX the emulator's header defines in C++ instead
TMA_HELPERS = ("mbarrier_init", "fence_mbarrier_init", "mbarrier_expect_tx", "mbarrier_arrive",
               "mbarrier_arrive_expect_tx", "mbarrier_try_wait", "tma_load_2d", "named_barrier_sync",
               "named_barrier_arrive", "setmaxnreg_inc", "setmaxnreg_dec", "tma_store_2d", "bulk_commit",
               "bulk_wait_read")


# kernels.cu's helpers for decode_layers' stage counters, whose inline PTX (red.release, ld.acquire) the emulator's
# header defines in C++ instead
KERNELS_HELPERS = ("stage_arrive", "stage_arrive_last", "stage_wait")


# the modules of nanoeuler_cuda.MODULES, as the emulator builds them: file, defines, what of it (kernels.cu's stage
# counters, flash_attn.cu's helpers of mma.sync, and of its TMA forward's wgmma and TMA, in C++)
SOURCES = {"kernels.cu": ("kernels.cu", (), lambda text: without_helpers(text, KERNELS_HELPERS)),
           "kernels.cu bf16": ("kernels.cu", ("-DFLOATX=bfloat16",),
                               lambda text: without_helpers(text, KERNELS_HELPERS)),
           "flash_attn.cu": ("flash_attn.cu", (), lambda text: without_helpers(
               text, TENSOR_CORE_HELPERS + WGMMA_HELPERS + TMA_HELPERS))}


def build(path, defines=(), select=None, cache_dir=CACHE_DIR, flags=()):
    """-> the emulator's shared library for the .cu file at path (select: the part of its
    text to emulate), compiled once per source and flags (more g++ flags: the tests give
    some that a system's g++ may add by itself)"""
    with open(path) as f:
        text = f.read()
    source = emulator_source(select(text) if select else text, defines)
    stem = os.path.splitext(os.path.basename(path))[0]
    key = hashlib.sha256(" ".join([source, *flags]).encode()).hexdigest()[:16]
    lib = os.path.join(cache_dir, f"{stem}_{key}.so")
    if not os.path.exists(lib):
        if shutil.which("g++") is None:
            raise RuntimeError("the CUDA emulator needs g++")
        os.makedirs(cache_dir, exist_ok=True)
        cpp = lib[:-3] + f".{os.getpid()}.cpp"
        with open(cpp, "w") as f:
            f.write(source)
        tmp = lib[:-3] + f".{os.getpid()}.so"         # the process's own: two test runs may build the same library
        subprocess.run(["g++", "-O1", "-std=c++20", "-ffp-contract=off", "-fPIC", "-shared", "-w", *flags, "-o",
                        tmp, cpp], check=True)
        os.replace(tmp, lib)
        os.remove(cpp)
    return lib


def load(path, defines=(), select=None, **build_options):
    """the emulator's library for a .cu file, its entry points typed for ctypes"""
    lib = ctypes.CDLL(build(path, defines, select, **build_options))
    lib.emu_kernel.argtypes, lib.emu_kernel.restype = [ctypes.c_char_p], ctypes.c_int
    lib.emu_launch.argtypes, lib.emu_launch.restype = [ctypes.c_int] * 5 + [ctypes.c_void_p], ctypes.c_void_p
    lib.emu_run.argtypes = lib.emu_free.argtypes = [ctypes.c_void_p]
    lib.emu_run.restype = ctypes.c_void_p
    lib.emu_set_late_copies.argtypes = lib.emu_set_warps_ahead.argtypes = [ctypes.c_int]
    lib.emu_set_stall_seconds.argtypes = [ctypes.c_double]
    return lib


# What the emulator cannot run: ptxas's register allocation. A fiber keeps every C++ variable, but ptxas (CUDA
# 13.0) gave the registers of a wgmma's register a to other values right after the wgmma when the a was undefined
# on one path into the loop around it, though every path taken wrote it first (the simple q-in-registers version of
# dev/variants/attention_forward_wgmma.cu: its q read as p, y 0.41 off on an H100, exact here). So this reads the
# kernel's PTX instead: each register a wgmma.mma_async takes as a must be written on every path from the entry.

def wgmma_registers_not_always_written(ptx):
    """PTX text -> [(entry, label of its block, registers)]: a wgmma's register a not written on every path from
    the entry to it (a predicated write counts on none)"""
    found = []
    regs = lambda operand: set(re.findall(r"%[a-z]+\d+", operand))
    for name, body in re.findall(r"\.entry (\w+)\((.*?)(?=\.entry |\Z)", ptx, re.S):
        blocks = [["entry", []]]                   # [label, [(predicated, opcode, operands)]], in order
        for line in body.split("\n"):
            line = line.split("//")[0].strip().rstrip(";")
            if not line or line[0] in ".{}" or line.startswith(")"):
                continue
            if line.endswith(":"):
                blocks.append([line[:-1], []])
                continue
            guard, line = (line.split(None, 1) if line[0] == "@" else ("", line))
            opcode, _, rest = line.partition(" ")
            blocks[-1][1].append((bool(guard), opcode, [o.strip() for o in re.findall(r"\{[^}]*\}|[^,{}]+", rest)
                                                        if o.strip()]))
            if opcode.startswith("bra") or opcode in ("ret", "exit"):
                blocks.append([blocks[-1][0] + "+", []])     # what follows a branch starts a block
        where = {label: i for i, (label, _) in reversed(list(enumerate(blocks)))}
        succ = []
        for i, (_, insts) in enumerate(blocks):
            nxt = [i + 1] if i + 1 < len(blocks) else []
            guarded, opcode, ops = insts[-1] if insts else (True, "", [])
            if opcode.startswith("bra"):
                succ.append([where[ops[0]]] + (nxt if guarded else []))
            else:
                succ.append(nxt if guarded or opcode not in ("ret", "exit") else [])

        def writes(state, inst):                   # the registers of a first operand that is not an address
            guarded, _, ops = inst
            return state | regs(ops[0]) if ops and not guarded and not ops[0].startswith("[") else state

        written = [set()] + [None] * (len(blocks) - 1)     # written on every path to a block; None: not reached yet
        changed = True
        while changed:
            changed = False
            for i, (_, insts) in enumerate(blocks):
                if written[i] is None:
                    continue
                out = written[i]
                for inst in insts:
                    out = writes(out, inst)
                for j in succ[i]:
                    new = out if written[j] is None else written[j] & out
                    if new != written[j]:
                        written[j], changed = new, True
        for i, (label, insts) in enumerate(blocks):
            have = written[i] or set()
            for inst in insts:
                _, opcode, ops = inst
                if opcode.startswith("wgmma.mma_async") and len(ops) > 1 and ops[1].startswith("{"):
                    if missing := sorted(regs(ops[1]) - have):
                        found.append((name, label, missing))
                have = writes(have, inst)
    return found


class Function:
    def __init__(self, lib, index, name):
        self.lib, self.index, self.name = lib, index, name


class Driver:
    """what nanoeuler_cuda asks of cuda.bindings.driver, on the emulator; enums and
    structs come from the real module. During a stream capture, launches and memsets
    join the graph (run when it is launched), and what a capture may not do on a GPU
    (synchronise, copy from the host, allocate or free) fails as it would there."""

    def __init__(self, real, sms=2):
        self.real, self.memory, self.capture, self.sms = real, {}, None, sms
        self.shared = {}                              # kernel -> its dynamic shared memory allowed (cuFuncSetAttribute)
        self.launches = self.programmatic = self.replays = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def capture_error(self, what):
        """(the error) when a capture is on: it is over, as a GPU ends it"""
        if self.capture is None:
            return None
        self.capture = "invalidated by " + what
        return (self.real.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)

    GUARD = 256                                   # bytes of canary before each allocation

    def alloc(self, n, fill):
        """n bytes, 64-aligned, after a guard of canary bytes (which check_guards reads) and
        right before a page that may not be read or written (mprotect): a kernel that reads or
        writes past the end (by more than the < 64 bytes of canary that round n up) fails its
        launch, named (emu_run returns the address, launch raises)"""
        n = max(n, 4)
        span = (n + 63) // 64 * 64
        body = (self.GUARD + span + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        pages = mmap.mmap(-1, body + mmap.PAGESIZE, flags=mmap.MAP_SHARED)   # a concurrent grid's blocks share it
        base = ctypes.addressof(ctypes.c_char.from_buffer(pages))
        if LIBC.mprotect(ctypes.c_void_p(base + body), mmap.PAGESIZE, 0):     # PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect")
        ptr = base + body - span
        ctypes.memset(ptr - self.GUARD, 0xFF, self.GUARD + span)       # NaN: a read before the start spreads
        ctypes.memset(ptr, fill, n)
        self.memory[ptr] = (pages, n, span)           # unmapped once dropped, the page no one may touch too
        return ptr

    def where(self, address):
        """', N bytes past the end of an allocation of M bytes' where address is so"""
        for ptr, (_, n, span) in self.memory.items():
            if ptr <= address < ptr + span + mmap.PAGESIZE:
                return f", {address - ptr - n:,} bytes past the end of an allocation of {n:,} bytes"
        return ""

    def check_guards(self, kernel):
        """a kernel that wrote before the start of an allocation, or into the canary after its
        end: named, with the allocation"""
        for ptr, (_, n, span) in self.memory.items():
            if ctypes.string_at(ptr - self.GUARD, self.GUARD) != b"\xff" * self.GUARD or \
                    ctypes.string_at(ptr + n, span - n) != b"\xff" * (span - n):
                raise AssertionError(f"{kernel} wrote outside an allocation of {n} bytes at {ptr:#x}")

    def fill(self, ptr, bits, n, ctype):
        def run():
            np.ctypeslib.as_array((ctype * n).from_address(int(ptr)))[:] = bits
        return self.enqueue(run)

    def enqueue(self, run):
        """run now, or at each replay of the graph being captured"""
        if isinstance(self.capture, list):
            self.capture.append(run)
        elif self.capture is None:
            run()
        return (0,)

    def cuMemAlloc(self, n):
        return self.capture_error("cuMemAlloc") or (0, self.alloc(n, 0xFF))   # unwritten memory reads as NaN

    def cuMemHostAlloc(self, n, flags): return (0, self.alloc(n, 0))
    def cuMemHostGetDevicePointer(self, host, flags): return (0, int(host))

    def cuMemFree(self, p):
        self.memory.pop(int(p), None)                    # freed for good even then: nothing reads it again
        return self.capture_error("cuMemFree") or (0,)

    def cuMemFreeHost(self, p):
        self.memory.pop(int(p), None)
        return (0,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        if self.capture is not None:                     # a graph replays no copy from the host here
            return self.capture_error("a copy to the GPU")
        ctypes.memmove(int(dst), int(src), n)
        return (0,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self.cuMemcpyHtoDAsync(dst, src, n, stream)

    def cuMemsetD32Async(self, p, bits, n, stream): return self.fill(p, bits, n, ctypes.c_uint32)
    def cuMemsetD16Async(self, p, bits, n, stream): return self.fill(p, bits, n, ctypes.c_uint16)
    def cuStreamSynchronize(self, stream): return self.capture_error("cuStreamSynchronize") or (0,)
    def cuStreamWaitEvent(self, stream, event, flags): return (0,)
    def cuGetErrorName(self, err): return (0, getattr(err, "name", "CUDA_ERROR_EMULATED").encode())

    def cuDeviceGetAttribute(self, attribute, dev):
        """what a script asks of the device: an H100's compute capability 9.0, the emulator's SMs; any other
        attribute raises, named"""
        a = self.real.CUdevice_attribute
        values = {a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9, a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                  a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: self.sms}
        if attribute not in values:
            raise ValueError(f"cuDeviceGetAttribute: {attribute.name} is not emulated")
        return (0, values[attribute])

    def cuDeviceGetName(self, n, dev): return (0, b"CPU emulator".ljust(n, b"\0"))
    def cuEventCreate(self, flags=0): return (0, object())
    def cuEventRecord(self, event, stream): return (0,)
    def cuEventSynchronize(self, event): return self.capture_error("cuEventSynchronize") or (0,)
    def cuEventElapsedTime(self, a, b): return (0, 0.0)
    def cuEventDestroy(self, event): return (0,)
    def cuGraphInstantiate(self, graph, flags): return (0, list(graph))
    def cuGraphDestroy(self, graph): return (0,)

    def cuStreamBeginCapture(self, stream, mode):
        assert self.capture is None, "a capture within a capture"
        self.capture = []
        return (0,)

    def cuStreamEndCapture(self, stream):
        graph, self.capture = self.capture, None
        if isinstance(graph, str):
            return (self.real.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
        return (0, graph)

    def cuGraphLaunch(self, graph, stream):
        self.replays += 1
        for run in graph:
            run()
        return (0,)

    def cuModuleGetFunction(self, module, name):
        index = module.emu_kernel(name)
        return (self.real.CUresult.CUDA_ERROR_NOT_FOUND, None) if index < 0 else (0, Function(module, index,
                                                                                             name.decode()))

    OCCUPANCY = 2                                 # blocks an SM holds at once, for any kernel (a persistent grid's)
    BLOCK_FAILED = ctypes.c_void_p(-2).value      # emu_run's EMU_BLOCK_FAILED: a block of a concurrent grid failed

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, f, block, shared):
        return (0, self.OCCUPANCY)

    def launch(self, f, grid, block, params):
        blocks = grid[0] * grid[1] * grid[2]
        if f.name.startswith(CONCURRENT) and blocks > self.sms * self.OCCUPANCY:
            raise AssertionError(f"{f.name}: a grid of {blocks} blocks, more than are resident at once ({self.sms} "
                                 f"SMs x {self.OCCUPANCY}): its blocks wait on each other, so on a GPU it would hang")
        launch = f.lib.emu_launch(f.index, *grid, block, params)       # the arguments' values, copied now
        self.launches += 1

        def run():
            fault = f.lib.emu_run(launch)
            if fault == self.BLOCK_FAILED:
                raise AssertionError(f"{f.name} failed in a block of its concurrent grid (the emulator's message is "
                                     f"on stderr)")
            if fault:
                raise AssertionError(f"{f.name} read or wrote memory past the end of an allocation, or none of "
                                     f"them (address {fault:#x}{self.where(fault)})")
            self.check_guards(f.name)

        if isinstance(self.capture, list):
            self.capture.append(run)
        elif self.capture is None:
            run()
            f.lib.emu_free(launch)
        return (0,)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        assert by == bz == 1 and shared <= self.shared.get(f.name, 48 * 1024)    # (at most emu_dynamic_shared's)
        return self.launch(f, (gx, gy, gz), bx, params)

    def cuFuncSetAttribute(self, f, attribute, value):
        """the dynamic shared memory a kernel may launch with, past the default 48 KB (an H100's most: 227 KB)"""
        assert attribute == self.real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        assert value <= 227 * 1024, value
        self.shared[f.name] = value
        return (0,)

    SWIZZLES = {"CU_TENSOR_MAP_SWIZZLE_NONE": 0, "CU_TENSOR_MAP_SWIZZLE_32B": 32, "CU_TENSOR_MAP_SWIZZLE_64B": 64,
                "CU_TENSOR_MAP_SWIZZLE_128B": 128}
    TMAP_TAG = 0x656d752d746d6170                          # the emulator's EmuTensorMap: "emu-tmap"

    def cuTensorMapEncodeTiled(self, dtype, rank, address, dims, strides, box, element_strides, interleave, swizzle,
                               l2, oob):
        """a tensor map in the emulator's own form (EmuTensorMap: 16 words, as CUtensorMap's opaque): the tag,
        the global address, the element's bytes, the rank, dims, the row stride in bytes, the box, the swizzle's
        bytes. Held to the driver's rules for what the emulator does (rank 2, 2- or 4-byte elements, element strides
        1, no interleave, zeros outside the tensor); what it breaks raises, named"""
        real, m = self.real, self.real.CUtensorMap()
        sizes = {real.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: 2,
                 real.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16: 2,
                 real.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32: 4}
        for values, kind in ((dims, real.cuuint64_t), (strides, real.cuuint64_t), (box, real.cuuint32_t),
                             (element_strides, real.cuuint32_t)):
            if not all(isinstance(v, kind) for v in values):         # as cuda-python's refuses plain ints
                raise TypeError(f"Cannot convert int to cuda.bindings.driver.{kind.__name__}")
        dims, strides, box = [int(d) for d in dims], [int(s) for s in strides], [int(b) for b in box]
        why = ("its data type is not bf16, uint16 or fp32" if dtype not in sizes else
               "rank is not 2 (the emulator's TMA is 2d)" if rank != 2 or len(dims) != 2 or len(box) != 2 else
               "element strides are not 1" if [int(e) for e in element_strides] != [1, 1] else
               "interleave is not NONE" if interleave != real.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
               else "the global address is not 16-byte aligned" if int(address) % 16 else
               "a global stride is not a multiple of 16 bytes" if len(strides) != 1 or strides[0] % 16 else
               "the global stride is shorter than a row" if strides[0] < dims[0] * sizes[dtype] else
               "a box dimension is outside 1 .. 256" if not all(1 <= b <= 256 for b in box) else
               "a box row is not a multiple of 16 bytes" if box[0] * sizes[dtype] % 16 else
               "the swizzle is not NONE, 32B, 64B or 128B" if swizzle.name not in self.SWIZZLES else
               "a box row is wider than the swizzle" if self.SWIZZLES[swizzle.name] and
               box[0] * sizes[dtype] > self.SWIZZLES[swizzle.name] else
               "oobFill is not NONE" if oob != real.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE else "")
        if why:
            raise ValueError(f"cuTensorMapEncodeTiled: {why}")
        words = [self.TMAP_TAG, int(address), sizes[dtype], 2, *dims, strides[0], *box, self.SWIZZLES[swizzle.name]]
        m.opaque = words + [0] * (16 - len(words))
        return (0, m)

    def cuLaunchKernelEx(self, config, f, params, extra):
        attr = config.attrs[0]
        assert config.numAttrs == 1 and attr.value.programmaticStreamSerializationAllowed == 1
        assert attr.id == self.real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.programmatic += 1
        return self.launch(f, (config.gridDimX, config.gridDimY, config.gridDimZ), config.blockDimX, params)


class Cublas:
    """GPU.cublas's gemm in numpy, with cuBLAS's types: a uint16 (bf16) array is read and
    written as bf16, an fp32 input read as bf16 in bf16 mode (its bf16 copy when it has
    one, else rounded, as Cublas.to_bf16 does), sums in float64, a bf16 output rounded once"""

    def __init__(self, nc):
        self.nc = nc

    def read(self, x, rows, cols):
        nc, n = self.nc, rows * cols
        if x.dtype == np.uint16 or (nc.gpu.precision == "bf16" and x.bf16 is not None):
            bits = x if x.dtype == np.uint16 else x.bf16
            v = nc.from_bf16(np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(bits.ptr)))
        else:
            v = np.ctypeslib.as_array((ctypes.c_float * n).from_address(x.ptr)).copy()
            v = nc.bf16_round(v) if nc.gpu.precision == "bf16" else v
        return v.reshape(rows, cols).astype(np.float64)

    def gemm(self, out, a, b, M, N, K, trans_a=False, trans_b=False, accumulate=False):
        """now, or at each replay of the graph being captured, as cuBLAS's kernels run"""
        self.nc.cu.enqueue(lambda: self.product(out, a, b, M, N, K, trans_a, trans_b, accumulate))

    def product(self, out, a, b, M, N, K, trans_a, trans_b, accumulate):
        nc = self.nc
        A = self.read(a, K, M).T if trans_a else self.read(a, M, K)
        B = self.read(b, N, K).T if trans_b else self.read(b, K, N)
        if out.dtype == np.uint16:
            o = np.ctypeslib.as_array((ctypes.c_uint16 * (M * N)).from_address(out.ptr)).reshape(M, N)
            r = (nc.from_bf16(o).astype(np.float64) if accumulate else 0) + A @ B
            o[...] = nc.bf16_round(r.astype(np.float32)).view(np.uint32) >> 16
        else:
            o = np.ctypeslib.as_array((ctypes.c_float * (M * N)).from_address(out.ptr)).reshape(M, N)
            o[...] = o + A @ B if accumulate else A @ B


def install(nc, sms=2, arch="90", reverse=False, warps_ahead=False):
    """nanoeuler_cuda (the module nc) on the emulator: its driver and its GPU, with the
    modules of nc.MODULES; reverse: blocks and fibers run in reverse order; warps_ahead:
    each warp of a block runs as far as it can before the next; -> the driver"""
    from cuda.bindings import driver as real
    root = os.path.dirname(os.path.abspath(nc.__file__))
    nc.cu = driver = Driver(real, sms)
    gpu = object.__new__(nc.GPU)                      # the GPU's state, without a device behind it
    gpu.stream, gpu.sms, gpu.arch, gpu.name = real.CUstream(0), sms, arch, "CPU emulator"
    gpu.modules = {name: load(os.path.join(root, file), defines, select)
                   for name, (file, defines, select) in SOURCES.items()}
    for lib in gpu.modules.values():
        lib.emu_set_reverse(int(reverse))
        lib.emu_set_warps_ahead(int(warps_ahead))
    gpu.functions, gpu.last_kernel, gpu.precision, gpu.profile, gpu.shared_allowed = {}, None, "fp32", None, {}
    gpu.cublas = Cublas(nc)
    nc.gpu = gpu
    return driver


def check_training(nc, rng, reporter):
    """nanoeuler_cuda's training checks: every kernels.cu kernel in both builds, the
    optimizer's, attention's passes in fp32, tf32 and bf16, then in each precision the
    model's loss and gradients, and in fp32 and bf16 SFT rows and whole steps (graph
    == one by one, bit for bit; AdamW; the NaN stop)"""
    nc.check_kernels(rng, reporter(nc.TOLERANCE["fp32"]), is_bf16=False)
    nc.check_kernels(rng, reporter(nc.KERNEL_BF16_TOLERANCE), is_bf16=True)
    nc.check_optimizer(rng, reporter(nc.TOLERANCE["fp32"]))
    for precision in ("fp32", "tf32", "bf16"):
        nc.init_gpu(precision)
        nc.check_attention(rng, reporter(nc.TOLERANCE[precision]))
    for precision in ("fp32", "tf32", "bf16"):
        nc.check_model(rng, reporter, precision)
    for precision in ("fp32", "bf16"):
        nc.check_step(rng, reporter(nc.TOLERANCE["fp32"]), precision)
        nc.check_sft(rng, reporter, precision)


WHAT = ["kernels", "training", "decoding", "fast", "check"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    # the words are checked here, not by choices=: Python 3.11's argparse checks a list default against the
    # choices as one value and refused the bare command ("invalid choice: ['kernels', 'training', 'decoding']")
    p.add_argument("what", nargs="*", metavar="{" + ",".join(WHAT) + "}",
                   help="kernels: check_kernels and check_optimizer (both builds); training: those, attention, "
                        "the model, SFT rows and steps; check: `nanoeuler_cuda.py check` itself, all of it; "
                        "decoding: check_decoding; fast: check_decode_logits on rows of up to 3 chunks, fp32; "
                        "none: kernels, training and decoding")
    p.add_argument("--reverse", action="store_true",
                   help="run blocks, and a block's threads between barriers, in reverse order (races show)")
    p.add_argument("--late-copies", action="store_true",
                   help="cp.async lands at the cp.async.wait_group that covers it, not at once (a read before its "
                        "wait shows)")
    p.add_argument("--warps-ahead", action="store_true",
                   help="each warp of a block runs as far as it can before the next, not a barrier at a time (a "
                        "missing __syncthreads shows)")
    args = p.parse_args(argv)
    if bad := [w for w in args.what if w not in WHAT]:
        p.error(f"{bad[0]!r} is not a check this emulator runs; give some of {', '.join(WHAT)}, or none")
    args.what = args.what or ["kernels", "training", "decoding"]
    return args


def main():
    args = parse_args()
    sys.path.insert(0, HERE)
    import nanoeuler as ne
    import nanoeuler_cuda as nc
    driver = install(nc, reverse=args.reverse, warps_ahead=args.warps_ahead)
    for lib in nc.gpu.modules.values():
        lib.emu_set_late_copies(int(args.late_copies))
    if "check" in args.what:
        nc.main(["check"])
        return
    failed = []

    def reporter(tol):
        def report(what, err):
            failed.extend([] if err < tol else [what])
            print(f"{what:<56} {err:9.1e}  {tol:.0e}  {'OK' if err < tol else 'NOT OK'}", flush=True)
        return report

    rng = np.random.default_rng(1337)
    if "training" in args.what:
        check_training(nc, rng, reporter)
    elif "kernels" in args.what:
        nc.check_kernels(rng, reporter(nc.TOLERANCE["fp32"]), is_bf16=False)
        nc.check_kernels(rng, reporter(nc.KERNEL_BF16_TOLERANCE), is_bf16=True)
        nc.check_optimizer(rng, reporter(nc.TOLERANCE["fp32"]))
    if "fast" in args.what:
        cfg = ne.Config(V=96, C=512, Hq=8, Hkv=1, L=1, T=160, F=176, K=2)
        flat = ne.init_params(cfg, seed=3) + rng.normal(0, 0.05, nc.num_params(cfg)).astype(np.float32)
        ids = rng.integers(0, cfg.V, 134).tolist()
        nc.check_decode_logits(reporter(nc.DECODE_TOLERANCE["fp32"]), "decode", cfg, flat,
                               ne.carve(flat.astype(np.float64), cfg), "fp32", ids, 126)
    if "decoding" in args.what:
        for precision in ("fp32", "bf16"):
            nc.check_decoding(rng, reporter(nc.DECODE_TOLERANCE[precision]), precision)
    print(f"{driver.launches} launches ({driver.programmatic} programmatic, {driver.replays} graph replays); "
          f"overall okay: {int(not failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
