"""
nanoeuler_cuda.py's training engine on an emulated GPU, so that its host side runs
without one: the driver calls that it makes, cuBLAS's GemmEx and every kernel that
training launches are replaced by numpy. Each kernel is emulated from its CUDA
source (same layouts, same rounding to bf16 where it stores floatX), and each
launch's arguments are checked against the kernel's signature in kernels.cu or
flash_attn.cu (count and ctypes type), its grid against the elements it must
cover, and every pointer it is given against the allocations. So check's kernel,
model and step checks and whole training steps exercise the buffers, the launch
arguments, the CUDA graph's capture and replay (a captured launch keeps the
argument values it had when captured, as on the device) and the NaN stop.
What this cannot show is the kernels' own correctness or speed: `python
nanoeuler_cuda.py check` on a GPU does that.

    python -m pytest -q test_gpu_host.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import argparse
import bisect
import ctypes
import gc
import math
import os
import re
import sys
import types

import numpy as np
import pytest

import nanoeuler_cuda as nc

HERE = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------
# the kernels' signatures, from the sources

def kernel_signatures():
    """{name: [argument kinds]}: "ptr", "int", "long" or "float", for every extern "C" kernel;
    {name: the file that defines it}"""
    sigs, files = {}, {}
    for file in nc.SOURCES:
        src = open(os.path.join(HERE, file)).read()
        for name, params in re.findall(
                r'extern "C" __global__ void (?:__launch_bounds__\([\w, ]+\) )?(\w+)\(([^)]*)\)', src):
            kinds = []
            for p in params.split(","):
                p = " ".join(p.split())
                kinds.append("ptr" if "*" in p else p.rsplit(" ", 1)[0].replace("const ", ""))
            sigs[name], files[name] = kinds, file
    return sigs, files


SIGNATURES, FILES = kernel_signatures()
CTYPE = {"ptr": ctypes.c_void_p, "int": ctypes.c_int, "long": ctypes.c_longlong, "float": ctypes.c_float}


# -----------------------------------------------------------------------------
# emulated memory: numpy buffers whose addresses are the "device pointers"

class Memory:
    def __init__(self):
        self.bases, self.buffers = [], {}

    def alloc(self, nbytes):
        buf = np.zeros(nbytes + 512, np.uint8)
        base = (buf.ctypes.data + 255) // 256 * 256               # cuMemAlloc aligns to 256 bytes
        self.buffers[base] = (buf, nbytes)
        bisect.insort(self.bases, base)
        return base

    def free(self, base):
        self.buffers.pop(base)
        self.bases.remove(base)

    def check(self, ptr, nbytes, what):
        """[ptr, ptr + nbytes) lies inside one allocation"""
        i = bisect.bisect_right(self.bases, ptr) - 1
        assert i >= 0, f"{what}: pointer {ptr:#x} is in no allocation"
        base = self.bases[i]
        assert ptr + nbytes <= base + self.buffers[base][1], f"{what}: {nbytes} bytes at {ptr:#x} overrun"

    def array(self, ptr, dtype, count, what="an access"):
        """count elements of dtype at ptr, a writable numpy view"""
        dtype, count = np.dtype(dtype), int(count)
        self.check(ptr, count * dtype.itemsize, what)
        assert ptr % dtype.itemsize == 0, f"{what}: {ptr:#x} is not aligned for {dtype}"
        return np.ctypeslib.as_array((ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)).view(dtype)


def to_bf16_bits(a):
    return (nc.bf16_round(np.asarray(a, np.float32)).view(np.uint32) >> 16).astype(np.uint16)


class Typed:
    """reads and writes of one kernel's arrays: float32, int32, and floatX (float32 or bf16)"""

    def __init__(self, mem, bf16, name):
        self.mem, self.bf16, self.name = mem, bf16, name

    def f32(self, ptr, n):
        return self.mem.array(ptr, np.float32, n, self.name)

    def i32(self, ptr, n):
        return self.mem.array(ptr, np.int32, n, self.name)

    def x(self, ptr, n):
        """floatX values as float64"""
        if self.bf16:
            return nc.from_bf16(self.mem.array(ptr, np.uint16, n, self.name)).astype(np.float64)
        return self.f32(ptr, n).astype(np.float64)

    def put_x(self, ptr, values):
        """store values as floatX (rounded to bf16 in the bf16 build); -> what was stored"""
        values = np.asarray(values, np.float64).reshape(-1)
        if self.bf16:
            self.mem.array(ptr, np.uint16, values.size, self.name)[:] = to_bf16_bits(values)
            return nc.bf16_round(values.astype(np.float32)).astype(np.float64)
        self.f32(ptr, values.size)[:] = values
        return values.astype(np.float32).astype(np.float64)

    def round_x(self, values):
        values = np.asarray(values, np.float64)
        return nc.bf16_round(values.astype(np.float32)).astype(np.float64) if self.bf16 else \
            values.astype(np.float32).astype(np.float64)


# -----------------------------------------------------------------------------
# the kernels, emulated: each reads its arguments as its CUDA source does

KERNELS = {}


def kernel(*names):
    def register(f):
        for name in names:
            KERNELS[name] = f
        return f
    return register


def covers(grid, block, n, per_thread=1):
    gx, gy, gz = grid
    assert gx * gy * gz * block * per_thread >= n, f"grid {grid} x {block} x {per_thread} does not cover {n}"


@kernel("embedding_forward_kernel")
def embedding_forward(t, a, grid, block):
    x, idx, tok_emb, N, C = a
    covers(grid, block, N * C)
    ids = t.i32(idx, N)
    table = t.f32(tok_emb, (ids.max() + 1) * C).reshape(-1, C)
    t.put_x(x, table[ids])


@kernel("embedding_backward_kernel")
def embedding_backward(t, a, grid, block):
    dtok_emb, idx, dx, N, C = a
    V, ids = grid[0], t.i32(idx, N)
    assert block == 256 and ids.max() < V
    d, g = t.x(dx, N * C).reshape(N, C), t.f32(dtok_emb, V * C).reshape(V, C)
    for v in np.unique(ids):
        g[v] += d[ids == v].sum(0)


def rmsnorm(x, w):
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    return x * rstd * w, rstd[:, 0]


