"""
dev/variants/attention_backward_tma.cu (the dk/dv and dq passes of the bf16 attention backward at D = 64 with
warpgroup MMA fed by TMA, issue 36) on tools/emulate_cuda.py's CPU emulator: dk, dv and the ds tiles it stores for
the dq pass (in flash_attn.cu's order), and dq from them, against numpy in float64 at small shapes (causal, GQA, a T
that ends inside a key tile, an odd number of key tiles: a block's second consumer with no keys), its tensor maps
made by the emulator's stand-in driver as the GPU script makes them; the same kernel with its causal mask taken out
is off by far more; each version again with the emulator's warps ahead (--warps-ahead); NVRTC compiles it for
sm_90a, and ptxas keeps its wgmma asynchronous with no spills. `python dev/variants/attention_backward_tma.py`
checks and times it on a GPU. The product's copy of the dk/dv pass's turns version (flash_attn.cu's
attention_backward_dkv_tma_kernel_64) too, launched by nanoeuler_cuda.attention_backward with its tensor maps (the
dq pass the product's mma.sync one), and through ptxas.
"""

import ctypes
import importlib.util
import math
import os
import shutil
import sys

import numpy as np
import pytest

from test_attention_tma import ptxas_log   # a .cu through NVRTC for sm_90a with ptxas -v: (error, its log)

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = os.path.join(HERE, "dev", "variants", "attention_backward_tma.cu")
_spec = importlib.util.spec_from_file_location("attention_backward_tma",
                                               os.path.join(HERE, "dev", "variants", "attention_backward_tma.py"))
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")
D = script.D


def emulator_module():
    spec = importlib.util.spec_from_file_location("emulate_cuda", os.path.join(HERE, "tools", "emulate_cuda.py"))
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    return emulator


def load(path=KERNEL, **options):
    """the emulator's library for the kernel file, its inline-PTX helpers replaced by the emulator's"""
    emulator = emulator_module()
    helpers = emulator.WGMMA_HELPERS + emulator.TMA_HELPERS + ("ldmatrix_x4_trans",)
    return emulator.load(path, select=lambda text: emulator.without_helpers(text, helpers), **options)


