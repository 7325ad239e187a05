"""What a grid barrier costs inside one persistent kernel, by kind (issue 35), against a launch
boundary of the same work in the same run. The persistent decoding pass of 2026-12-03
(dev/LOG-decode.md) paid 1.3 us a barrier (264 arrivals on one counter), more than a launch
boundary with programmatic launch (0.55 us empty, 1.34 us with a minimal stage); a persistent pass
pays only if some barrier is cheaper than that. Each launch of probe_barrier_kernel runs STAGES
stages; a stage is pdl_floor_probe.py's minimal one (every block sums the 768 floats the stage
before wrote, one L2 trip, and writes 8 of the next stage's), then a barrier of one kind:

  none     no barrier: the stage's own chain (the data read is wrong; only its time counts)
  counter  one counter: each block adds 1 (red.release.gpu), thread 0 spins on it (ld.acquire.gpu)
  flags    a flag a block, each on its own 128-byte line (st.release.gpu); every block's threads
           read all of them (ld.acquire.gpu) until each shows this stage, then __syncthreads
  clusterN the N blocks of a thread-block cluster meet first (barrier.cluster, release/acquire),
           one block a cluster adds to the counter and spins, then the cluster meets again
  LL       no barrier: each value travels with its flag in one 8-byte word (NCCL's low-latency
           protocol), and a stage polls its input words themselves: in one persistent kernel, and
           as a chain of launches with programmatic launch that never calls griddepcontrol.wait

Counters and flags grow from launch to launch (the launch's first stage is an argument), so
nothing is reset. A spin gives up after about a second and marks the run failed (a barrier over
blocks that are not all resident would never open). Run from the root of a tree:
python dev/variants/grid_barrier_probe.py"""
import ctypes
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np              # noqa: E402
import nanoeuler_cuda as nc     # noqa: E402
import pdl_floor_probe          # noqa: E402

