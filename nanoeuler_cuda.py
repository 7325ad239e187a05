"""
NanoEuler on NVIDIA GPUs: the model of nanoeuler.py, with its kernels in
kernels.cu and flash_attn.cu compiled at run time by NVRTC, and its matrix
products in cuBLAS, called through ctypes (on an H100 or H200, the bf16
forward's in flash_attn.cu). No framework.

    python nanoeuler_cuda.py check        # every kernel against numpy, then the whole model
    python nanoeuler_cuda.py train big    # train the 116M model (SPEC big) on one GPU
    python nanoeuler_cuda.py train big --gpus 2 --batch 32    # or data parallel on several
    srun -N 2 --ntasks-per-node 8 python nanoeuler_cuda.py train big --batch 128   # or on several hosts
    python nanoeuler_cuda.py bench        # tokens/s and MFU of training steps, then decoding speed
    python nanoeuler_cuda.py sft --model out/big/best.safetensors      # fine-tune on instructions
    python nanoeuler_cuda.py chat --model out/sft/best.safetensors [--speculative]

It shares with nanoeuler.py (imported, not copied): Config and the presets, the
tokenizer, the data pipeline, the checkpoint files and the training loop's log
and checkpoint logic. A checkpoint written here samples in nanoeuler.py and
the other way round.

The file reads in nanoeuler.py's order, under its names (rmsnorm_backward is a
numpy layer there, a launcher here and rmsnorm_backward_kernel_<width> in
kernels.cu). First the story:
- the device and its kernels: compiling the kernels (NVRTC, a disk cache), the
  CUDA plumbing (GPU memory, launches), the kernel launchers and cuBLAS's
  matmuls: the layers;
- the model on the GPU (GPUModel: its buffers, and forward, backward and AdamW
  in one run_step);
- training: GPUEngine (that step as one CUDA graph, for nanoeuler.train_loop)
  and the train command;
- decoding (nanoeuler.py's generation): GPUDecoder, its KV cache, sample;
- SFT, chat and serve (nanoeuler.py's, on the GPU), the command line.
Then what a first reading may skip: check (every kernel and the whole model
against nanoeuler.py, the gradient check's counterpart), the benchmark, several
GPUs (--gpus: data parallel over NCCL) and, last, several hosts (torchrun, srun,
mpirun, --nnodes; docs/multinode.md).

Precision: --precision fp32 (exact: fp32 matmuls, attention on CUDA cores), tf32
(matmuls and attention on tensor cores with 10-bit mantissas) or bf16 (the
default of every command: the activations and their gradients are
bfloat16, the kernels' floatX, and every product and attention runs on
tensor cores with fp32 sums). Master weights, their gradients and the
optimizer's moments are fp32 in every mode; in bf16 mode the matmuls read a
bf16 copy of the weights, which the AdamW kernel writes as it updates them.
kernels.cu says which tensors stay fp32 and why.

A training step (forward, backward, gradient norm and clip, AdamW) is one
CUDA graph, captured once and replayed; the host uploads the batch before it
and reads the loss and gradient norm after it, and a non-finite loss or norm
stops the update on the GPU (GRAPH_STEP, --no-graph: kernel by kernel).
No sum uses atomics (decoding's split attention counts its finished blocks
with one, then adds their parts in a fixed order), so a run is the same bits every time.
Decoding (sample, chat) keeps a KV cache and replays each step from a CUDA graph
(the decoding section).
Needs: pip install -r requirements-cuda.txt (cuda-python, NVRTC, the CUDA
headers, cuBLAS and, for --gpus, NCCL wheels) and an NVIDIA driver.
"""

import argparse
import collections
import contextlib
import ctypes
import errno
import fcntl
import gc
import hashlib
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import nanoeuler as ne
from nanoeuler import Config, NanoEulerError, PRESETS, num_params, param_shapes

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["kernels.cu", "flash_attn.cu"]
# the modules loaded: kernels.cu twice, its activations' type floatX being float (fp32, tf32)
# and bfloat16 (bf16), and flash_attn.cu, whose kernels name their types themselves
MODULES = {"kernels.cu": ("kernels.cu", ()), "kernels.cu bf16": ("kernels.cu", ("-DFLOATX=bfloat16",)),
           "flash_attn.cu": ("flash_attn.cu", ())}
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanoeuler")
HEAD_DIMS = (16, 32, 64)                       # flash_attn.cu is instantiated for these, each version
RMSNORM_WIDTHS = (256, 768, 1536)              # rmsnorm_backward_kernel_<width>: rows of up to width (MAX_C)


# -----------------------------------------------------------------------------
# compiling the kernels

def import_cuda():
    """cuda.bindings' driver and nvrtc modules, or one sentence on what to install"""
    try:
        from cuda.bindings import driver, nvrtc
        import cuda.pathfinder  # noqa: F401
    except ImportError:
        raise NanoEulerError("the GPU engine needs cuda-python and NVIDIA's NVRTC and runtime wheels: "
                             "pip install -r requirements-cuda.txt (nanoeuler.py runs on the CPU)") from None
    return driver, nvrtc


def include_dir():
    """the CUDA headers (from the nvidia-cuda-runtime wheel), for NVRTC's -I"""
    import cuda.pathfinder as pf
    try:
        d = pf.find_nvidia_header_directory("cudart")
    except Exception:
        d = None
    return d


def nvrtc_compile(name, source, arch, defines=()):
    """CUDA C source -> CUBIN bytes for sm_<arch>; a compile error names the file, line and log"""
    _, nvrtc = import_cuda()
    opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "--use_fast_math", "-lineinfo", *defines]
    inc = include_dir()
    if inc:
        opts.append(f"-I{inc}")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if err:
        raise NanoEulerError(f"NVRTC could not create a program for {name} ({err})")
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    # subtle: NVRTC writes into the buffers we pass, so they must be fresh bytearrays.
    # b" " * size for size 1 is Python's one cached b" ", and writing its NUL
    # terminator there turned every later space in the process into "\x00".
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.decode(errors="replace").strip("\x00 \n")
    if err:
        nvrtc.nvrtcDestroyProgram(prog)
        first = next((ln for ln in log.splitlines() if "error" in ln), log[:200])
        raise NanoEulerError(f"NVRTC could not compile {first.strip()} (sm_{arch}); the full log:\n{log}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = bytearray(size)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    return bytes(cubin)


def compile_kernels(arch, cache_dir=CACHE_DIR):
    """{module: CUBIN} of MODULES for sm_<arch>, from the disk cache when the source is unchanged.

    The CUBIN is built for the device's own compute capability: PTX from an
    NVRTC newer than the driver would not load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). On 9.0,
    flash_attn.cu is built for sm_90a, whose TMA forward needs Hopper's own instructions (its
    other kernels' machine code is the same as sm_90's, byte for byte under NVRTC 13). A cached
    file ends with the SHA-256 of the CUBIN before it: the driver crashes the
    process on a damaged CUBIN, so one that does not match is compiled again."""
    _, nvrtc = import_cuda()
    _, major, minor = nvrtc.nvrtcVersion()
    cubins = {}
    for name, (file, defines) in MODULES.items():
        with open(os.path.join(HERE, file)) as f:
            source = f.read()
        target = arch + "a" if arch == "90" and file == "flash_attn.cu" else arch
        key = hashlib.sha256(f"{source}|{defines}|sm_{target}|nvrtc {major}.{minor}".encode()).hexdigest()[:16]
        stem = name.replace(".cu", "").replace(" ", "_")
        path = os.path.join(cache_dir, f"{stem}_sm{target}_{key}.sealed.cubin")
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            cubin, digest = data[:-32], data[-32:]
            if cubin and hashlib.sha256(cubin).digest() == digest:
                cubins[name] = cubin
                continue
            print(f"{path} is damaged; compiling {name} again", file=sys.stderr)
        cubins[name] = nvrtc_compile(file, source, target, defines)
        os.makedirs(cache_dir, exist_ok=True)
        ne.atomic_write(path, cubins[name] + hashlib.sha256(cubins[name]).digest())
    return cubins


# -----------------------------------------------------------------------------
# CUDA plumbing

cu = None                                      # cuda.bindings.driver, once init_gpu ran
gpu = None                                     # the one GPU this program drives
memory_advice = "lower --batch"                # check's words when the GPU's memory runs out: main sets the command's


def check(result, what, out_of_memory=None):
    """cuda-python calls return (CUresult, *outputs): raise one sentence naming what failed;
    out_of_memory: the sentence for CUDA_ERROR_OUT_OF_MEMORY, where it is not the GPU's memory"""
    err = result[0]
    if int(err):
        _, name = cu.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        if "OUT_OF_MEMORY" in name:
            raise NanoEulerError(out_of_memory or f"out of GPU memory in {what}; {memory_advice}")
        raise NanoEulerError(f"CUDA error {name} in {what}")
    return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]


def ceil_div(a, b):
    return (a + b - 1) // b


