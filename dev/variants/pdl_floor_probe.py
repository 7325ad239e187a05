"""What a launch boundary costs in a decoding pass's graph (issue 35), apart from any stage's work:
chains of 83 launches (a big-model pass's count) captured in one CUDA graph and replayed, each launch

  empty: launch_dependents, the programmatic wait, thread 0 of block 0 adds 1 to a float;
  stage: the same, then every block sums the 768 floats the launch before wrote (one L2 trip),
         a warp sum and a block sum through shared memory, and writes 8 of the next launch's 768;

with and without programmatic dependent launch (PDL), at 1, 96 and 264 blocks of 256 threads;
and, in the same process, the big model's real one-row pass (random bf16 weights) replayed.
Run from the root of a tree: python dev/variants/pdl_floor_probe.py"""
import itertools
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nanoeuler as ne          # noqa: E402
import nanoeuler_cuda as nc     # noqa: E402
from decode_stage_probe import LAUNCHES, per_launch_us   # noqa: E402

SOURCE = r"""
__device__ __forceinline__ void ready() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
extern "C" __global__ void probe_empty_kernel(float* out, const float* in, int n) {
    ready();
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = in[0] + 1.0f;
}
// the minimal stage: every block sums the n floats of in (one L2 trip), and writes 8 of out
// (grid_barrier_probe.py's stages are this too)
__device__ __forceinline__ void minimal_stage(float* out, const float* in, int n) {
    __shared__ float part[8];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 8 && blockIdx.x * 8 + threadIdx.x < n)
        out[blockIdx.x * 8 + threadIdx.x] = (part[threadIdx.x] + in[blockIdx.x]) * 1e-3f;
}
extern "C" __global__ void probe_stage_kernel(float* out, const float* in, int n) {
    ready();
    minimal_stage(out, in, n);
}
"""
N, REPLAYS = 768, 200


def chain_us(name, blocks, pdl, a, b):
    """microseconds of GPU time a launch in a graph of LAUNCHES launches of `name`, a and b in turn"""
    turn = itertools.count()

    def launch():
        out, inp = (a, b) if next(turn) % 2 else (b, a)
        nc.decode_launch(name, blocks, 256, pdl, nc.ptr_arg(out), nc.ptr_arg(inp), nc.int_arg(N))
    return per_launch_us(launch, REPLAYS)


def main():
    nc.init_gpu("bf16")
    gpu = nc.gpu
    cubin = nc.nvrtc_compile("probe.cu", SOURCE, gpu.arch)
    module = nc.check(nc.cu.cuModuleLoadData(cubin), "loading probe.cu")
    for name in ("probe_empty_kernel", "probe_stage_kernel"):
        gpu.functions[name, False] = nc.check(nc.cu.cuModuleGetFunction(module, name.encode()), name)
    a, b = nc.DeviceArray((N,)).zero(), nc.DeviceArray((N,)).zero()
    print(f"{gpu.name}: {LAUNCHES} launches in a graph, {REPLAYS} replays; microseconds a launch")
    for name in ("probe_empty_kernel", "probe_stage_kernel"):
        for blocks in (1, 96, 264):
            for pdl in (True, False):
                print(f"  {name:<20} {blocks:>4} blocks  {'PDL' if pdl else 'plain':<5} "
                      f"{chain_us(name, blocks, pdl, a, b):6.2f} us")
    cfg = ne.PRESETS["big"]
    dec = nc.GPUDecoder(cfg, ne.init_params(cfg), "bf16")
    dec.wait(dec.prefill(list(range(16)), 1))
    us = [nc.replay_time(dec, 100) for _ in range(2)]
    print(f"  the big model's one-row pass (83 launches): {us[0]:.1f} / {us[1]:.1f} us, "
          f"{us[0] / 83:.2f} us a launch")


if __name__ == "__main__":
    main()