def statistics(qkv, dy, B, T, Hq, Hkv):
    """lse and delta (B, Hq, T) in float64 from qkv's and dy's bf16 values, as the forward and the delta kernel
    make them"""
    lse, delta = np.empty((B, Hq, T)), np.empty((B, Hq, T))
    future = np.triu(np.ones((T, T), bool), 1)
    for b in range(B):
        x = script.from_bf16(qkv.reshape(B, T, -1)[b]).astype(np.float64)
        g = script.from_bf16(dy.reshape(B, T, -1)[b]).astype(np.float64).reshape(T, Hq, D)
        q, k = x[:, :Hq * D].reshape(T, Hq, D), x[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
        v = x[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
        for h in range(Hq):
            s = q[:, h] @ k[:, h // (Hq // Hkv)].T / math.sqrt(D)
            s[future] = -np.inf
            mx = s.max(axis=1, keepdims=True)
            e = np.exp(s - mx)
            lse[b, h] = (mx + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
            delta[b, h] = (g[:, h] * (e / e.sum(axis=1, keepdims=True) @ v[:, h // (Hq // Hkv)])).sum(axis=1)
    return lse, delta


def ds_of_tiles(ds16, b, T, Hq):
    """flash_attn.cu's ds tiles of batch row b -> ds (Hq, queries, keys), zeros above the diagonal's tiles: word
    512 w + 32 (4 kk + j) + lane of a tile holds keys 16 w + lane / 4 + 8 (j % 2), queries 8 (2 kk + j / 2) + 2 (lane
    % 4) + 0, 1 (the accumulator layout packed as wgmma's register a)"""
    tiles = -(-T // 64)
    w, idx, lane = np.meshgrid(np.arange(4), np.arange(16), np.arange(32), indexing="ij")
    keys = 16 * w + lane // 4 + 8 * (idx % 4 % 2)
    queries = 8 * (2 * (idx // 4) + idx % 4 // 2) + 2 * (lane % 4)
    out = np.zeros((Hq, tiles * 64, tiles * 64))
    values = script.from_bf16(ds16).astype(np.float64)
    for h in range(Hq):
        for qi in range(tiles):
            for kj in range(qi + 1):
                start = (((b * Hq + h) * (tiles * (tiles + 1) // 2) + qi * (qi + 1) // 2 + kj) * 4096)
                tile = values[start:start + 4096].reshape(4, 16, 32, 2)
                out[h, 64 * qi + queries, 64 * kj + keys] = tile[..., 0]
                out[h, 64 * qi + queries + 1, 64 * kj + keys] = tile[..., 1]
    return out[:, :T, :T]


SMS = 3             # the persistent versions: as many blocks (fewer than the units: each walks several)


def run(lib, name, B, T, Hq, Hkv, seed=0, dq_name=None):
    """a version on the emulator -> the errors of dk, dv and ds (relative norms) against float64, every batch row;
    with dq_name, then that version of the dq pass on its ds, and dq's error instead"""
    from cuda.bindings import driver as real
    driver = emulator_module().Driver(real)
    qkv, dy = script.random_qkv(B, T, Hq, Hkv, seed), script.random_dy(B, T, Hq, seed + 1)
    lse64, delta64 = statistics(qkv, dy, B, T, Hq, Hkv)
    lse, delta = lse64.astype(np.float32), delta64.astype(np.float32)
    dqkv = np.full((B * T, (Hq + 2 * Hkv) * D), 0xFFFF, np.uint16)      # NaN: what the kernel does not write shows
    tiles = -(-T // 64)
    ds = np.full(B * Hq * tiles * (tiles + 1) // 2 * 4096, 0xFFFF, np.uint16)
    entry, grid, threads, _, args = script.arguments(driver, name, dqkv.ctypes.data, ds.ctypes.data,
                                                     qkv.ctypes.data, dy.ctypes.data, lse.ctypes.data,
                                                     delta.ctypes.data, B, T, Hq, Hkv, SMS)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
    launch = lib.emu_launch(lib.emu_kernel(entry.encode()), *grid, threads, params)
    fault = lib.emu_run(launch)
    lib.emu_free(launch)
    assert not fault, f"{name} read or wrote outside its arrays"
    if dq_name:
        entry, grid, threads, _, args = script.dq_arguments(driver, dq_name, dqkv.ctypes.data, qkv.ctypes.data,
                                                            ds.ctypes.data, B, T, Hq, Hkv, SMS)
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
        launch = lib.emu_launch(lib.emu_kernel(entry.encode()), *grid, threads, params)
        fault = lib.emu_run(launch)
        lib.emu_free(launch)
        assert not fault, f"{dq_name} read or wrote outside its arrays"
        out = script.from_bf16(dqkv).reshape(B, T, -1).astype(np.float64)
        return max(script.relative_error(out[b][:, :Hq * D], script.reference(qkv, dy, b, T, Hq, Hkv)[0])
                   for b in range(B))
    out = script.from_bf16(dqkv).reshape(B, T, -1).astype(np.float64)
    errors = []
    for b in range(B):
        _, dk_ref, dv_ref, ds_ref = script.reference(qkv, dy, b, T, Hq, Hkv)
        errors.append([script.relative_error(out[b][:, Hq * D:(Hq + Hkv) * D], dk_ref),
                       script.relative_error(out[b][:, (Hq + Hkv) * D:], dv_ref),
                       script.relative_error(ds_of_tiles(ds, b, T, Hq), np.tril(ds_ref))])
    return np.max(errors, axis=0)


@pytest.fixture(scope="module")
def variant():
    return load()


# B, T, Hq, Hkv: 2 key tiles of one kv head read by two query heads; 3 heads a kv head (the big model's 12 / 4), a T
# that ends inside a key tile and 3 key tiles (the second block's second consumer has none); two batch rows
# (q, dy rows past T are the next row's), no GQA
SHAPES = [(1, 128, 2, 1), (1, 160, 3, 1), (2, 192, 2, 2)]


@needs_gxx
@pytest.mark.parametrize("name", script.VERSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B%d_T%d_Hq%d_Hkv%d" % s)
def test_each_version_on_the_emulator_against_float64(variant, name, shape):
    dk, dv, ds = run(variant, name, *shape)
    assert max(dk, dv, ds) <= script.DKV_BOUND, (dk, dv, ds)


@needs_gxx
@pytest.mark.parametrize("dq_name", script.DQ_VERSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B%d_T%d_Hq%d_Hkv%d" % s)
def test_the_dq_pass_on_the_emulator_against_float64(variant, dq_name, shape):
    # on the ds tiles of the dk/dv pass (checked above against float64)
    assert run(variant, "tma dkv", *shape, dq_name=dq_name) <= script.DKV_BOUND


@needs_gxx
def test_each_version_and_dq_pass_with_each_warp_ahead(variant):
    # the emulator's warps ahead (each warp of a block runs as far as it can before the next, where they take turns a
    # barrier at a time): a missing barrier or mbarrier wait lets a warp read a stage before it is filled, or refill
    # one the others still read; at the shape whose persistent blocks walk several units (and the stages' rounds)
    variant.emu_set_warps_ahead(1)
    try:
        for name in script.VERSIONS:
            assert max(run(variant, name, *SHAPES[2])) <= script.DKV_BOUND, name
        for dq_name in script.DQ_VERSIONS:
            assert run(variant, "tma dkv", *SHAPES[2], dq_name=dq_name) <= script.DKV_BOUND, dq_name
    finally:
        variant.emu_set_warps_ahead(0)


@needs_gxx
def test_the_check_sees_a_broken_mask(tmp_path):
    text = open(KERNEL).read()
    old = "            if (edge && (query < key || query >= k.T)) p = 0.0f;\n"
    assert text.count(old) == 1
    (tmp_path / "broken.cu").write_text(text.replace(old, ""))
    lib = load(str(tmp_path / "broken.cu"), cache_dir=str(tmp_path))
    for name in script.VERSIONS:
        assert min(run(lib, name, *SHAPES[1])) > 10 * script.DKV_BOUND, name


@needs_gxx
def test_the_gpu_script_runs_on_the_emulator(variant, monkeypatch, capsys):
    # `python dev/variants/attention_backward_tma.py` as the lead runs it on a GPU, its host code on the emulator's
    # stand-in driver: both modules, tensor maps, launches, grids, shared memory sizes, the checks (the product's
    # forward, delta, dk/dv and dq passes, flash_attn.cu's, on the emulator too) and the table (small shapes; the
    # timings are 0 here)
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    emulator = emulator_module()
    driver = emulator.install(nc)
    nc.gpu.arch, nc.gpu.sms = "90", SMS
    libs = {"attention_backward_tma.cu": variant, "flash_attn.cu": nc.gpu.modules["flash_attn.cu"]}
    monkeypatch.setattr(nc, "nvrtc_compile", lambda name, source, arch: name.encode())
    monkeypatch.setattr(driver, "cuModuleLoadData", lambda cubin: (0, libs[cubin.decode()]), raising=False)
    monkeypatch.setattr(script.base, "start_gpu", lambda: nc.gpu)
    monkeypatch.setattr(script, "finish", lambda name: nc.gpu.sync())      # (the emulator's launches are done)
    monkeypatch.setattr(script.base, "timed", lambda run, reps: (run(), 1.0)[1])
    monkeypatch.setattr(script, "CHECKS", ((2, 128, 6, 2), (1, 160, 3, 1)))
    monkeypatch.setattr(script, "BATCHES", (2, 1))
    monkeypatch.setattr(script, "LAUNCHES", 1)
    with pytest.raises(SystemExit) as end:
        script.main()
    out = capsys.readouterr().out
    assert end.value.code == 0 and out.count("  OK\n") == 2 * (len(script.VERSIONS) + len(script.DQ_VERSIONS) + 1), out
    assert out.endswith("all OK\n"), out


def test_ptxas_keeps_every_wgmma_asynchronous_and_spills_nothing():
    # ptxas serializes wgmma it cannot prove safe (C7514, C7519) or injects waits (C7517) without failing
    pytest.importorskip("cuda.bindings")
    err, log = ptxas_log(KERNEL)
    entries = {entry for entry, _, _ in [*script.VERSIONS.values(), *script.DQ_VERSIONS.values()]}
    assert not err and "C751" not in log and log.count(" 0 bytes spill stores") == len(entries), log


@needs_gxx
@pytest.mark.parametrize("reverse, ahead", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["in order", "threads in reverse", "warps ahead", "warps ahead, reversed"])
def test_the_products_copy_as_nanoeuler_cuda_launches_it(monkeypatch, reverse, ahead):
    # flash_attn.cu's attention_backward_dkv_tma_kernel_64 (this file's `_turns_64`, persistent) through the
    # product's own launch: nanoeuler_cuda.attention_backward on the emulator's stand-in driver (compute capability
    # 9.0: its tensor maps, shared memory allowed, SMS persistent blocks; y and lse from the product's forward, delta
    # from its delta kernel, dq from its mma.sync dq pass on the ds stored) at each shape and at T 150 (lse's and
    # delta's rows of T floats no multiple of 16 bytes: the emulator refuses a copy that starts unaligned, as an
    # H100 does with CUDA_ERROR_ILLEGAL_INSTRUCTION) against float64, every element written; the warps of a block in
    # order, reversed, and each running as far as it can before the next (a missing barrier shows), in order and
    # reversed
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    driver = emulator_module().install(nc, sms=SMS, reverse=reverse, warps_ahead=ahead)
    nc.gpu.precision = "bf16"
    monkeypatch.setattr(nc, "ATTENTION_BACKWARD_TMA", True)      # the product's default, pinned here
    calls, launch = [], nc.attention_backward_dkv_tma
    monkeypatch.setattr(nc, "attention_backward_dkv_tma", lambda *args: (calls.append(args[-4:]), launch(*args)))
    launches, cu_launch = [], driver.cuLaunchKernel
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda f, gx, gy, gz, bx, *rest: (
        launches.append((f.name, gx, bx, rest[2])), cu_launch(f, gx, gy, gz, bx, *rest))[1])
    for B, T, Hq, Hkv in [*SHAPES, (2, 150, 3, 1)]:
        qkv, dy = script.random_qkv(B, T, Hq, Hkv), script.random_dy(B, T, Hq)
        qkv_g, dy_g = nc.to_gpu(qkv, np.uint16), nc.to_gpu(dy, np.uint16)
        y, lse, delta = (nc.DeviceArray((B * T, Hq * D), np.uint16), nc.DeviceArray((B, Hq, T)),
                         nc.DeviceArray((B, Hq, T)))
        dqkv, ds = nc.DeviceArray(qkv.shape, np.uint16), nc.DeviceArray((nc.attention_ds_size(B, T, Hq),), np.uint16)
        dqkv.fill_bits(0xFFFF)                                     # NaN: what the kernels do not write shows
        ds.fill_bits(0xFFFF)
        assert nc.attention_tma(D, qkv_g, backward=True)
        nc.attention_forward(y, lse, qkv_g, B, T, Hq, Hkv, D)
        nc.attention_backward(dqkv, dy_g, qkv_g, y, lse, delta, ds, B, T, Hq, Hkv, D)
        assert calls[-1] == (B, T, Hq, Hkv)                                # the TMA dk/dv pass ran
        # its launch: min(units, SMS) blocks, the units ceil(ceil(T / 64) / 2) B Hkv worked out by hand; 384 threads;
        # (4 + 2 4) 8192 (K, V, 4 stages' q, dy) + 2 4 96 4 (lse, delta) + 8 10 (mbarriers) + 1024 = 102480 bytes
        units = {(1, 128, 2, 1): 1, (1, 160, 3, 1): 2, (2, 192, 2, 2): 8, (2, 150, 3, 1): 4}[B, T, Hq, Hkv]
        assert ("attention_backward_dkv_tma_kernel_64", min(units, SMS), 384, 102480) in launches[-3:], launches[-3:]
        out = script.from_bf16(dqkv.download()).reshape(B, T, -1).astype(np.float64)
        assert np.isfinite(out).all(), (B, T, Hq, Hkv)
        for b in range(B):
            refs = script.reference(qkv, dy, b, T, Hq, Hkv)
            e = [script.relative_error(out[b][:, a * D:(a + n) * D], ref) for a, n, ref in
                 ((0, Hq, refs[0]), (Hq, Hkv, refs[1]), (Hq + Hkv, Hkv, refs[2]))]
            assert max(e) <= script.DKV_BOUND, ((B, T, Hq, Hkv), b, e)
    assert driver.shared == {"attention_forward_tma_kernel_64": script.forward_tma.shared_bytes(3, 128, 4),
                             "attention_backward_dkv_tma_kernel_64": nc.dkv_tma_shared_bytes()}


def test_ptxas_keeps_the_products_copy_asynchronous_and_spills_nothing():
    # the same of flash_attn.cu's attention_backward_dkv_tma_kernel_64, as nanoeuler_cuda builds it on an H100 or H200
    pytest.importorskip("cuda.bindings")
    err, log = ptxas_log(os.path.join(HERE, "flash_attn.cu"))
    assert not err and "C751" not in log, log
    entry = log.split("Function properties for attention_backward_dkv_tma_kernel_64")[1]
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in entry.splitlines()[1], entry[:300]
