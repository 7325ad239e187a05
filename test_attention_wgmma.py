"""
dev/variants/attention_forward_wgmma.cu (the bf16 attention forward at D = 64 with Hopper's warpgroup
MMA, issue 36) on tools/emulate_cuda.py's CPU emulator: y and lse of each version (simple, overlapped or
pipelined, 64 or 128 keys a step, a block a unit or persistent blocks walking several) against numpy in
float64 at small shapes (causal, GQA, a query tile past T, an odd number of tiles), within the GPU
script's bounds; the same kernel with its causal mask or its rescale taken out is off by far more; NVRTC
compiles it for sm_90a, and ptxas keeps its wgmma asynchronous with no spills; q's register fragments left undefined before the loop (as they ran
wrong on an H100, right on the emulator) are refused by the PTX check; and `python
dev/variants/attention_forward_wgmma.py`, the lead's GPU command, runs on the emulator's stand-in driver (its
checks and its timing table) at a small shape.
"""

import ctypes
import importlib.util
import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = os.path.join(HERE, "dev", "variants", "attention_forward_wgmma.cu")
_spec = importlib.util.spec_from_file_location("attention_forward_wgmma",
                                               os.path.join(HERE, "dev", "variants", "attention_forward_wgmma.py"))
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
    helpers = emulator.WGMMA_HELPERS + ("cp_async16", "cp_async_commit", "cp_async_wait")
    return emulator.load(path, select=lambda text: emulator.without_helpers(text, helpers), **options)


SMS = 3             # the persistent versions: as many blocks (fewer than the units: each walks several)


def run(lib, name, qkv, B, T, Hq, Hkv):
    """a version on the emulator -> y (B T, Hq D) as float32, lse (B, Hq, T); NaN where it did not write"""
    y = np.full((B * T, Hq * D), 0xFFFF, np.uint16)
    lse = np.full((B, Hq, T), np.nan, np.float32)
    entry, _, _, persistent = script.VERSIONS[name]
    units = script.units(B, T, Hq, Hkv)
    args = [ctypes.c_void_p(y.ctypes.data), ctypes.c_void_p(lse.ctypes.data), ctypes.c_void_p(qkv.ctypes.data),
            ctypes.c_int(B), ctypes.c_int(T), ctypes.c_int(Hq), ctypes.c_int(Hkv), ctypes.c_float(1 / np.sqrt(D))]
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
    launch = lib.emu_launch(lib.emu_kernel(entry.encode()), min(units, SMS) if persistent else units, 1, 1,
                            128 * script.warpgroups(Hq, Hkv), params)
    fault = lib.emu_run(launch)
    lib.emu_free(launch)
    assert not fault, f"{name} read or wrote outside its arrays"
    return script.from_bf16(y), lse


def errors(lib, name, B, T, Hq, Hkv, seed=0):
    """relative norms of y's and lse's errors against float64, every batch row"""
    qkv = script.random_qkv(B, T, Hq, Hkv, seed)
    y, lse = run(lib, name, qkv, B, T, Hq, Hkv)
    refs = [script.reference(qkv, b, T, Hq, Hkv) for b in range(B)]
    ey = script.relative_error(y.reshape(B, T, -1).astype(np.float64), np.stack([r[0] for r in refs]))
    el = script.relative_error(lse.astype(np.float64), np.stack([r[1] for r in refs]))
    return ey, el


@pytest.fixture(scope="module")
def variant():
    return load()


# B, T, Hq, Hkv: two warpgroups a block (Hq / Hkv = 2), 2 units of 5 steps; three (the big model's 12 / 4), a T
# that ends inside a query tile (rows past T not written, keys past T masked) and an odd number of tiles (the
# middle one a unit by itself); one warpgroup a block (no GQA), a unit of one step a batch row; 8 units over 3
# persistent blocks
SHAPES = [(1, 256, 2, 1), (1, 160, 3, 1), (2, 64, 1, 1), (2, 192, 6, 2)]