SOURCE = pdl_floor_probe.SOURCE + r"""
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void cluster_meet() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_size() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
// spin until *p >= target; false (and *failed set) after about 2^31 clocks
__device__ __forceinline__ bool spin(const unsigned* p, unsigned target, unsigned* failed) {
    long long t0 = clock64();
    while (ld_acquire(p) < target)
        if (clock64() - t0 > (1LL << 31)) { atomicExch(failed, 1u); return false; }
    return true;
}

// mode: 0 none, 1 counter, 2 flags, 3 cluster (launched with a cluster dimension)
extern "C" __global__ void probe_barrier_kernel(float* buf, unsigned* sync, unsigned* failed, int n,
                                                int stages, int mode, unsigned first) {
    unsigned* counter = sync;
    unsigned* flags = sync + 32;                      // flag of block b at flags[32 b]: its own line
    for (int s = 0; s < stages; s++) {
        minimal_stage(buf + ((s + 1) & 1) * n, buf + (s & 1) * n, n);   // pdl_floor_probe.py's
        unsigned epoch = first + s + 1;
        if (mode == 1) {
            __syncthreads();
            if (threadIdx.x == 0) {
                red_release(counter, 1u);
                if (!spin(counter, epoch * gridDim.x, failed)) return;
            }
            __syncthreads();
        } else if (mode == 2) {
            __syncthreads();
            if (threadIdx.x == 0) st_release(flags + 32 * blockIdx.x, epoch);
            bool ok = true;
            for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) ok = ok && spin(flags + 32 * b, epoch, failed);
            if (!__syncthreads_and(ok)) return;
        } else if (mode == 3) {
            cluster_meet();
            bool ok = true;
            if (cluster_rank() == 0 && threadIdx.x == 0) {
                red_release(counter, 1u);
                ok = spin(counter, epoch * (gridDim.x / cluster_size()), failed);
            }
            if (!__syncthreads_and(ok)) return;
            cluster_meet();
        } else {
            __syncthreads();                          // part[] is read before the next stage writes it
        }
    }
}

// LL hand-off (NCCL's low-latency protocol): a stage's values travel as 8-byte words, the float's
// bits beside a flag, each written by one 8-byte store, so a reader that sees the flag sees the
// value: a consumer polls its input words themselves, one L2 trip, with no fence and no barrier.
// Stage s reads ll[s] (n words) and writes 8 words of ll[s + 1]; every stage has its own words,
// zeroed before the launch (flag 0: not yet written).
__device__ __forceinline__ float ll_read(const unsigned long long* w, unsigned* failed) {
    unsigned long long x;                             // a 64-bit access: the PTX memory model's single copy
    long long t0 = clock64();
    do {
        asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(x) : "l"(w) : "memory");
        if (clock64() - t0 > (1LL << 31)) { atomicExch(failed, 1u); return 0.0f; }
    } while ((x >> 32) == 0ull);
    return __uint_as_float((unsigned)x);
}
__device__ __forceinline__ void ll_write(unsigned long long* w, float x) {
    unsigned long long word = (1ull << 32) | __float_as_uint(x);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(w), "l"(word) : "memory");
}
// one stage: sum the n words of in (waiting for each), write 8 of out
__device__ __forceinline__ void ll_stage(const unsigned long long* in, unsigned long long* out, int n, bool wait,
                                         unsigned* failed) {
    __shared__ float part[8];
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        v += wait ? ll_read(in + i, failed) : 0.0f;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 8 && blockIdx.x * 8 + threadIdx.x < n)
        ll_write(out + blockIdx.x * 8 + threadIdx.x, (part[threadIdx.x] + 1.0f) * 1e-3f);
    __syncthreads();
}
// persistent: stages 0..stages-1 in one launch, ll holds stages + 1 vectors of n words
extern "C" __global__ void probe_ll_persistent_kernel(unsigned long long* ll, unsigned* failed, int n, int stages) {
    for (int s = 0; s < stages; s++) ll_stage(ll + (long)s * n, ll + (long)(s + 1) * n, n, s > 0, failed);
}
// a chain of launches with programmatic launch and no griddepcontrol.wait: launch i is stage i
extern "C" __global__ void probe_ll_launch_kernel(unsigned long long* ll, unsigned* failed, int n, int i) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    ll_stage(ll + (long)i * n, ll + (long)(i + 1) * n, n, i > 0, failed);
}
"""
N, STAGES, LAUNCHES = 768, 830, 10
MODES = {"none": 0, "counter": 1, "flags": 2, "cluster": 3}


def launch(fn, blocks, cluster, args):
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    config = nc.cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = blocks, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 256, 1, 1
    config.sharedMemBytes, config.hStream = 0, nc.gpu.stream
    attrs = []
    if cluster > 1:
        attr = nc.cu.CUlaunchAttribute()
        attr.id = nc.cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        attrs.append(attr)
    config.attrs, config.numAttrs = attrs, len(attrs)
    nc.check(nc.cu.cuLaunchKernelEx(config, fn, ctypes.addressof(params), 0), "launching the probe")


def stage_us(fn, mode, blocks, cluster, buf, sync, failed):
    """GPU microseconds a stage, over LAUNCHES launches of STAGES stages; None if a spin gave up"""
    nc.check(nc.cu.cuMemsetD32Async(sync.ptr, 0, sync.size, nc.gpu.stream), "cuMemsetD32Async")
    nc.check(nc.cu.cuMemsetD32Async(failed.ptr, 0, 1, nc.gpu.stream), "cuMemsetD32Async")
    start, end = (nc.check(nc.cu.cuEventCreate(0), "cuEventCreate") for _ in range(2))
    args = lambda first: [nc.ptr_arg(buf), nc.ptr_arg(sync), nc.ptr_arg(failed), nc.int_arg(N),
                          nc.int_arg(STAGES), nc.int_arg(MODES[mode]), ctypes.c_uint(first)]
    held = [args(0)]
    launch(fn, blocks, cluster, held[0])                                   # warm-up: stages 1..STAGES
    nc.check(nc.cu.cuEventRecord(start, nc.gpu.stream), "cuEventRecord")
    for i in range(1, LAUNCHES + 1):
        held.append(args(i * STAGES))
        launch(fn, blocks, cluster, held[-1])
    nc.check(nc.cu.cuEventRecord(end, nc.gpu.stream), "cuEventRecord")
    nc.gpu.sync()
    ms = nc.check(nc.cu.cuEventElapsedTime(start, end), "cuEventElapsedTime")
    for e in (start, end):
        nc.cu.cuEventDestroy(e)
    return None if failed.download()[0] else ms * 1e3 / LAUNCHES / STAGES


