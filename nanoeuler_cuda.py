"""
NanoEuler on one NVIDIA GPU: the model of nanoeuler.py, with its kernels in
kernels.cu and flash_attn.cu compiled at run time by NVRTC, and every matrix
product in cuBLAS, called through ctypes. No framework.

    python nanoeuler_cuda.py check        # every kernel against numpy, then the whole model
    python nanoeuler_cuda.py train big    # train the 116M model (SPEC big) on one GPU
    python nanoeuler_cuda.py bench        # tokens/s and MFU of training steps

It shares with nanoeuler.py (imported, not copied): Config and the presets, the
tokenizer, the data pipeline, the checkpoint files and the training loop's log
and checkpoint logic. A checkpoint written here samples in nanoeuler.py and
the other way round.

Precision: --precision fp32 (exact fp32 matmuls), tf32 (matmuls on tensor cores
with 10-bit mantissas, fp32 everywhere else). Weights, gradients and optimizer
state are fp32 throughout.

What it leaves out, for now: bf16 activations, CUDA graphs, and several GPUs.
Needs: pip install -r requirements-cuda.txt (cuda-python, NVRTC, the CUDA
headers and cuBLAS wheels) and an NVIDIA driver.
"""

import ctypes
import hashlib
import math
import os
import sys
import time

import nanoeuler as ne
from nanoeuler import Config, NanoEulerError, PRESETS, num_params, param_shapes

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["kernels.cu", "flash_attn.cu"]
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanoeuler")
HEAD_DIMS = (16, 32, 64)                       # flash_attn.cu is instantiated for these


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


def nvrtc_compile(name, source, arch):
    """CUDA C source -> CUBIN bytes for sm_<arch>; a compile error names the file, line and log"""
    _, nvrtc = import_cuda()
    opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "--use_fast_math", "-lineinfo"]
    inc = include_dir()
    if inc:
        opts.append(f"-I{inc}")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if err:
        raise NanoEulerError(f"NVRTC could not create a program for {name} ({err})")
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.decode(errors="replace").strip("\x00 \n")
    if err:
        nvrtc.nvrtcDestroyProgram(prog)
        first = next((ln for ln in log.splitlines() if "error" in ln), log[:200])
        raise NanoEulerError(f"NVRTC could not compile {first.strip()} (sm_{arch}); the full log:\n{log}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin


def compile_kernels(arch, cache_dir=CACHE_DIR):
    """{file: CUBIN} for sm_<arch>, from the disk cache when the source is unchanged.

    The CUBIN is built for the device's own compute capability: PTX from an
    NVRTC newer than the driver would not load (see ../shared/notes)."""
    _, nvrtc = import_cuda()
    _, major, minor = nvrtc.nvrtcVersion()
    cubins = {}
    for name in SOURCES:
        with open(os.path.join(HERE, name)) as f:
            source = f.read()
        key = hashlib.sha256(f"{source}|sm_{arch}|nvrtc {major}.{minor}".encode()).hexdigest()[:16]
        path = os.path.join(cache_dir, f"{os.path.splitext(name)[0]}_sm{arch}_{key}.cubin")
        if os.path.exists(path):
            with open(path, "rb") as f:
                cubins[name] = f.read()
            continue
        cubins[name] = nvrtc_compile(name, source, arch)
        os.makedirs(cache_dir, exist_ok=True)
        ne.atomic_write_bytes(path, cubins[name])
    return cubins