@needs_gxx
@pytest.mark.parametrize("name", script.VERSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B%d_T%d_Hq%d_Hkv%d" % s)
def test_each_version_on_the_emulator_against_float64(variant, name, shape):
    ey, el = errors(variant, name, *shape)
    assert ey <= script.Y_BOUND and el <= script.LSE_BOUND, (ey, el)


@needs_gxx
@pytest.mark.parametrize("old, new", [
    ("    if (diagonal)\n", "    if (false)\n"),                                 # no causal mask
    ("correction[r] = exp2f((m[r] - mx[r][0]) * scale2);", "correction[r] = 1.0f;")])   # no rescale
def test_the_check_sees_a_broken_mask_or_rescale(tmp_path, old, new):
    # the same check on the kernel with one piece of its math taken out: off by far more than the bounds
    text = open(KERNEL).read()
    assert text.count(old) == 1
    (tmp_path / "broken.cu").write_text(text.replace(old, new))
    lib = load(str(tmp_path / "broken.cu"), cache_dir=str(tmp_path))
    for name in script.VERSIONS:
        ey, el = errors(lib, name, *SHAPES[0])
        assert ey > 10 * script.Y_BOUND and el > 10 * script.LSE_BOUND, (name, ey, el)


@needs_gxx
def test_the_gpu_script_runs_on_the_emulator(variant, monkeypatch, capsys):
    # `python dev/variants/attention_forward_wgmma.py` as the lead runs it on a GPU, its host code on the
    # emulator's stand-in driver: both modules, launches, grids, shared memory sizes, the checks (the product's
    # forward, flash_attn.cu's, on the emulator too) and the table (small shapes; the timings are 0 here)
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    emulator = emulator_module()
    driver = emulator.install(nc)
    nc.gpu.arch = "90"
    libs = {"attention_forward_wgmma.cu": variant, "flash_attn.cu": nc.gpu.modules["flash_attn.cu"]}
    monkeypatch.setattr(nc, "nvrtc_compile", lambda name, source, arch: name.encode())
    monkeypatch.setattr(driver, "cuModuleLoadData", lambda cubin: (0, libs[cubin.decode()]), raising=False)
    monkeypatch.setattr(script, "start_gpu", lambda: nc.gpu)
    monkeypatch.setattr(script, "timed", lambda run: (run(), 1.0)[1])
    monkeypatch.setattr(script, "CHECK", (2, 128, 6, 2))
    monkeypatch.setattr(script, "BATCHES", (2, 1))
    monkeypatch.setattr(script, "LAUNCHES", 1)
    with pytest.raises(SystemExit) as end:
        script.main()
    out = capsys.readouterr().out
    assert end.value.code == 0 and out.count("  OK\n") == len(script.VERSIONS) + 1 and out.endswith("all OK\n"), out


@needs_gxx
def test_each_version_with_copies_landing_at_their_wait(variant):
    # cp.async held until the cp.async.wait_group that covers it, the latest the PTX ISA allows (by default the
    # emulator copies at once, the earliest): a tile read before its wait would read what the stage held before
    variant.emu_set_late_copies(1)
    try:
        for name in script.VERSIONS:
            ey, el = errors(variant, name, *SHAPES[3])
            assert ey <= script.Y_BOUND and el <= script.LSE_BOUND, (name, ey, el)
    finally:
        variant.emu_set_late_copies(0)


@needs_gxx
@pytest.mark.parametrize("old, new, name", [
    ("cp_async_wait<AHEAD - 1>();                                //", "cp_async_wait<AHEAD>(); //", "wgmma"),
    ("cp_async_wait<STAGES - 3>();", "cp_async_wait<STAGES - 2>();", "wgmma pipelined")])
def test_a_wait_one_group_short_is_seen_only_with_late_copies(tmp_path, old, new, name):
    # the simple and the pipelined version waiting for one group of copies too few: right with copies done at once
    # (the round-1 emulator's only way), wrong with copies landing at their wait
    text = open(KERNEL).read()
    assert text.count(old) == 1
    (tmp_path / "broken.cu").write_text(text.replace(old, new))
    lib = load(str(tmp_path / "broken.cu"), cache_dir=str(tmp_path))
    ey, el = errors(lib, name, *SHAPES[3])
    assert ey <= script.Y_BOUND and el <= script.LSE_BOUND, (ey, el)
    lib.emu_set_late_copies(1)
    ey, el = errors(lib, name, *SHAPES[3])
    assert ey > 10 * script.Y_BOUND, (ey, el)


def test_q_left_undefined_before_the_loop_is_refused():
    # the simple q-in-registers version as it ran wrong on an H100 (y 0.41 off, 2026-12-07; right on the emulator):
    # its q fragments, written at every tile's first step only, undefined on the loop's first way in
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import test_wgmma
    text = open(KERNEL).read()
    old = "qf[HD / 16][4] = {};"
    assert text.count(old) == 1
    check = emulator_module().wgmma_registers_not_always_written
    assert not check(test_wgmma.ptx_of(text, "attention_forward_wgmma.cu"))
    found = check(test_wgmma.ptx_of(text.replace(old, "qf[HD / 16][4];"), "attention_forward_wgmma.cu"))
    wrong = {"attention_forward_wgmma_qr_64", "attention_forward_wgmma_k128_qr_64"}     # the simple ones
    assert {entry for entry, _, _ in found} == wrong, found


def test_the_variant_compiles_for_sm_90a_with_nvrtc():
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    cubin = nc.nvrtc_compile("attention_forward_wgmma.cu", open(KERNEL).read(), "90a")
    for entry, _, _, _ in script.VERSIONS.values():
        assert entry.encode() in cubin, entry               # extern "C": the name is in the CUBIN


def test_ptxas_keeps_every_wgmma_asynchronous_and_spills_nothing():
    # ptxas serializes wgmma it cannot prove safe (C7514, C7519: an accumulator read or a wgmma under a branch
    # before its wait) or injects waits (C7517): the overlap would be gone without a word but this one
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    _, nvrtc = nc.import_cuda()
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"--use_fast_math", b"--ptxas-options=-v"]
    err, prog = nvrtc.nvrtcCreateProgram(open(KERNEL).read().encode(), b"attention_forward_wgmma.cu", 0, [], [])
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    log = log.decode(errors="replace")
    assert not err and "C751" not in log and log.count(" 0 bytes spill stores") == len(script.ENTRIES), log