def ll_persistent_us(fn, blocks, ll, failed):
    """GPU microseconds a stage of probe_ll_persistent_kernel, its words zeroed before each launch
    (the memsets timed apart and taken off)"""
    def one(launch_too):
        nc.check(nc.cu.cuMemsetD32Async(ll.ptr, 0, ll.size, nc.gpu.stream), "cuMemsetD32Async")
        if launch_too:
            args = [nc.ptr_arg(ll), nc.ptr_arg(failed), nc.int_arg(N), nc.int_arg(STAGES)]
            held.append(args)
            launch(fn, blocks, 1, args)
    held = []
    nc.check(nc.cu.cuMemsetD32Async(failed.ptr, 0, 1, nc.gpu.stream), "cuMemsetD32Async")
    times = []
    for launch_too in (True, False):
        one(launch_too)                                                    # warm-up
        start, end = (nc.check(nc.cu.cuEventCreate(0), "cuEventCreate") for _ in range(2))
        nc.check(nc.cu.cuEventRecord(start, nc.gpu.stream), "cuEventRecord")
        for _ in range(LAUNCHES):
            one(launch_too)
        nc.check(nc.cu.cuEventRecord(end, nc.gpu.stream), "cuEventRecord")
        nc.gpu.sync()
        times.append(nc.check(nc.cu.cuEventElapsedTime(start, end), "cuEventElapsedTime") * 1e3)
        for e in (start, end):
            nc.cu.cuEventDestroy(e)
    if failed.download()[0]:
        return "gave up"
    return f"{(times[0] - times[1]) / LAUNCHES / STAGES:6.2f} us (memsets {times[1] / LAUNCHES:.1f} us a launch, off)"


def ll_chain_us(blocks, ll, failed):
    """GPU microseconds a launch: a graph of a memset of the words and LAUNCHES probe_ll_launch_kernel
    launches (stage i = launch i), replayed; the memset alone timed the same way and taken off"""
    from decode_stage_probe import LAUNCHES as CHAIN
    nc.check(nc.cu.cuMemsetD32Async(failed.ptr, 0, 1, nc.gpu.stream), "cuMemsetD32Async")
    words = 2 * (CHAIN + 1) * N
    held = []

    def chain(launches):
        nc.check(nc.cu.cuMemsetD32Async(ll.ptr, 0, words, nc.gpu.stream), "cuMemsetD32Async")
        for i in range(launches):
            held.append([nc.ptr_arg(ll), nc.ptr_arg(failed), nc.int_arg(N), nc.int_arg(i)])
            nc.decode_launch("probe_ll_launch_kernel", blocks, 256, True, *held[-1])
    us = []
    for launches in (CHAIN, 0):
        graph = nc.capture_graph(lambda: chain(launches), "an LL probe")
        nc.check(nc.cu.cuGraphLaunch(graph, nc.gpu.stream), "cuGraphLaunch")      # warm-up
        start, end = (nc.check(nc.cu.cuEventCreate(0), "cuEventCreate") for _ in range(2))
        nc.check(nc.cu.cuEventRecord(start, nc.gpu.stream), "cuEventRecord")
        for _ in range(100):
            nc.check(nc.cu.cuGraphLaunch(graph, nc.gpu.stream), "cuGraphLaunch")
        nc.check(nc.cu.cuEventRecord(end, nc.gpu.stream), "cuEventRecord")
        nc.gpu.sync()
        us.append(nc.check(nc.cu.cuEventElapsedTime(start, end), "cuEventElapsedTime") * 1e3 / 100)
    if failed.download()[0]:
        return "gave up"
    return f"{(us[0] - us[1]) / CHAIN:6.2f} us a launch (memset {us[1]:.1f} us a replay, off)"