class DeviceArray:
    """memory on the GPU: a pointer, a shape, a numpy dtype (float32, int32, float64, or
    uint16 for bfloat16 bits), copies to and from numpy"""

    bf16 = None                                # an fp32 array's bf16 copy, which bf16 matmuls read (weights)
    pinned = None                              # staging()'s page-locked memory, made on first use, freed with it

    def __init__(self, shape, dtype=np.float32, ptr=None, owner=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self.owner = owner                     # a view keeps the memory it points into alive
        if ptr is None:
            self.ptr = int(check(cu.cuMemAlloc(max(self.nbytes, 4)), f"cuMemAlloc of {self.nbytes:,} bytes"))
            self.owned, self.driver = True, cu
        else:
            self.ptr, self.owned = ptr, False

    def __del__(self):
        # only the driver that made it frees it, and only while it is still this module's: tests
        # put the CPU emulator in and take it out, and one test's garbage may be collected in another's
        if getattr(self, "owned", False) and self.driver is cu:
            cu.cuMemFree(self.ptr)

    def view(self, offset, shape, dtype=None):
        """the elements from offset on, as an array of shape (no copy); dtype: read as another
        type of the same size (the float32 numbers in an int32 buffer)"""
        assert dtype is None or np.dtype(dtype).itemsize == self.dtype.itemsize
        return DeviceArray(shape, dtype or self.dtype, self.ptr + offset * self.dtype.itemsize, owner=self)

    def upload(self, a):
        a = np.ascontiguousarray(a, dtype=self.dtype)
        assert a.size == self.size, (a.shape, self.shape)
        check(cu.cuMemcpyHtoDAsync(self.ptr, a.ctypes.data, self.nbytes, gpu.stream), "cuMemcpyHtoDAsync")
        gpu.sync("a copy to the GPU")          # before the numpy array can go away
        return self

    def upload_async(self, a):
        """as upload, without waiting for the GPU: a is copied into page-locked memory of
        this array's own, which the GPU copies from in stream order (the copy before
        from it done first: PinnedBuffer)"""
        a = np.ascontiguousarray(a, dtype=self.dtype)
        assert a.size == self.size, (a.shape, self.shape)
        self.staging()[:] = a.reshape(-1)
        return self.upload_staged()

    def staging(self):
        """this array's page-locked memory as a numpy array (flat) to write what
        upload_staged then copies, once the GPU has read what it held before"""
        if self.pinned is None:
            self.pinned = PinnedBuffer(self.nbytes)
        self.pinned.wait()
        return self.pinned.array.view(self.dtype)

    def upload_staged(self):
        """copy what was written into staging() to the GPU, in stream order"""
        check(cu.cuMemcpyHtoDAsync(self.ptr, self.pinned.ptr, self.nbytes, gpu.stream), "cuMemcpyHtoDAsync")
        self.pinned.record()
        return self

    def download(self):
        out = np.empty(self.shape, self.dtype)
        check(cu.cuMemcpyDtoHAsync(out.ctypes.data, self.ptr, self.nbytes, gpu.stream), "cuMemcpyDtoHAsync")
        gpu.sync("a copy from the GPU")
        return out

    def fill_bits(self, bits):
        """every element set to a bit pattern: 0 is zero, 0x7FC00000 a float32 NaN, 0xFFFF a bf16 one"""
        if self.dtype.itemsize == 2:
            check(cu.cuMemsetD16Async(self.ptr, bits, self.size, gpu.stream), "cuMemsetD16Async")
        else:
            check(cu.cuMemsetD32Async(self.ptr, bits, self.size, gpu.stream), "cuMemsetD32Async")
        return self

    def zero(self):
        return self.fill_bits(0)


def to_gpu(a, dtype=np.float32):
    return DeviceArray(np.shape(a), dtype).upload(a)


def host_alloc(nbytes, flags=0):
    """nbytes of page-locked host memory (cuMemHostAlloc): the machine's RAM, locked so that the
    GPU copies it directly; a refusal says so (it is not the GPU's memory that ran out)"""
    return check(cu.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc",
                 f"cuMemHostAlloc could not allocate {nbytes:,} bytes of page-locked host memory (this machine's "
                 "RAM, not the GPU's); free memory on this machine, or raise its limit (a container's memory "
                 "limit, ulimit -l)")


class PinnedBuffer:
    """page-locked host memory that the GPU copies from asynchronously, and an event
    recorded after the last such copy: wait() before writing it again"""
    host = event = None                                  # until made: a half-made buffer (refused) frees what it got

    def __init__(self, nbytes):
        self.driver = cu
        self.host = host_alloc(max(nbytes, 4))
        self.ptr = int(self.host)
        self.array = np.ctypeslib.as_array((ctypes.c_char * nbytes).from_address(self.ptr))   # its bytes
        self.event = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING.value), "cuEventCreate")
        self.recorded = False

    def wait(self):
        if self.recorded:
            check(cu.cuEventSynchronize(self.event), "waiting for a copy to the GPU")

    def record(self):
        check(cu.cuEventRecord(self.event, gpu.stream), "cuEventRecord")
        self.recorded = True

    def floats(self):
        """its memory as float32s, in an array that keeps this buffer (and so the memory) alive: a
        checkpoint's writer thread may still read it after an error has let the engine go"""
        raw = (ctypes.c_float * (len(self.array) // 4)).from_address(self.ptr)
        raw.owner = self
        return np.ctypeslib.as_array(raw)

    def __del__(self):
        if self.driver is cu:                            # as DeviceArray's: the driver that made it
            if self.event is not None:
                cu.cuEventDestroy(self.event)
            if self.host is not None:
                cu.cuMemFreeHost(self.host)


def count_gpus():
    """-> how many GPUs the driver sees (at least 1), or one sentence on why there are none"""
    global cu
    cu, _ = import_cuda()
    try:
        check(cu.cuInit(0), "cuInit")
        n = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
    except RuntimeError as e:                            # libcuda missing: no driver
        if isinstance(e, NanoEulerError):
            raise
        raise NanoEulerError("no NVIDIA driver was found, so there is no GPU to run on; "
                             "nanoeuler.py runs the same model on the CPU") from None
    if not n:
        raise NanoEulerError("no NVIDIA GPU was found; nanoeuler.py runs the same model on the CPU")
    return n


class GPU:
    """the device, its context and stream, the compiled kernels and cuBLAS"""

    def __init__(self, precision="fp32", device=0):
        n = count_gpus()
        if device >= n:
            raise NanoEulerError(f"there is no GPU {device}: this machine has {n}; lower --gpus")
        self.dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        # a real stream, not the legacy NULL one: every copy is Async on it
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        attr = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev), "attr")
        minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev), "attr")
        self.sms = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev), "attr")
        self.name = check(cu.cuDeviceGetName(256, self.dev), "cuDeviceGetName").split(b"\0")[0].decode()
        self.arch = f"{major}{minor}"
        self.modules = {name: check(cu.cuModuleLoadData(cubin), f"loading {name}")
                        for name, cubin in compile_kernels(self.arch).items()}
        self.functions, self.last_kernel, self.shared_allowed = {}, None, {}
        self.precision = precision
        self.cublas = Cublas(self.stream)

    def function(self, name, bf16=False):
        """kernel `name`: from kernels.cu's bf16 build (floatX = bfloat16) when bf16, else from
        its float build; or from flash_attn.cu"""
        if (name, bf16) not in self.functions:
            for module in ("kernels.cu bf16" if bf16 else "kernels.cu", "flash_attn.cu"):
                err, f = cu.cuModuleGetFunction(self.modules[module], name.encode())
                if not int(err):
                    self.functions[name, bf16] = f
                    break
            else:
                raise NanoEulerError(f"kernel {name} is in neither {SOURCES[0]} nor {SOURCES[1]}")
        return self.functions[name, bf16]

    def launch(self, name, grid, block, *args, shared=0, bf16=False):
        """args are ctypes values (see ptr_arg, int_arg, long_arg, float_arg below); kept alive for the call. bf16: the
        kernel's activations are bfloat16 (kernels.cu's bf16 build)"""
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        grid = grid if isinstance(grid, tuple) else (grid, 1, 1)
        self.last_kernel = name
        if shared > max(48 * 1024, self.shared_allowed.get(name, 0)):    # past a default's 48 KB: allowed once a
            allow = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES   # size, before capture
            check(cu.cuFuncSetAttribute(self.function(name, bf16), allow, shared), f"allowing {name} {shared} bytes")
            self.shared_allowed[name] = shared                  # (never lowered: a smaller launch fits the larger)
        with self.timed(name):
            check(cu.cuLaunchKernel(self.function(name, bf16), *grid, block, 1, 1, shared, self.stream,
                                    ctypes.addressof(params), 0), f"launching {name}")

    # bench --profile: a pair of CUDA events around every kernel and matmul, summed by name
    profile = None

    def timed(self, name):
        return EventTimer(self, name) if self.profile is not None else contextlib.nullcontext()

    def profile_report(self):
        """-> {name: (calls, total ms)} of what ran since profile was set to []"""
        self.sync()
        totals = {}
        for name, a, b in self.profile:
            calls, ms = totals.get(name, (0, 0.0))
            totals[name] = (calls + 1, ms + check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime"))
            cu.cuEventDestroy(a)
            cu.cuEventDestroy(b)
        self.profile = None
        return totals

    def scratch(self, n):
        """n floats of scratch memory, shared by every kernel that needs some (one stream: one at a time)"""
        if getattr(self, "_scratch", None) is None or self._scratch.size < n:
            self._scratch = DeviceArray((n,))
        return self._scratch

    def sync(self, what="the GPU's work"):
        where = f" (during or before kernel {self.last_kernel})" if self.last_kernel else ""
        check(cu.cuStreamSynchronize(self.stream), what + where)


class EventTimer:
    """records a CUDA event before and after what it wraps, for GPU.profile"""

    def __init__(self, gpu_, name):
        self.gpu, self.name = gpu_, name

    def __enter__(self):
        self.events = [check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        check(cu.cuEventRecord(self.events[0], self.gpu.stream), "cuEventRecord")

    def __exit__(self, *exc):
        check(cu.cuEventRecord(self.events[1], self.gpu.stream), "cuEventRecord")
        self.gpu.profile.append((self.name, *self.events))


def ptr_arg(a):
    """a kernel's pointer argument: a DeviceArray's address, or a raw one (None: nullptr)"""
    return ctypes.c_void_p(a.ptr if isinstance(a, DeviceArray) else int(a or 0))


# a kernel's int, long (64 bits) and float arguments
int_arg, long_arg, float_arg = ctypes.c_int, ctypes.c_longlong, ctypes.c_float


def init_gpu(precision="fp32", device=0):
    global gpu
    if gpu is None:
        gpu = GPU(precision, device)
    gpu.precision = precision
    return gpu


# -----------------------------------------------------------------------------
# kernel launchers (same order and names as kernels.cu and flash_attn.cu)
#
# An activation array is float32, or uint16 holding bfloat16 bits: kernels.cu's floatX.
# Each launcher runs the build of kernels.cu whose floatX is its arrays' type (bf16(a)).

def bf16(a):
    """is a an array of bfloat16 (the bits, as uint16)"""
    return a.dtype == np.uint16


def pack(a):
    """elements of a in 16 bytes: kernels.cu's PACK, what one thread moves at a time"""
    return 16 // a.dtype.itemsize


def embedding_forward(x, idx, tok_emb, N, C):
    """x[n] = tok_emb[idx[n]] for the N positions (N, C), a thread per element"""
    block = 256
    gpu.launch("embedding_forward_kernel", ceil_div(N * C, block), block, ptr_arg(x), ptr_arg(idx), ptr_arg(tok_emb),
               int_arg(N), int_arg(C), bf16=bf16(x))


def embedding_backward(dtok_emb, idx, dx, N, C, V):
    """one block per vocabulary entry, each finding its rows in idx (no sort on the host)"""
    gpu.launch("embedding_backward_kernel", V, 256, ptr_arg(dtok_emb), ptr_arg(idx), ptr_arg(dx), int_arg(N),
               int_arg(C), bf16=bf16(dx))


def rmsnorm_forward(out, rstd, x, w, N, C):
    """out = x * rstd * w for each row of x (N, C), rstd = 1 / sqrt(mean(x^2) + eps) kept for the
    backward; a warp per row"""
    block = 256                                              # 8 rows per block, a warp each
    gpu.launch("rmsnorm_forward_kernel", ceil_div(N, block // 32), block, ptr_arg(out), ptr_arg(rstd), ptr_arg(x),
               ptr_arg(w), int_arg(N), int_arg(C), bf16=bf16(x))


def residual_rmsnorm_forward(x, out, rstd, x_in, a, w, N, C):
    """x = x_in + a (the residual add), out = rmsnorm(x) * w, in one pass"""
    block = 256
    gpu.launch("residual_rmsnorm_forward_kernel", ceil_div(N, block // 32), block, ptr_arg(x), ptr_arg(out),
               ptr_arg(rstd), ptr_arg(x_in), ptr_arg(a), ptr_arg(w), int_arg(N), int_arg(C), bf16=bf16(x))


def rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C, accumulate=True, partial=None):
    """dx += (or = without accumulate) the input gradient, dw += the weight gradient;
    partial: scratch for dw's per-block sums (GPUModel's own, which a graph may hold)"""
    block = 256
    # few blocks, few partial sums of dw: two an SM, as many as fit at once in bf16 at C = 768 (126
    # registers a thread; the fp32 build's 151 fit one); the narrowest build of the kernel that takes C
    grid = min(ceil_div(N, block // 32), 2 * gpu.sms)
    partial = gpu.scratch(grid * C) if partial is None else partial
    assert partial.size >= grid * C
    width = next(width for width in RMSNORM_WIDTHS if C <= width)
    gpu.launch(f"rmsnorm_backward_kernel_{width}", grid, block, ptr_arg(dx), ptr_arg(partial), ptr_arg(dout), ptr_arg(x),
               ptr_arg(w), ptr_arg(rstd), int_arg(N), int_arg(C), int_arg(int(accumulate)), shared=4 * C * block // 32,
               bf16=bf16(dx))
    gpu.launch("rmsnorm_backward_dw_kernel", ceil_div(C, 32), 256, ptr_arg(dw), ptr_arg(partial), int_arg(grid),
               int_arg(C), bf16=bf16(dx))


def rope_forward(qkv, cos, sin, N, T, n_heads, D, stride, pos=0):
    """the first n_heads heads of each row of qkv (q and k) rotated in place by the angle of
    position pos + t, t the row's place in its sequence of T (rotate-half RoPE); a thread per PACK pairs"""
    block = 256
    gpu.launch("rope_forward_kernel", ceil_div(N * n_heads * D // 2 // pack(qkv), block), block, ptr_arg(qkv),
               ptr_arg(cos), ptr_arg(sin), int_arg(N), int_arg(T), int_arg(n_heads), int_arg(D), int_arg(stride),
               int_arg(pos), bf16=bf16(qkv))


def rope_backward(dqkv, cos, sin, N, T, n_heads, D, stride, pos=0):
    """dq and dk in dqkv rotated back in place: rope_forward's transpose, the opposite angle"""
    block = 256
    gpu.launch("rope_backward_kernel", ceil_div(N * n_heads * D // 2 // pack(dqkv), block), block, ptr_arg(dqkv),
               ptr_arg(cos), ptr_arg(sin), int_arg(N), int_arg(T), int_arg(n_heads), int_arg(D), int_arg(stride),
               int_arg(pos), bf16=bf16(dqkv))


def swiglu_forward(out, gu, N, F):
    """out (N, F) = silu(gate) * up, gu (N, 2F) holding gate then up; a thread per PACK outputs"""
    block = 256
    gpu.launch("swiglu_forward_kernel", ceil_div(N * F // pack(out), block), block, ptr_arg(out), ptr_arg(gu),
               int_arg(N), int_arg(F), bf16=bf16(out))


def swiglu_backward(dgu, dout, gu, N, F):
    """dgu (N, 2F) = d loss / d gate, then d loss / d up, from dout (N, F)"""
    block = 256
    gpu.launch("swiglu_backward_kernel", ceil_div(N * F // pack(dgu), block), block, ptr_arg(dgu), ptr_arg(dout),
               ptr_arg(gu), int_arg(N), int_arg(F), bf16=bf16(dgu))


def residual_forward(out, x, a, n):
    """out = x + a over n elements (decoding's prefill; training fuses the add into
    residual_rmsnorm_forward)"""
    block = 256
    gpu.launch("residual_forward_kernel", ceil_div(n, block), block, ptr_arg(out), ptr_arg(x), ptr_arg(a),
               long_arg(n), bf16=bf16(out))


def cross_entropy_forward(logits, losses, targets, dscale, N, V, K):
    """logits (N, K, V) -> d loss / d logits in place, losses (K, N)"""
    block = 256
    gpu.launch("cross_entropy_forward_kernel", N * K, block, ptr_arg(logits), ptr_arg(losses), ptr_arg(targets),
               ptr_arg(dscale), int_arg(N), int_arg(V), int_arg(K), bf16=bf16(logits))


def cross_entropy_sum(sums, losses, N, K):
    """sums[k] (float64) = head k's losses added up"""
    gpu.launch("cross_entropy_sum_kernel", K, 256, ptr_arg(sums), ptr_arg(losses), int_arg(N))


def to_bf16(out, x, n):
    """out (bf16 bits) = x (fp32) rounded to nearest even, 4 elements a thread"""
    block = 256
    gpu.launch("to_bf16_kernel", ceil_div(n, 4 * block), block, ptr_arg(out), ptr_arg(x), long_arg(n))


def grad_norm(partial, grads, n):
    """partial[b] = block b's share of the sum of squares (partial.size blocks)"""
    gpu.launch("grad_norm_kernel", partial.size, 512, ptr_arg(partial), ptr_arg(grads), long_arg(n))


def clip_grad_norm(results, clip, partial, K, max_norm):
    """results[K] = the gradient norm; clip = (scale, apply): see clip_grad_norm_kernel"""
    gpu.launch("clip_grad_norm_kernel", 1, 32, ptr_arg(results), ptr_arg(clip), ptr_arg(partial),
               int_arg(partial.size), int_arg(K), float_arg(max_norm))


def adamw_update(params, params16, grads, m, v, decay, n, hyper, clip, beta1=0.9, beta2=0.95, eps=1e-8,
                 weight_decay=0.1):
    """hyper = (lr, 1 - beta1^step, 1 - beta2^step) and clip (clip_grad_norm's) in GPU memory"""
    block = 256
    grid = min(ceil_div(n, 4 * block), 8 * gpu.sms)             # a grid-stride loop: see the kernel
    gpu.launch("adamw_update_kernel", grid, block, ptr_arg(params), ptr_arg(params16),
               ptr_arg(grads), ptr_arg(m), ptr_arg(v), ptr_arg(decay), long_arg(n), ptr_arg(hyper), ptr_arg(clip),
               float_arg(beta1), float_arg(beta2), float_arg(eps), float_arg(weight_decay))


# query rows (dk/dv: keys) a block of every attention pass but the bf16 forward: flash_attn.cu's BR,
# MMA_BLOCK_ROWS and TILE
ATTENTION_ROWS = 64
FORWARD_MT = {16: 1, 32: 1, 64: 2}     # as in flash_attn.cu: m-tiles a warp of the bf16 forward (64 MT rows a block)
# flash_attn.cu's entry points by version: forward, dk/dv, dq, each written out for D in HEAD_DIMS
ATTENTION_KERNELS = {
    "fp32": ("attention_forward_kernel_{D}", "attention_backward_dkv_kernel_{D}",
             "attention_backward_dq_kernel_{D}"),
    "tf32": ("attention_forward_tf32_kernel_{D}", "attention_backward_dkv_tf32_kernel_{D}",
             "attention_backward_dq_tf32_kernel_{D}"),
    "bf16": ("attention_forward_bf16_kernel_{D}", "attention_backward_dkv_bf16_kernel_{D}",
             "attention_backward_dq_bf16_kernel_{D}"),
}


def attention_path(D, qkv):
    """which of flash_attn.cu's versions runs: bf16 for bf16 activations, else fp32 (CUDA
    cores, exact) or tf32 (tensor cores) by the precision"""
    if bf16(qkv):
        assert D in HEAD_DIMS
        return "bf16"
    return "fp32" if gpu.precision == "fp32" else "tf32"


# the bf16 forward at D = 64 on compute capability 9.0 (H100, H200): flash_attn.cu's attention_forward_tma (TMA and
# warpgroup MMA; 96.1 us a layer at batch 64 against the mma.sync kernel's 143.7 on an H100, dev/LOG.md); False:
# the mma.sync kernel everywhere (an A/B). Its backward is the same: y and lse have the same layout
ATTENTION_FORWARD_TMA = True
# the bf16 backward's dk/dv pass there: flash_attn.cu's attention_backward_dkv_tma (dev/variants/
# attention_backward_tma.cu's turns version, persistent), the dq pass the mma.sync one on the ds it stores in the
# same order: on an H100 0.6-1.0 ms off a batch-64 step, the same bits run to run (BENCHMARKS.md); False: the A/B
ATTENTION_BACKWARD_TMA = True
TMA_KEYS, TMA_STAGES = 128, 4            # as in flash_attn.cu: STEP_KEYS and STAGES, keys a step and K/V stages
DKV_STAGES = 4                           # and DKV_STAGES: the TMA dk/dv pass's q, dy, lse and delta stages
DKV_STAT_BOX, DKV_STAT_STRIDE = 68, 96  # its lse and delta: floats a copy, floats a stage (flash_attn.cu's)
TENSOR_MAPS = {}                         # (address, rows, columns, box, dtype) -> a TMA kernel's tensor map


def attention_tma(D, qkv, backward=False):
    """does attention_forward (backward: attention_backward's dk/dv pass) run its TMA kernel on these activations
    (TMA reads 16-byte-aligned rows)"""
    on = ATTENTION_BACKWARD_TMA if backward else ATTENTION_FORWARD_TMA
    return on and gpu.arch == "90" and D == 64 and bf16(qkv) and qkv.ptr % 16 == 0


def tensor_map(a, rows, cols, box_rows, box_cols=64, row_stride=None):
    """a TMA kernel's CUtensorMap over the first `rows` rows of `cols` elements of a, 128 bytes to pass by value:
    boxes of box_cols x box_rows, zeros past the rows and columns (a store stops there); bf16 rows of 2 cols bytes
    (or row_stride elements apart), 128-byte swizzled as wgmma reads them, or fp32 unswizzled (the rows' stride
    rounded up to 16 bytes: one row of any length does). Made once per buffer and shape (GPUModel makes its own
    when it allocates them: a CUDA graph keeps the values it was captured with, and the buffers never move); a map
    is the same for the same address and sizes, so one left from a freed buffer is still right for a new one there"""
    key = (a.ptr, rows, cols, box_rows, box_cols, bf16(a), row_stride)
    if key not in TENSOR_MAPS:
        u64, u32 = cu.cuuint64_t, cu.cuuint32_t                  # (cuda-python takes no plain ints)
        enum = lambda kind, name: getattr(getattr(cu, f"CUtensorMap{kind}"), f"CU_TENSOR_MAP_{name}")
        kind, size, swizzle = ("BFLOAT16", 2, "128B") if bf16(a) else ("FLOAT32", 4, "NONE")
        stride = size * (row_stride or cols) if rows > 1 else ceil_div(size * cols, 16) * 16
        m = check(cu.cuTensorMapEncodeTiled(
            enum("DataType", f"DATA_TYPE_{kind}"), 2, a.ptr, [u64(cols), u64(rows)], [u64(stride)],
            [u32(box_cols), u32(box_rows)], [u32(1), u32(1)], enum("Interleave", "INTERLEAVE_NONE"),
            enum("Swizzle", f"SWIZZLE_{swizzle}"), enum("L2promotion", "L2_PROMOTION_L2_256B"),
            enum("FloatOOBfill", "FLOAT_OOB_FILL_NONE")), "cuTensorMapEncodeTiled")
        TENSOR_MAPS[key] = (ctypes.c_uint64 * 16)(*[int(w) for w in m.opaque])
    return TENSOR_MAPS[key]


def tensor_maps(qkv, rows):
    """the TMA forward's two tensor maps over the first `rows` rows of qkv (bf16, (rows, (Hq+2Hkv)*64)): boxes of a
    head's 64 columns by 64 rows (q) and TMA_KEYS rows (k, v)"""
    return tensor_map(qkv, rows, qkv.shape[-1], 64), tensor_map(qkv, rows, qkv.shape[-1], TMA_KEYS)


def backward_tensor_maps(qkv, dy, lse, delta, B, T, Hq):
    """the TMA dk/dv pass's four: qkv's (the forward's 64-row one), dy's (the same over (B*T, Hq*64)), and lse's
    and delta's, each one row of B*Hq*T floats (rows of T floats would need T a multiple of 4) in boxes of 68: a
    copy must start 16-byte aligned (else CUDA_ERROR_ILLEGAL_INSTRUCTION), so a step's 64 are read from the
    multiple of 4 at or before their first (flash_attn.cu's DKV_STAT_BOX)"""
    return (tensor_map(qkv, B * T, qkv.shape[-1], 64), tensor_map(dy, B * T, Hq * 64, 64),
            tensor_map(lse, 1, B * Hq * T, 1, DKV_STAT_BOX), tensor_map(delta, 1, B * Hq * T, 1, DKV_STAT_BOX))


def attention_forward_tma(y, lse, qkv, B, T, Hq, Hkv):
    """attention_forward at D = 64 by flash_attn.cu's TMA kernel: persistent blocks, one an SM, of a producer
    warpgroup and W consumers, one a query head of the W (a divisor of Hq/Hkv, at most 3) that read one kv head"""
    W = max(w for w in (1, 2, 3) if (Hq // Hkv) % w == 0)
    units = B * (Hq // W) * ((ceil_div(T, 64) + 1) // 2)          # pairs of 64-row query tiles of W heads
    shared = 2 * W * 8192 + TMA_STAGES * 256 * TMA_KEYS + 1024 + 8 * (3 * TMA_STAGES + 4)   # q, K/V, align, mbarriers
    name, (map_q, map_kv) = "attention_forward_tma_kernel_64", tensor_maps(qkv, B * T)
    gpu.launch(name, min(units, gpu.sms), 128 * (W + 1), ptr_arg(y), ptr_arg(lse), map_q, map_kv, int_arg(B),
               int_arg(T), int_arg(Hq), int_arg(Hkv), float_arg(1 / math.sqrt(64)), shared=shared)


def attention_forward(y, lse, qkv, B, T, Hq, Hkv, D, tma=None):
    """y (B*T, Hq*D) and lse (B, Hq, T) from qkv (B*T, (Hq+2Hkv)*D), q and k rotated; tma: False runs the mma.sync
    kernel where attention_tma would pick the TMA one (check runs both)"""
    if attention_tma(D, qkv) and tma is not False:
        return attention_forward_tma(y, lse, qkv, B, T, Hq, Hkv)
    path = attention_path(D, qkv)
    kernel = ATTENTION_KERNELS[path][0].format(D=D)
    args = (ptr_arg(y), ptr_arg(lse), ptr_arg(qkv), int_arg(T), int_arg(Hq), int_arg(Hkv), float_arg(1 / math.sqrt(D)))
    if path == "bf16":                                               # the last query tiles (most keys) first
        gpu.launch(kernel, (Hq, B, ceil_div(T, ATTENTION_ROWS * FORWARD_MT[D])), 128, *args)
    else:                                                            # fp32: one thread per query row
        gpu.launch(kernel, (ceil_div(T, ATTENTION_ROWS), Hq, B), ATTENTION_ROWS if path == "fp32" else 128, *args)


def attention_ds_size(B, T, Hq):
    """elements of the bf16 dk/dv pass's ds tiles for the dq pass (flash_attn.cu's ds_tile):
    ATTENTION_ROWS x ATTENTION_ROWS for each causal pair of tiles of each (b, query head)"""
    tiles = ceil_div(T, ATTENTION_ROWS)
    return B * Hq * tiles * (tiles + 1) // 2 * ATTENTION_ROWS ** 2


def dkv_tma_shared_bytes():
    """the TMA dk/dv pass's dynamic shared memory: K, V (2 consumers), the stages' q, dy, lse and delta, the
    mbarriers, 1024 to align the tiles"""
    return (2 * 2 + 2 * DKV_STAGES) * 8192 + 2 * 4 * DKV_STAT_STRIDE * DKV_STAGES + 8 * (2 * DKV_STAGES + 2) + 1024


def attention_backward_dkv_tma(dqkv, ds, qkv, dy, lse, delta, B, T, Hq, Hkv):
    """attention_backward's dk/dv pass at D = 64 by flash_attn.cu's TMA kernel: persistent blocks, one an SM, of a
    producer warpgroup and 2 consumers, each 64 keys of the unit's 128 of a kv head; ds as the mma.sync pass stores
    it"""
    units = ceil_div(ceil_div(T, 64), 2) * B * Hkv
    name, maps = "attention_backward_dkv_tma_kernel_64", backward_tensor_maps(qkv, dy, lse, delta, B, T, Hq)
    gpu.launch(name, min(units, gpu.sms), 384, ptr_arg(dqkv), ptr_arg(ds), *maps, int_arg(B), int_arg(T),
               int_arg(Hq), int_arg(Hkv), float_arg(1 / math.sqrt(64)), shared=dkv_tma_shared_bytes())


def attention_backward(dqkv, dy, qkv, y, lse, delta, ds, B, T, Hq, Hkv, D, tma=None):
    """dqkv = d loss / d qkv (dq and dk before rope's backward); delta (B, Hq, T) and, for
    the bf16 passes, ds (attention_ds_size bf16 elements) are scratch; tma: False runs the mma.sync dk/dv pass
    where attention_tma would pick the TMA one (check runs both)"""
    block, path = 256, attention_path(D, qkv)
    delta_args = (ptr_arg(delta), ptr_arg(dy), ptr_arg(y), int_arg(B), int_arg(T), int_arg(Hq), int_arg(D))
    lanes = D * (2 if path == "bf16" else 4) // 16                  # a 16-byte pack of a row each
    gpu.launch("attention_backward_delta_bf16_kernel" if path == "bf16" else "attention_backward_delta_kernel",
               ceil_div(B * T * Hq * lanes, block), block, *delta_args)
    inputs = (ptr_arg(qkv), ptr_arg(dy), ptr_arg(lse), ptr_arg(delta))
    sizes = (int_arg(T), int_arg(Hq), int_arg(Hkv), float_arg(1 / math.sqrt(D)))
    _, dkv_kernel, dq_kernel = (name.format(D=D) for name in ATTENTION_KERNELS[path])
    blocks = ceil_div(T, ATTENTION_ROWS)
    if path == "bf16":                                               # dq from the ds that the dk/dv pass stores
        assert ds is not None and ds.size >= attention_ds_size(B, T, Hq) and ds.dtype == np.uint16
        if attention_tma(D, qkv, backward=True) and all(a.ptr % 16 == 0 for a in (dy, lse, delta)) and tma is not False:
            attention_backward_dkv_tma(dqkv, ds, qkv, dy, lse, delta, B, T, Hq, Hkv)
        else:
            gpu.launch(dkv_kernel, (Hkv, B, blocks), 128, ptr_arg(dqkv), ptr_arg(ds), *inputs, *sizes)
        gpu.launch(dq_kernel, (Hq, B, blocks), 128, ptr_arg(dqkv), ptr_arg(qkv), ptr_arg(ds), *sizes)
    else:                                                            # fp32 dq: one thread per query row
        gpu.launch(dkv_kernel, (blocks, Hkv, B), 128, ptr_arg(dqkv), *inputs, *sizes)
        gpu.launch(dq_kernel, (blocks, Hq, B), ATTENTION_ROWS if path == "fp32" else 128, ptr_arg(dqkv), *inputs,
                   *sizes)


# the bf16 forward's products out = a @ b.T on compute capability 9.0 (H100, H200): flash_attn.cu's TMA product
# (persistent blocks, wgmma fed by TMA, out through TMA stores: dev/variants/wgmma_probe.cu's
# `_persistent_store_bn256`, 0.97-1.10x cuBLAS's time on the big model's four at batch 64 on an H100, dev/LOG.md),
# and w_gate_up's with SwiGLU in its epilogue (matmul_swiglu_forward: no swiglu_forward pass). 1.0-1.1 ms of the
# batch-64 step on an H100 (53.9-54.0 ms against 54.7-55.0, BENCHMARKS.md); False: cuBLAS and swiglu_forward
# everywhere (an A/B)
PRODUCT_TMA = True
PRODUCT_BM, PRODUCT_BN, PRODUCT_STAGES = 128, 256, 4      # as in flash_attn.cu: a tile of out, and a's and b's stages
# its dynamic shared memory: the stages, two 64 x 64 boxes of out a consumer, 1024 to align them, the mbarriers
PRODUCT_SHARED = PRODUCT_STAGES * (PRODUCT_BM + PRODUCT_BN) * 64 * 2 + 4 * 8192 + 1024 + 8 * 2 * PRODUCT_STAGES


# the bf16 backward's data gradients out = a @ b, b a weight (K, N) row-major (dx = dy @ W: cuBLAS's "NN"), on
# compute capability 9.0: flash_attn.cu's matmul_backward_tma_kernel (dev/variants/wgmma_probe.cu's
# `_persistent_store_nn_bn256`, 1.02-1.10x cuBLAS's rate on the big model's four at batch 64 on an H100, dev/LOG.md),
# and w_down's with swiglu_backward in its epilogue (matmul_swiglu_backward: no swiglu_backward pass, no ds). Off
# until a GPU has timed it in a training step (dev/LOG.md's chapter says how); False: cuBLAS and swiglu_backward
PRODUCT_TMA_BACKWARD = False


def product_tma(out, a, b, N, K, backward=False):
    """does matmul run flash_attn.cu's TMA product for out = a @ b.T (N, K: b's shape; backward: out = a @ b, b (K,
    N), by PRODUCT_TMA_BACKWARD's switch): bf16 a and out, b bf16 or a weight with a bf16 copy (a buffer that stays
    put: its tensor map is made once), rows 16-byte aligned"""
    b16 = b if bf16(b) else b.bf16
    on = PRODUCT_TMA_BACKWARD if backward else PRODUCT_TMA
    return (on and gpu.arch == "90" and bf16(out) and bf16(a) and b16 is not None and N % 8 == 0
            and K % 8 == 0 and all(x.ptr % 16 == 0 for x in (out, a, b16)))


def matmul_forward_tma(out, a, b, M, N, K):
    """out (M, N) = a (M, K) @ b (N, K).T by flash_attn.cu's matmul_forward_tma_kernel: persistent blocks, one an
    SM, of a producer warpgroup and two consumers on 128 x 256 tiles of out (any M, N, K: TMA's zeros and clipping)"""
    b16 = b if bf16(b) else b.bf16
    maps = tensor_map(a, M, K, PRODUCT_BM), tensor_map(b16, N, K, PRODUCT_BN), tensor_map(out, M, N, 64)
    tiles = ceil_div(M, PRODUCT_BM) * ceil_div(N, PRODUCT_BN)
    gpu.launch("matmul_forward_tma_kernel", min(tiles, gpu.sms), 384, *maps, int_arg(M), int_arg(N), int_arg(K),
               shared=PRODUCT_SHARED)


def matmul_swiglu_forward(gu, s, a, w, M, F, K):
    """gu (M, 2F) = a (M, K) @ w (2F, K).T (w_gate_up: gate then up) and s (M, F) = silu(gate) * up: one pass of
    flash_attn.cu's matmul_swiglu_forward_tma_kernel where product_tma holds (tiles of 128 features, gate and up
    side by side; s the same bits as swiglu_forward's from gu), else matmul then swiglu_forward"""
    if not (product_tma(gu, a, w, 2 * F, K) and bf16(s) and s.ptr % 16 == 0):
        matmul(gu, a, w, M, 2 * F, K, trans_b=True)
        return swiglu_forward(s, gu, M, F)
    w16 = w if bf16(w) else w.bf16
    halves = [tensor_map(gu.view(f, (M, F)), M, F, 64, row_stride=2 * F) for f in (0, F)]   # gate's, up's
    maps = tensor_map(a, M, K, PRODUCT_BM), tensor_map(w16, 2 * F, K, PRODUCT_BN // 2), *halves, tensor_map(s, M, F, 64)
    tiles = ceil_div(M, PRODUCT_BM) * ceil_div(F, PRODUCT_BN // 2)
    gpu.launch("matmul_swiglu_forward_tma_kernel", min(tiles, gpu.sms), 384, *maps, int_arg(M), int_arg(F), int_arg(K),
               shared=PRODUCT_SHARED)


def matmul_backward_tma(out, a, b, M, N, K):
    """out (M, N) = a (M, K) @ b (K, N) (b row-major: a weight, dx = dy @ W) by flash_attn.cu's
    matmul_backward_tma_kernel: the forward's geometry (128 x 256 tiles, any M, N, K), b's stage 4 boxes of 64
    columns x 64 k"""
    b16 = b if bf16(b) else b.bf16
    maps = tensor_map(a, M, K, PRODUCT_BM), tensor_map(b16, K, N, 64), tensor_map(out, M, N, 64)
    tiles = ceil_div(M, PRODUCT_BM) * ceil_div(N, PRODUCT_BN)
    gpu.launch("matmul_backward_tma_kernel", min(tiles, gpu.sms), 384, *maps, int_arg(M), int_arg(N), int_arg(K),
               shared=PRODUCT_SHARED)


def matmul_swiglu_backward(dgu, ds, dx, w, gu, M, F, K):
    """dgu (M, 2F) = swiglu_backward of ds = dx (M, K) @ w (K, F) (w_down) and gu (the forward's gate then up): one
    pass of flash_attn.cu's matmul_swiglu_backward_tma_kernel where product_tma(backward) holds (ds not written;
    dgu the same bits as matmul + swiglu_backward with that kernel's ds), else matmul into ds then swiglu_backward"""
    if not (product_tma(dgu, dx, w, F, K, backward=True) and bf16(gu) and gu.ptr % 16 == 0):
        matmul(ds, dx, w, M, F, K)
        return swiglu_backward(dgu, ds, gu, M, F)
    w16 = w if bf16(w) else w.bf16
    halves = [tensor_map(dgu.view(f, (M, F)), M, F, 64, row_stride=2 * F) for f in (0, F)]   # d gate's, d up's
    maps = tensor_map(dx, M, K, PRODUCT_BM), tensor_map(w16, K, F, 64), *halves
    tiles = ceil_div(M, PRODUCT_BM) * ceil_div(F, PRODUCT_BN)
    gpu.launch("matmul_swiglu_backward_tma_kernel", min(tiles, gpu.sms), 384, *maps, ptr_arg(gu), int_arg(M),
               int_arg(F), int_arg(K), shared=PRODUCT_SHARED)


# -----------------------------------------------------------------------------
# matmuls (cuBLAS)
#
# cuBLAS is column-major; our arrays are row-major. A row-major (r, c) array is,
# byte for byte, a column-major (c, r) array: its transpose. So for a row-major
# out = op(a) @ op(b), ask cuBLAS for out.T = op(b).T @ op(a).T: swap the two
# operands and swap M and N. Nothing is copied or transposed.

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT = 68, 77, -1


class Cublas:
    def __init__(self, stream, workspace_bytes=32 << 20):
        import cuda.pathfinder as pf
        try:
            lib = ctypes.CDLL(pf.load_nvidia_dynamic_lib("cublas").abs_path)
        except Exception:
            raise NanoEulerError("cuBLAS was not found: pip install nvidia-cublas (see requirements-cuda.txt)") \
                from None
        pointer, integer = ctypes.c_void_p, ctypes.c_int         # handles, streams and addresses; ints and enums
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(pointer)]
        lib.cublasSetStream_v2.argtypes = [pointer, pointer]
        lib.cublasSetWorkspace_v2.argtypes = [pointer, pointer, ctypes.c_size_t]
        # handle, transa, transb, m, n, k, alpha, (A, Atype, lda), (B, Btype, ldb), beta, C, Ctype, ldc, compute, algo
        lib.cublasGemmEx.argtypes = [pointer, *[integer] * 5, pointer, *[pointer, integer, integer] * 2,
                                     pointer, pointer, *[integer] * 4]
        lib.cublasGetStatusName.argtypes, lib.cublasGetStatusName.restype = [integer], ctypes.c_char_p
        self.lib, handle = lib, pointer()
        self.check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle.value
        self.check(lib.cublasSetStream_v2(self.handle, int(stream)), "cublasSetStream")
        self.workspace = DeviceArray((workspace_bytes // 4,))  # ours, so graph capture needs no allocation
        self.check(lib.cublasSetWorkspace_v2(self.handle, self.workspace.ptr, workspace_bytes), "cublasSetWorkspace")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.bf16 = [None, None]               # scratch for the two operands of a bf16 matmul

    def check(self, status, what):
        if status:
            raise NanoEulerError(f"cuBLAS error {self.lib.cublasGetStatusName(status).decode()} in {what}")

    def gemm(self, out, a, b, M, N, K, trans_a=False, trans_b=False, accumulate=False):
        """row-major out (M,N) = op(a) @ op(b), or += with accumulate. Each array's type is
        cuBLAS's: bf16 activations in and out as they are (fp32 sums inside), fp32 the
        weights' gradients; in bf16 mode an fp32 input is read as bf16 (see operand)"""
        lda = M if trans_a else K                            # row-major leading dimensions
        ldb = K if trans_b else N
        compute = CUBLAS_COMPUTE_32F_FAST_TF32 if gpu.precision == "tf32" else CUBLAS_COMPUTE_32F
        a, a_type = self.operand(0, a, M * K)
        b, b_type = self.operand(1, b, K * N)
        out_type = CUDA_R_16BF if out.dtype == np.uint16 else CUDA_R_32F
        beta = self.one if accumulate else self.zero
        with gpu.timed(f"matmul {'T' if trans_a else 'N'}{'T' if trans_b else 'N'}"):
            self.check(self.lib.cublasGemmEx(
                self.handle, CUBLAS_OP_T if trans_b else CUBLAS_OP_N, CUBLAS_OP_T if trans_a else CUBLAS_OP_N,
                N, M, K, ctypes.addressof(self.one), b.ptr, b_type, ldb, a.ptr, a_type, lda,
                ctypes.addressof(beta), out.ptr, out_type, N, compute, CUBLAS_GEMM_DEFAULT),
                f"a {M}x{N}x{K} matmul")

    def operand(self, i, x, n):
        """-> x as a product reads it, and its cuBLAS type: bf16 arrays (activations) as they
        are; fp32 ones as they are, except in bf16 mode, where both inputs must be bf16"""
        if x.dtype == np.uint16:
            return x, CUDA_R_16BF
        if gpu.precision != "bf16":
            return x, CUDA_R_32F
        return self.to_bf16(i, x, n), CUDA_R_16BF

    def to_bf16(self, i, x, n):
        """x's bf16 copy when it has one (the weights do), else x (fp32: decoding's prefill)
        rounded into bf16 scratch buffer i, grown as needed"""
        if x.bf16 is not None:
            return x.bf16
        if self.bf16[i] is None or self.bf16[i].size < n:
            self.bf16[i] = DeviceArray((n,), np.uint16)
        to_bf16(self.bf16[i], x, n)
        return self.bf16[i]


def matmul(out, a, b, M, N, K, trans_a=False, trans_b=False, accumulate=False):
    """row-major out (M,N) = op(a) @ op(b) (+= with accumulate): the forward's x @ W.T and the backward's dy @ W by
    flash_attn.cu's TMA products where product_tma holds, everything else by cuBLAS"""
    if trans_b and not trans_a and not accumulate and product_tma(out, a, b, N, K):
        return matmul_forward_tma(out, a, b, M, N, K)
    if not trans_b and not trans_a and not accumulate and product_tma(out, a, b, N, K, backward=True):
        return matmul_backward_tma(out, a, b, M, N, K)
    gpu.cublas.gemm(out, a, b, M, N, K, trans_a, trans_b, accumulate)


# -----------------------------------------------------------------------------
# the model on the GPU

def grad_buckets(cfg):
    """{part: (lo, hi)}: the slices of the flat gradient that the backward finishes one
    after another, "heads" (with final_norm), layers L-1 .. 0, "tok_emb"; on several
    GPUs each is summed over the ranks as soon as it is done"""
    start, offset = {}, 0
    for name, shape in param_shapes(cfg):
        start[name], offset = offset, offset + math.prod(shape)
    ends = [start[f"layers.{l}.attn_norm"] for l in range(cfg.L)] + [start["final_norm"], offset]
    return {"heads": (ends[-2], offset), **{l: (ends[l], ends[l + 1]) for l in reversed(range(cfg.L))},
            "tok_emb": (0, ends[0])}


# bf16 mode keeps its activations in bf16 (kernels.cu's floatX). False: in fp32, with
# the matmuls rounding their fp32 inputs into scratch first and attention in tf32: the
# same numbers as bf16 mode had before floatX, slower; a fallback, should bf16 fail
BF16_ACTIVATIONS = True


def activations_bf16(cfg):
    """are a model's activations bf16: in bf16 mode, where flash_attn.cu has bf16 passes for D"""
    return gpu.precision == "bf16" and BF16_ACTIVATIONS and cfg.D in HEAD_DIMS


def check_sizes(cfg):
    """what the training kernels need: an attention kernel for D, rows of C and F in
    16-byte packs, and rows of at most kernels.cu's MAX_C (the norms hold a row in registers)"""
    if cfg.D not in HEAD_DIMS:
        raise NanoEulerError(f"head dim D = C/Hq = {cfg.D} has no attention kernel; flash_attn.cu is "
                             f"instantiated for D in {HEAD_DIMS}")
    if cfg.C % 8 or cfg.F % 8 or cfg.C > RMSNORM_WIDTHS[-1]:
        raise NanoEulerError(f"GPU training needs C and F multiples of 8 and C at most {RMSNORM_WIDTHS[-1]} (this model: "
                             f"C={cfg.C}, F={cfg.F}); nanoeuler.py trains it on the CPU")


def target_counts(targets):
    """targets (B, T, K) -> the kept targets (not -1) of each head (K,). A pre-training batch
    has none dropped, found in one pass (0.04 ms of host time at batch 64, with the GPU
    idle); otherwise a count a head (0.2 ms; (targets >= 0).sum(axis=(0, 1)) took 0.7)"""
    K = targets.shape[-1]
    if not (targets < 0).any():
        return np.full(K, targets.size // K)
    return np.array([np.count_nonzero(targets[..., k] >= 0) for k in range(K)])


class GPUModel:
    """parameters, gradients, AdamW moments (one allocation each, carved into the
    SPEC tensors as nanoeuler.carve does) and the activations of one batch of B rows,
    in floatX: bf16 (uint16 bits) in bf16 mode, else fp32 (activations_bf16).

    A step is staged (stage, stage_hyper: the batch and the step's numbers uploaded
    into fixed buffers), then run_step runs forward, backward, the gradient norm
    and clip, and AdamW without the host (GPUEngine captures it as a CUDA graph);
    results holds the loss sums and the norm for the host after it.

    With shards > 1 (ZeRO-1, several GPUs) this rank keeps the moments of its
    1/shards of the flat parameters only, and update() changes only that part;
    the flat buffers are padded to a multiple of shards for NCCL's all-gather."""

    def __init__(self, cfg, B, flat=None, m=None, v=None, shards=1, shard=0):
        check_sizes(cfg)
        self.cfg, self.B, self.N = cfg, B, B * cfg.T
        self.bf16 = activations_bf16(cfg)
        self.n_params = n_params = num_params(cfg)
        chunk = ceil_div(ceil_div(n_params, shards), 8) * 8                # 8: AdamW's 16-byte loads stay aligned
        self.lo, self.hi = shard * chunk, (shard + 1) * chunk        # this rank's part of the moments
        padded = lambda a: np.pad(a, (0, chunk * shards - n_params))
        self.flat = DeviceArray((chunk * shards,)).upload(padded(ne.init_params(cfg) if flat is None else flat))
        self.grads = DeviceArray((chunk * shards,)).zero()
        zeros = np.zeros(n_params, np.float32)
        self.m = DeviceArray((chunk,)).upload(padded(zeros if m is None else m)[self.lo:self.hi])
        self.v = DeviceArray((chunk,)).upload(padded(zeros if v is None else v)[self.lo:self.hi])
        self.decay = to_gpu(padded(ne.decay_mask(cfg)), np.uint8)   # 1 for matrices, 0 for norm weights
        self.params, self.dparams = self.carve(self.flat), self.carve(self.grads)
        # bf16 mode: the weights' bf16 copy, which the matmuls read and adamw_update writes
        self.flat16 = DeviceArray((chunk * shards,), np.uint16) if gpu.precision == "bf16" else None
        if self.flat16 is not None:
            for name, view16 in self.carve(self.flat16).items():
                self.params[name].bf16 = view16
        self.refresh_bf16()
        cos, sin = ne.rope_table(cfg.T, cfg.D, 0, np.float32)
        self.cos, self.sin = to_gpu(cos), to_gpu(sin)               # (T, D/2) each
        self.allocate_activations()
        self.buckets, self.on_grads = grad_buckets(cfg), None

    def grads_done(self, bucket):
        """the backward has finished this part of the gradients (see grad_buckets)"""
        if self.on_grads:
            self.on_grads(*self.buckets[bucket])

    def carve(self, buf):
        """the SPEC tensors in buf, and two more views over neighbours: w_gate_up (w_gate then
        w_up, one (2F, C) matmul) and heads (the K heads, one (K V, C) matmul), as nanoeuler.carve"""
        views, offset = {}, 0
        for name, shape in param_shapes(self.cfg):
            views[name] = buf.view(offset, shape)
            offset += math.prod(shape)
        for l in range(self.cfg.L):
            gate = views[f"layers.{l}.w_gate"]
            views[f"layers.{l}.w_gate_up"] = DeviceArray((2 * self.cfg.F, self.cfg.C), buf.dtype, gate.ptr, buf)
        views["heads"] = DeviceArray((self.cfg.K * self.cfg.V, self.cfg.C), buf.dtype, views["heads.0"].ptr, buf)
        return views

    def refresh_bf16(self):
        """the weights' bf16 copy from the fp32 ones: at the start, and after ZeRO's gather"""
        if self.flat16 is not None:
            to_bf16(self.flat16, self.flat, self.flat.size)

    def allocate_activations(self):
        """what the backward reads, per layer, plus a few buffers that every layer reuses, all
        floatX; and the step's inputs and outputs"""
        cfg, N, B, K = self.cfg, self.N, self.B, self.cfg.K
        C, QKV, HD, F = cfg.C, (cfg.Hq + 2 * cfg.Hkv) * cfg.D, cfg.Hq * cfg.D, cfg.F
        act = lambda *shape: DeviceArray(shape, np.uint16 if self.bf16 else np.float32)
        f32 = lambda *shape: DeviceArray(shape)
        per_layer = lambda make: [make() for _ in range(cfg.L)]
        self.x = [act(N, C) for _ in range(cfg.L + 1)]              # the residual stream into each layer
        self.x_mid = per_layer(lambda: act(N, C))                   # and after each layer's attention
        # the norms' outputs, the attention's and the MLP's inputs (nanoeuler.py's h and m)
        self.attn_in, self.mlp_in = per_layer(lambda: act(N, C)), per_layer(lambda: act(N, C))
        self.rstd_attn, self.rstd_mlp = per_layer(lambda: f32(N)), per_layer(lambda: f32(N))
        self.qkv, self.y = per_layer(lambda: act(N, QKV)), per_layer(lambda: act(N, HD))   # q, k rotated in place
        self.lse = per_layer(lambda: f32(B, cfg.Hq, cfg.T))
        for qkv in self.qkv if attention_tma(cfg.D, self.qkv[0]) else ():
            tensor_maps(qkv, N)                                      # the TMA forward's, made now: see tensor_maps
        self.gu, self.s = per_layer(lambda: act(N, 2 * F)), per_layer(lambda: act(N, F))
        self.xf, self.rstd_final = act(N, C), f32(N)
        self.logits, self.losses = act(N, K * cfg.V), f32(K, N)    # logits: d loss / d logits after the loss
        self.branch_out = act(N, C)             # the attention's or the MLP's output, on its way into the stream
        # scratch for the backward: each layer overwrites what the layer after it used
        self.dx = act(N, C)                                         # the residual stream's gradient
        # d loss / d (a norm's output): nanoeuler.py's dxf, dm and dh in turn, in one buffer
        self.dnorm_out = act(N, C)
        self.ds, self.dgu, self.dy, self.dqkv = act(N, F), act(N, 2 * F), act(N, HD), act(N, QKV)
        self.delta = f32(B, cfg.Hq, cfg.T)
        for qkv, lse in zip(self.qkv, self.lse) if attention_tma(cfg.D, self.qkv[0], backward=True) else ():
            backward_tensor_maps(qkv, self.dy, lse, self.delta, B, cfg.T, cfg.Hq)     # the TMA dk/dv pass's
        # attention's ds (d loss / d scores), from the bf16 dk/dv pass to the dq pass
        self.attention_ds = DeviceArray((attention_ds_size(B, cfg.T, cfg.Hq) if self.bf16 else 1,), np.uint16)
        self.norm_partial = f32(2 * gpu.sms * C)                    # rmsnorm_backward's dw per block
        # the step's inputs, uploaded into these same buffers before each step (a graph reads them)
        self.inputs = DeviceArray((N + N * K + K,), np.int32)
        self.idx, self.targets = self.inputs.view(0, (N,)), self.inputs.view(N, (N, K))
        self.dscale = self.inputs.view(N + N * K, (K,), np.float32)  # weight of head k / its kept targets
        self.hyper = f32(3)                                          # lr, 1 - beta1^step, 1 - beta2^step
        # and its outputs: the K loss sums then the gradient norm, for the host; the clip for AdamW
        self.results, self.clip = DeviceArray((K + 1,), np.float64), f32(2)
        self.partial = f32(2 * gpu.sms)                              # grad_norm's per block

    def stage(self, idx, targets=None, counts=None):
        """upload a batch: idx (B,T), targets (B,T,K) (B up to self.B) -> counts (K,), the kept
        targets per head: of the whole batch when given (these rows being a part of it,
        on several GPUs), so that the parts' losses and gradients add up to the whole's"""
        cfg, K = self.cfg, self.cfg.K
        B = idx.shape[0]
        N = self.n_tokens = B * cfg.T
        packed = self.inputs.staging()                 # the page-locked buffer itself: no copy
        ids, tgt, dscale = packed[:self.N], packed[self.N:self.N * (1 + K)], packed[self.N * (1 + K):]
        ids[:N], ids[N:] = idx.reshape(-1), 0
        if targets is None:
            tgt[:], dscale[:] = 0, 0
        else:
            tgt[:N * K], tgt[N * K:] = targets.reshape(-1), 0
            counts = target_counts(tgt[:N * K].reshape(N, K)) if counts is None else counts
            dscale.view(np.float32)[:] = np.array(ne.mtp_weights(cfg)) / np.maximum(counts, 1)
        self.inputs.upload_staged()
        return counts

    def stage_hyper(self, lr, step, beta1=0.9, beta2=0.95):
        self.hyper.upload_async(np.array([lr, 1 - beta1 ** step, 1 - beta2 ** step]))

    def loss(self, sums, counts):
        """the loss sums (K,) of results -> loss, ce (K,) (SPEC: CE_0 + mtp_weight * mean(CE_1..))"""
        ce = np.asarray(sums, np.float64) / np.maximum(counts, 1)
        return float((np.array(ne.mtp_weights(self.cfg)) * ce).sum()), ce

    def forward(self, idx, targets=None, counts=None):
        """idx (B,T), targets (B,T,K) -> loss, ce (K,), launched now (evaluation, several GPUs,
        check). The fused cross entropy leaves d loss / d logits in self.logits, ready for
        backward. Without targets it stops at the logits, (B*T, K, V) in self.logits.
        counts: see stage."""
        counts = self.stage(idx, targets, counts)
        self.run_forward(targets is not None)
        if targets is not None:
            return self.loss(self.results.view(0, (self.cfg.K,)).download(), counts)

    def run_forward(self, with_loss=True):
        """the forward of the staged batch: logits, then with_loss the cross entropy (d loss
        / d logits in place of the logits) and the loss sums into results"""
        cfg, T, N = self.cfg, self.cfg.T, self.n_tokens
        C, D, F, V, K = cfg.C, cfg.D, cfg.F, cfg.V, cfg.K
        QKV, HD = (cfg.Hq + 2 * cfg.Hkv) * D, cfg.Hq * D
        B, p = N // T, self.params
        embedding_forward(self.x[0], self.idx, p["tok_emb"], N, C)
        rmsnorm_forward(self.attn_in[0], self.rstd_attn[0], self.x[0], p["layers.0.attn_norm"], N, C)
        for l in range(cfg.L):
            w = lambda name: p[f"layers.{l}.{name}"]
            matmul(self.qkv[l], self.attn_in[l], w("wqkv"), N, QKV, C, trans_b=True)
            rope_forward(self.qkv[l], self.cos, self.sin, N, T, cfg.Hq + cfg.Hkv, D, QKV)
            attention_forward(self.y[l], self.lse[l], self.qkv[l], B, T, cfg.Hq, cfg.Hkv, D)
            matmul(self.branch_out, self.y[l], w("wo"), N, C, HD, trans_b=True)
            # x_mid = x + y @ wo.T (residual), and its norm for the MLP, in one pass
            residual_rmsnorm_forward(self.x_mid[l], self.mlp_in[l], self.rstd_mlp[l], self.x[l], self.branch_out,
                                     w("mlp_norm"), N, C)
            # gu = m @ w_gate_up.T and s = silu(gate) * up, in one pass where the TMA product runs
            matmul_swiglu_forward(self.gu[l], self.s[l], self.mlp_in[l], w("w_gate_up"), N, F, C)
            matmul(self.branch_out, self.s[l], w("w_down"), N, C, F, trans_b=True)
            # x[l+1] = x_mid + s @ w_down.T (residual), and its norm: the next layer's, or the final one
            last = l == cfg.L - 1
            out, rstd = (self.xf, self.rstd_final) if last else (self.attn_in[l + 1], self.rstd_attn[l + 1])
            norm_w = p["final_norm"] if last else p[f"layers.{l + 1}.attn_norm"]
            residual_rmsnorm_forward(self.x[l + 1], out, rstd, self.x_mid[l], self.branch_out, norm_w, N, C)
        matmul(self.logits, self.xf, p["heads"], N, K * V, C, trans_b=True)   # (N, K*V): the K heads side by side
        if with_loss:
            cross_entropy_forward(self.logits, self.losses, self.targets, self.dscale, N, V, K)
            cross_entropy_sum(self.results, self.losses, N, K)

    def backward(self):
        """adds d loss / d params into self.grads; mirrors forward in reverse"""
        cfg, T, N = self.cfg, self.cfg.T, self.n_tokens
        C, D, F, V, K = cfg.C, cfg.D, cfg.F, cfg.V, cfg.K
        QKV, HD = (cfg.Hq + 2 * cfg.Hkv) * D, cfg.Hq * D
        B, p, g = N // T, self.params, self.dparams
        # the chain starts in self.logits: the fused cross entropy wrote d loss / d logits there;
        # one product over all K heads sums their gradients into the input they share (here dh)
        matmul(self.dnorm_out, self.logits, p["heads"], N, C, K * V)
        matmul(g["heads"], self.logits, self.xf, K * V, C, N, trans_a=True, accumulate=True)
        rmsnorm_backward(self.dx, g["final_norm"], self.dnorm_out, self.x[cfg.L], p["final_norm"], self.rstd_final,
                         N, C, accumulate=False, partial=self.norm_partial)
        self.grads_done("heads")
        for l in reversed(range(cfg.L)):
            w = lambda name: p[f"layers.{l}.{name}"]
            dw = lambda name: g[f"layers.{l}.{name}"]
            # forward was: x[l+1] = x_mid + s @ w_down.T
            # dgu = swiglu_backward(dx @ w_down), in one pass where the TMA product runs (ds then not written)
            matmul_swiglu_backward(self.dgu, self.ds, self.dx, w("w_down"), self.gu[l], N, F, C)
            matmul(dw("w_down"), self.dx, self.s[l], C, F, N, trans_a=True, accumulate=True)
            matmul(self.dnorm_out, self.dgu, w("w_gate_up"), N, C, 2 * F)
            matmul(dw("w_gate_up"), self.dgu, self.mlp_in[l], 2 * F, C, N, trans_a=True, accumulate=True)
            # dx += : the residual stream's gradient takes both paths
            rmsnorm_backward(self.dx, dw("mlp_norm"), self.dnorm_out, self.x_mid[l], w("mlp_norm"), self.rstd_mlp[l],
                             N, C, partial=self.norm_partial)
            # forward was: x_mid = x[l] + y @ wo.T
            matmul(self.dy, self.dx, w("wo"), N, HD, C)
            matmul(dw("wo"), self.dx, self.y[l], C, HD, N, trans_a=True, accumulate=True)
            attention_backward(self.dqkv, self.dy, self.qkv[l], self.y[l], self.lse[l], self.delta, self.attention_ds,
                               B, T, cfg.Hq, cfg.Hkv, D)
            rope_backward(self.dqkv, self.cos, self.sin, N, T, cfg.Hq + cfg.Hkv, D, QKV)
            matmul(self.dnorm_out, self.dqkv, w("wqkv"), N, C, QKV)
            matmul(dw("wqkv"), self.dqkv, self.attn_in[l], QKV, C, N, trans_a=True, accumulate=True)
            rmsnorm_backward(self.dx, dw("attn_norm"), self.dnorm_out, self.x[l], w("attn_norm"), self.rstd_attn[l],
                             N, C, partial=self.norm_partial)
            self.grads_done(l)
        embedding_backward(g["tok_emb"], self.idx, self.dx, N, C, V)
        self.grads_done("tok_emb")

    def run_update(self, clip, weight_decay):
        """the gradient norm, the clip, and AdamW on this rank's part of the parameters (all of
        them on one GPU), with the staged hyper; skipped on the GPU when the loss sums or the
        norm are not finite. The norm goes to results[K]."""
        grad_norm(self.partial, self.grads, self.grads.size)
        clip_grad_norm(self.results, self.clip, self.partial, self.cfg.K, clip)
        part = lambda a: None if a is None else a.view(self.lo, (self.hi - self.lo,))
        adamw_update(part(self.flat), part(self.flat16), part(self.grads), self.m, self.v, part(self.decay),
                     self.hi - self.lo, self.hyper, self.clip, weight_decay=weight_decay)

    def update(self, lr, step, clip, weight_decay):
        """run_update with this step's lr, launched now -> the norm before clipping. With
        ZeRO, refresh_bf16() follows once every rank's part is in place."""
        self.stage_hyper(lr, step)
        self.run_update(clip, weight_decay)
        return float(self.results.view(self.cfg.K, (1,)).download()[0])

    def run_step(self, clip, weight_decay):
        """a whole training step of the staged batch and hyper, with no host in it: what
        GPUEngine captures as a graph"""
        self.grads.zero()
        self.run_forward()
        self.backward()
        self.run_update(clip, weight_decay)


# -----------------------------------------------------------------------------
# training

PEAK_TFLOPS = {"H100": {"fp32": 67, "tf32": 495, "bf16": 989}, "H200": {"fp32": 67, "tf32": 495, "bf16": 989},
               "A100": {"fp32": 19.5, "tf32": 156, "bf16": 312}}        # dense, from the vendors' datasheets


def flops_per_token(cfg):
    """6 per weight of every matmul (forward + backward), plus causal attention's two matmuls"""
    matmul_params = num_params(cfg) - cfg.V * cfg.C - (2 * cfg.L + 1) * cfg.C      # no lookup, no norms
    return 6 * matmul_params + 6 * cfg.L * cfg.Hq * cfg.D * cfg.T      # 12 L Hq D T, halved by the mask


# a training step is one CUDA graph, captured at the second step and replayed (the first
# runs kernel by kernel, so that cuBLAS has set itself up before a capture); False, or
# --no-graph: every step kernel by kernel. Both give the same bits.
GRAPH_STEP = True
# train and sft save a checkpoint every 10 minutes (and at the end): the big model's
# 200 steps of 15 ms (the CPU's --save-every) took 3 s, and its pair 2 s to write
SAVE_MINUTES = 10


def capture_graph(run, what):
    """run()'s launches on gpu.stream captured as a CUDA graph, not run -> the executable graph
    (a training step's, a decoding step's). The garbage collector waits from before the
    capture begins to after it ends: a DeviceArray it freed inside one (cuMemFree) would end
    it with an error."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        check(cu.cuStreamBeginCapture(gpu.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
              "cuStreamBeginCapture")
        try:
            run()
        finally:
            graph = check(cu.cuStreamEndCapture(gpu.stream), f"cuStreamEndCapture (capturing {what})")
    finally:
        if collecting:
            gc.enable()
    try:
        return check(cu.cuGraphInstantiate(graph, 0), f"cuGraphInstantiate ({what})")
    finally:
        check(cu.cuGraphDestroy(graph), "cuGraphDestroy")


class GPUEngine:
    """nanoeuler.train_loop's engine, on the GPU"""

    def __init__(self, cfg, flat, m, v, args, rank=0, world=1):
        self.cfg, self.args = cfg, args
        rows = shard_rows(args.batch, world, rank)
        self.zero = args.zero
        self.model = GPUModel(cfg, rows.stop - rows.start, flat, m, v, world if self.zero else 1,
                              rank if self.zero else 0)
        peak = next((p for name, p in PEAK_TFLOPS.items() if name in gpu.name), None)
        self.peak = peak[gpu.precision] * 1e12 if peak else None
        self.flops_per_step = flops_per_token(cfg) * args.batch * cfg.T / world    # this GPU's share
        # not where cuBLAS rounds fp32 inputs into scratch (BF16_ACTIVATIONS off): it may move
        self.use_graph = GRAPH_STEP and not getattr(args, "no_graph", False) and \
            (gpu.precision != "bf16" or self.model.bf16)
        self.graph, self.steps, self.saved = None, 0, None

    def step(self, idx, targets, lr, step):
        """upload the batch and the step's numbers, one step on the GPU (from the graph when
        there is one), then read the loss sums and the norm: the host waits once. A non-finite
        loss or norm has left the weights and moments as they were (see run_update)."""
        m = self.model
        counts = m.stage(idx, targets)
        m.stage_hyper(lr, step)
        if self.use_graph and self.steps > 0 and len(idx) == m.B and gpu.profile is None:
            if self.graph is None:
                self.graph = capture_graph(lambda: m.run_step(self.args.clip, self.args.weight_decay),
                                           "a training step")
            check(cu.cuGraphLaunch(self.graph, gpu.stream), "cuGraphLaunch (a training step)")
        else:
            m.run_step(self.args.clip, self.args.weight_decay)
        self.steps += 1
        results = m.results.download()
        loss, ce = m.loss(results[:self.cfg.K], counts)
        return loss, ce, float(results[self.cfg.K])

    def evaluate(self, batches, token_bytes):
        def ce_of(idx, targets):                       # in parts of B rows: B/N of the batch on N GPUs
            counts, B = target_counts(targets), self.model.B
            return sum(self.model.forward(idx[i:i + B], targets[i:i + B], counts)[1] for i in range(0, len(idx), B))
        return ne.evaluate(ce_of, batches, token_bytes)

    def host_params(self):
        return self.model.flat.view(0, (self.model.n_params,)).download()

    def host_weights(self):
        """the weights and moments copied into page-locked memory of the engine's own (the same
        each time, freed with the engine): a checkpoint is written from there while the next
        steps run, and the GPU waits only for the copy (1.4 GB for the big model)"""
        n = self.model.n_params
        self.saved = self.saved or [PinnedBuffer(4 * n) for _ in range(3)]
        for host, a in zip(self.saved, (self.model.flat, self.model.m, self.model.v)):
            check(cu.cuMemcpyDtoHAsync(host.ptr, a.ptr, 4 * n, gpu.stream), "cuMemcpyDtoHAsync")
        gpu.sync("a checkpoint's copy from the GPU")
        return [host.floats() for host in self.saved]

    def mfu(self, dt):
        return self.flops_per_step / dt / self.peak if self.peak else None

    def close(self):
        gpu.sync()


def preset_config(name):
    """SPEC's preset `name` (train's and bench's model_size), or one sentence naming the choices"""
    if name not in PRESETS:
        raise NanoEulerError(f"unknown model {name}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def cmd_train(args):
    """one GPU, or --gpus N: DataParallelEngine and launch_ranks, in the data-parallel section at the end"""
    cfg = ne.preset_with(preset_config(args.model_size), args)
    ne.corpus_files(args.data)                  # a --data that is not there: said before the GPU is asked
    rank, world, local, place = rank_and_world(args)
    if args.gpus and not world:                 # the launcher: the data once, here, then the ranks
        count_gpus()                            # no driver, no GPU: said before minutes of preparing data
        return launch_ranks(args.argv, args.gpus, lock=args.run.held, place=place, args=args,
                            before=lambda: ne.prepare_data(args.data, cfg.V, args.out))
    if place:                                   # a rank of torchrun, srun or mpirun
        rank, world, local = join_world(args, place)
        local = gpu_of(local, place)
        prepare_once(args, cfg)
    init_gpu(args.precision, local)
    if world and rank == 0:
        stop_when_orphaned()
    if world:
        make_engine = lambda cfg, flat, m, v: DataParallelEngine(cfg, flat, m, v, args, rank, world)
    else:
        make_engine = lambda cfg, flat, m, v: GPUEngine(cfg, flat, m, v, args)

    def lead(args, cfg, tok, engine, next_batch, val_batches, run, state):
        if world:
            engine.share_start({"rng": state["rng"], "data": data_digest(tok, val_batches)})
        ne.train_loop(args, cfg, tok, engine, next_batch, val_batches, run, state)

    def follow_rank0(args, cfg, tok, engine, next_batch, val_batches, run, state):
        start = engine.share_start({})
        if start["data"] != data_digest(tok, val_batches):
            raise NanoEulerError(f"rank {rank}'s data is not rank 0's (another tokenizer, or other validation "
                                 "rows): give every host the same --data text")
        follow(engine, next_batch, ne.saved_rng(start))

    if rank:                                    # rank 0 resumes and hands the others its start (DataParallelEngine)
        args.resume = False
    ne.pretrain(args, ne.check_config(cfg), make_engine,
                lambda engine: [("device", f"{gpu.name} x {max(world, 1)}, sm_{gpu.arch}, {gpu.sms} SMs, "
                                           f"{args.precision} matmuls, peak "
                                           f"{engine.peak / 1e12 if engine.peak else '?'} TFLOP/s per GPU" +
                                           (", data parallel over NCCL" + (", ZeRO-1" if args.zero else "")
                                            if world else ""))],
                loop=lead if rank == 0 else follow_rank0)


# -----------------------------------------------------------------------------
# decoding: nanoeuler.py's generation section on the GPU
#
# GPUDecoder holds the weights for decoding (bf16, or fp32 with --precision fp32),
# a KV cache and the buffers of one step. The prompt is pre-filled in one pass
# (cuBLAS products over all its rows, as in training; attention and the cache
# write by the decode kernel over all the rows); then each step feeds R rows, the last token and in
# speculative decoding the drafts after it, through the decode kernels of
# kernels.cu: a memory-bound matrix-vector product per weight with the norm,
# swiglu or residual add fused in, rope and the cache write in one kernel, one
# attention kernel over the cache, head 0 and the draft heads in one product,
# argmax and the acceptance rule on the GPU. The step reads its position and
# token ids from GPU memory and updates them itself, so it is captured once
# per R as a CUDA graph and replayed; in greedy mode the only thing that
# crosses to the host is each step's chosen ids, which the accept kernel
# writes straight into page-locked host memory (a ring the host reads behind
# the GPU, LOOKAHEAD steps ahead at most).
# A step is 5 kernels a layer: the qkv product with the attention norm fused in,
# attention with rope and the cache write fused in, the wo product combining
# attention's chunks of keys as it reads them and adding into the residual
# stream, the gate/up product with the MLP norm fused in, the down product
# reading swiglu of gate/up and adding into the residual; and 3 more
# (embedding, heads with the final norm, argmax with the acceptance rule).
# kernels.cu's decoding section says why each kernel splits its work as it does.

DECODE_MAX_ROWS = 4             # as in kernels.cu: R at most, so drafts <= 3
DECODE_OUTS = 4                 # as in kernels.cu: outputs (weight rows) a warp of decode_matvec
DECODE_LOADS = 2                # as in kernels.cu: 16-byte loads in flight a weight row per lane of decode_matvec
DECODE_CHUNK = 64               # as in kernels.cu: keys per block of the split attention
DECODE_HEADS = 4                # as in kernels.cu: query heads per block of the split attention
SPLIT_HEAD_DIMS = (8, 16, 32, 64, 128)      # attention_decode_split_kernel_<D> is written out for these
# kernels.cu's decode_matvec entry points by (the input's treatment, the weights' type)
DECODE_MATVEC_KERNELS = {
    ("plain", "f32"): "decode_matvec_plain_f32_kernel", ("plain", "bf16"): "decode_matvec_plain_bf16_kernel",
    ("rmsnorm", "f32"): "decode_matvec_rmsnorm_f32_kernel", ("rmsnorm", "bf16"): "decode_matvec_rmsnorm_bf16_kernel",
    ("swiglu", "f32"): "decode_matvec_swiglu_f32_kernel", ("swiglu", "bf16"): "decode_matvec_swiglu_bf16_kernel",
    ("attention", "f32"): "decode_matvec_attention_f32_kernel",
    ("attention", "bf16"): "decode_matvec_attention_bf16_kernel",
}
DECODE_PREFILL_ROWS = 512       # a prefill's rows per launch of the split attention (its scratch grows with them)
# decoding's attention: "split" over chunks of keys (attention_decode_split_kernel_<D>), or
# "single", one block per query head and row (attention_decode_kernel, the kernel before it,
# kept to fall back on; head dims the split one lacks always take it)
DECODE_ATTENTION = "split"
# programmatic dependent launch of a step's kernels (sm_90 on; see kernels.cu): on an H200
# 3,300 tokens/s against 2,768 without (BENCHMARKS.md); `check` compares it with plain
# launches bit for bit
DECODE_PDL = True
# a pass's layers as one kernel (kernels.cu's decode_layers: the split attention's five stages a layer, met at
# counters in global memory, not 5 L kernels): where the split attention runs. Off until a GPU has timed it against
# the kernels one by one (dev/LOG.md); `check` compares its bits with theirs
DECODE_PERSISTENT = False
RING = 64                       # entries of the ring of chosen ids, each (count, ids...)
LOOKAHEAD = 8                   # greedy: steps queued before the host reads the first one's ids
DEFAULT_DRAFTS = 1              # --drafts: head 1 alone, the best at SPEC's weight (1.00x, 2 drafts 0.98x: H100,
                                # 2026-12-06); on the flow's --mtp-weight 1.5 model, with DraftPolicy picking the
                                # depth, 1 / 2 / 3 drafts are within 2% (1.35 / 1.36 / 1.34x, H100 2026-12-07)
DRAFT_WINDOW = 8                # DraftPolicy: the drafting passes whose tokens it averages
DRAFT_PROBE = 2                 # DraftPolicy: passes that feed drafts in a probe
DRAFT_WAIT = (16, 256)          # DraftPolicy: plain passes before a probe, the first wait and the longest


def matvec_splits(In, Out, elems, sms):
    """warps sharing decode_matvec's outputs (1, 2, 4 or 8), from the matrix's shape alone (so
    each row's sum runs in the same order whatever R): enough that a lane's part of a
    weight row (In / elems 16-byte chunks in all) is one round of DECODE_LOADS loads, and
    more while the matrix makes fewer than 8 warps per SM and each lane keeps a chunk
    (splits at most 8: past that a lane's part takes several rounds)"""
    chunks, splits = In // elems, 1
    while splits < 8 and (ceil_div(chunks, splits) > 32 * DECODE_LOADS or
                          (Out * splits < 8 * DECODE_OUTS * sms and chunks >= 2 * 32 * splits)):
        splits *= 2
    return splits


def decode_launch(name, grid, block, pdl, *args, shared=0):
    """gpu.launch, or with pdl through cuLaunchKernelEx with programmatic stream
    serialization: the kernel may start while the one before it still runs (each decode
    kernel waits for it in decode_wait before it reads what it wrote)"""
    if not pdl:
        return gpu.launch(name, grid, block, *args, shared=shared)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid if isinstance(grid, tuple) else (grid, 1, 1)
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes, config.hStream = shared, gpu.stream
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config.attrs, config.numAttrs = [attr], 1
    gpu.last_kernel = name
    with gpu.timed(name):
        check(cu.cuLaunchKernelEx(config, gpu.function(name), ctypes.addressof(params), 0),
              f"launching {name} (programmatic dependent launch; DECODE_PDL = False turns it off)")


def decode_matvec(out, x, w, norm_w, R, In, Out, mode="plain", accumulate=False, ld_out=None, splits=None,
                  pdl=False, records=()):
    """out (R, ld_out) [+]= in' @ w.T, in' = x (plain), rmsnorm(x) * norm_w (rmsnorm),
    swiglu(x) (swiglu, x (R, 2 In)) or attention's output combined from the split
    attention's records in x (attention: norm_w is *pos, records (Hq, Hkv, chunks of T));
    w fp32 or bf16 (uint16); splits: matvec_splits of (In, Out) unless given"""
    kind = "bf16" if w.dtype == np.uint16 else "f32"
    splits = splits or matvec_splits(In, Out, 8 if kind == "bf16" else 4, gpu.sms)
    decode_launch(DECODE_MATVEC_KERNELS[mode, kind], ceil_div(Out, 8 * DECODE_OUTS // splits), 256, pdl, ptr_arg(out),
                  ptr_arg(x), ptr_arg(w), ptr_arg(norm_w), int_arg(R), int_arg(In), int_arg(Out),
                  int_arg(ld_out or Out), int_arg(int(accumulate)), int_arg(splits), *map(int_arg, records),
                  shared=4 * R * In if mode == "attention" else 0)            # attention: its rows, combined


class DecodeBuffers(ctypes.Structure):
    """kernels.cu's DecodeBuffers: decode_layers' buffers, layer 0's weights and cache"""
    _fields_ = [(name, ctypes.c_void_p) for name in ("x", "qkv", "gu", "partial", "wqkv", "attn_norm", "wo",
                                                      "w_gate_up", "mlp_norm", "w_down", "k_cache", "v_cache", "cos",
                                                      "sin", "pos", "ready")]


class DecodeShape(ctypes.Structure):
    """kernels.cu's DecodeShape: decode_layers' sizes"""
    _fields_ = [("stride", ctypes.c_longlong), ("cache_stride", ctypes.c_longlong),
                *[(name, ctypes.c_int) for name in ("R", "C", "F", "L", "Hq", "Hkv", "gz")],
                ("splits", ctypes.c_int * 4), ("scale", ctypes.c_float)]


def attention_kernel(D, attention=None):
    """"split" or "single": the attention kernel decoding runs at head dim D"""
    attention = attention or DECODE_ATTENTION
    if attention not in ("split", "single"):
        raise NanoEulerError(f"DECODE_ATTENTION is {attention!r}; it must be 'split' or 'single'")
    return "split" if attention == "split" and D in SPLIT_HEAD_DIMS else "single"


def split_scratch(cfg):
    """(floats of partial records, ints of counts) the split attention needs: a record per
    (row, block, chunk of keys), a count per (row, block), for the rows of one launch"""
    rows, blocks = min(cfg.T, DECODE_PREFILL_ROWS), cfg.Hkv * ceil_div(cfg.Hq // cfg.Hkv, DECODE_HEADS)
    return rows * blocks * ceil_div(cfg.T, DECODE_CHUNK) * DECODE_HEADS * (cfg.D + 2), rows * blocks


def attention_decode(y, k_cache, v_cache, qkv, cos, sin, pos, R, Hq, Hkv, D, keys, kernel="split", scratch=None,
                     pdl=False, row0=0, combine=True):
    """y = the R rows' causal attention over the cache and this pass's keys, with rope and the cache
    write of the R rows' keys and values fused in (see the kernels); keys: the
    most keys a row can see (T in a step, row0 + R in a prefill); scratch: (partial, count) for
    the split kernel (split_scratch; count zeroed once); row0: the launch's first row of the pass
    (split only); combine=False (split only): no y, every row's records left in scratch for
    decode_matvec's "attention" input"""
    scale = float_arg(1 / math.sqrt(D))
    if kernel == "single":                     # launched plainly: it has no decode_wait
        warps = 8
        gpu.launch("attention_decode_kernel", (Hq, R, 1), 32 * warps, ptr_arg(y), ptr_arg(k_cache),
                   ptr_arg(v_cache), ptr_arg(qkv), ptr_arg(cos), ptr_arg(sin), ptr_arg(pos), int_arg(Hq),
                   int_arg(Hkv), int_arg(D), scale, shared=4 * (D + 2 * warps + warps * D))
        return
    grid = (Hkv * ceil_div(Hq // Hkv, DECODE_HEADS), R, ceil_div(keys, DECODE_CHUNK))
    decode_launch(f"attention_decode_split_kernel_{D}", grid, 256, pdl, ptr_arg(y), ptr_arg(scratch[0]),
                  ptr_arg(scratch[1]), ptr_arg(k_cache), ptr_arg(v_cache), ptr_arg(qkv), ptr_arg(cos), ptr_arg(sin),
                  ptr_arg(pos), int_arg(row0), int_arg(Hq), int_arg(Hkv), scale, int_arg(int(combine)))


def argmax_accept(ids, pos, counter, ring, amax, logits, V, R, n_heads, pdl=False):
    """amax = each row's argmax of logits (R * n_heads, V), then nanoeuler.generate's acceptance
    rule on the GPU: the kept tokens into ring, the next feed into ids, pos moved on (one block)"""
    decode_launch("argmax_accept_kernel", 1, 1024, pdl, ptr_arg(ids), ptr_arg(pos), ptr_arg(counter), ptr_arg(ring),
                  ptr_arg(amax), ptr_arg(logits), int_arg(V), int_arg(R), int_arg(n_heads), int_arg(RING))


class HostRing:
    """page-locked host memory that kernels write into directly (mapped): the chosen ids"""
    host = None                                          # until made: a half-made ring (refused) frees nothing

    def __init__(self, n):
        self.driver = cu
        self.host = host_alloc(4 * n, cu.CU_MEMHOSTALLOC_DEVICEMAP)
        self.ptr = int(check(cu.cuMemHostGetDevicePointer(self.host, 0), "cuMemHostGetDevicePointer"))
        self.array = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(int(self.host)))
        self.array[:] = 0

    def __del__(self):
        if self.driver is cu and self.host is not None:  # as DeviceArray's: the driver that made it
            cu.cuMemFreeHost(self.host)


def decode_check_sizes(cfg):
    """the decode kernels read weight rows 16 bytes at a time and split attention's block by D;
    the prefill's norms hold a row in registers, as training's do (C at most kernels.cu's MAX_C)"""
    if cfg.C % 8 or cfg.F % 8 or cfg.D % 8 or cfg.D > 128 or cfg.T < 2 or cfg.C > RMSNORM_WIDTHS[-1]:
        raise NanoEulerError(f"GPU decoding needs C and F multiples of 8, C at most {RMSNORM_WIDTHS[-1]} and a head "
                             f"dim that is a multiple of 8 up to 128 "
                             f"(this model: C={cfg.C}, F={cfg.F}, D={cfg.D}); nanoeuler.py samples it on the CPU")


class GPUDecoder:
    """weights, KV cache and step buffers for decoding one sequence on the GPU (see above);
    attention: "split" or "single" (default DECODE_ATTENTION), pdl: programmatic dependent
    launch of the step's kernels (default DECODE_PDL; on sm_90 and later only), persistent: the layers as one
    kernel (default DECODE_PERSISTENT; with the split attention only)"""

    def __init__(self, cfg, flat, precision="bf16", attention=None, pdl=None, persistent=None):
        decode_check_sizes(cfg)
        init_gpu(precision)
        self.cfg, self.precision = cfg, precision
        self.attention = attention_kernel(cfg.D, attention)
        self.pdl = bool(DECODE_PDL if pdl is None else pdl) and int(gpu.arch) >= 90
        C, D, F, V, T = cfg.C, cfg.D, cfg.F, cfg.V, cfg.T
        QKV, HD, R = (cfg.Hq + 2 * cfg.Hkv) * D, cfg.Hq * D, DECODE_MAX_ROWS
        n = num_params(cfg)
        self.flat = to_gpu(flat)
        self.params = GPUModel.carve(self, self.flat)                 # the SPEC tensors, w_gate_up too
        self.weights = self.params                                     # what the step's products read
        if precision == "bf16":                                        # bf16 copies: half the bytes per step
            self.flat16 = DeviceArray((n,), np.uint16)
            to_bf16(self.flat16, self.flat, n)
            self.weights = GPUModel.carve(self, self.flat16)
            for name, w16 in self.weights.items():
                self.params[name].bf16 = w16                           # prefill's cuBLAS products read them
        self.heads = self.weights["heads.0"].view(0, (cfg.K * V, C))   # heads 0..K-1 lie one after another
        # head 0's sums in the order of a one-head product whatever n_heads: plain == speculative
        self.head_splits = matvec_splits(C, V, 8 if precision == "bf16" else 4, gpu.sms)
        cos, sin = ne.rope_table(T, D, 0, np.float32)
        self.cos, self.sin = to_gpu(cos), to_gpu(sin)
        caches = DeviceArray((cfg.L, T, cfg.Hkv, D)), DeviceArray((cfg.L, T, cfg.Hkv, D))     # a layer's T Hkv D on
        self.k_cache, self.v_cache = ([c.view(l * T * cfg.Hkv * D, (T, cfg.Hkv, D)) for l in range(cfg.L)]
                                      for c in caches)
        partial, count = split_scratch(cfg)
        self.split = (DeviceArray((partial,)), DeviceArray((count,), np.int32).zero())   # counts reset themselves
        # the prefill's activations (T rows; p_norm_out: h, then m) and the step's (R rows)
        self.p_ids, self.p_x, self.p_norm_out = DeviceArray((T,), np.int32), DeviceArray((T, C)), DeviceArray((T, C))
        self.p_rstd, self.p_qkv, self.p_y = DeviceArray((T,)), DeviceArray((T, QKV)), DeviceArray((T, HD))
        self.p_gu, self.p_s, self.p_branch_out = DeviceArray((T, 2 * F)), DeviceArray((T, F)), DeviceArray((T, C))
        self.ids, self.x, self.qkv = DeviceArray((R,), np.int32), DeviceArray((R, C)), DeviceArray((R, QKV))
        self.y, self.gu = DeviceArray((R, HD)), DeviceArray((R, 2 * F))
        self.logits, self.amax = DeviceArray((R, cfg.K * V)), DeviceArray((R, cfg.K), np.int32)
        self.pos, self.counter = DeviceArray((1,), np.int32).zero(), DeviceArray((1,), np.int32).zero()
        self.ring = HostRing(RING * (1 + DECODE_MAX_ROWS))
        self.passes = 0                                                # accept kernels queued: == *counter
        no_timing = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self.events = [check(cu.cuEventCreate(no_timing), "cuEventCreate") for _ in range(RING)]
        self.graphs = {}                                               # (R, n_heads) -> executable graph
        self.costs = {}                                                # pass_cost's, by R
        self.persistent = self.attention == "split" and bool(DECODE_PERSISTENT if persistent is None else persistent)
        if self.persistent:
            self.ready = DeviceArray((5 * cfg.L,), np.int32).zero()    # decode_layers' stage counters (a pass
                                                                           # leaves them 0: stage_arrive_last)
            self.layer_kernel = f"decode_layers_{'bf16' if precision == 'bf16' else 'f32'}_{D}"
            self.layer_splits = [matvec_splits(In, Out, 8 if precision == "bf16" else 4, gpu.sms)
                                 for In, Out in ((C, QKV), (HD, C), (C, 2 * F), (F, C))]
            stages = [ceil_div(Out, 8 * DECODE_OUTS // k) for Out, k in zip((QKV, C, 2 * F, C), self.layer_splits)]
            stages.append(cfg.Hkv * ceil_div(cfg.Hq // cfg.Hkv, DECODE_HEADS) * R * ceil_div(T, DECODE_CHUNK))
            kernel, shared = gpu.function(self.layer_kernel), 4 * R * HD     # dynamic shared memory: wo's rows
            # allowed whatever its size: with the kernel's static shared memory it may pass the default 48 KB
            allow = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(kernel, allow, shared), f"allowing {self.layer_kernel} {shared} bytes")
            fit = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel, 256, shared), "the occupancy query")
            self.layer_blocks = min(fit * gpu.sms, max(stages))     # all resident at once: they wait on each other

    def decode_layers(self, x, R):
        """layers() as one kernel, kernels.cu's decode_layers (self.persistent)"""
        cfg, w, p = self.cfg, self.weights, self.params
        stride = sum(math.prod(shape) for name, shape in param_shapes(cfg) if name.startswith("layers.0."))
        first = lambda name, t=w: t[f"layers.0.{name}"].ptr
        buffers = DecodeBuffers(x.ptr, self.qkv.ptr, self.gu.ptr, self.split[0].ptr, first("wqkv"),
                                first("attn_norm", p), first("wo"), first("w_gate_up"), first("mlp_norm", p),
                                first("w_down"), self.k_cache[0].ptr, self.v_cache[0].ptr, self.cos.ptr, self.sin.ptr,
                                self.pos.ptr, self.ready.ptr)
        shape = DecodeShape(stride, cfg.T * cfg.Hkv * cfg.D, R, cfg.C, cfg.F, cfg.L, cfg.Hq, cfg.Hkv,
                            ceil_div(cfg.T, DECODE_CHUNK), (ctypes.c_int * 4)(*self.layer_splits), 1 / math.sqrt(cfg.D))
        decode_launch(self.layer_kernel, self.layer_blocks, 256, self.pdl, buffers, shape,
                      shared=4 * R * cfg.Hq * cfg.D)

    def attend(self, l, y, qkv, R, prefill=False, pdl=False, combine=True):
        """attention of layer l over R rows of qkv at *pos (and their cache write) into y (or,
        combine=False, its records); a prefill's rows DECODE_PREFILL_ROWS at a time (the split
        kernel's scratch)"""
        cfg = self.cfg
        step = DECODE_PREFILL_ROWS if prefill and self.attention == "split" else R
        for row0 in range(0, R, step):
            rows = min(step, R - row0)
            attention_decode(y, self.k_cache[l], self.v_cache[l], qkv, self.cos, self.sin, self.pos, rows, cfg.Hq,
                             cfg.Hkv, cfg.D, row0 + rows if prefill else cfg.T, self.attention, self.split, pdl, row0,
                             combine)

    def layers(self, x, R):
        """the blocks over R rows of x in place, rows at *pos..: decode kernels (R small)"""
        cfg, w, pdl = self.cfg, self.weights, self.pdl
        C, F, QKV, HD = cfg.C, cfg.F, (cfg.Hq + 2 * cfg.Hkv) * cfg.D, cfg.Hq * cfg.D
        if self.persistent:
            return self.decode_layers(x, R)
        for l in range(cfg.L):
            lw = lambda name: w[f"layers.{l}.{name}"]
            norm = lambda name: self.params[f"layers.{l}.{name}"]
            decode_matvec(self.qkv, x, lw("wqkv"), norm("attn_norm"), R, C, QKV, "rmsnorm", pdl=pdl)
            if self.attention == "split":                              # the wo product combines the chunks
                self.attend(l, self.y, self.qkv, R, pdl=pdl, combine=False)
                decode_matvec(x, self.split[0], lw("wo"), self.pos, R, HD, C, "attention", accumulate=True, pdl=pdl,
                              records=(cfg.Hq, cfg.Hkv, ceil_div(cfg.T, DECODE_CHUNK)))
            else:
                self.attend(l, self.y, self.qkv, R, pdl=pdl)
                decode_matvec(x, self.y, lw("wo"), None, R, HD, C, accumulate=True, pdl=pdl)
            decode_matvec(self.gu, x, lw("w_gate_up"), norm("mlp_norm"), R, C, 2 * F, "rmsnorm", pdl=pdl)
            decode_matvec(x, self.gu, lw("w_down"), None, R, F, C, "swiglu", accumulate=True, pdl=pdl)

    def tail(self, x, R, n_heads, pdl=False):
        """final norm, heads 0..n_heads-1 and their argmax at R rows of x, the acceptance rule"""
        cfg = self.cfg
        decode_matvec(self.logits, x, self.heads, self.params["final_norm"], R, cfg.C, n_heads * cfg.V, "rmsnorm",
                      splits=self.head_splits, pdl=pdl)
        argmax_accept(self.ids, self.pos, self.counter, self.ring.ptr, self.amax, self.logits, cfg.V, R, n_heads, pdl)
        self.passes += 1

    def step(self, R, n_heads):
        """one decoding pass over the R fed ids at *pos (see the kernels)"""
        embedding_forward(self.x, self.ids, self.params["tok_emb"], R, self.cfg.C)
        self.layers(self.x, R)
        self.tail(self.x, R, n_heads, self.pdl)

    def launch_step(self, R, n_heads):
        """step() replayed from its CUDA graph (captured on first use); -> its ring entry"""
        key = (R, n_heads)
        if key not in self.graphs:
            passes = self.passes
            try:
                self.graphs[key] = capture_graph(lambda: self.step(R, n_heads), "a decoding step")
            finally:                                                   # also when a Ctrl-C stops a chat's reply
                self.passes = passes                                   # captured, not run
        check(cu.cuGraphLaunch(self.graphs[key], gpu.stream), "cuGraphLaunch")
        self.passes += 1
        return self.record()

    def record(self):
        entry = (self.passes - 1) % RING
        check(cu.cuEventRecord(self.events[entry], gpu.stream), "cuEventRecord")
        return entry

    def prefill(self, tokens, n_heads):
        """tokens at positions 0..n-1, in one pass (cuBLAS products over the n rows); the
        tail at the last row as after a step -> its ring entry"""
        cfg, p = self.cfg, self.params
        n, C, D, F = len(tokens), cfg.C, cfg.D, cfg.F
        gpu.precision = self.precision                                 # cuBLAS's, for this decoder
        QKV, HD = (cfg.Hq + 2 * cfg.Hkv) * D, cfg.Hq * D
        self.p_ids.view(0, (n,)).upload(np.asarray(tokens, np.int32))
        self.pos.zero()                                                # a memset: no wait for the GPU
        # the ring starts again: no pass the host reads is in flight here (generate waits
        # for the queue before a slide), and this puts the counts in step again if a Ctrl-C
        # came between a launch and its count (chat goes on after one)
        self.counter.zero()
        self.passes = 0
        x = self.p_x
        embedding_forward(x, self.p_ids, p["tok_emb"], n, C)
        for l in range(cfg.L):
            w = lambda name: p[f"layers.{l}.{name}"]
            rmsnorm_forward(self.p_norm_out, self.p_rstd, x, w("attn_norm"), n, C)
            matmul(self.p_qkv, self.p_norm_out, w("wqkv"), n, QKV, C, trans_b=True)
            self.attend(l, self.p_y, self.p_qkv, n, prefill=True)
            matmul(self.p_branch_out, self.p_y, w("wo"), n, C, HD, trans_b=True)
            residual_forward(x, x, self.p_branch_out, n * C)
            rmsnorm_forward(self.p_norm_out, self.p_rstd, x, w("mlp_norm"), n, C)
            matmul(self.p_gu, self.p_norm_out, w("w_gate_up"), n, 2 * F, C, trans_b=True)
            swiglu_forward(self.p_s, self.p_gu, n, F)
            matmul(self.p_branch_out, self.p_s, w("w_down"), n, C, F, trans_b=True)
            residual_forward(x, x, self.p_branch_out, n * C)
        self.pos.fill_bits(n - 1)                                      # the tail's row; accept moves it to n
        self.tail(x.view((n - 1) * C, (1, C)), 1, n_heads)
        return self.record()

    def wait(self, entry):
        """-> the ids that pass `entry` chose (its ring entry), once it is done"""
        check(cu.cuEventSynchronize(self.events[entry]), "the GPU's decoding step")
        e = self.ring.array[entry * (1 + DECODE_MAX_ROWS):(entry + 1) * (1 + DECODE_MAX_ROWS)]
        return [int(t) for t in e[1:1 + e[0]]]

    def set_feed(self, ids, pos):
        """sampling: the host's choice of the next feed and position, in place of the argmax's"""
        self.ids.view(0, (len(ids),)).upload(np.asarray(ids, np.int32))
        self.pos.fill_bits(pos)

    def pass_cost(self, R):
        """GPU time of a pass over R rows and R heads against a plain one (1 row, 1 head), each
        replayed from its graph up to 20 times from position 0, measured once (DraftPolicy's
        cost; the cache and feed it leaves are a prefill's to set); 1 where the window is
        too short to measure it or the timing is 0 (an emulator)"""
        replays = min(20, (self.cfg.T - 1) // R - 1)                   # every replay moves *pos by R at most
        if R not in self.costs:
            us = []
            for rows in (1, R):
                self.set_feed([0] * rows, 0)
                us.append(replay_time(self, replays, rows, rows) if replays > 0 else 0.0)
            self.costs[R] = us[1] / us[0] if us[0] > 0 else 1.0
        return self.costs[R]


def replay_time(dec, replays, R=1, n_heads=1):
    """microseconds of GPU time per replay of the graph of a step over R rows and n_heads
    heads (the plain step: 1, 1), replayed `replays` times from *pos"""
    dec.wait(dec.launch_step(R, n_heads))               # captured now if it was not yet
    a, b = (check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2))
    check(cu.cuEventRecord(a, gpu.stream), "cuEventRecord")
    for _ in range(replays):
        check(cu.cuGraphLaunch(dec.graphs[R, n_heads], gpu.stream), "cuGraphLaunch")
    check(cu.cuEventRecord(b, gpu.stream), "cuEventRecord")
    gpu.sync()
    dec.passes += replays                               # the replays' accept kernels counted too
    us = check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime") * 1e3 / replays
    for e in (a, b):
        cu.cuEventDestroy(e)
    return us


class DraftPolicy:
    """when speculative decoding drafts, and how many drafts it feeds. A pass that drafts d
    (1 + d heads) lets the next one feed them after the last token (1 + d rows); such a pass
    costs costs[d] times a plain one (GPUDecoder.pass_cost). A pass fed f drafts that gave t
    tokens tells what any d <= f drafts would have given: min(t, d + 1), acceptance stopping at
    the first wrong draft. So after each pass fed drafts the policy feeds the d whose last
    DRAFT_WINDOW passes fed d or more gave the most tokens per cost, and stops drafting when
    none gave more than its cost (drafts that always fail, as on random weights, then cost
    nearly nothing). A deeper d than any recent pass was fed is tried when it could pay: it
    gives at most the tokens of the deepest known plus the share of its passes that took
    every draft. After DRAFT_WAIT[0] plain passes a probe drafts the most again for DRAFT_PROBE
    passes, judged on their own, the wait doubling after each probe up to DRAFT_WAIT[1] and
    back to the first once drafting pays. Counts alone decide, never a clock, and the output
    does not depend on them: every emitted token is head 0's choice."""

    def __init__(self, drafts, costs=None):
        self.drafts = drafts
        self.costs = costs or {drafts: 1.0}                            # drafts fed -> a pass's cost
        self.recent = collections.deque(maxlen=4 * DRAFT_WINDOW)      # (drafts fed, tokens) of passes fed drafts
        self.drafting, self.depth = drafts > 0, drafts                # depth: drafts fed while drafting
        self.probe, self.plain, self.wait = 0, 0, DRAFT_WAIT[0]        # probe: its passes still to queue
        self.heads = 1                                                 # the last pass's: rows the next can feed

    def next(self):
        """-> (rows, heads) of the next pass queued"""
        if self.drafts and not self.drafting and not self.probe:
            self.plain += 1
            if self.plain > self.wait:                                 # a pass drafts, DRAFT_PROBE feed drafts
                self.plain, self.probe, self.wait = 0, 1 + DRAFT_PROBE, min(2 * self.wait, DRAFT_WAIT[1])
                self.depth = self.drafts
                self.recent.clear()
        heads = 1 + self.depth if self.drafting or self.probe else 1
        self.probe = max(self.probe - 1, 0)
        rows, self.heads = min(self.heads, heads), heads
        return rows, heads

    def observe(self, rows, tokens):
        """a pass over rows rows gave tokens tokens (passes fed drafts count, with the costs known for them)"""
        if not self.drafts or rows - 1 not in self.costs:
            return
        self.recent.append((rows - 1, tokens))
        value, best, bound = 1.0, 0, 0.0                               # a plain pass: 1 token at cost 1
        for d in sorted(self.costs):
            seen = [t for f, t in self.recent if f >= d][-DRAFT_WINDOW:]
            if not seen:                                               # no recent pass was fed d drafts:
                best = d if bound / self.costs[d] > value else best    # one draft more, if it could pay
                break
            tokens_d = sum(min(t, d + 1) for t in seen) / len(seen)
            bound = tokens_d + sum(t > d for t in seen) / len(seen)    # d + 1 drafts: the passes taking all, +1
            if tokens_d / self.costs[d] > value:
                value, best = tokens_d / self.costs[d], d
        self.drafting = best > 0
        if self.drafting:
            self.depth, self.wait = best, DRAFT_WAIT[0]


def queue_passes(decoder, queue, lookahead, tokens, feed, pos, policy, T):
    """generate's queue of passes in flight, (ring entry, rows fed (0 = a prefill), heads),
    filled up to lookahead while the furthest the position can be leaves room for the rows
    the next pass may feed; policy: DraftPolicy -> feed, pos (a slide, when the cache is
    full, re-feeds the last T/2 tokens from 0)"""
    while len(queue) < lookahead:
        reach = pos + sum(rows for _, rows, _ in queue)
        if reach + policy.heads <= T:
            rows, heads = policy.next()
            queue.append((decoder.launch_step(rows, heads), rows, heads))
        elif queue:
            break                                                      # near the end: wait for the queue
        elif pos + 1 <= T:                                             # fewer drafts, as the CPU feeds
            rows, heads = policy.next()
            queue.append((decoder.launch_step(min(rows, T - pos), heads), min(rows, T - pos), heads))
        else:                                                          # the cache is full: slide
            _, heads = policy.next()
            queue.append((decoder.prefill(tokens[-(T // 2):], heads), 0, heads))
            feed, pos = tokens[-(T // 2):], T // 2
    return feed, pos


def sample_rows(decoder, cfg, rows, n_heads, feed, rng, temperature, top_k, top_p):
    """sampling: the tokens a finished pass over rows rows gives, by nanoeuler.generate's
    rule (sample row j; go on while it equals the draft fed at row j+1) -> chosen, and the
    heads' argmax of each row (the next drafts)"""
    R = max(rows, 1)
    logits = decoder.logits.view(0, (R, n_heads * cfg.V)).download()[:, :cfg.V]
    amax = decoder.amax.view(0, (R, n_heads)).download()
    guesses = feed[1:rows]
    chosen = []
    for j in range(len(guesses) + 1):
        chosen.append(ne.sample_token(logits[j], rng, temperature, top_k, top_p))
        if j == len(guesses) or guesses[j] != chosen[-1]:
            break
    return chosen, amax


def generate(decoder, cfg, prompt, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=None,
             speculative=False, stop=None, stats=None, drafts=None):
    """nanoeuler.generate on the GPU, the same arguments with a GPUDecoder for params:
    yields new token ids one by one, after the prompt ids, with the same window
    slide (the last T/2 tokens fed again from position 0 when the cache is full)
    and the same speculative acceptance rule (every emitted token is head 0's
    choice), so greedy output is plain greedy output. Unlike nanoeuler.generate
    it drafts only while drafting pays (DraftPolicy): which passes draft changes
    the speed, never the tokens.

    Greedy: the GPU chooses and accepts, the host reads the chosen ids up to
    LOOKAHEAD passes behind it, queueing a pass only while it surely fits in the
    window (each pass moves the position by 1 to R); near the end of the window
    it waits, and feeds fewer drafts where nanoeuler.generate does.
    Sampling: after each pass the host reads the rows' logits of head 0,
    samples as nanoeuler.generate does and sets the next feed itself."""
    rng = np.random.default_rng(seed)
    T = cfg.T
    tokens = list(prompt)[-(T - 1):] if prompt else []
    if not tokens:
        raise NanoEulerError("the prompt is empty; give at least one token")
    n_drafts = cfg.K - 1 if drafts is None else max(0, min(drafts, cfg.K - 1))
    n_drafts = min(n_drafts, DECODE_MAX_ROWS - 1) if speculative else 0
    policy = DraftPolicy(n_drafts, costs={d: decoder.pass_cost(1 + d) for d in range(1, n_drafts + 1)})
    greedy = temperature <= 0
    lookahead = LOOKAHEAD if greedy else 1
    queue = []                                  # passes in flight: (ring entry, rows fed (0 = a prefill), heads)
    feed = list(tokens)                         # sampling: what the oldest pass in flight was fed
    pos, emitted = 0, 0                         # pos: where the next pass after the queue's starts, at least
    _, heads = policy.next()
    queue.append((decoder.prefill(tokens, heads), 0, heads))
    pos = len(tokens)
    while True:
        feed, pos = queue_passes(decoder, queue, lookahead, tokens, feed, pos, policy, T)
        entry, rows, heads = queue.pop(0)
        if greedy:
            chosen = decoder.wait(entry)
        else:
            decoder.wait(entry)
            chosen, amax = sample_rows(decoder, cfg, rows, heads, feed, rng, temperature, top_k, top_p)
        if rows:
            pos += len(chosen)
        policy.observe(rows, len(chosen))
        if stats is not None:
            stats["steps"] = stats.get("steps", 0) + 1
            stats["drafted"] = stats.get("drafted", 0) + (rows > 1)
            stats["fed"] = stats.get("fed", 0) + max(rows - 1, 0)           # drafts fed
        for t in chosen:
            tokens.append(t)
            emitted += 1
            if stats is not None:                       # counted as given: max_new_tokens or stop may cut a pass
                stats["tokens"] = stats.get("tokens", 0) + 1
            yield t
            if t == stop or emitted >= max_new_tokens:
                return
        if not greedy:
            feed = [chosen[-1]] + amax[len(chosen) - 1 if rows else 0, 1:].tolist()
            decoder.set_feed(feed, pos)


def make_decoder(args):
    """sample's, chat's and serve's make_params(cfg, flat) -> a GPUDecoder; with --speculative, a note where
    --drafts (already at most K-1) asks for more drafts than a decoding step's DECODE_MAX_ROWS rows can feed"""
    def make(cfg, flat):
        if getattr(args, "speculative", False) and args.drafts > DECODE_MAX_ROWS - 1:
            print(f"note: a GPU decoding step feeds {DECODE_MAX_ROWS} rows; drafting with {DECODE_MAX_ROWS - 1} "
                  f"heads, not --drafts {args.drafts}", file=sys.stderr)
        return GPUDecoder(cfg, flat, args.precision)
    return make


def cmd_sample(args):
    """nanoeuler.py's sample (the prompt, streaming, its notes), generating on the GPU"""
    ne.cmd_sample(args, make_params=make_decoder(args), gen=generate)


# -----------------------------------------------------------------------------
# supervised fine-tuning and chat (nanoeuler.py's, with the GPU engine and decoder)

def cmd_sft(args):
    """nanoeuler.py sft (same template, data reader, masks, validation and checkpoints) on the GPU"""
    args.zero = False
    ne.load_model(args.model), ne.load_instructions(args.data)   # bad files are refused before the GPU starts
    init_gpu(args.precision)
    ne.cmd_sft(args, make_engine=lambda cfg, flat, m, v: GPUEngine(cfg, flat, m, v, args),
               engine_line=f"{gpu.name}, sm_{gpu.arch}, {args.precision} matmuls")


def cmd_chat(args):
    """nanoeuler.py chat's REPL (/reset, /quit, Ctrl-D), generating on the GPU"""
    ne.cmd_chat(args, make_params=make_decoder(args), gen=generate)


def cmd_serve(args):
    """nanoeuler.py serve (serve.py's page and API), generating on the GPU"""
    ne.cmd_serve(args, make_params=make_decoder(args), gen=generate)


# -----------------------------------------------------------------------------
# command line

vocab_size_or_preset = ne.number_type(int, ne.FIRST_MERGE_ID, ne.MAX_V, f"0 (the preset's) or a vocabulary size "
                                      f"from {ne.FIRST_MERGE_ID} to {ne.MAX_V:,}", off=0)


def add_precision_flag(sp):
    """train's, sft's and bench's --precision (sample and chat say what it means for decoding)"""
    sp.add_argument("--precision", default="bf16", choices=["fp32", "tf32", "bf16"],
                    help="fp32; tf32 (fp32, products on tensor cores in tf32); bf16 (activations and their "
                         "gradients in bfloat16, fp32 master weights, gradients and optimizer state)")


def add_gpus_flags(sp):
    sp.add_argument("--gpus", type=ne.nonnegative_int, default=0,
                    help="data parallel over N GPUs through NCCL, one process each (--batch is the whole "
                         "batch); 0 = this process on one GPU, without NCCL")
    sp.add_argument("--zero", action="store_true", help="with --gpus: shard AdamW's moments (ZeRO-1)")


def add_graph_flag(sp):
    sp.add_argument("--no-graph", action="store_true",
                    help="launch each training step kernel by kernel, not as one CUDA graph (the same bits)")


def add_bench_flags(sp):
    sp.add_argument("model_size", nargs="?", default="big", help="SPEC preset: big or small")
    sp.add_argument("--batch", type=ne.positive_int, default=16, help="rows of T+K tokens per step")
    sp.add_argument("--steps", type=ne.positive_int, default=10, help="timed steps")
    add_precision_flag(sp)
    sp.add_argument("--profile", action="store_true", help="also time every kernel of one step")
    sp.add_argument("--model", default=None, help="trained model for the decoding timings (default: random weights)")
    sp.add_argument("--max-new-tokens", type=ne.positive_int, default=500, help="decoding: tokens to generate")
    sp.add_argument("--decode-precision", default="bf16", help="decoding: weights, bf16 or fp32 or both (bf16,fp32)")
    sp.add_argument("--decode-only", action="store_true", help="decoding timings only, no training steps")
    sp.add_argument("--no-decode", action="store_true", help="training steps only, no decoding timings")
    sp.add_argument("--decode-variants", action="store_true",
                    help="decoding: also time the other attention kernel and programmatic dependent launch")
    add_gpus_flags(sp)
    add_graph_flag(sp)
    add_nodes_flags(sp)
    sp.add_argument("--clip", type=ne.positive_float_or_off, default=1.0,
                    help="the timed steps clip the gradient norm as train's do; 0 = off")
    sp.add_argument("--weight-decay", type=ne.nonnegative_float, default=0.1,
                    help="the timed steps' AdamW weight decay, as train's")


def add_generation_flags(sp):
    """sample's and chat's: nanoeuler.py's, and the precision decoding reads the weights in"""
    ne.add_generation_flags(sp, DEFAULT_DRAFTS)
    sp.add_argument("--precision", default="bf16", choices=["fp32", "tf32", "bf16"],
                    help="weights read by decoding: bf16, or fp32 (tf32: fp32 with a tf32 prefill)")


def build_parser():
    p = ne.ArgumentParser(prog="nanoeuler_cuda.py", description="NanoEuler on NVIDIA GPUs")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="every kernel and the whole model against nanoeuler.py").add_argument(
        "--seed", type=ne.nonnegative_int, default=1337, help="seed of the random inputs")
    sp = sub.add_parser("train", help="train a model (big by default) on the GPU")
    sp.add_argument("model_size", nargs="?", default="big", help="SPEC preset: big or small")
    sp.add_argument("--data", default=os.path.join(ne.DATA_DIR, "gutenberg"),
                    help="UTF-8 text file or folder of .txt files")
    sp.add_argument("--vocab-size", type=vocab_size_or_preset, default=0, help="BPE vocabulary; 0 = the preset's V")
    add_precision_flag(sp)
    # 600 steps of 16 x 512 tokens are about 4.5 passes over the 1.1M tokens of the
    # embedded books (9 s of steps on an H200, 15.4 ms each; validation 1.83 bits per byte
    # at step 600, still falling); for more, bring more text (get_data.sh) and raise --steps
    ne.add_training_flags(sp, 600, 16, 6e-4, 100, None, threads=False, save_minutes=SAVE_MINUTES, mtp_weight=True)
    add_gpus_flags(sp)
    add_graph_flag(sp)
    add_nodes_flags(sp)
    add_bench_flags(sub.add_parser("bench", help="time training steps, decoding and prefill"))
    sp = sub.add_parser("sft", help="fine-tune on instructions on the GPU, loss on responses only")
    sp.add_argument("--model", required=True, help="pretrained .safetensors (e.g. out/big/best.safetensors)")
    sp.add_argument("--data", default=ne.DEFAULT_SFT, help="JSONL (instruction/input/response) or Alpaca JSON")
    add_precision_flag(sp)
    ne.add_training_flags(sp, 600, 16, 1e-3, 30, os.path.join("out", "sft"), threads=False, save_minutes=SAVE_MINUTES)
    sp = sub.add_parser("sample", help="continue a prompt on the GPU (KV cache, CUDA graphs)")
    add_generation_flags(sp)
    sp.add_argument("--prompt", type="argv_text", default="", help="text to continue (default: none, a new document)")
    add_generation_flags(sub.add_parser("chat", help="chat on stdin/stdout, generating on the GPU"))
    add_nodes_flags(sub.add_parser("rendezvous", help="under a launcher or --nnodes: check that every rank finds "
                                                      "rank 0 and gets the same id, without a GPU"))
    sp = sub.add_parser("serve", help="chat in the browser, and an OpenAI-shaped API (docs/serve.md), on the GPU")
    ne.add_serve_flags(sp)
    sp.add_argument("--precision", default="bf16", choices=["fp32", "tf32", "bf16"],
                    help="weights read by decoding: bf16, or fp32 (tf32: fp32 with a tf32 prefill)")
    return p


def main(argv=None):
    global memory_advice
    started = ne.now()                                             # --minutes counts the whole run from here
    args = build_parser().parse_args(argv)
    args.started = started
    args.argv = sys.argv[1:] if argv is None else list(argv)       # what --gpus starts once per GPU
    commands = {"check": cmd_check, "train": cmd_train, "bench": cmd_bench, "sample": cmd_sample, "sft": cmd_sft,
                "chat": cmd_chat, "rendezvous": cmd_rendezvous, "serve": cmd_serve}
    before = memory_advice
    if not hasattr(args, "batch") or getattr(args, "decode_only", False):
        # decoding holds the model (its weights, their bf16 copy, a KV cache of its T rows) whatever
        # the --max-new-tokens; check, a few small arrays
        memory_advice = "free the GPU's memory (nvidia-smi lists what holds it)" + (
            ", or decode a smaller model" if args.command != "check" else "")
    try:
        ne.run_command(commands[args.command], args)
    finally:                                                       # (a test's next command: its own)
        memory_advice = before



# -----------------------------------------------------------------------------
# check
#
# The story ends above; check, the benchmark and several GPUs and hosts follow.
#
# Every kernel against the numpy layer it mirrors, in float64, in both builds of
# kernels.cu: fp32 from the same float32 inputs, and bf16 (floatX = bfloat16) from
# the same inputs rounded to bf16, its bf16 outputs compared with the float64 result
# rounded to bf16, so that what is left is the kernel's own error (see
# KERNEL_BF16_TOLERANCE). Outputs are poisoned with NaN before each launch, so a
# kernel that skips an element fails. Error = norm(gpu - ref) / norm(ref).
# Then attention, the whole model (loss and every parameter gradient against
# nanoeuler.py in float64 on the same weights and batch) and whole training steps.

NAN_BITS = 0x7FC00000
TOLERANCE = {"fp32": 1e-5, "tf32": 1e-2, "bf16": 1e-2}
# A bf16 kernel computes in fp32 and rounds once, as the reference rounds its float64
# result: they differ only where the two land on either side of a rounding boundary,
# one bf16 step (2^-8) in a few elements in 10^4 (measured in a numpy float32
# emulation of rmsnorm, swiglu and the cross entropy: 0 to 1.6e-5). Rounding alone
# is 1.7e-3, so 1e-3 also fails a kernel that does not round as it should.
KERNEL_BF16_TOLERANCE = 1e-3


def bf16_round(a):
    """float32 -> the float32 value of its bf16 rounding (to nearest even), as the kernels round"""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rel_diff(got, ref):
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def activation(a, is_bf16):
    """a on the GPU as an activation: float32, or its bf16 rounding (uint16 bits)"""
    if not is_bf16:
        return to_gpu(a)
    return to_gpu((bf16_round(a).view(np.uint32) >> 16).astype(np.uint16), np.uint16)


def values(d):
    """a DeviceArray's numbers (bf16 bits decoded), as float64"""
    a = d.download()
    return (from_bf16(a) if a.dtype == np.uint16 else a).astype(np.float64)


def poisoned(shape, is_bf16=False):
    """an output array full of NaN: float32, or bf16"""
    if is_bf16:
        return DeviceArray(shape, np.uint16).fill_bits(0xFFFF)
    return DeviceArray(shape).fill_bits(NAN_BITS)


def check_kernels(rng, report, is_bf16):
    """kernels.cu's layer kernels in the build whose floatX is bf16 (is_bf16) or float"""
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    rnd = bf16_round if is_bf16 else (lambda a: np.asarray(a, np.float32))     # as the kernels store
    f64 = lambda a: np.asarray(a, np.float64)
    name = lambda what: what + (" (bf16)" if is_bf16 else "")
    B, T, C, V, F, K = 3, 100, 96, 200, 160, 3                  # T: not a multiple of any tile
    N = B * T
    # embedding; token 5 fills every third row, so its rows span several of the backward's chunks
    idx, tok_emb = rng.integers(0, V, (B, T)), f32(V, C)
    idx[:, ::3] = 5
    x = poisoned((N, C), is_bf16)
    embedding_forward(x, to_gpu(idx, np.int32), to_gpu(tok_emb), N, C)
    report(name("embedding_forward"), rel_diff(values(x), rnd(tok_emb[idx].reshape(N, C))))
    for rows, width in ((N, C), (20, 1040)):                       # 1040: columns in two slices, the last short
        ids, dx, start = rng.integers(0, 7, rows), rnd(f32(rows, width)), f32(7, width)
        d = to_gpu(start)                                           # parameter gradients add up: +=
        embedding_backward(d, to_gpu(ids, np.int32), activation(dx, is_bf16), rows, width, 7)
        report(name(f"embedding_backward C={width}"),
               rel_diff(d.download(), start + ne.embedding_backward(f64(dx), (ids, (7, width)))))
    for width in (C, 520, 1040):                                    # each build of rmsnorm_backward_kernel
        check_rmsnorm(rng, report, is_bf16, N if width == C else 40, width)
    check_rope(rng, report, is_bf16, B, T)
    # swiglu
    gu, dout = rnd(f32(N, 2 * F) * 3), rnd(f32(N, F))
    out, dgu = poisoned((N, F), is_bf16), poisoned((N, 2 * F), is_bf16)
    swiglu_forward(out, activation(gu, is_bf16), N, F)
    swiglu_backward(dgu, activation(dout, is_bf16), activation(gu, is_bf16), N, F)
    ref, cache = ne.swiglu_forward(f64(gu))
    report(name("swiglu_forward"), rel_diff(values(out), rnd(ref)))
    report(name("swiglu_backward"), rel_diff(values(dgu), rnd(ne.swiglu_backward(f64(dout), cache))))
    # residual (decoding's prefill; training fuses it into the norm)
    a, b = rnd(f32(N, C)), rnd(f32(N, C))
    out = poisoned((N, C), is_bf16)
    residual_forward(out, activation(a, is_bf16), activation(b, is_bf16), N * C)
    report(name("residual_forward"), rel_diff(values(out), rnd(f64(a) + b)))
    # V + 3: not in 16-byte packs; 4104 and 4099: rows in which each of the 256 threads takes
    # several packs, or elements, one after another (its running sum rescaled as its max grows)
    for rows, vocab in ((N, V), (N, V + 3), (20, 4104), (20, 4099)):
        check_cross_entropy(rng, report, is_bf16, rows, vocab, K)


def check_rmsnorm(rng, report, is_bf16, N, C):
    """rmsnorm_forward, the residual add fused into it, and rmsnorm_backward (+= and =)"""
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    rnd = bf16_round if is_bf16 else (lambda a: np.asarray(a, np.float32))
    name = lambda what: what + (f" C={C}" if C > 256 else "") + (" (bf16)" if is_bf16 else "")
    x_in, a, w, dout, dx0, dw0 = rnd(f32(N, C)), rnd(f32(N, C)), f32(C), rnd(f32(N, C)), rnd(f32(N, C)), f32(C)
    out, rstd = poisoned((N, C), is_bf16), poisoned((N,))
    rmsnorm_forward(out, rstd, activation(x_in, is_bf16), to_gpu(w), N, C)
    ref, cache = ne.rmsnorm_forward(x_in.astype(np.float64), w.astype(np.float64))
    report(name("rmsnorm_forward"), rel_diff(values(out), rnd(ref)))
    report(name("rmsnorm_forward rstd"), rel_diff(rstd.download(), cache[2][:, 0]))
    x, out, rstd_sum = poisoned((N, C), is_bf16), poisoned((N, C), is_bf16), poisoned((N,))
    residual_rmsnorm_forward(x, out, rstd_sum, activation(x_in, is_bf16), activation(a, is_bf16), to_gpu(w), N, C)
    x_ref = rnd(x_in.astype(np.float64) + a)                      # as stored, and normalised as stored
    ref, cache_sum = ne.rmsnorm_forward(x_ref.astype(np.float64), w.astype(np.float64))
    report(name("residual_rmsnorm_forward x"), rel_diff(values(x), x_ref))
    report(name("residual_rmsnorm_forward"), rel_diff(values(out), rnd(ref)))
    report(name("residual_rmsnorm_forward rstd"), rel_diff(rstd_sum.download(), cache_sum[2][:, 0]))
    rdx, rdw = ne.rmsnorm_backward(dout.astype(np.float64), cache)
    for accumulate in (True, False):
        dx, dw = activation(dx0, is_bf16) if accumulate else poisoned((N, C), is_bf16), to_gpu(dw0)
        rmsnorm_backward(dx, dw, activation(dout, is_bf16), activation(x_in, is_bf16), to_gpu(w), rstd, N, C,
                         accumulate)
        what = "rmsnorm_backward" + (" dx +=" if accumulate else " dx =")
        report(name(what), rel_diff(values(dx), rnd(rdx + (dx0 if accumulate else 0))))
        report(name(what + ", dw"), rel_diff(dw.download() - dw0, rdw))


def check_rope(rng, report, is_bf16, B, T):
    """rope in place on the q and k heads of a qkv buffer, at an offset position, both ways"""
    rnd = bf16_round if is_bf16 else (lambda a: np.asarray(a, np.float32))
    name = lambda what: what + (" (bf16)" if is_bf16 else "")
    N, Hq, Hkv, D, pos = B * T, 4, 2, 32, 7
    QKV, QK = (Hq + 2 * Hkv) * D, (Hq + Hkv) * D
    qkv = rnd(rng.normal(size=(N, QKV)))
    cos, sin = (to_gpu(t) for t in ne.rope_table(T + pos, D, 0, np.float32))
    heads = qkv[:, :QK].reshape(B, T, Hq + Hkv, D).astype(np.float64)
    for backward in (False, True):
        q = activation(qkv, is_bf16)
        (rope_backward if backward else rope_forward)(q, cos, sin, N, T, Hq + Hkv, D, QKV, pos)
        ref = ne.rope_backward(heads, ne.rope_forward(heads, pos)[1]) if backward else ne.rope_forward(heads, pos)[0]
        got, what = values(q), "rope_backward" if backward else "rope_forward"
        report(name(what), rel_diff(got[:, :QK], rnd(ref.reshape(N, -1))))
        report(name(what + " leaves v"), float(np.any(got[:, QK:] != qkv[:, QK:])))


def check_cross_entropy(rng, report, is_bf16, N, V, K):
    """the fused cross entropy over K heads (logits (N, K, V)), some targets ignored, and its sums"""
    rnd = bf16_round if is_bf16 else (lambda a: np.asarray(a, np.float32))
    name = lambda what: what + (" (bf16)" if is_bf16 else "")
    logits, targets = rnd(rng.normal(size=(N, K, V)) * 2), rng.integers(0, V, (N, K))
    targets[rng.random((N, K)) < 0.2] = -1
    counts = (targets >= 0).sum(0)
    weights = np.array([1.0, 0.25, 0.25])
    lg, losses, sums = activation(logits, is_bf16), poisoned((K, N)), DeviceArray((K,), np.float64)
    cross_entropy_forward(lg, losses, to_gpu(targets, np.int32), to_gpu(weights / counts), N, V, K)
    cross_entropy_sum(sums, losses, N, K)
    got_d, got_sums = values(lg), sums.download()
    for k in range(K):
        ref_loss, cache = ne.cross_entropy_forward(logits[:, k].astype(np.float64), targets[:, k])
        report(name(f"cross_entropy V={V} head {k} loss"), abs(got_sums[k] / counts[k] - ref_loss) / ref_loss)
        report(name(f"cross_entropy V={V} head {k} dlogits"),
               rel_diff(got_d[:, k], rnd(ne.cross_entropy_backward(weights[k], cache))))


def check_optimizer(rng, report):
    """to_bf16, the gradient norm and clip, and AdamW writing the bf16 copy, on the flat buffers
    (fp32 whatever the activations); a non-finite loss sum or gradient leaves them unchanged"""
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    x = f32(1000)
    x16 = poisoned((1000,), True)
    to_bf16(x16, to_gpu(x), x.size)
    report("to_bf16", rel_diff(from_bf16(x16.download()), bf16_round(x)))
    n, K, lr, step = 100_003, 3, 1e-2, 3                         # n: the last thread has fewer than 4
    p, g, m, v = f32(n), f32(n), f32(n) * 0.1, np.abs(f32(n)) * 0.1
    decay = (rng.random(n) < 0.7).astype(np.uint8)
    norm = np.linalg.norm(g.astype(np.float64))
    cases = (("under the clip", 2 * norm, [1.0, 2.0, 3.0]), ("clipped", norm / 3, [1.0, 2.0, 3.0]),
             ("a NaN loss sum", 1.0, [1.0, np.nan, 3.0]))
    for case, max_norm, sums in cases:
        pg, p16, mg, vg = to_gpu(p), poisoned((n,), True), to_gpu(m), to_gpu(v)
        results, clip, partial = to_gpu(sums + [0.0], np.float64), poisoned((2,)), poisoned((64,))
        hyper = to_gpu([lr, 1 - 0.9 ** step, 1 - 0.95 ** step])
        grad_norm(partial, to_gpu(g), n)
        clip_grad_norm(results, clip, partial, K, max_norm)
        adamw_update(pg, p16, to_gpu(g), mg, vg, to_gpu(decay, np.uint8), n, hyper, clip, weight_decay=0.1)
        what = f"adamw, {case}"
        report(f"grad_norm ({what})", abs(results.download()[K] - norm) / norm)
        if np.isnan(sums[1]):                                      # nothing changes, not even the bf16 copy
            unchanged = [np.array_equal(a.download(), b) for a, b in ((pg, p), (mg, m), (vg, v))]
            report(f"{what}: no update", float(not all(unchanged) or np.any(p16.download() != 0xFFFF)))
            continue
        rp, rm, rv = (a.astype(np.float64) for a in (p, m, v))
        ne.adamw_update(rp, g.astype(np.float64) * min(1.0, max_norm / norm), rm, rv, step, lr, decay, weight_decay=0.1)
        report(f"{what}: params", rel_diff(pg.download(), rp))
        report(f"{what}: moments", max(rel_diff(mg.download(), rm), rel_diff(vg.download(), rv)))
        report(f"{what}: bf16 copy", float(np.any(from_bf16(p16.download()) != bf16_round(pg.download()))))
    g[12345] = np.inf                                              # a non-finite gradient: no update either
    results, clip, partial = to_gpu([1.0, 2.0, 3.0, 0.0], np.float64), poisoned((2,)), poisoned((64,))
    grad_norm(partial, to_gpu(g), n)
    clip_grad_norm(results, clip, partial, K, 1.0)
    report("clip_grad_norm of an infinite gradient: apply = 0", float(clip.download()[1] != 0))


# check's TMA products: the big model's four forward products (M, N, K) at a ragged M (a row tile and 72 rows of
# another), w_gate_up's also with SwiGLU (F = N / 2); and the backward's data gradients of the same weights,
# (M, K) = (M, N) @ b (N, K), w_down's also with swiglu_backward (F = K)
PRODUCT_CHECKS = {"wqkv": (200, 1280, 768), "wo": (200, 768, 768), "w_gate_up": (200, 4096, 768),
                  "w_down": (200, 768, 2048)}


def check_products(rng, report):
    """flash_attn.cu's TMA products (compute capability 9.0; elsewhere none) against float64 of the same bf16
    inputs, rounded as they round: PRODUCT_CHECKS, and w_gate_up's with SwiGLU: gu, s, and s against
    swiglu_forward's from that gu, bit for bit (the same math on the same bf16 gate and up); each weight's data
    gradient dy @ b, and w_down's with swiglu_backward: dgu, and dgu against swiglu_backward's from that product's
    ds, bit for bit. With PRODUCT_TMA and PRODUCT_TMA_BACKWARD on for the time, as check runs both attention
    passes whichever is the default"""
    global PRODUCT_TMA, PRODUCT_TMA_BACKWARD
    on, PRODUCT_TMA, on_backward, PRODUCT_TMA_BACKWARD = PRODUCT_TMA, True, PRODUCT_TMA_BACKWARD, True
    try:
        f64 = lambda x: np.asarray(x, np.float64)
        for what, (M, N, K) in PRODUCT_CHECKS.items():
            a, b = bf16_round(rng.normal(size=(M, K))), bf16_round(rng.normal(size=(N, K)))
            a_g, b_g, out = activation(a, True), activation(b, True), poisoned((M, N), True)
            if not product_tma(out, a_g, b_g, N, K):
                return                                             # cuBLAS: the model's checks cover it
            matmul(out, a_g, b_g, M, N, K, trans_b=True)
            ref = bf16_round(f64(a) @ f64(b).T)                    # (M, K) @ (K, N) -> (M, N)
            report(f"product {what} {M}x{N}x{K} (TMA)", rel_diff(values(out), ref))
            if what == "w_gate_up":
                F = N // 2
                gu, s, s_alone = poisoned((M, N), True), poisoned((M, F), True), poisoned((M, F), True)
                matmul_swiglu_forward(gu, s, a_g, b_g, M, F, K)
                swiglu_forward(s_alone, gu, M, F)
                report(f"product {what} + swiglu: gu (TMA)", rel_diff(values(gu), ref))
                s_ref = bf16_round(ne.swiglu_forward(f64(ref))[0])
                report(f"product {what} + swiglu: s (TMA)", rel_diff(values(s), s_ref))
                report(f"product {what} + swiglu: s == swiglu_forward's (bits)",
                       float(not np.array_equal(s.download(), s_alone.download())))
            dy = bf16_round(rng.normal(size=(M, N)))              # the data gradient: (M, N) @ b (N, K) -> (M, K)
            dy_g, dx = activation(dy, True), poisoned((M, K), True)
            matmul(dx, dy_g, b_g, M, K, N)
            dx_ref = bf16_round(f64(dy) @ f64(b))
            report(f"product {what} dx {M}x{K}x{N} (TMA)", rel_diff(values(dx), dx_ref))
            if what == "w_down":                                   # ds = dy @ w_down, and swiglu_backward
                F = K
                gu = bf16_round(rng.normal(size=(M, 2 * F)))
                gu_g, dgu, dgu_alone = activation(gu, True), poisoned((M, 2 * F), True), poisoned((M, 2 * F), True)
                matmul_swiglu_backward(dgu, poisoned((M, F), True), dy_g, b_g, gu_g, M, F, N)
                swiglu_backward(dgu_alone, dx, gu_g, M, F)         # dx: ds, from matmul_backward_tma_kernel
                dgu_ref = bf16_round(ne.swiglu_backward(dx_ref, ne.swiglu_forward(f64(gu))[1]))
                report(f"product {what} dx + swiglu_backward: dgu (TMA)", rel_diff(values(dgu), dgu_ref))
                report(f"product {what} dx + swiglu_backward: dgu == swiglu_backward's (bits)",
                       float(not np.array_equal(dgu.download(), dgu_alone.download())))
    finally:
        PRODUCT_TMA, PRODUCT_TMA_BACKWARD = on, on_backward


def check_attention(rng, report):
    """the attention path of gpu.precision at each head dim: CUDA cores in fp32, tensor
    cores in tf32, and in bf16 the bf16 passes, which read and write bf16 activations.

    The bf16 passes are given q, k, v and dy in bf16, so their reference is the
    float64 attention of those same inputs, and the error left is the kernel's own:
    p and ds rounded to bf16 (a relative 2^-9 at most) on their way into the second
    products, which averages down over the keys to a few 1e-3 of the output's norm,
    and the outputs' own rounding to bf16 (1.7e-3). The bar, TOLERANCE["bf16"] = 1e-2,
    sits above that, while a wrong fragment, mask or tile gives errors of order 1."""
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    B, T = 2, 150                                              # T: no multiple of a tile; 2 blocks of 128 rows
    N = B * T
    for D, Hq, Hkv in ((32, 4, 2), (64, 3, 1), (16, 2, 2)):
        QKV = (Hq + 2 * Hkv) * D
        is_bf16 = gpu.precision == "bf16" and BF16_ACTIVATIONS and D in HEAD_DIMS
        rnd = bf16_round if is_bf16 else (lambda a: a)            # what the kernels read
        qkv, dy = rnd(f32(N, QKV)), rnd(f32(N, Hq * D))
        qkv_g, dy_g = activation(qkv, is_bf16), activation(dy, is_bf16)
        path = attention_path(D, qkv_g)
        q = qkv[:, :Hq * D].astype(np.float64).reshape(B, T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].astype(np.float64).reshape(B, T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].astype(np.float64).reshape(B, T, Hkv, D)
        ref, cache = ne.attention_forward(q, k, v)
        what = f"attention {path} D={D} G={Hq // Hkv}"
        tma = attention_tma(D, qkv_g)                             # sm_90: the TMA forward, and the other one too
        for kernel in ([True, False] if tma else [None]):
            y, lse = poisoned((N, Hq * D), is_bf16), poisoned((B, Hq, T))
            attention_forward(y, lse, qkv_g, B, T, Hq, Hkv, D, tma=kernel)
            report(f"{what} forward" + {True: " (TMA)", False: " (mma.sync)", None: ""}[kernel],
                   rel_diff(values(y), ref.reshape(N, -1)))
        dq, dk, dv = ne.attention_backward(dy.astype(np.float64).reshape(B, T, Hq, D), cache)
        tma = attention_tma(D, qkv_g, backward=True)              # sm_90: the TMA dk/dv pass, and the other one too
        for kernel in ([True, False] if tma else [None]):
            dqkv = poisoned((N, QKV), is_bf16)
            ds = poisoned((attention_ds_size(B, T, Hq),), True)   # every tile the dq pass reads must be written
            attention_backward(dqkv, dy_g, qkv_g, y, lse, DeviceArray((B, Hq, T)), ds, B, T, Hq, Hkv, D, tma=kernel)
            got, how = values(dqkv), {True: " (TMA)", False: " (mma.sync)", None: ""}[kernel]
            report(f"{what} dq{how}", rel_diff(got[:, :Hq * D], dq.reshape(N, -1)))
            report(f"{what} dk{how}", rel_diff(got[:, Hq * D:(Hq + Hkv) * D], dk.reshape(N, -1)))
            report(f"{what} dv{how}", rel_diff(got[:, (Hq + Hkv) * D:], dv.reshape(N, -1)))


# The whole model in bf16 mode is held to a float64 reference that rounds where the GPU
# rounds (kernels.cu's floatX): rounded_forward and rounded_backward are nanoeuler's
# model_forward and model_backward, from the same layer functions, with rnd applied to
# each matrix as the matmuls read it and to each activation and activation gradient as
# a kernel or a product stores it. What they leave out is the kernels' own arithmetic
# (fp32 sums in another order; attention rounds p and ds to bf16 inside: see
# check_attention), so the difference measures the kernels, not bf16.

def rnd_bf16(a):
    """float64 -> float64 holding the bf16 rounding of a's float32 value, as a kernel that
    computed a in fp32 stores it"""
    return bf16_round(np.asarray(a, np.float32)).astype(np.float64)


def rounded_forward(params, cfg, idx, targets, rnd):
    """idx (B,T), targets (B,T,K) -> loss, ce (K,), cache; see above"""
    B, T = idx.shape
    N, C, D, K, V, Hq, Hkv = B * T, cfg.C, cfg.D, cfg.K, cfg.V, cfg.Hq, cfg.Hkv
    w = lambda name: rnd(params[name])                             # a matrix as the matmuls read it
    x = rnd(params["tok_emb"][idx.reshape(-1)])                    # (N, C)
    h, c_norm = ne.rmsnorm_forward(x, params["layers.0.attn_norm"])
    h, layers = rnd(h), []
    for l in range(cfg.L):
        lw = lambda name: w(f"layers.{l}.{name}")
        qkv = rnd(h @ lw("wqkv").T)                                 # (N, (Hq+2Hkv)*D)
        qk, c_rope = ne.rope_forward(qkv[:, :(Hq + Hkv) * D].reshape(B, T, Hq + Hkv, D))
        qk = rnd(qk)                                                # (B,T,Hq+Hkv,D), rotated in place
        y, c_att = ne.attention_forward(qk[:, :, :Hq], qk[:, :, Hq:], qkv[:, (Hq + Hkv) * D:].reshape(B, T, Hkv, D))
        y = rnd(y.reshape(N, Hq * D))
        x_mid = rnd(x + rnd(y @ lw("wo").T))                        # residual, then the MLP's norm
        m, c_mlp = ne.rmsnorm_forward(x_mid, params[f"layers.{l}.mlp_norm"])
        m = rnd(m)
        gu = rnd(m @ lw("w_gate_up").T)                             # (N, 2F)
        s, c_swiglu = ne.swiglu_forward(gu)
        s = rnd(s)
        x_next = rnd(x_mid + rnd(s @ lw("w_down").T))               # residual, then the next norm
        norm_w = params["final_norm"] if l == cfg.L - 1 else params[f"layers.{l + 1}.attn_norm"]
        layers.append((c_norm, h, qkv, c_rope, c_att, y, c_mlp, m, gu, c_swiglu, s))
        h, c_norm = ne.rmsnorm_forward(x_next, norm_w)
        h, x = rnd(h), x_next
    logits = rnd(h @ w("heads").reshape(K * V, C).T).reshape(N, K, V)
    flat_targets = targets.reshape(N, K)
    ce, c_heads = [], []
    for k in range(K):
        ce_k, c = ne.cross_entropy_forward(logits[:, k], flat_targets[:, k])
        ce.append(ce_k)
        c_heads.append(c)
    loss = sum(wk * c for wk, c in zip(ne.mtp_weights(cfg), ce))
    return loss, np.array(ce), (layers, c_norm, h, c_heads, idx, (B, T), rnd)


def rounded_backward(params, grads, cache, cfg):
    """adds d loss / d params into grads (nanoeuler.carve views); mirrors rounded_forward"""
    layers, c_final, xf, c_heads, idx, (B, T), rnd = cache
    N, C, D, K, V, Hq = B * T, cfg.C, cfg.D, cfg.K, cfg.V, cfg.Hq
    w = lambda name: rnd(params[name])
    dlogits = np.stack([ne.cross_entropy_backward(wk, c) for wk, c in zip(ne.mtp_weights(cfg), c_heads)], 1)
    dlogits = rnd(dlogits).reshape(N, K * V)                        # in place of the logits
    dxf = rnd(dlogits @ w("heads").reshape(K * V, C))               # every head adds
    grads["heads"] += (dlogits.T @ xf).reshape(K, V, C)
    dx, dnorm = ne.rmsnorm_backward(dxf, c_final)
    dx = rnd(dx)
    grads["final_norm"] += dnorm
    for l in reversed(range(cfg.L)):
        c_norm, h, qkv, c_rope, c_att, y, c_mlp, m, gu, c_swiglu, s = layers[l]
        lw = lambda name: w(f"layers.{l}.{name}")
        g = lambda name: grads[f"layers.{l}.{name}"]
        ds = rnd(dx @ lw("w_down"))
        g("w_down")[...] += dx.T @ s
        dgu = rnd(ne.swiglu_backward(ds, c_swiglu))
        dm = rnd(dgu @ lw("w_gate_up"))
        g("w_gate_up")[...] += dgu.T @ m
        dxm, dnorm = ne.rmsnorm_backward(dm, c_mlp)
        g("mlp_norm")[...] += dnorm
        dx = rnd(dx + dxm)                                          # residual: both paths
        dy = rnd(dx @ lw("wo"))
        g("wo")[...] += dx.T @ y
        dq, dk, dv = (rnd(d) for d in ne.attention_backward(dy.reshape(B, T, Hq, D), c_att))
        dqk = rnd(ne.rope_backward(np.concatenate([dq, dk], axis=2), c_rope))
        dqkv = np.concatenate([dqk.reshape(N, -1), dv.reshape(N, -1)], -1)
        dh = rnd(dqkv @ lw("wqkv"))
        g("wqkv")[...] += dqkv.T @ h
        dxa, dnorm = ne.rmsnorm_backward(dh, c_norm)
        g("attn_norm")[...] += dnorm
        dx = rnd(dx + dxa)                                          # residual: both paths
    np.add.at(grads["tok_emb"], idx.reshape(-1), dx)


# The whole model in bf16 mode (bf16 activations) is held to rounded_forward and
# rounded_backward. A numpy float32 emulation of the kernels (the same rounding points,
# fp32 sums) came within 3.0e-3 .. 7.4e-3 of them in every gradient, on check_model's
# config and three seeds (and within 5.5e-3 .. 1.3e-2 of plain float64): a value that
# lands on the other side of a rounding boundary in one computation moves a later value
# by a bf16 step, which moves later roundings, so two correct bf16 computations drift
# apart down the chain, and the gradients, sums with much cancellation, show it.
# Attention's own rounding of p and ds adds a few 1e-3 of its outputs: the kernels
# themselves on tools/emulate_cuda.py (the tensor-core attention passes included), over
# 8 seeds, came within 0.95e-2 .. 1.17e-2 on check_model's config (dheads.2 the worst)
# and 0.91e-2 .. 1.40e-2 on check_sft's. Hence 3e-2, twice the worst seen, where wrong
# wiring gives far more (emulated: a missing residual path 0.86, rope's backward
# rotating the wrong way 0.35, a head's gradient missing 1.0). With BF16_ACTIVATIONS
# off (fp32 activations, the matmuls' inputs rounded) the reference is plain float64,
# which the same bar holds too: 9.5e-3 measured on an H200 at worst, before floatX.
MODEL_BF16_TOLERANCE = 3e-2


def model_errors(cfg, B, flat, idx, targets, precision):
    """the GPU model's loss and gradients on one batch against the float64 reference:
    nanoeuler.py's model, or with bf16 activations the one that rounds as they do
    -> loss error, {tensor: gradient error}, the bar (TOLERANCE, or MODEL_BF16_TOLERANCE in bf16)"""
    init_gpu(precision)
    model = GPUModel(cfg, B, flat)
    loss, _ = model.forward(idx, targets)
    model.backward()
    got = ne.carve(model.grads.download()[:flat.size], cfg)
    params, grads_ref = ne.carve(flat.astype(np.float64), cfg), np.zeros(flat.size)
    if model.bf16:
        loss_ref, _, cache = rounded_forward(params, cfg, idx, targets, rnd_bf16)
        rounded_backward(params, ne.carve(grads_ref, cfg), cache, cfg)
    else:
        loss_ref, _, cache = ne.model_forward(params, cfg, idx, targets)
        ne.model_backward(ne.carve(grads_ref, cfg), cache)
    ref = ne.carve(grads_ref, cfg)
    errors = {name: rel_diff(got[name], ref[name]) for name, _ in param_shapes(cfg)}
    bar = MODEL_BF16_TOLERANCE if precision == "bf16" else TOLERANCE[precision]
    return abs(loss - loss_ref) / abs(loss_ref), errors, bar


def check_model(rng, reporter, precision):
    """loss and every parameter gradient against nanoeuler.py in float64 (see model_errors);
    reporter(bar) -> report"""
    cfg = Config(V=96, C=128, Hq=2, Hkv=1, L=2, T=80, F=344, K=3)   # D = 64; T > one tile
    B = 3
    flat = ne.init_params(cfg, seed=int(rng.integers(1 << 30)))
    flat += rng.normal(0, 0.05, flat.size).astype(np.float32)      # norm weights off 1, larger weights
    rows = rng.integers(0, cfg.V, (B, cfg.T + cfg.K))
    idx, targets = ne.split_rows(rows, cfg.T, cfg.K)
    targets = targets.copy()
    targets[0, :5, 0] = targets[2, 10:20] = -1
    loss_error, errors, bar = model_errors(cfg, B, flat, idx, targets, precision)
    report = reporter(bar)
    report(f"model {precision} loss", loss_error)
    for name, error in errors.items():
        report(f"model {precision} d{name}", error)


def check_step(rng, report, precision):
    """whole training steps: from a CUDA graph the same bits as launched one by one (losses,
    norms, weights, moments); the first step's update as nanoeuler.adamw_update makes it
    from the GPU's gradients; a NaN loss changes nothing and says so"""
    cfg = Config(V=96, C=128, Hq=2, Hkv=1, L=2, T=80, F=344, K=3)
    B, lr = 3, 1e-3
    flat = ne.init_params(cfg, seed=int(rng.integers(1 << 30)))
    batches = [ne.split_rows(rng.integers(0, cfg.V, (B, cfg.T + cfg.K)), cfg.T, cfg.K) for _ in range(4)]
    init_gpu(precision)
    runs = []
    for graph in (False, True):
        args = argparse.Namespace(batch=B, zero=False, clip=1.0, weight_decay=0.1, no_graph=not graph)
        engine = GPUEngine(cfg, flat, None, None, args)
        out = [engine.step(idx, targets, lr, s + 1) for s, (idx, targets) in enumerate(batches)]
        runs.append((out, [a.copy() for a in engine.host_weights()]))   # the engine's buffers go with it
        if not graph:                                              # step 1 again, against numpy
            check_update(engine, flat, batches[0], lr, report, precision)
    (out_a, w_a), (out_b, w_b) = runs
    same = all(np.array_equal(a, b) for a, b in zip(w_a, w_b)) and \
        all(la == lb and na == nb and np.array_equal(ca, cb) for (la, ca, na), (lb, cb, nb) in zip(out_a, out_b))
    report(f"step {precision}: graph == one by one, 4 steps (bits)", float(not same))
    model = engine.model                                           # the graph's: a NaN in the final norm
    model.flat.view((model.params["final_norm"].ptr - model.flat.ptr) // 4, (1,)).upload([np.nan])
    before = [model.flat.download(), model.m.download(), model.v.download()]
    if model.flat16 is not None:
        before.append(model.flat16.download())
    loss, _, _ = engine.step(*batches[0], lr, 5)
    after = [a.download() for a in (model.flat, model.m, model.v, model.flat16) if a is not None]
    report(f"step {precision}: NaN loss, no update", float(np.isfinite(loss) or not all(
        np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))))


def check_update(engine, flat, batch, lr, report, precision):
    """one step from flat: the weights' change against nanoeuler.adamw_update's from the
    GPU's own gradients (which the step leaves in model.grads), clipped at 1 as
    clip_grad_norm (fp32 arithmetic on both sides of the update: the fp32 bar)"""
    model, n = engine.model, flat.size
    model.flat.upload(np.pad(flat, (0, model.flat.size - n)))
    model.m.zero(), model.v.zero()
    model.refresh_bf16()
    _, _, norm = engine.step(*batch, lr, 1)
    grads = model.grads.download()[:n].astype(np.float64)
    ref, m, v = flat.astype(np.float64), np.zeros(n), np.zeros(n)
    ref_norm = ne.clip_grad_norm(grads, 1.0)
    ne.adamw_update(ref, grads, m, v, 1, lr, ne.decay_mask(engine.cfg), weight_decay=0.1)
    report(f"step {precision}: gradient norm", abs(norm - ref_norm) / ref_norm)
    report(f"step {precision}: AdamW update", rel_diff(model.flat.download()[:n] - flat, ref - flat))


def check_sft(rng, reporter, precision):
    """the GPU model's loss and gradients on SFT rows (targets -1 on the prompt and the
    padding, a head with no target at all in a row) against nanoeuler.py in float64"""
    cfg = Config(V=96, C=64, Hq=2, Hkv=1, L=2, T=40, F=176, K=3)
    B = 3
    flat = ne.init_params(cfg, seed=int(rng.integers(1 << 30)))
    flat += rng.normal(0, 0.05, flat.size).astype(np.float32)
    rows = rng.integers(0, cfg.V, (B, cfg.T + cfg.K))
    mask = np.zeros(rows.shape, bool)
    mask[0, 8:30] = mask[1, 20:] = mask[2, 2:5] = True              # response spans; row 2 mostly padding
    idx, targets = ne.sft_targets(rows, mask, cfg.T, cfg.K)
    loss_error, errors, bar = model_errors(cfg, B, flat, idx, targets, precision)
    report = reporter(bar)
    report(f"sft {precision} loss ({(targets >= 0).sum()} of {targets.size} targets kept)", loss_error)
    worst = max(errors, key=errors.get)
    report(f"sft {precision} gradients (worst: d{worst})", errors[worst])


# Decoding: GPUDecoder's logits after a prefill and after single-token and
# several-row passes against nanoeuler.model_forward's own KV-cache decoding in
# float64. fp32 decoding is held to the kernels' bar. bf16 decoding is compared
# with the float64 model whose matrices are rounded to bf16 as the decoder's are;
# what is left is the prefill's cuBLAS products, which round their activations to
# bf16 as well (2^-9 relative each, a few hundred of them summed per output, over
# both layers and into the cache the later steps read): a few 1e-3 measured,
# so 2e-2 flags a real fault (a wrong row or head gives errors near 1).
DECODE_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def bf16_matrices(flat, cfg):
    """flat with every matrix the decoder reads in bf16 rounded so (not tok_emb, not the norms)"""
    out = flat.astype(np.float64)
    views = ne.carve(out, cfg)
    for name, shape in param_shapes(cfg):
        if len(shape) == 2 and name != "tok_emb":
            views[name][...] = bf16_round(views[name].astype(np.float32))
    return out


def reference_params(flat, cfg, precision):
    """the float64 reference's parameters (carved) for a decoder of precision: in bf16, its matrices rounded as the
    decoder holds them"""
    return ne.carve(bf16_matrices(flat, cfg) if precision == "bf16" else flat.astype(np.float64), cfg)


def margin_model(cfg, rng):
    """nanoeuler's speculative test model: the next token depends mostly on the current one
    (head k maps t to f^(k+1)(t) with large margins, the blocks add a little noise), so
    the drafts are often right; head 2 is noisy for a third of the tokens, so drafts
    are rejected too"""
    flat = rng.normal(0, 0.01, num_params(cfg))
    params = ne.carve(flat, cfg)
    for name, shape in param_shapes(cfg):
        if len(shape) == 1:
            params[name][...] = 1.0
    params["tok_emb"][...] = np.eye(cfg.V, cfg.C)
    f, nxt = rng.permutation(cfg.V), np.arange(cfg.V)
    for k in range(cfg.K):
        nxt = f[nxt]
        params[f"heads.{k}"][...] = 0
        params[f"heads.{k}"][nxt, np.arange(cfg.V)] = 30.0
    params["heads.2"][:, :cfg.V // 3] = rng.normal(0, 30.0, (cfg.V, cfg.V // 3))
    return flat.astype(np.float32)


def check_decode_logits(report, what, cfg, flat, params, precision, ids, n0, **options):
    """GPUDecoder's logits (options: its attention, pdl) after a prefill of ids[:n0],
    one-token steps at n0..n0+3 and a 3-row pass after them, against nanoeuler.model_forward
    with a KV cache (params: the float64 model); and a 3-row pass over n0..n0+2 == those
    one-token steps, bit for bit. -> every logit read, in order"""
    dec, kv, V = GPUDecoder(cfg, flat, precision, **options), ne.new_kv_cache(cfg, 1, np.float64), cfg.V

    def compare(name, feed, pos, R):
        seen.append(dec.logits.view(0, (R, V)).download())
        ref = ne.model_forward(params, cfg, np.array([feed]), pos=pos, kv=kv)[0][0, -R:]
        report(f"{what} {name} logits", rel_diff(seen[-1], ref))

    seen = []
    dec.wait(dec.prefill(ids[:n0], 1))
    compare(f"prefill ({n0} tokens)", ids[:n0], 0, 1)
    for pos in range(n0, n0 + 4):                              # four one-token steps
        dec.set_feed([ids[pos]], pos)
        dec.wait(dec.launch_step(1, 1))
        compare(f"step at {pos}", ids[pos:pos + 1], pos, 1)
    dec.set_feed(ids[n0 + 4:n0 + 7], n0 + 4)                   # a pass over three rows (a verifying pass)
    dec.wait(dec.launch_step(3, 1))
    compare(f"3-row pass at {n0 + 4}", ids[n0 + 4:n0 + 7], n0 + 4, 3)
    dec.set_feed(ids[n0:n0 + 3], n0)                           # rows of a pass == one-row steps, bit for bit
    dec.wait(dec.launch_step(3, 1))
    seen.append(dec.logits.view(0, (3, V)).download())
    report(f"{what} 3-row pass == 1-row steps", float(np.any(seen[-1] != np.concatenate(seen[1:4]))))
    return seen


def check_decoding(rng, report, precision):
    """check_decode_logits with the attention kernel in use and the other one, on a model
    whose rows see one chunk of keys and on one (D = 64 as the big model's, G = 8 query
    heads per kv head: two blocks each) whose rows see up to three, the 3-row pass
    straddling a chunk's end; on sm_90 the step's kernels with programmatic
    dependent launch give the bits of plain launches, and decode_layers those of the
    layers' kernels one by one (or the other way round); then check_speculative"""
    cfg = Config(V=96, C=64, Hq=4, Hkv=2, L=2, T=40, F=176, K=4)
    wide = Config(V=96, C=512, Hq=8, Hkv=1, L=1, T=160, F=176, K=2)
    other = "single" if attention_kernel(cfg.D) == "split" else "split"
    for c, n0 in ((cfg, 12), (wide, 126)):
        flat = ne.init_params(c, seed=int(rng.integers(1 << 30)))
        flat += rng.normal(0, 0.05, flat.size).astype(np.float32)
        params = reference_params(flat, c, precision)
        ids = rng.integers(0, c.V, n0 + 8).tolist()
        what = f"decode {precision}" + (f" D={c.D} G={c.Hq // c.Hkv}" if c is wide else "")
        seen = check_decode_logits(report, what, c, flat, params, precision, ids, n0)
        check_decode_logits(report, f"{what} {other}", c, flat, params, precision, ids, n0, attention=other)
        variants = [("without PDL" if DECODE_PDL else "PDL launches", dict(pdl=not DECODE_PDL))] * (int(gpu.arch) >= 90)
        variants.append(("kernels one by one" if DECODE_PERSISTENT else "persistent layers",
                         dict(persistent=not DECODE_PERSISTENT)))
        for name, options in variants:
            try:
                got = check_decode_logits(lambda *_: None, what, c, flat, params, precision, ids, n0, **options)
                same = all(np.array_equal(a, b) for a, b in zip(seen, got))
            except NanoEulerError as e:
                print(f"  {name} failed: {e}")
                same = False
            report(f"{what} {name} == default (bits)", float(not same))
        if c is cfg:
            check_speculative(report, precision, cfg, flat, ids[:5])


def check_speculative(report, precision, cfg, flat, prompt):
    """greedy speculative == plain == nanoeuler.py over several window slides on a model with
    clear margins, == plain on the random model (flat) too; sampling as nanoeuler.py's"""
    what = f"decode {precision}"
    mcfg = Config(V=24, C=32, Hq=4, Hkv=2, L=2, T=20, F=48, K=4)
    mflat = margin_model(mcfg, np.random.default_rng(7))
    mdec, mparams = GPUDecoder(mcfg, mflat, precision), ne.carve(mflat.astype(np.float64), mcfg)
    for start in ([1], [3, 5, 7], [i % mcfg.V for i in range(mcfg.T + 5)]):
        plain = list(generate(mdec, mcfg, start, 3 * mcfg.T, temperature=0))
        cpu = list(ne.generate(mparams, mcfg, start, 3 * mcfg.T, temperature=0))
        report(f"{what} greedy == nanoeuler.py, {len(start)}-token prompt", float(plain != cpu))
        for drafts in (None, 1, 2):
            stats = {}
            spec = list(generate(mdec, mcfg, start, 3 * mcfg.T, temperature=0, speculative=True, stats=stats,
                                 drafts=drafts))
            report(f"{what} speculative ({drafts or mcfg.K - 1} drafts) == plain", float(spec != plain))
            report(f"{what}   tokens per pass {stats['tokens'] / stats['steps']:.2f} > 1.3",
                   float(stats["tokens"] / stats["steps"] <= 1.3))
    # the random model too: bits equal, whatever the margins (rows are computed alike)
    dec = GPUDecoder(cfg, flat, precision)
    plain = list(generate(dec, cfg, prompt, 3 * cfg.T, temperature=0))
    spec = list(generate(dec, cfg, prompt, 3 * cfg.T, temperature=0, speculative=True))
    report(f"{what} random model: speculative == plain", float(spec != plain))
    if precision == "fp32":                                    # sampling: the host's path, same seed as the CPU
        got = list(generate(mdec, mcfg, [3, 5], 2 * mcfg.T, temperature=1.5, seed=3, speculative=True, drafts=2))
        ref = list(ne.generate(mparams, mcfg, [3, 5], 2 * mcfg.T, temperature=1.5, seed=3, speculative=True,
                               drafts=2))
        report(f"{what} sampled (seed 3) == nanoeuler.py", float(got != ref))


def cmd_check(args):
    init_gpu("fp32")
    print(f"GPU check on {gpu.name} (sm_{gpu.arch}): kernels and model against nanoeuler.py in float64")
    print(f"{'what':<48} {'rel err':>9}  bar")
    rng = np.random.default_rng(args.seed)
    failed = []

    def reporter(tol):
        def report(what, err):
            ok = err < tol                                         # NaN fails too
            failed.extend([] if ok else [what])
            print(f"{what:<48} {err:9.1e}  {tol:.0e}  {'OK' if ok else 'NOT OK'}")
        return report

    check_kernels(rng, reporter(TOLERANCE["fp32"]), is_bf16=False)
    check_kernels(rng, reporter(KERNEL_BF16_TOLERANCE), is_bf16=True)
    check_products(rng, reporter(KERNEL_BF16_TOLERANCE))
    check_optimizer(rng, reporter(TOLERANCE["fp32"]))
    for precision in ("fp32", "tf32", "bf16"):
        init_gpu(precision)
        check_attention(rng, reporter(TOLERANCE[precision]))
    for precision in ("fp32", "tf32", "bf16"):
        check_model(rng, reporter, precision)
    for precision in ("fp32", "bf16"):
        check_step(rng, reporter(TOLERANCE["fp32"]), precision)
        check_sft(rng, reporter, precision)
        check_decoding(rng, reporter(DECODE_TOLERANCE[precision]), precision)
    print(f"overall okay: {int(not failed)}")
    if failed:
        sys.exit(1)


# -----------------------------------------------------------------------------
# benchmark

def time_attention(model, reps=20):
    """-> (forward, forward + backward) of attention alone on layer 0's buffers, in
    microseconds, the mean of reps runs between two CUDA events (comparable to
    PyTorch's scaled_dot_product_attention, which is also given q, k, v in bf16)"""
    cfg, B = model.cfg, model.B
    forward = lambda: attention_forward(model.y[0], model.lse[0], model.qkv[0], B, cfg.T, cfg.Hq, cfg.Hkv, cfg.D)
    backward = lambda: attention_backward(model.dqkv, model.dy, model.qkv[0], model.y[0], model.lse[0], model.delta,
                                          model.attention_ds, B, cfg.T, cfg.Hq, cfg.Hkv, cfg.D)
    times = []
    for passes in ([forward], [forward, backward]):
        for f in passes:                                             # warm-up
            f()
        events = [check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        check(cu.cuEventRecord(events[0], gpu.stream), "cuEventRecord")
        for _ in range(reps):
            for f in passes:
                f()
        check(cu.cuEventRecord(events[1], gpu.stream), "cuEventRecord")
        gpu.sync()
        times.append(1e3 * check(cu.cuEventElapsedTime(*events), "cuEventElapsedTime") / reps)
        for e in events:
            cu.cuEventDestroy(e)
    return times


def check_bench_flags(args):
    """bench's flags that argparse cannot check alone, before a GPU starts"""
    preset_config(args.model_size)
    if not set(args.decode_precision.split(",")) <= {"bf16", "fp32"}:
        raise NanoEulerError(f"--decode-precision {args.decode_precision}: give bf16, fp32 or bf16,fp32")
    if args.decode_only and args.no_decode:
        raise NanoEulerError("--decode-only and --no-decode together leave nothing to time; give one of them")


def cmd_bench(args):
    """ms per training step, tokens/s and MFU of the big model, median of timed steps after warm-up;
    then decoding speed (bench_decoding)"""
    check_bench_flags(args)
    rank, world, local, place = rank_and_world(args)
    if args.gpus and not world:
        return launch_ranks(args.argv, args.gpus, place=place, args=args)
    if place:                                          # a rank of torchrun, srun or mpirun
        rank, world, local = join_world(args, place)
        local = gpu_of(local, place)
    if args.decode_only:
        return bench_decoding(args)
    if args.model:
        ne.load_model(args.model)                      # a bad file is refused before the GPU starts
    init_gpu(args.precision, local)
    cfg = PRESETS[args.model_size]
    engine = (DataParallelEngine(cfg, ne.init_params(cfg), None, None, args, rank, world) if world else
              GPUEngine(cfg, ne.init_params(cfg), None, None, args))
    rng = np.random.default_rng(0)                     # the same batches on every rank

    def next_batch(rng):
        return ne.split_rows(rng.integers(0, cfg.V, (args.batch, cfg.T + cfg.K)), cfg.T, cfg.K)

    if rank:
        return follow(engine, next_batch, rng)
    print(f"{gpu.name} x {max(world, 1)}, {args.model_size} model ({num_params(cfg):,} parameters), "
          f"batch {args.batch} x {cfg.T}, {args.precision} matmuls, "
          f"{'bf16' if engine.model.bf16 else 'fp32'} activations, " +
          (f"data parallel over NCCL{', ZeRO-1' if args.zero else ''}" if world else
           "each step one CUDA graph" if engine.use_graph else "each step kernel by kernel (no graph)"))
    times = []
    for step in range(args.steps + 3):
        idx, targets = next_batch(rng)
        gpu.sync()
        t0 = time.perf_counter()
        engine.step(idx, targets, 1e-4, step + 1)
        gpu.sync()
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times[3:]))
    mfu = engine.mfu(dt)
    print(f"  {dt * 1e3:8.1f} ms/step  {args.batch * cfg.T / dt:10,.0f} tok/s" +
          (f"  mfu {100 * mfu:.1f}%" if mfu is not None else ""))
    if args.profile:
        profile_step(engine, next_batch(rng), args.steps + 4)
    engine.close()
    if not world and not args.no_decode:
        del engine
        bench_decoding(args)


# bench --profile's families, by the kernel name's start (the first that matches)
FAMILIES = ("matmul", "attention", "residual_rmsnorm", "rmsnorm", "swiglu", "rope", "cross_entropy", "embedding",
            "grad_norm", "clip_grad_norm", "adamw", "to_bf16", "residual")


def profile_step(engine, batch, step):
    """GPU time of one step replayed from its graph (when it has one), then one step
    launched kernel by kernel with a pair of CUDA events around each kernel and matmul
    (the events cost a little time of their own), by family and by kernel"""
    cfg, model = engine.cfg, engine.model
    if engine.graph is not None:
        replays = 10
        events = [check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        check(cu.cuEventRecord(events[0], gpu.stream), "cuEventRecord")
        for _ in range(replays):
            check(cu.cuGraphLaunch(engine.graph, gpu.stream), "cuGraphLaunch")
        check(cu.cuEventRecord(events[1], gpu.stream), "cuEventRecord")
        gpu.sync()
        ms = check(cu.cuEventElapsedTime(*events), "cuEventElapsedTime") / replays
        print(f"  one step replayed from its graph: {ms:.2f} ms of GPU time (mean of {replays})")
    gpu.profile = []
    engine.step(*batch, 1e-4, step)
    totals = gpu.profile_report()
    families = {}
    for name, (calls, ms) in totals.items():
        family = next((f for f in FAMILIES if name.startswith(f)), name)
        families[family] = (families.get(family, (0, 0))[0] + calls, families.get(family, (0, 0))[1] + ms)
    print(f"  one step launched kernel by kernel, GPU time (CUDA events; {sum(ms for _, ms in totals.values()):.1f} "
          f"ms in all), by family:")
    for name, (calls, ms) in sorted(families.items(), key=lambda kv: -kv[1][1]):
        print(f"    {name:<36} {calls:4d} calls {ms:8.2f} ms")
    print("  and by kernel:")
    for name, (calls, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"    {name:<36} {calls:4d} calls {ms:8.2f} ms")
    forward, both = time_attention(model)
    tma = [what for what, backward in (("forward", False), ("dk/dv", True))
           if attention_tma(cfg.D, model.qkv[0], backward)]
    path = attention_path(cfg.D, model.qkv[0]) + "".join(f" TMA {what}" for what in tma)
    print(f"  attention of one layer (B={model.B}, T={cfg.T}, {cfg.Hq} query and {cfg.Hkv} kv heads, D={cfg.D}, "
          f"{path}): forward {forward:.1f} us, forward+backward {both:.1f} us")


BENCH_PROMPT = "ROMEO:\nWhat say you"


def profile_decoding(dec, prompt, replays=100):
    """GPU time of a plain step (one row) replayed from its graph, after the prompt and with
    the cache nearly full (attention's share grows with the keys); by kernel when launched
    one by one"""
    T = dec.cfg.T
    replays = min(replays, T - 1 - len(prompt))         # a pass writes the cache at *pos: at most T - 1
    if replays < 1:
        print(f"  (no profile: the {len(prompt)}-token prompt leaves no room in the context of {T})")
        return
    dec.wait(dec.prefill(prompt, 1))
    us = replay_time(dec, replays)
    if T > len(prompt) + replays + 2:                   # a prompt that leaves room for the replays, no more
        late = (prompt * T)[:T - replays - 2]
        dec.wait(dec.prefill(late, 1))
        print(f"  one step at positions {len(late) + 1}..{len(late) + replays}: {replay_time(dec, replays):.1f} us of GPU "
              f"time replayed from its graph")
    dec.wait(dec.prefill(prompt, 1))
    gpu.profile = []
    dec.step(1, 1)
    totals = gpu.profile_report()
    calls = sum(c for c, _ in totals.values())
    print(f"  one step at position {len(prompt) + 1}: {us:.1f} us of GPU time replayed from its graph ({calls} "
          f"kernels); launched one by one, by kernel (CUDA events; {sum(ms for _, ms in totals.values()) * 1e3:.0f} "
          f"us in all):")
    print_by_kernel(totals)
    # what a speculative pass costs beside a plain one: more rows, more heads (21 passes of R
    # rows, each moving *pos by 1 to R, must stay inside the window)
    most = min(dec.cfg.K, DECODE_MAX_ROWS)
    rows = range(1, most + 1) if T >= len(prompt) + 21 * most else []
    for R, n_heads in sorted({(R, n) for R in rows for n in (1, R)}):
        dec.wait(dec.prefill(prompt, 1))
        print(f"  a pass over {R} row{'s' * (R > 1)} and {n_heads} head{'s' * (n_heads > 1)}: "
              f"{replay_time(dec, 20, R, n_heads):.1f} us of GPU time replayed from its graph")
    R = min(1 + DEFAULT_DRAFTS, most)                   # a model with one head has no drafts
    if R < 2 or T < len(prompt) + R:
        return
    dec.wait(dec.prefill(prompt, 1))
    gpu.profile = []
    dec.step(R, R)
    print(f"  a pass over {R} rows and {R} heads, launched one by one, by kernel:")
    print_by_kernel(gpu.profile_report())


def print_by_kernel(totals):
    """profile_report's {name: (calls, ms)}, the costliest first, in microseconds"""
    for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"    {name:<36} {n:4d} calls {ms * 1e3:8.1f} us")


def time_generate(dec, cfg, prompt, n, speculative=False, drafts=None):
    """-> (tokens, seconds, stats) of greedy generate, the median of 3 runs after a warm-up"""
    times = []
    for _ in range(4):
        stats = {}
        gpu.sync()
        t0 = time.perf_counter()
        out = list(generate(dec, cfg, prompt, n, temperature=0, speculative=speculative, stats=stats, drafts=drafts))
        times.append(time.perf_counter() - t0)
    return out, float(np.median(times[1:])), stats


def print_speeds(dec, cfg, prompt, n, drafts_list, what=""):
    """plain and speculative tokens/s of dec -> plain's (tokens, seconds)"""
    plain, dt, _ = time_generate(dec, cfg, prompt, n)
    print(f"  {'plain KV cache' + what:<32} {len(plain) / dt:8,.0f} tok/s  ({dt * 1e3 / len(plain):.3f} ms/token)")
    for drafts in drafts_list:
        spec, dt_s, stats = time_generate(dec, cfg, prompt, n, True, drafts)
        same = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), len(plain))
        default = " (default)" if drafts == DEFAULT_DRAFTS else ""
        name = f"speculative, {drafts} draft" + "s" * (drafts > 1) + default + what
        print(f"  {name:<32} {len(spec) / dt_s:8,.0f} tok/s  {stats['tokens'] / stats['steps']:.2f} tokens per pass, "
              f"{dt / dt_s:.2f}x plain, same as plain for {same} of {len(plain)} tokens; {stats['drafted']} of "
              f"{stats['steps']} passes fed drafts, {stats['fed'] / max(stats['drafted'], 1):.2f} each (a pass over "
              f"{1 + drafts}: {dec.pass_cost(1 + drafts):.2f}x one)")
    return plain, dt


def bench_variants(cfg, flat, precision, prompt, n, plain):
    """the other attention kernel, and launches the other way than DECODE_PDL's (sm_90 on),
    plain and with the default drafts"""
    other = "single" if attention_kernel(cfg.D) == "split" else "split"
    variants = [(f", {other} attention", dict(attention=other))]
    if int(gpu.arch) >= 90:                    # launches the other way than DECODE_PDL's
        flip = "without PDL" if DECODE_PDL else "PDL launches"
        variants += [(f", {flip}", dict(pdl=not DECODE_PDL))]
    for what, kwargs in variants:
        try:
            dec = GPUDecoder(cfg, flat, precision, **kwargs)
            got, _ = print_speeds(dec, cfg, prompt, n, [DEFAULT_DRAFTS], what)
        except NanoEulerError as e:
            print(f"  {what[2:]}: {e}")
            continue
        same = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), len(plain))
        print(f"    ({what[2:]}: the same tokens as the default kernels for {same} of {len(plain)})")


def bench_decoding(args):
    """batch-1 decoding: plain greedy and speculative tokens/s (the median of 3 runs of
    --max-new-tokens after a warm-up, BENCH_PROMPT's first 16 tokens at most, the window
    sliding past T as it must), prefill of a 500-token prompt, on --model or on random
    weights of the preset; --decode-variants: also the other attention kernel and PDL"""
    if args.model:
        cfg, flat, tok = ne.load_model(args.model)
        prompt, what = tok.encode(BENCH_PROMPT)[:16], args.model
    else:
        cfg = PRESETS[args.model_size]
        flat, what = ne.init_params(cfg), f"random weights of {args.model_size} (give --model for a trained one)"
        prompt = list(range(16))
    n = args.max_new_tokens
    for precision in args.decode_precision.split(","):
        dec = GPUDecoder(cfg, flat, precision)
        print(f"\ndecoding on {gpu.name}, batch 1, greedy, {precision} weights, {len(prompt)}-token prompt, "
              f"{n} new tokens (median of 3 after a warm-up), {what}; {dec.attention} attention"
              f"{', PDL launches' if dec.pdl else ''}")
        plain, _ = print_speeds(dec, cfg, prompt, n, range(1, min(cfg.K, DECODE_MAX_ROWS)))
        if args.decode_variants:
            bench_variants(cfg, flat, precision, prompt, n, plain)
        if args.profile:
            profile_decoding(dec, prompt)
        long = (prompt * (500 // len(prompt) + 1))[:min(500, cfg.T)]
        times = []
        for _ in range(11):
            gpu.sync()
            t0 = time.perf_counter()
            dec.wait(dec.prefill(long, 1))
            times.append(time.perf_counter() - t0)
        print(f"  {f'prefill of {len(long)} tokens':<32} {np.median(times[1:]) * 1e3:8.2f} ms  "
              "(median of 10 after a warm-up)")


# -----------------------------------------------------------------------------
# several GPUs: data parallel over NCCL
#
# One process per GPU, each this program with NANOEULER_RANK set (launch_ranks
# starts them). Every rank draws the same global batch (same seed, same random
# state) and runs only its own rows, dividing by the whole batch's target
# counts: so the ranks' gradients sum to the one-GPU gradient, and NCCL's
# all-reduce sums them, a layer at a time on a second stream while the backward
# goes on with the layers below. Rank 0 runs nanoeuler.train_loop (log,
# evaluation, checkpoints); the others follow() what it broadcasts.
# --zero (ZeRO-1): each rank keeps AdamW's moments for 1/N of the parameters and
# updates only those; an all-gather then gives every rank all the parameters.

NCCL_FLOAT32, NCCL_FLOAT64, NCCL_SUM = 7, 8, 0
STEP, GATHER, STOP = 1, 2, 3                   # what rank 0 tells the others
START_BYTES = 2048                             # share_start's room for rank 0's start, as JSON
nccl = None                                    # libnccl through ctypes, once load_nccl ran


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def load_nccl():
    global nccl
    if nccl is None:
        # NVLink multicast (NVLS) off, before NCCL reads its settings: on a host whose GPUs
        # others share it can put them out of service; the ranks inherit this too
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        import cuda.pathfinder as pf
        try:
            lib = ctypes.CDLL(pf.load_nvidia_dynamic_lib("nccl").abs_path)
        except Exception:
            raise NanoEulerError("--gpus needs NCCL: pip install nvidia-nccl-cu13 (see requirements-cuda.txt)") \
                from None
        vp, ci, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [ci], ctypes.c_char_p
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), ci, NcclUniqueId, ci]
        lib.ncclAllReduce.argtypes = [vp, vp, sz, ci, ci, vp, vp]
        lib.ncclBroadcast.argtypes = [vp, vp, sz, ci, ci, vp, vp]
        lib.ncclAllGather.argtypes = [vp, vp, sz, ci, vp, vp]
        lib.ncclCommDestroy.argtypes = [vp]
        nccl = lib
    return nccl


def nccl_check(status, what):
    if status:
        raise NanoEulerError(f"NCCL error in {what}: {nccl.ncclGetErrorString(status).decode()}")


def nccl_unique_id():
    """the 128 bytes every rank needs to find the others, as hex (made by the launcher)"""
    uid = NcclUniqueId()
    nccl_check(load_nccl().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid).hex()


class Comm:
    """one rank's NCCL communicator: sums, broadcasts and gathers of DeviceArrays, in place"""

    def __init__(self, unique_id, world, rank):
        load_nccl()
        comm, uid = ctypes.c_void_p(), NcclUniqueId.from_buffer_copy(bytes.fromhex(unique_id))
        nccl_check(nccl.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), f"ncclCommInitRank ({rank} of {world})")
        self.comm, self.rank = comm.value, rank

    @staticmethod
    def dtype(a):
        return NCCL_FLOAT64 if a.dtype == np.float64 else NCCL_FLOAT32

    def all_reduce(self, a, stream):
        nccl_check(nccl.ncclAllReduce(a.ptr, a.ptr, a.size, self.dtype(a), NCCL_SUM, self.comm, int(stream)),
                   f"ncclAllReduce of {a.size:,} numbers")

    def broadcast(self, a, stream):
        nccl_check(nccl.ncclBroadcast(a.ptr, a.ptr, a.size, self.dtype(a), 0, self.comm, int(stream)), "ncclBroadcast")

    def all_gather(self, part, whole, stream):
        """whole = every rank's part, one after another (part may be rank's own slice of whole)"""
        nccl_check(nccl.ncclAllGather(part.ptr, whole.ptr, part.size, self.dtype(part), self.comm, int(stream)),
                   f"ncclAllGather of {whole.size:,} numbers")

    def close(self):
        nccl.ncclCommDestroy(self.comm)


def shard_rows(B, world, rank):
    """the rows of a batch of B that rank runs: contiguous, as even as can be"""
    if B < world:
        raise NanoEulerError(f"a batch of {B} rows cannot be shared by {world} GPUs; raise --batch")
    return slice(rank * B // world, (rank + 1) * B // world)


class DataParallelEngine(GPUEngine):
    """GPUEngine as rank `rank` of `world`; see the section's comment"""

    def __init__(self, cfg, flat, m, v, args, rank, world):
        self.rank, self.world = rank, world
        self.comm = Comm(os.environ["NANOEULER_NCCL_ID"], world, rank)
        if rank == 0 and os.environ.get("NANOEULER_ID_FILE"):      # every rank has the id: --rendezvous's
            with contextlib.suppress(OSError):                      # file is done with
                os.remove(os.environ.pop("NANOEULER_ID_FILE"))
        flat, m, v = (self.from_rank0(a) for a in (flat, m, v))
        super().__init__(cfg, flat, m, v, args, rank, world)
        self.comm_stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        no_timing = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self.ready, self.reduced = (check(cu.cuEventCreate(no_timing), "cuEventCreate") for _ in range(2))
        self.order = DeviceArray((3,), np.float64)                # command, lr, step
        self.ce = DeviceArray((cfg.K,), np.float64)
        self.model.on_grads = self.all_reduce_grads

    def from_rank0(self, a):
        """rank 0's copy of a host array (the weights, the moments), on every rank: so only rank 0
        reads --resume's checkpoint, and every rank starts where it does"""
        if a is None:
            return None
        d = to_gpu(a, a.dtype)
        self.comm.broadcast(d, gpu.stream)
        return d.download()

    def share_start(self, start):
        """rank 0's start (a dict: its random generator's state, the data order, and what its data
        is, data_digest), on every rank"""
        text = json.dumps(start).encode() if self.rank == 0 else b""
        assert len(text) < START_BYTES
        buf = np.zeros(START_BYTES, np.float64)
        buf[:len(text)] = np.frombuffer(text, np.uint8)
        got = self.from_rank0(buf).astype(np.uint8).tobytes().rstrip(b"\0")
        return json.loads(got)

    def command(self, *order):
        """rank 0: tell the others what comes next; the others: wait for it -> (command, lr, step)"""
        if self.rank == 0:
            self.order.upload(np.array(order + (0,) * (3 - len(order)), np.float64))
        self.comm.broadcast(self.order, gpu.stream)
        return self.order.download()

    def all_reduce_grads(self, lo, hi):
        """the backward has finished grads[lo:hi]: sum them over the ranks, on the second stream"""
        check(cu.cuEventRecord(self.ready, gpu.stream), "cuEventRecord")
        check(cu.cuStreamWaitEvent(self.comm_stream, self.ready, 0), "cuStreamWaitEvent")
        self.comm.all_reduce(self.model.grads.view(lo, (hi - lo,)), self.comm_stream)

    def step(self, idx, targets, lr, step):
        if self.rank == 0:
            self.command(STEP, lr, step)
        counts = target_counts(targets)            # of the whole batch
        rows = shard_rows(len(idx), self.world, self.rank)
        self.model.grads.zero()
        _, ce = self.model.forward(idx[rows], targets[rows], counts)
        ce = self.ce.upload(ce)
        self.comm.all_reduce(ce, gpu.stream)
        ce = ce.download()                                  # the whole batch's, the same on every rank
        loss = float(np.dot(ne.mtp_weights(self.cfg), ce))
        if not np.isfinite(loss):
            return loss, ce, float("nan")
        self.model.backward()                               # which starts the all-reduces
        check(cu.cuEventRecord(self.reduced, self.comm_stream), "cuEventRecord")
        check(cu.cuStreamWaitEvent(gpu.stream, self.reduced, 0), "cuStreamWaitEvent")
        norm = self.model.update(lr, step, self.args.clip, self.args.weight_decay)
        if self.zero:                                       # each rank's updated part, to every rank
            m = self.model
            self.comm.all_gather(m.flat.view(m.lo, (m.hi - m.lo,)), m.flat, gpu.stream)
            m.refresh_bf16()                                # AdamW wrote this rank's part of the bf16 copy
        return loss, ce, norm

    def gather_moments(self):
        """ZeRO: every rank's part of m and v, whole, on the host (the gradients' buffer,
        free between steps, holds them on the way)"""
        m, n = self.model, self.model.n_params
        moments = []
        for part in (m.m, m.v):
            self.comm.all_gather(part, m.grads, gpu.stream)
            moments.append(m.grads.view(0, (n,)).download())
        return moments

    def host_weights(self):
        if not self.zero:
            return super().host_weights()
        self.command(GATHER)
        return (self.host_params(), *self.gather_moments())

    def close(self):
        if self.rank == 0:
            watch.end()                                     # the others may end now: see Watch
            self.command(STOP)
        gpu.sync()
        self.comm.close()


def data_digest(tok, val_batches):
    """what a rank's data is, in short: its tokenizer and its validation rows (hosts with no
    shared folder each tokenize their own copy of --data)"""
    h = hashlib.sha256(tok.to_json().encode())
    for idx, targets in val_batches:
        h.update(np.ascontiguousarray(idx).tobytes())
    return h.hexdigest()[:16]


def follow(engine, next_batch, rng):
    """ranks 1..N-1, in place of nanoeuler.train_loop: do what rank 0 says until it says stop"""
    while True:
        command, lr, step = engine.command()
        if command == STEP:
            loss, _, norm = engine.step(*next_batch(rng), lr, int(step))
            if not (np.isfinite(loss) and np.isfinite(norm)):
                return watch.wait()                         # rank 0 saw the same and says why
        elif command == GATHER:
            engine.gather_moments()
        else:
            break
    watch.end()
    engine.close()


def launch_ranks(argv, world, program=os.path.abspath(__file__), lock=None, place=None, args=None, before=None):
    """--gpus N: start this program once per GPU with NANOEULER_RANK = 0..N-1 and wait.
    Rank 0 prints; the others print only their errors. Ctrl-C goes to rank 0,
    which saves a checkpoint and tells the others to stop (SIGTERM and SIGHUP too:
    the ranks run in sessions of their own, so a closed terminal reaches only us). If a
    rank fails, the rest are stopped: they would wait for it for ever. The
    launcher holds --out's lock (run_command's, `lock`); the ranks, its children, share it.
    Should the launcher itself be killed (kill -9, the out-of-memory killer), rank 0 sends
    itself SIGTERM (stop_when_orphaned), so it saves and stops the others, and it holds the
    lock until then: it has the lock's open file too (a flock lasts while one is open).
    With --nnodes (place), one such launcher on each host: host 0's hands NCCL's id to the
    others (exchange_id), its GPUs are ranks 0..N-1, host 1's N..2N-1 and so on; the hosts'
    launchers keep the connection open (Watch), so that a host whose launcher stops stops them all.
    before(): what to do once the hosts have met, before the ranks start (the data, which may take
    minutes that the other hosts should not spend waiting to meet)."""
    n = count_gpus()
    if world > n:
        raise NanoEulerError(f"--gpus {world}, but this machine has {n} GPU(s)")
    links, first, total = {}, 0, world
    if place:
        unique_id, links = exchange_id(place, run_settings(args), args.rendezvous_timeout, nccl_unique_id)
        first, total = place.rank * world, place.world * world
    else:
        unique_id = nccl_unique_id()
    hosts = Watch(links, place.rank if place else 0, poll=True)
    try:
        before and before()
    except BaseException:
        hosts.done(2)
        raise
    env = {**os.environ, "NANOEULER_NCCL_ID": unique_id, "NANOEULER_WORLD": str(total),
           "NCCL_NVLS_ENABLE": "0", "NANOEULER_LAUNCHER": str(os.getpid())}
    procs = []

    def forward(signum, frame):                              # rank 0 saves, then stops the others
        if not procs or first:                               # none started yet, or rank 0 is on another host:
            raise KeyboardInterrupt if signum == signal.SIGINT else ne.Interrupted(signum)   # stop at once
        procs[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    culprit = gone = None                                    # the first rank to fail; a host whose launcher did
    try:
        for r in range(world):                               # inside the try: a rank started is a rank stopped
            held = {"NANOEULER_LOCK_FD": str(lock.fileno())} if lock and r == 0 else {}
            procs.append(subprocess.Popen([sys.executable, program, *argv],
                                          env={**env, "NANOEULER_RANK": str(first + r), "NANOEULER_LOCAL_RANK": str(r),
                                               **held},
                                          start_new_session=True,
                                          stdout=None if first + r == 0 else subprocess.DEVNULL,
                                          pass_fds=[lock.fileno()] if held else []))
        while culprit is None and procs[0].poll() is None and gone is None:
            culprit = next((r for r, p in enumerate(procs) if p.poll()), None)
            gone = hosts.gone()
            time.sleep(0.1)
        culprit = 0 if culprit is None and gone is None and procs[0].returncode else culprit
        deadline = time.time() + (30 if culprit is None and gone is None else 0)   # the others had their STOP
        for p in procs:
            try:
                p.wait(timeout=max(0.01, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        hosts.done(procs[culprit].returncode if culprit is not None else 2 if gone is not None else 0)
    if gone is not None:
        raise NanoEulerError(f"host {gone}'s launcher stopped (its own output says why), so every rank here stopped; "
                             "resume with --resume")
    code = procs[culprit].returncode if culprit is not None else 0
    if code < 0:                                             # a signal: the process said nothing
        name = signal.Signals(-code).name
        why = " (the out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
        raise NanoEulerError(f"GPU {culprit}'s process was killed by {name}{why}, so every rank stopped; resume "
                             "with --resume")
    if culprit == 0:
        sys.exit(code)                                       # rank 0 has said why
    if culprit:
        raise NanoEulerError(f"GPU {culprit}'s process stopped with exit code {code} (its message is above), so "
                             "every rank stopped; resume with --resume")


def stop_when_orphaned(every=0.2):
    """rank 0 of --gpus: once its launcher is gone (kill -9, the out-of-memory killer: no
    handler ran), send ourselves SIGTERM, once, as a Ctrl-C would reach us, so that we save
    and stop the others. A thread that watches our parent pid: Linux's parent-death signal
    came twice on the H200 (perhaps once for each of the launcher's CUDA and NCCL threads we
    were handed to as they ended), and a second SIGTERM means "quit at once, unsaved"."""
    value, fd = os.environ.get("NANOEULER_LAUNCHER", ""), os.environ.get("NANOEULER_LOCK_FD", "")
    launcher = int(value) if value.isdecimal() else 0             # set by launch_ranks, for its ranks only

    def watch():
        while os.getppid() == launcher:
            time.sleep(every)
        if fd.isdecimal():                                       # the lock now names us as its holder
            with contextlib.suppress(OSError):
                os.ftruncate(int(fd), 0)
                os.pwrite(int(fd), f"{os.getpid()}\n".encode(), 0)
        os.kill(os.getpid(), signal.SIGTERM)
    if launcher:
        threading.Thread(target=watch, daemon=True, name="launcher watch").start()


def rank_and_world(args):
    """(rank, world, local rank, place) of this process: (0, 0, 0, None) when it is the only
    one, without NCCL; a rank that launch_ranks started: the numbers it was given; under
    torchrun, srun or mpirun, or our own launcher with --nnodes: place (find_place), the
    rendezvous still to come. Refuses --zero with one GPU, before anything starts."""
    found = {name: os.environ.get(name, "0") for name in ("NANOEULER_RANK", "NANOEULER_WORLD")}
    for name, value in found.items():                         # set by launch_ranks, for its ranks only
        if not value.isdecimal():
            raise NanoEulerError(f"{name}={value!r} in the environment is not a number; it is for the ranks "
                                 "that --gpus starts: unset it")
    rank, world = int(found["NANOEULER_RANK"]), int(found["NANOEULER_WORLD"])
    if world:
        return rank, world, int(os.environ.get("NANOEULER_LOCAL_RANK", rank)), None
    place = find_place(args)
    if args.zero and not args.gpus and not place:
        raise NanoEulerError("--zero shares the optimizer's moments among several GPUs; give --gpus N with it")
    return 0, 0, 0, place


# -----------------------------------------------------------------------------
# several hosts: torchrun, srun, mpirun and --nnodes; the NCCL id from rank 0 to the others
#
# A cluster's launcher starts one process per GPU on every host and tells each
# its place in environment variables (LAUNCHERS); the program's own launcher
# (--gpus N) does the same on one host, and with --nnodes on several, one
# launcher per host. Either way every rank needs the 128 bytes of NCCL's unique
# id, which rank 0 makes: it listens on a TCP port and hands the id to each
# rank that connects (send_id), once all have come and agree on the world's size
# and the run's settings; the others connect to it, retrying until a timeout
# (receive_id). Or rank 0 writes the id to a file in a folder every host
# shares and the others wait for it (--rendezvous file:PATH). Like llm.c, which
# has no PyTorch either. The rendezvous command does this alone, without a GPU.

DEFAULT_PORT = 29500
RENDEZVOUS_TIMEOUT = 300
HELLO = "nanoeuler rendezvous 1"            # every message's first field: a stranger on the port is told apart
MAX_MESSAGE = 1 << 20
MAX_HOSTS = 1 << 20                # a longer Slurm node list is not read (gpu[0-999999999999] filled memory)
# launcher: (rank, world size, local rank) variables, the innermost launcher first (torchrun
# may run under srun, and an mpirun inside a Slurm job sees the job's variables too)
LAUNCHERS = {"torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
             "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
             "MPI (PMI)": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
             "srun": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")}
# not compared between ranks: where each host keeps its files, and how it finds rank 0
LOCAL_SETTINGS = {"argv", "run", "started", "data", "out", "node_rank", "master_addr", "master_port",
                  "rendezvous", "rendezvous_timeout"}


class Place(NamedTuple):
    """this process's place in the world, and where rank 0 listens"""
    launcher: str               # torchrun, srun, mpirun, MPI (PMI) or --nnodes
    rank: int
    world: int
    local_rank: int
    addr: str | None            # rank 0's host (None: not known, which only rank 0 and a file can do without)
    port: int
    source: str                 # what gave addr and port, for messages
    file: str | None            # --rendezvous file:PATH


def expand_nodelist(nodelist):
    """Slurm's compressed host list -> the hosts: "gpu[01-03,7],login1" -> gpu01 gpu02 gpu03 gpu7
    login1 (numbers keep the first number's width; several brackets in one name multiply)"""
    hosts, depth, start = [], 0, 0
    for i, c in enumerate(nodelist + ","):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            hosts += expand_host(nodelist[start:i])
            start = i + 1
            if len(hosts) > MAX_HOSTS:
                hosts = [""]
        if depth < 0 or depth > 1:
            break
    if depth or not hosts or not all(hosts):
        raise NanoEulerError(f"Slurm's node list {nodelist!r} cannot be read; set MASTER_ADDR to the first "
                             "host's name (e.g. MASTER_ADDR=$(scontrol show hostnames | head -1))")
    return hosts


def expand_host(item):
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    head, ranges, tail = m.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not (lo.isdecimal() and (hi.isdecimal() or not hi)) or (hi and not 0 <= int(hi) - int(lo) < MAX_HOSTS):
            return [""]                                   # expand_nodelist says so
        out += [f"{head}{n:0{len(lo)}d}" for n in range(int(lo), int(hi or lo) + 1)]
    tails = expand_host(tail)
    return [h + t for h in out for t in tails] if len(out) * len(tails) <= MAX_HOSTS else [""]


def env_int(env, name, launcher):
    value = env.get(name)
    if value is None:
        raise NanoEulerError(f"{name} is not set, though {launcher}'s other variables are; start the program "
                             f"with {launcher} itself, or set {name}")
    if not value.strip().isdecimal():
        raise NanoEulerError(f"{name}={value!r} in the environment is not a whole number; {launcher} sets it: "
                             "start the program with it, or unset it")
    return int(value)


def port_number(value, what):
    if not (value.isdecimal() and 0 < int(value) < 65536):
        raise NanoEulerError(f"{what}={value!r} is not a port number (1 to 65535)")
    return int(value)


def find_launcher(env=os.environ):
    """-> (launcher, rank, world, local rank, rank 0's address or None, its port or None,
    what gave each) from the first launcher whose rank and world variables are set; None
    without one. Inconsistent variables are refused in one sentence."""
    for name, (rank_var, world_var, local_var) in LAUNCHERS.items():
        if rank_var not in env or world_var not in env:
            continue
        rank, world = env_int(env, rank_var, name), env_int(env, world_var, name)
        local = env_int(env, local_var, name)
        if not rank < world:
            raise NanoEulerError(f"{rank_var}={rank} is not below {world_var}={world}: the ranks are 0 to "
                                 f"{world_var} - 1; {name}'s variables disagree (set by hand?)")
        addr, port = env.get("MASTER_ADDR") or None, None
        addr_source, port_source = "MASTER_ADDR" if addr else None, "MASTER_PORT"
        if "MASTER_PORT" in env:
            port = port_number(env["MASTER_PORT"], "MASTER_PORT")
            if name == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                port = port_number(str(port + 1), "MASTER_PORT + 1")
                port_source = "MASTER_PORT + 1, as torchrun's agent listens on MASTER_PORT"
        if name == "srun" and addr is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if nodelist:
                addr, addr_source = expand_nodelist(nodelist)[0], "the first host of Slurm's node list"
        return name, rank, world, local, addr, port, addr_source, port_source
    return None


def find_place(args, env=os.environ):
    """-> this process's Place among several processes, from a launcher's variables or
    --nnodes, the flags before the environment; None for a process on its own (or our
    own --gpus launcher on one host). Refuses what cannot work, in one sentence."""
    file = args.rendezvous[len("file:"):] if args.rendezvous.startswith("file:") else None
    if args.rendezvous != "tcp" and not file:
        raise NanoEulerError(f"--rendezvous {args.rendezvous}: give tcp (rank 0 listens) or file:PATH (a file in "
                             "a folder every host shares)")
    found, gpus = find_launcher(env), getattr(args, "gpus", None)      # None: rendezvous, which starts nothing
    if found and args.nnodes > 1:
        raise NanoEulerError(f"--nnodes is for hosts with no launcher, but {found[0]} started this process; "
                             f"leave out --nnodes and --node-rank ({found[0]} sets the ranks)")
    if found and found[2] > 1 and gpus:
        raise NanoEulerError(f"{found[0]} started {found[2]} processes and --gpus {gpus} would start {gpus} more "
                             f"each; start one process per GPU with {found[0]} and leave out --gpus")
    if found and found[2] == 1 and gpus:
        found = None                                   # one task of a job (srun -N1) runs our own launcher
    if found:
        name, rank, world, local, addr, port, addr_source, port_source = found
    elif args.nnodes > 1:
        if gpus == 0:
            raise NanoEulerError("--nnodes is for the program's own launcher on each host: give --gpus N, the "
                                 "GPUs of each host, with it")
        if args.node_rank >= args.nnodes:
            raise NanoEulerError(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}: the hosts "
                                 f"are 0 to {args.nnodes - 1}")
        port = port_number(env["MASTER_PORT"], "MASTER_PORT") if "MASTER_PORT" in env else None
        name, rank, world, local, addr = "--nnodes", args.node_rank, args.nnodes, 0, env.get("MASTER_ADDR") or None
        addr_source, port_source = "MASTER_ADDR" if addr else None, "MASTER_PORT"
    else:
        if args.node_rank:
            raise NanoEulerError(f"--node-rank {args.node_rank} without --nnodes: give --nnodes, the number of "
                                 "hosts, with it")
        return None
    if args.master_addr:
        addr, addr_source = args.master_addr, "--master-addr"
    if args.master_port:
        port, port_source = args.master_port, "--master-port"
    if port is None:
        port, port_source = DEFAULT_PORT, "the default port"
    source = ", ".join(s for s in (addr_source, port_source) if s)
    if addr is None and rank > 0 and world > 1 and not file:
        raise NanoEulerError(f"{name} tells no one where rank 0 is: set MASTER_ADDR to its host (mpirun -x "
                             "MASTER_ADDR=host0), give --master-addr, or give --rendezvous file:PATH in a folder "
                             "every host shares")
    return Place(name, rank, world, local, addr, port, source, file)


def run_settings(args):
    """what every rank must run with alike: the command and its flags, but for each host's paths
    and how it finds rank 0 (LOCAL_SETTINGS), as text"""
    return {k: str(v) for k, v in sorted(vars(args).items()) if k not in LOCAL_SETTINGS}


def settings_differ(mine, theirs):
    """the first few settings that differ, as "--batch 32 there, 16 here" (name) -> text"""
    names = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return "; ".join(f"--{k.replace('_', '-')} {theirs.get(k, '(none)')} there, {mine.get(k, '(none)')} here"
                     for k in names[:3])


def send_message(conn, **fields):
    conn.sendall(json.dumps({"hello": HELLO, **fields}).encode() + b"\n")


def read_message(conn, timeout):
    """one message from conn within timeout s -> its dict; {}: the connection closed before a
    whole message; None: what came is not one of ours; raises socket.timeout"""
    conn.settimeout(max(timeout, 0.001))
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_MESSAGE:
        part = conn.recv(65536)
        if not part:
            return {} if not data else None
        data += part
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message if isinstance(message, dict) and message.get("hello") == HELLO else None


def listen(port):
    """a socket listening on port on every interface of this host (IPv6 and IPv4 where it can)"""
    try:
        if socket.has_dualstack_ipv6():
            with contextlib.suppress(OSError):
                return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        return socket.create_server(("", port), backlog=128)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise NanoEulerError(f"rank 0 cannot listen on port {port}: another program on this host uses it "
                                 "(another job?); give every rank another with --master-port or MASTER_PORT") from None
        raise NanoEulerError(f"rank 0 cannot listen on port {port} ({e.strerror}); give another with --master-port "
                             "or MASTER_PORT") from None


def ranks_text(ranks, count=None):
    """the first 8 of ranks, and how many more of count (default: len(ranks)) there are"""
    count = len(ranks) if count is None else count
    return ", ".join(map(str, ranks[:8])) + (f" and {count - 8} more" if count > 8 else "")


def send_id(unique_id, place, settings, timeout, clock=time.monotonic, server=None):
    """rank 0: hand unique_id (hex) to the world's other ranks, over TCP (each connects and
    says who it is) or through --rendezvous's file -> {rank: open connection} (empty with a
    file), which stay open while the run lasts (watch_peers). A rank that disagrees on the
    world or the settings stops every rank that has come, with the same sentence."""
    if place.file:
        write_id_file(place.file, unique_id, place.world, settings)
        return {}
    server = server or listen(place.port)
    peers, deadline = {}, clock() + timeout
    try:
        with server:
            while len(peers) < place.world - 1:
                left = deadline - clock()
                if left <= 0:
                    # the first missing ranks only: a WORLD_SIZE of 10**20 is a number, not a list to build
                    missing = [r for r in range(1, min(place.world, len(peers) + 10)) if r not in peers]
                    missing = ranks_text(missing, place.world - 1 - len(peers))
                    raise NanoEulerError(f"rank(s) {missing} of {place.world} never came to rank 0 "
                                         f"(port {place.port}: {place.source}) within {timeout:g} s; are they "
                                         "running, and can they reach this host on that port?")
                server.settimeout(left)
                try:
                    conn, peer = server.accept()
                except (socket.timeout, TimeoutError):
                    continue
                try:
                    hello = read_message(conn, min(left, 30))
                except OSError:
                    hello = None
                if not hello:                          # not one of ours (a port scan?): not our business
                    conn.close()
                    continue
                problem = hello_problem(hello, place.world, settings, peers, peer[0])
                if problem:
                    for c in [conn, *peers.values()]:
                        with contextlib.suppress(OSError):
                            send_message(c, error=problem)
                    conn.close()
                    raise NanoEulerError(problem)
                peers[hello["rank"]] = conn
            for conn in peers.values():
                send_message(conn, id=unique_id)
        return peers
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise


def hello_problem(hello, world, settings, peers, host):
    """what is wrong with a rank's hello to rank 0, as the sentence every rank will say; None"""
    rank, theirs = hello.get("rank"), hello.get("world")
    who = f"rank {rank} (on {hello.get('host', host)})"
    if theirs != world:
        return f"{who} says the world has {theirs} ranks, rank 0 says {world}: start every rank with the same " \
               "launcher settings"
    if not isinstance(rank, int) or not 0 < rank < world:
        return f"a process on {hello.get('host', host)} says it is rank {rank}, but rank 0 is here; start every " \
               "rank with the same launcher"
    if rank in peers:
        return f"two processes say they are rank {rank}; give each host its own --node-rank"
    if hello.get("settings") != settings:
        return f"{who} runs with other settings than rank 0 ({settings_differ(settings, hello.get('settings', {}))}); " \
               "start every rank with the same command line"
    return None


def receive_id(place, settings, timeout, clock=time.monotonic):
    """ranks 1..: rank 0's unique id (hex), asked for over TCP until the timeout, or read from
    --rendezvous's file -> (id, the connection to rank 0, None with a file)"""
    if place.file:
        return read_id_file(place.file, place.world, settings, timeout, clock), None
    where, deadline = f"{place.addr}:{place.port}", clock() + timeout
    never = f"rank 0 never answered at {where} ({place.source}) within {timeout:g} s; is it running there, and " \
            "can this host reach that port?"
    while True:
        left = deadline - clock()
        if left <= 0:
            raise NanoEulerError(never)
        try:
            conn = socket.create_connection((place.addr, place.port), timeout=min(left, 10))
        except socket.gaierror:
            raise NanoEulerError(f"rank 0's host {place.addr} ({place.source}) is not a name or address this host "
                                 "knows; give rank 0's host name or IP address") from None
        except OSError:                                # not listening yet (refused), or not reachable yet
            time.sleep(min(0.2, max(left, 0)))
            continue
        try:
            send_message(conn, rank=place.rank, world=place.world, settings=settings, host=socket.gethostname())
            reply = read_message(conn, deadline - clock())
        except (socket.timeout, TimeoutError):
            conn.close()
            raise NanoEulerError(f"rank 0 at {where} did not hand out the id within {timeout:g} s: other ranks never "
                                 "came (rank 0 says which)") from None
        except OSError:
            conn.close()
            time.sleep(min(0.2, max(left, 0)))
            continue
        if not reply:
            conn.close()
            if reply == {}:
                raise NanoEulerError(f"rank 0 at {where} closed the connection before it handed out the id (did it "
                                     "stop? its own output says why)")
            raise NanoEulerError(f"the program at {where} is not NanoEuler's rank 0 (another program on that "
                                 "port?); give every rank another with --master-port or MASTER_PORT")
        if "error" in reply:
            conn.close()
            raise NanoEulerError(str(reply["error"]))
        return str(reply["id"]), conn


def write_id_file(path, unique_id, world, settings):
    """--rendezvous file:PATH, rank 0: the id, whole or not at all (written aside, then renamed)"""
    if os.path.lexists(path):
        raise NanoEulerError(f"--rendezvous file:{path} is there already, left by an earlier run (rank 0 removes "
                             "it once every rank has the id); delete it, or give each run a new path")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"hello": HELLO, "id": unique_id, "world": world, "settings": settings}, f)
        os.replace(tmp, path)
    except OSError as e:
        raise NanoEulerError(f"--rendezvous file:{path} cannot be written ({e.strerror}); give a path in a folder "
                             "every host shares and can write") from None
    os.environ["NANOEULER_ID_FILE"] = path             # rank 0 removes it once NCCL has every rank


def read_id_file(path, world, settings, timeout, clock=time.monotonic):
    deadline = clock() + timeout
    while True:
        try:
            with open(path) as f:
                found = json.load(f)
            break
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            raise NanoEulerError(f"--rendezvous file:{path} cannot be read ({getattr(e, 'strerror', None) or e}); "
                                 "delete it and start every rank again") from None
        if clock() >= deadline:
            raise NanoEulerError(f"--rendezvous file:{path} did not appear within {timeout:g} s; is rank 0 "
                                 "running, and is that folder shared by every host (the same path on each)?")
        time.sleep(0.1)
    if not isinstance(found, dict) or found.get("hello") != HELLO:
        raise NanoEulerError(f"--rendezvous file:{path} is not a NanoEuler id file; give a new path")
    if found.get("world") != world:
        raise NanoEulerError(f"--rendezvous file:{path} is for a world of {found.get('world')} ranks, this rank's "
                             f"has {world}: start every rank with the same launcher settings (or is the file "
                             "an earlier run's? delete it)")
    if found.get("settings") != settings:
        raise NanoEulerError(f"rank 0 runs with other settings than this rank ("
                             f"{settings_differ(settings, found.get('settings', {}))}); start every rank with the "
                             "same command line")
    return str(found["id"])


def exchange_id(place, settings, timeout, make_id):
    """the world's unique id on every rank, made by rank 0 -> (id, {rank: connection} on rank 0
    or the connection to rank 0 elsewhere)"""
    if place.world == 1:
        return make_id(), {}
    if place.rank == 0:
        if not place.file:
            server = listen(place.port)                # a port in use: said before NCCL is asked
        where = f"the file {place.file}" if place.file else f"port {place.port} ({place.source})"
        print(f"rendezvous: rank 0 of {place.world} ({place.launcher}) hands NCCL's id to the others through {where}",
              flush=True)
        unique_id = make_id()
        return unique_id, send_id(unique_id, place, settings, timeout, server=None if place.file else server)
    return receive_id(place, settings, timeout)


class Watch:
    """the rendezvous's connections, kept open while the run lasts ({rank: socket}: rank 0's to
    every other, or another's to rank 0), so that when a process ends, however it ends, the
    other end hears of it at once, whatever the launcher does, rather than wait in NCCL for
    ever. A rank under torchrun, srun or mpirun: a thread waits on them, and a connection that
    closes while the watch is on stops this process with one sentence (rank 0 ends it before
    its last word to the others, which end theirs on hearing it). Our launchers on several
    hosts (poll): launch_ranks asks gone() as it polls its ranks, and each says done(code)
    before it closes, so a host whose launcher ends cleanly is not taken for one that failed."""

    def __init__(self, links, rank, poll=False):
        """links: exchange_id's (a dict on rank 0, rank 0's socket or None elsewhere)"""
        links = links if isinstance(links, dict) else {0: links} if links else {}
        self.links, self.rank, self.on, self.finished = links, rank, True, set()
        self.thread = None
        if self.links and not poll:
            self.thread = threading.Thread(target=self.run, daemon=True, name="rank watch")
            self.thread.start()

    def closed(self, timeout):
        """-> the ranks whose connection has closed within timeout s (None: wait), and which said done(0)"""
        open_links = {r: c for r, c in self.links.items() if r not in self.finished}
        if not open_links:
            return []
        ready, _, _ = select.select(list(open_links.values()), [], [], timeout)
        ended = []
        for r, c in open_links.items():
            if c in ready:
                try:
                    data = c.recv(4096)
                except OSError:
                    data = b""
                if b'"done": 0}' in data:
                    self.finished.add(r)                          # ends cleanly: not an alarm
                elif not data or b'"done"' in data:
                    self.finished.add(r)
                    ended.append(r)
        return ended

    def run(self):
        while len(self.finished) < len(self.links):
            ended = self.closed(None)
            if ended and self.on:
                who = f"rank {ended[0]}'s process" if self.rank == 0 else "rank 0"
                with contextlib.suppress(OSError):
                    print(f"error: {who} stopped (its own output, or its launcher's, says why), so "
                          f"{'every rank stops; resume with --resume' if self.rank == 0 else 'this rank stops too'}",
                          file=sys.stderr, flush=True)
                os._exit(2)

    def gone(self):
        """poll: a host whose launcher ended without done(0), or None"""
        ended = self.closed(0) if self.on else []
        return ended[0] if ended else None

    def end(self):
        """the run ends as it should: the others may end now"""
        self.on = False

    def wait(self):
        """until every connection has closed (rank 0, which stops the run, has ended)"""
        self.on = False
        if self.thread:
            self.thread.join()

    def done(self, code):
        for c in self.links.values():
            with contextlib.suppress(OSError):
                send_message(c, done=code)
            c.close()


watch = Watch({}, 0)                                   # this rank's; join_world makes one under a launcher


def join_world(args, place):
    """a rank of torchrun, srun or mpirun: NCCL's id from rank 0 (exchange_id), the watch on
    the others (Watch); a rank other than 0 prints nothing (stdout to /dev/null; its errors
    still say themselves) and leaves Ctrl-C and SIGTERM, which its launcher sends every
    rank, to rank 0, which saves and tells it to stop -> (rank, world, local rank)"""
    global watch
    unique_id, links = exchange_id(place, run_settings(args), args.rendezvous_timeout, nccl_unique_id)
    os.environ["NANOEULER_NCCL_ID"] = unique_id
    watch = Watch(links, place.rank)
    if place.rank:
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
    return place.rank, place.world, place.local_rank


def gpu_of(local_rank, place):
    """a launcher's rank's GPU: its local rank, or the one GPU it sees where the launcher gave
    each rank its own (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank)"""
    n = count_gpus()
    if local_rank < n or n == 1:
        return local_rank if local_rank < n else 0
    raise NanoEulerError(f"{place.launcher} made this rank local rank {local_rank}, but it sees {n} GPUs; start at "
                         "most one rank per GPU on each host")


def prepare_once(args, cfg):
    """the ranks on one host tokenize the corpus into their shared cache one at a time: the
    first makes it, the others find it made"""
    cache = ne.data_cache(args.out)             # prepare_data's folder (an --out that is it: refused here)
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, "prepare.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        ne.prepare_data(args.data, cfg.V, args.out)


def world_rank(args):
    """this process's rank in the whole world, before any rendezvous: only rank 0 holds --out
    (run_command asks cmd_train.holds_out)"""
    if os.environ.get("NANOEULER_WORLD", "0") not in ("", "0"):
        return int(os.environ.get("NANOEULER_RANK", "0")) if os.environ.get("NANOEULER_RANK", "0").isdecimal() else 0
    place = find_place(args)
    return place.rank if place else 0


cmd_train.holds_out = lambda args: world_rank(args) == 0            # run_command asks: only rank 0 holds --out


def add_nodes_flags(sp):
    """train's, bench's and rendezvous's flags for several hosts"""
    g = sp.add_argument_group("several hosts (torchrun, srun and mpirun set the ranks; docs/multinode.md)")
    g.add_argument("--nnodes", type=ne.positive_int, default=1,
                   help="with --gpus N and no cluster launcher: the hosts, each running this command")
    g.add_argument("--node-rank", type=ne.nonnegative_int, default=0, help="with --nnodes: this host's, 0 to N-1")
    g.add_argument("--master-addr", default=None,
                   help="rank 0's host, where the others ask for NCCL's id (default: MASTER_ADDR, under srun "
                        "the first host of the job)")
    g.add_argument("--master-port", type=ne.number_type(int, 1, 65535, "a port, 1 to 65535"),
                   default=None, help=f"the port rank 0 listens on (default: MASTER_PORT, under torchrun "
                                      f"MASTER_PORT + 1, else {DEFAULT_PORT})")
    g.add_argument("--rendezvous", default="tcp",
                   help="tcp: rank 0 hands out the id over TCP; file:PATH: through a file in a folder every host "
                        "shares (it must not exist yet)")
    g.add_argument("--rendezvous-timeout", type=ne.positive_float, default=RENDEZVOUS_TIMEOUT,
                   help="seconds the ranks wait for each other before they stop")


def cmd_rendezvous(args):
    """every rank finds rank 0 and gets the same id, with no GPU: rank 0 makes up 128 bytes in
    place of NCCL's id; each rank prints its place and a digest of the id it got"""
    place = find_place(args)
    if place is None:
        raise NanoEulerError("rendezvous found no launcher: start it with torchrun, srun or mpirun, or give "
                             "--nnodes, --node-rank and --master-addr")
    unique_id, _ = exchange_id(place, run_settings(args), args.rendezvous_timeout, lambda: os.urandom(128).hex())
    how = "itself, a world of one" if place.world == 1 else f"file {place.file}" if place.file else \
        f"{place.addr or 'this host'}:{place.port}, {place.source}"
    left = f"; delete {place.file} before the next run" if place.file and place.rank == 0 < place.world - 1 else ""
    sys.stdout.write(f"rank {place.rank} of {place.world} ({place.launcher}, local rank {place.local_rank}): id "
                     f"{hashlib.sha256(bytes.fromhex(unique_id)).hexdigest()[:16]} from rank 0 ({how}){left}\n")
    sys.stdout.flush()                                 # one write: ranks that share a terminal do not mix lines


if __name__ == "__main__":
    main()