@kernel("rmsnorm_forward_kernel")
def rmsnorm_forward(t, a, grid, block):
    out, rstd, x, w, N, C = a
    covers(grid, block // 32, N)
    o, r = rmsnorm(t.x(x, N * C).reshape(N, C), t.f32(w, C))
    t.put_x(out, o)
    t.f32(rstd, N)[:] = r


@kernel("residual_rmsnorm_forward_kernel")
def residual_rmsnorm_forward(t, a, grid, block):
    x, out, rstd, x_in, add, w, N, C = a
    covers(grid, block // 32, N)
    s = t.put_x(x, t.x(x_in, N * C) + t.x(add, N * C)).reshape(N, C)      # normalised as stored
    o, r = rmsnorm(s, t.f32(w, C))
    t.put_x(out, o)
    t.f32(rstd, N)[:] = r


@kernel("rmsnorm_backward_kernel_256", "rmsnorm_backward_kernel_768", "rmsnorm_backward_kernel_1536")
def rmsnorm_backward(t, a, grid, block, shared):
    dx, partial, dout, x, w, rstd, N, C, accumulate = a
    assert shared >= 4 * C * block // 32 and grid[0] * block // 32 >= 1
    xs, d, r = t.x(x, N * C).reshape(N, C), t.x(dout, N * C).reshape(N, C), t.f32(rstd, N)[:, None]
    wv = t.f32(w, C)
    xhat = xs * r
    g = d * wv
    dxv = r * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    t.put_x(dx, (t.x(dx, N * C).reshape(N, C) if accumulate else 0) + dxv)
    parts = t.f32(partial, grid[0] * C).reshape(grid[0], C)               # one block's sum holds it all
    parts[:] = 0
    parts[0] = (d * xhat).sum(0)


@kernel("rmsnorm_backward_dw_kernel")
def rmsnorm_backward_dw(t, a, grid, block):
    dw, partial, blocks, C = a
    covers(grid, 32, C)
    t.f32(dw, C)[:] += t.f32(partial, blocks * C).reshape(blocks, C).sum(0)


@kernel("rope_forward_kernel", "rope_backward_kernel")
def rope(t, a, grid, block, sign):
    qkv, cos, sin, N, T, n_heads, D, stride, pos = a
    half, pack = D // 2, 8 if t.bf16 else 4
    assert half % pack == 0 and stride % pack == 0
    covers(grid, block, N * n_heads * half // pack)
    q = t.x(qkv, N * stride).reshape(N, stride)
    c = t.f32(cos, (pos + T) * half).reshape(-1, half)[pos + np.arange(N) % T][:, None]
    s = sign * t.f32(sin, (pos + T) * half).reshape(-1, half)[pos + np.arange(N) % T][:, None]
    heads = q[:, :n_heads * D].reshape(N, n_heads, D)
    x1, x2 = heads[..., :half], heads[..., half:]
    q[:, :n_heads * D] = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(N, -1)
    t.put_x(qkv, q)


KERNELS["rope_forward_kernel"] = lambda t, a, grid, block: rope(t, a, grid, block, 1.0)
KERNELS["rope_backward_kernel"] = lambda t, a, grid, block: rope(t, a, grid, block, -1.0)


@kernel("swiglu_forward_kernel")
def swiglu_forward(t, a, grid, block):
    out, gu, N, F = a
    covers(grid, block, N * F, 8 if t.bf16 else 4)
    t.put_x(out, ne.swiglu_forward(t.x(gu, N * 2 * F).reshape(N, 2 * F))[0])


@kernel("swiglu_backward_kernel")
def swiglu_backward(t, a, grid, block):
    dgu, dout, gu, N, F = a
    covers(grid, block, N * F, 8 if t.bf16 else 4)
    _, cache = ne.swiglu_forward(t.x(gu, N * 2 * F).reshape(N, 2 * F))
    t.put_x(dgu, ne.swiglu_backward(t.x(dout, N * F).reshape(N, F), cache))


@kernel("residual_forward_kernel")
def residual_forward(t, a, grid, block):
    out, x, add, n = a
    covers(grid, block, n)
    t.put_x(out, t.x(x, n) + t.x(add, n))


@kernel("cross_entropy_forward_kernel")
def cross_entropy_forward(t, a, grid, block):
    logits, losses, targets, dscale, N, V, K = a
    assert grid[0] == N * K
    z = t.x(logits, N * K * V).reshape(N, K, V)
    tg, scale = t.i32(targets, N * K).reshape(N, K), t.f32(dscale, K)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)      # (N, K)
    keep = tg >= 0
    picked = np.take_along_axis(z, np.maximum(tg, 0)[..., None], -1)[..., 0]
    t.f32(losses, K * N)[:] = np.where(keep, lse - picked, 0).T.reshape(-1)
    d = np.exp(z - lse[..., None])
    np.put_along_axis(d, np.maximum(tg, 0)[..., None], np.take_along_axis(d, np.maximum(tg, 0)[..., None], -1) - 1, -1)
    t.put_x(logits, d * np.where(keep, scale, 0)[..., None])


@kernel("cross_entropy_sum_kernel")
def cross_entropy_sum(t, a, grid, block):
    sums, losses, N = a
    K = grid[0]
    t.mem.array(sums, np.float64, K)[:] = t.f32(losses, K * N).reshape(K, N).astype(np.float64).sum(1)


@kernel("to_bf16_kernel")
def to_bf16(t, a, grid, block):
    out, x, n = a
    covers(grid, block, n, 4)
    t.mem.array(out, np.uint16, n)[:] = to_bf16_bits(t.f32(x, n))


@kernel("grad_norm_kernel")
def grad_norm(t, a, grid, block):
    partial, grads, n = a
    parts = t.f32(partial, grid[0])
    parts[:] = 0
    parts[0] = (t.f32(grads, n).astype(np.float64) ** 2).sum()


@kernel("clip_grad_norm_kernel")
def clip_grad_norm(t, a, grid, block):
    results, clip, partial, blocks, K, max_norm = a
    res = t.mem.array(results, np.float64, K + 1)
    norm = math.sqrt(t.f32(partial, blocks).astype(np.float64).sum())
    ok = np.isfinite(norm) and np.all(np.isfinite(res[:K]))
    res[K] = norm
    t.f32(clip, 2)[:] = [max_norm / norm if max_norm > 0 and norm > max_norm else 1.0, float(ok)]


@kernel("adamw_update_kernel")
def adamw_update(t, a, grid, block):
    params, params16, grads, m, v, decay, n, hyper, clip, beta1, beta2, eps, weight_decay = a
    assert grid[0] >= 1 and block % 32 == 0                                # a grid-stride loop covers any n
    for ptr in (params, grads, m, v):
        assert ptr % 16 == 0, "adamw_update_kernel loads 16 bytes at a time"
    scale, apply = t.f32(clip, 2)
    if apply == 0:
        return
    lr, bias1, bias2 = (np.float32(h) for h in t.f32(hyper, 3))
    p, g, mm, vv = (t.f32(ptr, n) for ptr in (params, grads, m, v))
    d = t.mem.array(decay, np.uint8, n).astype(np.float32)
    g = g * np.float32(scale)
    mm[:] = beta1 * mm + (1 - beta1) * g
    vv[:] = beta2 * vv + (1 - beta2) * g * g
    p[:] = p * (1 - lr * weight_decay * d) - lr / bias1 * mm / (np.sqrt(vv / bias2) + eps)
    if params16:
        t.mem.array(params16, np.uint16, n)[:] = to_bf16_bits(p)


def attention_inputs(t, qkv, B, T, Hq, Hkv, D):
    x = t.x(qkv, B * T * (Hq + 2 * Hkv) * D).reshape(B, T, Hq + 2 * Hkv, D)
    return x[:, :, :Hq], x[:, :, Hq:Hq + Hkv], x[:, :, Hq + Hkv:]


def attention_grid(name, grid, T, Hq, Hkv, kv):
    """-> B, from the grid: (Hq or Hkv, B, tiles) for the bf16 passes, (tiles, Hq or Hkv, B) else"""
    heads = Hkv if kv else Hq
    if "bf16" in name:                        # 64 rows a block; the forward's follow its m-tiles a warp
        rows = 64 * (nc.FORWARD_MT[kernel_dim(name)] if "forward" in name else 1)
        assert grid[0] == heads and grid[2] == -(-T // rows), (name, grid, T)
        return grid[1]
    assert grid[1] == heads and grid[0] * 64 >= T
    return grid[2]


def kernel_dim(name):
    return int(name.rsplit("_", 1)[1])


def attention_forward(t, a, grid, block, name):
    y, lse, qkv, T, Hq, Hkv, scale = a
    D = kernel_dim(name)
    B = attention_grid(name, grid, T, Hq, Hkv, False)
    assert abs(scale - 1 / math.sqrt(D)) < 1e-7
    q, k, v = attention_inputs(t, qkv, B, T, Hq, Hkv, D)
    out, (qg, kt, vt, att) = ne.attention_forward(q, k, v)
    t.put_x(y, out)
    G = Hq // Hkv
    s = (qg / math.sqrt(D)) @ kt + ne.causal_mask(T, T, G, np.float64)          # (B,Hkv,G*T,T)
    m = s.max(-1, keepdims=True)
    l = m[..., 0] + np.log(np.exp(s - m).sum(-1))                             # (B,Hkv,G*T)
    t.f32(lse, B * Hq * T)[:] = l.reshape(B, Hkv, G, T).reshape(B, Hq, T).reshape(-1)


def attention_backward(t, a, grid, block, name):
    """the dk/dv kernel writes dk and dv, the dq kernel dq, from qkv, dy, lse and delta; in
    bf16 the dk/dv kernel also stores ds, tile by tile (flash_attn.cu's ds_tile), and the
    dq kernel reads dq = scale ds k from those tiles"""
    bf16_pass, kv = "bf16" in name, "_dkv_" in name
    if bf16_pass and not kv:
        return attention_backward_dq_from_ds(t, a, grid, name)
    if bf16_pass:
        dqkv, ds_tiles, qkv, dy, lse, delta, T, Hq, Hkv, scale = a
    else:
        dqkv, qkv, dy, lse, delta, T, Hq, Hkv, scale = a
    D = kernel_dim(name)
    B = attention_grid(name, grid, T, Hq, Hkv, kv)
    q, k, v = attention_inputs(t, qkv, B, T, Hq, Hkv, D)
    _, cache = ne.attention_forward(q, k, v)
    dq, dk, dv = ne.attention_backward(t.x(dy, B * T * Hq * D).reshape(B, T, Hq, D), cache)
    out = t.x(dqkv, B * T * (Hq + 2 * Hkv) * D).reshape(B, T, Hq + 2 * Hkv, D)
    if kv:
        out[:, :, Hq:Hq + Hkv], out[:, :, Hq + Hkv:] = dk, dv
    else:
        out[:, :, :Hq] = dq
    t.put_x(dqkv, out)
    if bf16_pass:                                                   # ds (B, Hq, T, T), rounded, into tiles
        ds = attention_ds(t, qkv, dy, B, T, Hq, Hkv, D)
        tiles, store = ds_tile_views(t, ds_tiles, B, T, Hq)
        for (qi, kj), tile in tiles.items():
            rows = ds[:, :, qi * 64:(qi + 1) * 64, kj * 64:(kj + 1) * 64]
            tile[:] = 0
            tile[:, :, :rows.shape[3], :rows.shape[2]] = to_bf16_bits(rows.transpose(0, 1, 3, 2))   # keys as rows
            store((qi, kj), tile)


def attention_ds(t, qkv, dy, B, T, Hq, Hkv, D):
    """d loss / d scores (B, Hq, T, T), as nanoeuler.attention_backward makes it"""
    q, k, v = attention_inputs(t, qkv, B, T, Hq, Hkv, D)
    G = Hq // Hkv
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)          # (B, T, Hq, D): head h reads kv head h // G
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(D) + ne.causal_mask(T, T, 1, np.float64)
    att = np.exp(s - s.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    datt = np.einsum("bqhd,bkhd->bhqk", t.x(dy, B * T * Hq * D).reshape(B, T, Hq, D), vr)
    return att * (datt - (datt * att).sum(-1, keepdims=True))


def ds_tile_order():
    """flat index in a stored ds tile (flash_attn.cu's ds_tile: the dk/dv pass's registers)
    of (key, query) of a 64 x 64 tile, as a (64, 64) array"""
    key, query = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    warp, half, group = key // 16, key % 16 // 8, key % 8
    nt, in_group, odd = query // 8, query % 8 // 2, query % 2
    word = 512 * warp + 32 * (2 * nt + half) + 4 * group + in_group     # register 2 nt + half of lane 4 group + in_group
    return 2 * word + odd


def ds_tile_views(t, ds_tiles, B, T, Hq):
    """{(query tile, key tile): (B, Hq, 64 keys, 64 queries) copy}, and a function that stores
    such an array into its tile, the bf16 buffer laid out as ds_tile"""
    n, order = -(-T // 64), ds_tile_order()
    pairs = [(qi, kj) for qi in range(n) for kj in range(qi + 1)]       # pair index qi (qi + 1) / 2 + kj
    buf = t.mem.array(ds_tiles, np.uint16, B * Hq * len(pairs) * 64 * 64, t.name).reshape(B, Hq, len(pairs), 4096)
    tiles = {pair: buf[:, :, i][..., order] for i, pair in enumerate(pairs)}

    def store(pair, bits):
        buf[:, :, pairs.index(pair), order.reshape(-1)] = bits.reshape(B, Hq, 4096)
    return tiles, store


def attention_backward_dq_from_ds(t, a, grid, name):
    dqkv, qkv, ds_tiles, T, Hq, Hkv, scale = a
    D = kernel_dim(name)
    B = attention_grid(name, grid, T, Hq, Hkv, False)
    _, k, _ = attention_inputs(t, qkv, B, T, Hq, Hkv, D)
    ds = np.zeros((B, Hq, T, T))
    for (qi, kj), tile in ds_tile_views(t, ds_tiles, B, T, Hq)[0].items():
        rows = ds[:, :, qi * 64:(qi + 1) * 64, kj * 64:(kj + 1) * 64]
        rows[:] = nc.from_bf16(tile).transpose(0, 1, 3, 2)[:, :, :rows.shape[2], :rows.shape[3]]
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, np.repeat(k, Hq // Hkv, axis=2))
    out = t.x(dqkv, B * T * (Hq + 2 * Hkv) * D).reshape(B, T, Hq + 2 * Hkv, D)
    out[:, :, :Hq] = dq
    t.put_x(dqkv, out)


for _name in SIGNATURES:
    if _name.startswith("attention_forward"):
        KERNELS[_name] = lambda t, a, grid, block, n=_name: attention_forward(t, a, grid, block, n)
    elif _name.startswith(("attention_backward_dkv", "attention_backward_dq")):
        KERNELS[_name] = lambda t, a, grid, block, n=_name: attention_backward(t, a, grid, block, n)


@kernel("attention_backward_delta_kernel", "attention_backward_delta_bf16_kernel")
def attention_backward_delta(t, a, grid, block):
    delta, dy, y, B, T, Hq, D = a
    covers(grid, block, B * T * Hq * D // (8 if t.bf16 else 4))            # a 16-byte pack a thread
    prod = (t.x(dy, B * T * Hq * D) * t.x(y, B * T * Hq * D)).reshape(B, T, Hq, D).sum(-1)
    t.f32(delta, B * Hq * T)[:] = prod.transpose(0, 2, 1).reshape(-1)


# -----------------------------------------------------------------------------
# the driver and cuBLAS, emulated

class Function:
    def __init__(self, name, module):
        self.name, self.module = name, module


class Graph:
    def __init__(self, ops):
        self.ops = ops


class Driver:
    """the cuda.bindings.driver calls nanoeuler_cuda makes, on Memory; launches run the
    emulated kernels, or are recorded while a stream capture is on"""
    OK = 0

    def __init__(self):
        self.mem, self.capture, self.host = Memory(), None, {}
        self.CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=types.SimpleNamespace(value=1))
        self.CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=types.SimpleNamespace(value=2))
        self.CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_GLOBAL=0)
        self.CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
                                                        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
                                                        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="sms")
        self.CU_MEMHOSTALLOC_DEVICEMAP = 2

    def run(self, op):
        if self.capture is not None:
            self.capture.append(op)
        else:
            op()

    def cuInit(self, flags): return (self.OK,)
    def cuDeviceGetCount(self): return (self.OK, 1)
    def cuDeviceGet(self, i): return (self.OK, i)
    def cuDevicePrimaryCtxRetain(self, dev): return (self.OK, "ctx")
    def cuCtxSetCurrent(self, ctx): return (self.OK,)
    def cuStreamCreate(self, flags): return (self.OK, 7)
    def cuDeviceGetName(self, n, dev): return (self.OK, b"Emulated GPU\0")
    def cuDeviceGetAttribute(self, attr, dev): return (self.OK, {"major": 9, "minor": 0, "sms": 4}[attr])
    def cuModuleLoadData(self, cubin): return (self.OK, cubin)
    def cuGetErrorName(self, err): return (self.OK, b"CUDA_ERROR_EMULATED")

    def cuModuleGetFunction(self, module, name):
        name = name.decode()
        if FILES.get(name) != module.split(" ")[0]:               # "kernels.cu bf16": kernels.cu's bf16 build
            return (1, None)
        return (self.OK, Function(name, module))

    def cuMemAlloc(self, n): return (self.OK, self.mem.alloc(n))
    def cuMemFree(self, ptr): return (self.OK,) if self.mem.free(ptr) is None else (1,)

    def cuMemHostAlloc(self, n, flags):
        buf = np.zeros(n + 64, np.uint8)
        ptr = (buf.ctypes.data + 63) // 64 * 64
        self.host[ptr] = buf
        return (self.OK, ptr)

    def cuMemFreeHost(self, ptr):
        self.host.pop(int(ptr), None)
        return (self.OK,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        self.mem.check(int(dst), n, "cuMemcpyHtoDAsync")
        data = bytes((ctypes.c_uint8 * n).from_address(int(src)))        # a graph would read it at replay
        self.run(lambda: ctypes.memmove(int(dst), data, n))
        return (self.OK,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        assert self.capture is None
        self.mem.check(int(src), n, "cuMemcpyDtoHAsync")
        ctypes.memmove(int(dst), int(src), n)
        return (self.OK,)

    def cuMemsetD32Async(self, ptr, value, count, stream):
        self.run(lambda: self.mem.array(int(ptr), np.uint32, count, "cuMemsetD32").fill(value))
        return (self.OK,)

    def cuMemsetD16Async(self, ptr, value, count, stream):
        self.run(lambda: self.mem.array(int(ptr), np.uint16, count, "cuMemsetD16").fill(value))
        return (self.OK,)

    def cuStreamSynchronize(self, stream):
        assert self.capture is None, "a synchronisation inside a captured step"
        return (self.OK,)

    def cuEventCreate(self, flags): return (self.OK, object())
    def cuEventRecord(self, event, stream): return (self.OK,)
    def cuEventSynchronize(self, event): return (self.OK,)
    def cuEventElapsedTime(self, a, b): return (self.OK, 0.0)
    def cuEventDestroy(self, event): return (self.OK,)
    def cuStreamWaitEvent(self, stream, event, flags): return (self.OK,)

    def cuStreamBeginCapture(self, stream, mode):
        assert self.capture is None
        self.capture = []
        return (self.OK,)

    def cuStreamEndCapture(self, stream):
        graph, self.capture = Graph(self.capture), None
        return (self.OK, graph)

    def cuGraphInstantiate(self, graph, flags): return (self.OK, graph)
    def cuGraphDestroy(self, graph): return (self.OK,)

    def cuGraphLaunch(self, graph, stream):
        for op in graph.ops:
            op()
        return (self.OK,)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        kinds = SIGNATURES[f.name]
        slots = (ctypes.c_void_p * len(kinds)).from_address(params)
        args = [CTYPE[k].from_address(slots[i]).value for i, k in enumerate(kinds)]
        args = [a or 0 if k == "ptr" else a for a, k in zip(args, kinds)]
        bf16 = f.module == "kernels.cu bf16" or f.module == "flash_attn.cu" and "bf16" in f.name
        typed = Typed(self.mem, bf16, f.name)
        run = KERNELS[f.name]
        extra_args = {"shared": shared} if f.name.startswith("rmsnorm_backward_kernel") else {}
        self.run(lambda: run(typed, args, (gx, gy, gz), bx, **extra_args))
        return (self.OK,)


CUDA_R_32F, CUDA_R_16BF = 0, 14


class CublasLib:
    """cublasGemmEx, column-major as cuBLAS defines it, in float64, stored as Ctype"""

    def __init__(self, driver):
        self.driver = driver

    def matrix(self, ptr, dtype, rows, cols, ld):
        """a column-major (rows, cols) matrix with leading dimension ld, as float64"""
        assert ld >= rows
        n = ld * (cols - 1) + rows
        raw = self.driver.mem.array(ptr, np.uint16 if dtype == CUDA_R_16BF else np.float32, n, "cublasGemmEx")
        vals = nc.from_bf16(raw) if dtype == CUDA_R_16BF else raw
        full = np.zeros(ld * cols)
        full[:n] = vals
        return full.reshape(cols, ld).T[:rows]

    def cublasGemmEx(self, handle, ta, tb, m, n, k, alpha, A, a_type, lda, B, b_type, ldb, beta, C, c_type, ldc,
                     compute, algo):
        assert a_type == b_type and a_type in (CUDA_R_32F, CUDA_R_16BF) and c_type in (CUDA_R_32F, CUDA_R_16BF), \
            "cublasGemmEx: a type combination cuBLAS does not take"
        alpha, beta = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value

        def gemm():
            a = self.matrix(A, a_type, *((m, k) if ta == 0 else (k, m)), lda)
            b = self.matrix(B, b_type, *((k, n) if tb == 0 else (n, k)), ldb)
            c = alpha * (a if ta == 0 else a.T) @ (b if tb == 0 else b.T)
            if beta:
                c += beta * self.matrix(C, c_type, m, n, ldc)
            count = ldc * (n - 1) + m
            out = self.driver.mem.array(C, np.uint16 if c_type == CUDA_R_16BF else np.float32, count, "gemm C")
            for j in range(n):                                     # column by column: ldc may exceed m
                col = c[:, j]
                out[j * ldc:j * ldc + m] = to_bf16_bits(col) if c_type == CUDA_R_16BF else col
        self.driver.run(gemm)
        return 0

    def cublasGetStatusName(self, status):
        return b"CUBLAS_STATUS_EMULATED"


# -----------------------------------------------------------------------------
# nanoeuler_cuda on the emulated GPU

@pytest.fixture
def emulated(monkeypatch):
    driver = Driver()
    monkeypatch.setattr(nc, "import_cuda", lambda: (driver, None))
    monkeypatch.setattr(nc, "compile_kernels", lambda arch: {name: name for name in nc.MODULES})
    monkeypatch.setattr(nc, "gpu", None)
    monkeypatch.setattr(nc, "cu", None)

    class Cublas(nc.Cublas):
        def __init__(self, stream, workspace_bytes=32 << 20):
            self.lib, self.handle = CublasLib(driver), 1
            self.workspace = nc.DeviceArray((workspace_bytes // 4,))
            self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
            self.bf16 = [None, None]

    monkeypatch.setattr(nc, "Cublas", Cublas)
    launch = nc.GPU.launch

    def checked_launch(self, name, grid, block, *args, shared=0, bf16=False):
        kinds = SIGNATURES[name]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments for {len(kinds)} parameters"
        for i, (a, k) in enumerate(zip(args, kinds)):
            assert type(a) is CTYPE[k], f"{name}: argument {i} is {type(a).__name__}, the kernel takes {k}"
        return launch(self, name, grid, block, *args, shared=shared, bf16=bf16)

    monkeypatch.setattr(nc.GPU, "launch", checked_launch)
    monkeypatch.setattr(nc, "check_decoding", lambda rng, report, precision: None)   # not emulated
    # nor the TMA forward that compute capability 9.0 gets (tensor maps): tools/emulate_cuda.py runs it
    # (test_cuda_pipeline.py's training checks); here the mma.sync forward everywhere
    monkeypatch.setattr(nc, "ATTENTION_FORWARD_TMA", False)
    monkeypatch.setattr(nc, "ATTENTION_BACKWARD_TMA", False)                         # and the mma.sync dk/dv pass
    monkeypatch.setattr(nc, "PRODUCT_TMA", False)                                    # and cuBLAS's products
    monkeypatch.setattr(nc, "PRODUCT_TMA_BACKWARD", False)                           # in the backward too
    monkeypatch.setattr(nc, "check_products", lambda rng, report: None)   # TMA: test_matmul_tma runs it
    return driver


def test_signatures_are_read():
    assert SIGNATURES["adamw_update_kernel"] == ["ptr"] * 6 + ["long", "ptr", "ptr"] + ["float"] * 4
    assert SIGNATURES["attention_forward_bf16_kernel_64"] == ["ptr"] * 3 + ["int"] * 3 + ["float"]
    assert set(KERNELS) <= set(SIGNATURES)                      # every emulation has its kernel


def test_memory_is_freed_by_the_driver_that_made_it_and_no_other(monkeypatch):
    """one test's garbage may be collected during a later test, when nanoeuler_cuda's cu is another
    driver (another test's emulator, or the real one test_inputs' count_gpus leaves, which raises
    without a GPU): that one is not asked to free it; the driver that made it frees it"""
    class Recording:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *args: self.calls.append(name) or (0,)

    made, later = Driver(), Recording()
    monkeypatch.setattr(nc, "cu", made)
    a, pinned = nc.DeviceArray((4,)), nc.PinnedBuffer(16)
    view = a.view(1, (2,))
    assert len(made.mem.buffers) == 1 and len(made.host) == 1
    monkeypatch.setattr(nc, "cu", later)
    del a, pinned, view                                       # no cycle: freed here
    assert later.calls == [] and len(made.mem.buffers) == 1 and len(made.host) == 1
    monkeypatch.setattr(nc, "cu", made)
    a, pinned = nc.DeviceArray((4,)), nc.PinnedBuffer(16)
    del a, pinned
    assert len(made.mem.buffers) == 1 and len(made.host) == 1   # these two freed; the first two stay unfreed


@pytest.mark.parametrize("make, refused", [
    (lambda: nc.DeviceArray((4,)), "cuMemAlloc"), (lambda: nc.PinnedBuffer(16), "cuMemHostAlloc"),
    (lambda: nc.PinnedBuffer(16), "cuEventCreate"), (lambda: nc.HostRing(4), "cuMemHostAlloc"),
    (lambda: nc.HostRing(4), "cuMemHostGetDevicePointer")])
def test_memory_the_driver_refused_is_one_sentence_and_its_half_made_object_frees_what_it_got(monkeypatch, make,
                                                                                            refused):
    """the driver refusing an allocation or an event (out of page-locked memory, say): the sentence,
    and the half-made object's __del__ frees what was made before it and raises nothing (an
    exception there is unraisable: printed, it would fail whichever test collected the object)"""
    unraisable, driver = [], Driver()
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(driver, refused, lambda *args: (2, None), raising=False)      # (no mapped memory here)
    monkeypatch.setattr(nc, "cu", driver)
    try:
        make()
    except ne.NanoEulerError as e:
        said = str(e)
    else:
        pytest.fail(f"{refused} refused, and nothing said")
    gc.collect()                                              # the traceback held the half-made object
    assert said.startswith(f"CUDA error CUDA_ERROR_EMULATED in {refused}")
    assert [u.exc_value for u in unraisable] == [] and driver.host == {} and driver.mem.buffers == {}


def test_check_passes_on_the_emulated_gpu(emulated, capsys):
    # every launch of check (decoding aside) with its arguments checked: the kernels are
    # numpy here, so what this tests is the host: launchers, buffers, the model's wiring,
    # the rounding reference, graph capture and replay, the NaN stop
    nc.cmd_check(argparse.Namespace(seed=5))
    out = capsys.readouterr().out
    assert "overall okay: 1" in out and "NOT OK" not in out
    for line in ("model bf16 dlayers.1.wqkv", "step bf16: graph == one by one", "step bf16: NaN loss, no update",
                 "residual_rmsnorm_forward (bf16)", "adamw, clipped: bf16 copy", "adamw, a NaN loss sum: no update"):
        assert line in out, line


def engine_args(**more):
    return argparse.Namespace(**{"batch": 2, "zero": False, "clip": 1.0, "weight_decay": 0.1, "no_graph": False,
                                 **more})


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_graph_steps_resume_bit_identically(emulated, precision):
    # a run of 5 steps against 2 steps, then an engine made from their weights and moments
    # (a resume) for 3 more: the same bits; and the steps from the second on were replayed
    nc.init_gpu(precision)
    cfg = ne.Config(V=64, C=64, Hq=2, Hkv=1, L=2, T=40, F=176, K=3)
    rng = np.random.default_rng(0)
    batches = [ne.split_rows(rng.integers(0, cfg.V, (2, cfg.T + cfg.K)), cfg.T, cfg.K)] * 5   # learnt by heart
    flat = ne.init_params(cfg)
    straight = nc.GPUEngine(cfg, flat, None, None, engine_args())
    losses = [straight.step(*b, 1e-2, s + 1)[0] for s, b in enumerate(batches)]
    assert straight.graph is not None and losses[-1] < losses[0] - 0.5
    first = nc.GPUEngine(cfg, flat, None, None, engine_args())
    for s, b in enumerate(batches[:2]):
        first.step(*b, 1e-2, s + 1)
    resumed = nc.GPUEngine(cfg, *first.host_weights(), engine_args())
    more = [resumed.step(*b, 1e-2, s + 3)[0] for s, b in enumerate(batches[2:])]
    assert more == losses[2:]
    for a, b in zip(straight.host_weights(), resumed.host_weights()):
        assert np.array_equal(a, b)


def test_evaluation_in_parts_is_the_float64_loss_of_the_whole_batch(emulated):
    # 5 validation rows on an engine of 2: parts of 2, 2 and 1 rows, with -1 targets (as SFT's)
    # in some rows; the mean CE_0 over the kept targets and bits per byte, in float64 by hand
    nc.init_gpu("fp32")
    cfg = ne.Config(V=64, C=64, Hq=2, Hkv=1, L=1, T=40, F=176, K=2)
    flat = ne.init_params(cfg) + np.random.default_rng(2).normal(0, 0.05, ne.num_params(cfg)).astype(np.float32)
    engine = nc.GPUEngine(cfg, flat, None, None, engine_args())
    rng = np.random.default_rng(3)
    idx, targets = ne.split_rows(rng.integers(0, cfg.V, (5, cfg.T + cfg.K)), cfg.T, cfg.K)
    targets[0, :30], targets[3, 5:] = -1, -1
    token_bytes = rng.integers(1, 4, cfg.V)
    logits, _ = ne.model_forward(ne.carve(flat.astype(np.float64), cfg), cfg, idx)
    t0 = targets[..., 0]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    kept = t0 >= 0
    nats = -np.take_along_axis(logp, np.where(kept, t0, 0)[..., None], -1)[..., 0][kept].sum()
    ce, bpb = engine.evaluate([(idx, targets)], token_bytes)
    assert abs(ce - nats / kept.sum()) < 1e-5 * ce
    assert abs(bpb - nats / np.log(2) / token_bytes[t0[kept]].sum()) < 1e-5 * bpb


def test_a_smaller_batch_runs_kernel_by_kernel(emulated):
    # evaluation and a last short batch use the same buffers, launched one by one
    nc.init_gpu("bf16")
    cfg = ne.Config(V=64, C=64, Hq=2, Hkv=1, L=1, T=40, F=176, K=2)
    engine = nc.GPUEngine(cfg, ne.init_params(cfg), None, None, engine_args(batch=3))
    rng = np.random.default_rng(1)
    idx, targets = ne.split_rows(rng.integers(0, cfg.V, (3, cfg.T + cfg.K)), cfg.T, cfg.K)
    engine.step(idx, targets, 1e-3, 1)
    engine.step(idx, targets, 1e-3, 2)
    loss, ce, norm = engine.step(idx[:2], targets[:2], 1e-3, 3)
    assert engine.graph is not None and np.isfinite(loss) and np.isfinite(norm)
    want = ne.model_forward(ne.carve(engine.host_params().astype(np.float64), cfg), cfg, idx[:2], targets[:2])[1]
    got = engine.model.forward(idx[:2], targets[:2])[1]
    assert np.allclose(got, want, rtol=2e-2)


# -----------------------------------------------------------------------------
# the host's sizes, bounds and hand-offs (each found by a one-line mutant that no test caught)

def one_layer_batch(precision, rows):
    """the GPU set up in precision; a one-layer model's config, fresh weights, and rows of random ids"""
    nc.init_gpu(precision)
    cfg = ne.Config(V=64, C=64, Hq=2, Hkv=1, L=1, T=40, F=176, K=2)
    rng = np.random.default_rng(1)
    idx, targets = ne.split_rows(rng.integers(0, cfg.V, (rows, cfg.T + cfg.K)), cfg.T, cfg.K)
    return cfg, ne.init_params(cfg), idx, targets.copy()


def test_a_short_last_batch_trains_as_it_would_without_the_graph(emulated):
    # the graph was captured for 3 rows; a batch of 2 must not replay it (its padding rows'
    # targets would join the loss and the gradient)
    cfg, flat, idx, targets = one_layer_batch("bf16", 3)
    runs = []
    for no_graph in (False, True):
        engine = nc.GPUEngine(cfg, flat, None, None, engine_args(batch=3, no_graph=no_graph))
        engine.step(idx, targets, 1e-3, 1)
        engine.step(idx, targets, 1e-3, 2)
        runs.append((engine.step(idx[:2], targets[:2], 1e-3, 3)[0], engine.host_params()))
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1])


def test_a_head_with_no_kept_target_adds_nothing_and_training_goes_on(emulated):
    # (SFT rows can leave head 1 nothing to predict): 0 / 0 would make the loss NaN and stop the run
    cfg, flat, idx, targets = one_layer_batch("fp32", 2)
    targets[..., 1] = -1
    engine = nc.GPUEngine(cfg, flat, None, None, engine_args(no_graph=True))
    loss, ce, norm = engine.step(idx, targets, 1e-3, 1)
    want = ne.model_forward(ne.carve(flat.astype(np.float64), cfg), cfg, idx, targets)[0]   # float64: CE_0 alone
    assert np.isfinite(norm) and abs(loss - want) < 1e-5 * want
    after = engine.host_params()
    assert np.isfinite(after).all() and not np.array_equal(after, flat)


def test_update_returns_the_gradients_norm(emulated):
    # GPUModel.update (the data-parallel path) -> the norm of the whole gradient, as float64 numpy has it
    cfg, flat, idx, targets = one_layer_batch("fp32", 2)
    model = nc.GPUModel(cfg, 2, flat)
    model.grads.zero()
    model.forward(idx, targets)
    model.backward()
    norm = model.update(1e-3, 1, 1.0, 0.1)
    _, _, cache = ne.model_forward(ne.carve(flat.astype(np.float64), cfg), cfg, idx, targets)
    grads = np.zeros(flat.size)
    ne.model_backward(ne.carve(grads, cfg), cache)
    assert abs(norm - np.linalg.norm(grads)) < 1e-4 * np.linalg.norm(grads)


def test_zero_shards_keep_8_float_alignment_and_each_rank_counts_its_own_flops(emulated):
    nc.init_gpu("fp32")
    cfg = ne.Config(V=65, C=64, Hq=2, Hkv=1, L=2, T=40, F=176, K=3)
    assert ne.num_params(cfg) == 109120
    model = nc.GPUModel(cfg, 2, shards=3, shard=1)
    assert (model.lo, model.hi) == (36376, 72752)       # ceil(109120 / 3) = 36374, up to a multiple of 8
    engine = nc.GPUEngine(cfg, ne.init_params(cfg), None, None, engine_args(batch=4), rank=1, world=2)
    assert engine.model.B == 2 and engine.flops_per_step == nc.flops_per_token(cfg) * 2 * cfg.T


class LaunchLog:
    """a stand-in gpu that keeps (kernel, grid, block, shared) of each launch"""
    sms, precision = 2, "fp32"

    def __init__(self):
        self.launches = []

    def launch(self, name, grid, block, *args, shared=0, bf16=False):
        self.launches.append((name, grid, block, shared))

    def scratch(self, n):
        return nc.DeviceArray((n,), ptr=8)


def placeholder(*shape):
    return nc.DeviceArray(shape, np.float32, ptr=8)


def test_launch_sizes_by_hand(monkeypatch):
    log = LaunchLog()
    monkeypatch.setattr(nc, "gpu", log)
    # attention_decode_kernel's shared memory: q[D], warp_m[8], warp_l[8], warp_acc[8 * D] floats
    a = [placeholder(1) for _ in range(7)]
    nc.attention_decode(*a, 2, 8, 1, 64, 100, kernel="single")
    assert log.launches[0][3] == 4 * (64 + 8 + 8 + 8 * 64)
    # rmsnorm_backward: the narrowest build whose width holds C
    for C, width in ((256, 256), (768, 768), (1536, 1536), (200, 256)):
        log.launches.clear()
        nc.rmsnorm_backward(placeholder(8, C), placeholder(C), placeholder(8, C), placeholder(8, C), placeholder(C),
                            placeholder(8), 8, C)
        assert log.launches[0][0] == f"rmsnorm_backward_kernel_{width}"
    # decode_matvec's splits for 1024 bf16 inputs (128 chunks of 8: 2 splits make 64 a lane, one
    # round) and 2112 outputs: 2112 x 2 = 8 warps x 4 outputs x 132 SMs, enough warps already
    assert nc.matvec_splits(1024, 2112, 8, 132) == 2


def test_the_widest_sizes_the_kernels_are_built_for_are_accepted():
    nc.check_sizes(ne.Config(V=64, C=1536, Hq=24, Hkv=8, L=1, T=8, F=4096, K=2))     # C = the widest rmsnorm
    with pytest.raises(ne.NanoEulerError):
        nc.check_sizes(ne.Config(V=64, C=1600, Hq=25, Hkv=5, L=1, T=8, F=4096, K=2))
    nc.decode_check_sizes(ne.Config(V=64, C=1024, Hq=8, Hkv=8, L=1, T=8, F=256, K=2))   # D = 128
    nc.decode_check_sizes(ne.Config(V=64, C=1536, Hq=12, Hkv=4, L=1, T=8, F=256, K=2))  # C = the widest rmsnorm
    with pytest.raises(ne.NanoEulerError):
        nc.decode_check_sizes(ne.Config(V=64, C=1088, Hq=8, Hkv=8, L=1, T=8, F=256, K=2))   # D = 136
    # wider rows than the prefill's norms hold: an H200 decoded C = 1600 and 2048 into other
    # tokens than the CPU's, with exit 0, before this was refused
    for C, Hq in ((1544, 193), (1600, 20), (2048, 16)):
        with pytest.raises(ne.NanoEulerError, match=f"C at most 1536 .*C={C}, F=256"):
            nc.decode_check_sizes(ne.Config(V=64, C=C, Hq=Hq, Hkv=1, L=1, T=8, F=256, K=2))


def test_flag_bounds_and_defaults():
    parse = nc.build_parser().parse_args
    for precision in ("bf16,fp32", "fp32"):
        nc.check_bench_flags(parse(["bench", "--decode-precision", precision]))
    assert parse(["train", "--vocab-size", "260"]).vocab_size == 260        # 256 bytes + 4 specials
    with pytest.raises(SystemExit):
        parse(["train", "--vocab-size", "259"])
    args = parse(["train"])
    assert (args.steps, args.batch, args.lr, args.warmup) == (600, 16, 6e-4, 100)


def test_the_decoding_queue_fills_to_the_end_of_the_window():
    class Decoder:
        rows = []

        def launch_step(self, R, n_heads):
            self.rows.append(R)
            return 0

    policy = nc.DraftPolicy(3)
    assert policy.next() == (1, 4)                                      # the pass queued: it drafts 3
    decoder, queue = Decoder(), [(0, 4, 4)]
    nc.queue_passes(decoder, queue, 8, list(range(12)), [], 12, policy, 20)   # 12 + 4 queued + 4 = 20 = T
    assert decoder.rows == [4] and queue == [(0, 4, 4), (0, 4, 4)]


def test_only_rank_0_speaks_and_a_rank_launches_no_ranks(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(nc, "count_gpus", lambda: 3)
    monkeypatch.setattr(nc, "nccl_unique_id", lambda: "ab" * 128)
    script = tmp_path / "rank.py"
    script.write_text("import os; print('rank', os.environ['NANOEULER_RANK'])\n")
    nc.launch_ranks([], 3, program=str(script))
    assert capfd.readouterr().out == "rank 0\n"

    class Started(Exception):
        pass

    def init_gpu(precision, device=0):
        assert device == 1
        raise Started

    (tmp_path / "c.txt").write_text("some text\n")
    monkeypatch.setenv("NANOEULER_RANK", "1")
    monkeypatch.setenv("NANOEULER_WORLD", "2")
    monkeypatch.setattr(nc, "count_gpus", lambda: 2)
    monkeypatch.setattr(ne, "prepare_data", lambda *a, **k: pytest.fail("a rank prepared the data"))
    monkeypatch.setattr(nc, "launch_ranks", lambda *a, **k: pytest.fail("a rank launched ranks"))
    monkeypatch.setattr(nc, "init_gpu", init_gpu)
    with pytest.raises(Started):
        nc.cmd_train(nc.build_parser().parse_args(["train", "small", "--gpus", "2", "--data",
                                                   str(tmp_path / "c.txt"), "--out", str(tmp_path / "o")]))


@pytest.mark.parametrize("drafts, speculative, noted", [(5, True, True), (3, True, False), (5, False, False)])
def test_the_gpu_decoder_says_when_drafts_exceed_what_a_step_feeds(monkeypatch, capsys, drafts, speculative, noted):
    # a K = 6 model allows --drafts 5, a GPU decoding step feeds 4 rows (3 drafts): said once, on stderr
    monkeypatch.setattr(nc, "GPUDecoder", lambda cfg, flat, precision: (cfg, precision))
    args = argparse.Namespace(speculative=speculative, drafts=drafts, precision="bf16")
    assert nc.make_decoder(args)("cfg", None) == ("cfg", "bf16")
    err = capsys.readouterr().err
    assert ("drafting with 3 heads, not --drafts 5" in err) == noted, err