def main():
    nc.init_gpu("bf16")
    gpu = nc.gpu
    cubin = nc.nvrtc_compile("barrier.cu", SOURCE, gpu.arch)
    module = nc.check(nc.cu.cuModuleLoadData(cubin), "loading barrier.cu")
    fn = nc.check(nc.cu.cuModuleGetFunction(module, b"probe_barrier_kernel"), "probe_barrier_kernel")
    per_sm = nc.check(nc.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, 256, 0), "occupancy")
    buf = nc.DeviceArray((2 * N,)).zero()
    sync = nc.DeviceArray((32 * 1024 + 32,), np.uint32).zero()
    failed = nc.DeviceArray((1,), np.uint32).zero()
    print(f"{gpu.name}, {gpu.sms} SMs, {per_sm} probe blocks an SM at most; {LAUNCHES} launches of "
          f"{STAGES} stages; GPU microseconds a stage")
    # the same stage as a chain of launches with programmatic launch, same run (pdl_floor_probe.py)
    gpu.functions["probe_stage_kernel", False] = nc.check(
        nc.cu.cuModuleGetFunction(module, b"probe_stage_kernel"), "probe_stage_kernel")
    a, b = nc.DeviceArray((N,)).zero(), nc.DeviceArray((N,)).zero()
    for blocks in (gpu.sms, 2 * gpu.sms):
        us = pdl_floor_probe.chain_us("probe_stage_kernel", blocks, True, a, b)
        print(f"  {blocks:>4} blocks  launches (PDL), same stage: {us:6.2f} us a launch", flush=True)
    ll = nc.DeviceArray((2 * (STAGES + 1) * N,), np.uint32)
    fn_ll = nc.check(nc.cu.cuModuleGetFunction(module, b"probe_ll_persistent_kernel"), "probe_ll_persistent_kernel")
    for blocks in (gpu.sms, 2 * gpu.sms):
        print(f"  {blocks:>4} blocks  LL, persistent: {ll_persistent_us(fn_ll, blocks, ll, failed)}", flush=True)
    gpu.functions["probe_ll_launch_kernel", False] = nc.check(
        nc.cu.cuModuleGetFunction(module, b"probe_ll_launch_kernel"), "probe_ll_launch_kernel")
    for blocks in (gpu.sms, 2 * gpu.sms):
        print(f"  {blocks:>4} blocks  LL, launches (PDL, no wait): {ll_chain_us(blocks, ll, failed)}", flush=True)
    for blocks in (gpu.sms, 2 * gpu.sms):
        if blocks > per_sm * gpu.sms:
            continue
        for mode, cluster in (("none", 1), ("counter", 1), ("flags", 1), ("cluster", 2), ("cluster", 4),
                              ("cluster", 8)):
            if blocks % cluster:
                continue
            try:
                us = stage_us(fn, mode, blocks, cluster, buf, sync, failed)
                said = "gave up (not all blocks resident?)" if us is None else f"{us:6.2f} us"
            except nc.NanoEulerError as e:
                said = f"not run: {e}"
            name = mode + (str(cluster) if cluster > 1 else "")
            print(f"  {blocks:>4} blocks  {name:<9} {said}", flush=True)


if __name__ == "__main__":
    main()
