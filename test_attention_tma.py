"""
dev/variants/attention_forward_tma.cu (a FlashAttention-3-style bf16 attention forward at D = 64: wgmma fed by TMA
through mbarriers, a producer warpgroup and one consumer warpgroup per query head, issue 36) on
tools/emulate_cuda.py's CPU emulator: y and lse of each version (64 or 128 keys a step, waited for at once or
overlapped, a block a unit or persistent blocks walking several) against numpy in float64 at small shapes (causal,
GQA, a T that ends inside a query tile, an odd number of tiles), within the GPU script's bounds, also with the
threads run in reverse order; the same kernel with its causal mask or its rescale taken out is off by far more;
NVRTC compiles it for sm_90a, and ptxas keeps its wgmma asynchronous with no spills; and
`python dev/variants/attention_forward_tma.py`, the lead's GPU command, runs on the emulator's stand-in driver.
The product's copy of `_pipelined_turns_128` (flash_attn.cu's attention_forward_tma_kernel_64) too, launched by
nanoeuler_cuda.attention_forward with its tensor maps, and through ptxas.

    python -m pytest -q test_attention_tma.py
"""

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = os.path.join(HERE, "dev", "variants", "attention_forward_tma.cu")
_spec = importlib.util.spec_from_file_location("attention_forward_tma",
                                               os.path.join(HERE, "dev", "variants", "attention_forward_tma.py"))
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
    helpers = emulator.WGMMA_HELPERS + emulator.TMA_HELPERS
    return emulator.load(path, select=lambda text: emulator.without_helpers(text, helpers), **options)


SMS = 3             # the persistent versions: as many blocks (fewer than the units: each walks several)


class Emulated:
    """what arguments() asks of nanoeuler_cuda: the stand-in driver's tensor maps and a GPU of SMS SMs"""

    def __init__(self):
        from cuda.bindings import driver as real
        self.cu = emulator_module().Driver(real)
        self.gpu = type("GPU", (), {"sms": SMS})()


def run(lib, name, qkv, B, T, Hq, Hkv, monkeypatch):
    """a version on the emulator -> y (B T, Hq D) as float32, lse (B, Hq, T); NaN where it did not write"""
    y = np.full((B * T, Hq * D), 0xFFFF, np.uint16)
    lse = np.full((B, Hq, T), np.nan, np.float32)
    emulated = Emulated()
    monkeypatch.setattr(script.nc, "gpu", emulated.gpu)
    entry, grid, threads, _, args = script.arguments(emulated.cu, name, y.ctypes.data, lse.ctypes.data,
                                                     qkv.ctypes.data, B, T, Hq, Hkv)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
    launch = lib.emu_launch(lib.emu_kernel(entry.encode()), grid, 1, 1, threads, params)
    fault = lib.emu_run(launch)
    lib.emu_free(launch)
    assert not fault, f"{name} read or wrote outside its arrays"
    return script.from_bf16(y), lse


def errors(lib, name, B, T, Hq, Hkv, monkeypatch, seed=0):
    """relative norms of y's and lse's errors against float64, every batch row"""
    qkv = script.random_qkv(B, T, Hq, Hkv, seed)
    y, lse = run(lib, name, qkv, B, T, Hq, Hkv, monkeypatch)
    refs = [script.reference(qkv, b, T, Hq, Hkv) for b in range(B)]
    ey = script.relative_error(y.reshape(B, T, -1).astype(np.float64), np.stack([r[0] for r in refs]))
    el = script.relative_error(lse.astype(np.float64), np.stack([r[1] for r in refs]))
    return ey, el


@pytest.fixture(scope="module")
def variant():
    return load()


# B, T, Hq, Hkv: two consumer warpgroups (Hq / Hkv = 2), 2 units of 5 steps of 64 keys (3 and 4 of 128: the even
# tiles' last steps half masked); three (the big model's 12 / 4), a T that ends inside a query tile (rows past T
# not written, keys past T masked: the next batch row's, or zeros past the end) and an odd number of tiles (the
# middle one a unit by itself); one consumer (no GQA), a unit of one step a batch row; 8 units over 3 persistent
# blocks (each stage's and q buffer's mbarriers through several phases)
SHAPES = [(1, 256, 2, 1), (2, 160, 3, 1), (2, 64, 1, 1), (2, 192, 6, 2)]


@needs_gxx
@pytest.mark.parametrize("name", script.VERSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B%d_T%d_Hq%d_Hkv%d" % s)
def test_each_version_on_the_emulator_against_float64(variant, name, shape, monkeypatch):
    pytest.importorskip("cuda.bindings")
    ey, el = errors(variant, name, *shape, monkeypatch)
    assert ey <= script.Y_BOUND and el <= script.LSE_BOUND, (ey, el)


@needs_gxx
@pytest.mark.parametrize("name", script.VERSIONS)
def test_each_version_with_the_threads_in_reverse_order(name):
    # the consumers run before the producer, and the blocks in reverse: what waits on what is the mbarriers' alone
    # (in a process of its own, so that what the emulator refuses is named here, not a crash of pytest)
    pytest.importorskip("cuda.bindings")
    code = f"""
import sys
sys.path.insert(0, {HERE!r})
import pytest
import test_attention_tma as t
lib = t.load()
lib.emu_set_reverse(1)
with pytest.MonkeyPatch.context() as mp:
    ey, el = t.errors(lib, {name!r}, 2, 192, 6, 2, mp)
assert ey <= t.script.Y_BOUND and el <= t.script.LSE_BOUND, (ey, el)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:].decode()


@needs_gxx
@pytest.mark.parametrize("old, new", [
    ("    if (diagonal)\n", "    if (false)\n"),                                 # no causal mask
    ("correction[r] = exp2f((m[r] - mx[r][0]) * scale2);", "correction[r] = 1.0f;")])   # no rescale
def test_the_check_sees_a_broken_mask_or_rescale(tmp_path, old, new, monkeypatch):
    # the same check on the kernel with one piece of its math taken out: off by far more than the bounds
    pytest.importorskip("cuda.bindings")
    text = open(KERNEL).read()
    assert text.count(old) == 1
    (tmp_path / "broken.cu").write_text(text.replace(old, new))
    lib = load(str(tmp_path / "broken.cu"), cache_dir=str(tmp_path))
    for name in script.VERSIONS:
        ey, el = errors(lib, name, *SHAPES[0], monkeypatch)
        assert ey > 10 * script.Y_BOUND and el > 10 * script.LSE_BOUND, (name, ey, el)


@needs_gxx
def test_the_gpu_script_runs_on_the_emulator(variant, monkeypatch, capsys):
    # `python dev/variants/attention_forward_tma.py` as the lead runs it on a GPU, its host code on the emulator's
    # stand-in driver: both modules, tensor maps, launches, grids, shared memory sizes, the checks (the product's
    # forward, flash_attn.cu's, on the emulator too) and the table (small shapes; the timings are 0 here)
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    emulator = emulator_module()
    driver = emulator.install(nc)
    nc.gpu.arch, nc.gpu.sms = "90", SMS
    libs = {"attention_forward_tma.cu": variant, "flash_attn.cu": nc.gpu.modules["flash_attn.cu"]}
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
    assert end.value.code == 0 and out.count("  OK\n") == 2 * (len(script.VERSIONS) + 1), out
    assert out.endswith("all OK\n"), out


# and for the product's launch, 4 query heads a kv head: W = 2 consumers (the largest of 1, 2, 3 that divides 4), so
# a kv head's query heads are two units (query head h reads kv head h / 4: the units' first heads 0, 2, 4, 6 read kv
# heads 0, 0, 1, 1, where h % Hkv would read 0 every time)
PRODUCT_SHAPES = [(1, 128, 8, 2)]
# (B, T, Hq, Hkv) -> W and the units, B (Hq / W) ceil(ceil(T / 64) / 2), worked out by hand: the grid is
# min(units, SMS) persistent blocks (no idle ones), 128 (W + 1) threads
LAUNCH = {(1, 256, 2, 1): (2, 2), (2, 160, 3, 1): (3, 4), (2, 64, 1, 1): (1, 2), (2, 192, 6, 2): (3, 8),
          (1, 128, 8, 2): (2, 4)}


@needs_gxx
@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "threads in reverse"])
def test_the_products_copy_as_nanoeuler_cuda_launches_it(monkeypatch, reverse):
    # flash_attn.cu's attention_forward_tma_kernel_64 (this file's _pipelined_turns_128) through the product's own
    # launch: nanoeuler_cuda.attention_forward on the emulator's stand-in driver (compute capability 9.0: its tensor
    # maps, shared memory allowed, SMS persistent blocks) at each shape against float64, every element written; its
    # grid, threads and shared memory as LAUNCH says
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    driver = emulator_module().install(nc, sms=SMS, reverse=reverse)
    nc.gpu.precision = "bf16"
    launches, launch = [], driver.cuLaunchKernel
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda f, gx, gy, gz, bx, *rest: (
        launches.append((f.name, gx, bx, rest[2])), launch(f, gx, gy, gz, bx, *rest))[1])
    for B, T, Hq, Hkv in [*SHAPES, *PRODUCT_SHAPES]:
        qkv = script.random_qkv(B, T, Hq, Hkv)
        dqkv = nc.to_gpu(qkv, np.uint16)
        y, lse = nc.DeviceArray((B * T, Hq * D), np.uint16), nc.DeviceArray((B, Hq, T))
        y.fill_bits(0xFFFF)                                        # NaN: what the kernel does not write shows
        lse.fill_bits(0x7FC00000)
        assert nc.attention_tma(D, dqkv)
        nc.attention_forward(y, lse, dqkv, B, T, Hq, Hkv, D)
        refs = [script.reference(qkv, b, T, Hq, Hkv) for b in range(B)]
        ey = script.relative_error(script.from_bf16(y.download()).reshape(B, T, -1).astype(np.float64),
                                   np.stack([r[0] for r in refs]))
        el = script.relative_error(lse.download().astype(np.float64), np.stack([r[1] for r in refs]))
        assert ey <= script.Y_BOUND and el <= script.LSE_BOUND, ((B, T, Hq, Hkv), ey, el)
        W, units = LAUNCH[B, T, Hq, Hkv]                            # the launch, as attention_forward_tma says
        assert launches[-1] == ("attention_forward_tma_kernel_64", min(units, SMS), 128 * (W + 1),
                                script.shared_bytes(W, 128, 4)), ((B, T, Hq, Hkv), launches[-1])
    assert driver.shared == {"attention_forward_tma_kernel_64": script.shared_bytes(3, 128, 4)}   # (W = 3's, once)


def ptxas_log(path=KERNEL):
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    _, nvrtc = nc.import_cuda()
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"--use_fast_math", b"--ptxas-options=-v"]
    err, prog = nvrtc.nvrtcCreateProgram(open(path).read().encode(), os.path.basename(path).encode(), 0, [], [])
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    return err, log.decode(errors="replace")


def test_the_variant_compiles_for_sm_90a_with_nvrtc():
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    cubin = nc.nvrtc_compile("attention_forward_tma.cu", open(KERNEL).read(), "90a")
    for entry, _, _, _ in [*script.VERSIONS.values(), *script.PROBES.values()]:
        assert entry.encode() in cubin, entry               # extern "C": the name is in the CUBIN


def test_ptxas_keeps_every_wgmma_asynchronous_and_spills_nothing():
    # ptxas serializes wgmma it cannot prove safe (C7514, C7519: an accumulator read or a wgmma under a branch
    # before its wait) or injects waits (C7517): the overlap would be gone without a word but this one. No stack
    # frame either (a local array: a loop NVRTC left rolled)
    pytest.importorskip("cuda.bindings")
    err, log = ptxas_log()
    entries = len({entry for entry, _, _, _ in [*script.VERSIONS.values(), *script.PROBES.values()]})
    assert not err and "C751" not in log and log.count(" 0 bytes spill stores") == entries, log
    assert log.count("0 bytes stack frame") == entries, log


def test_ptxas_keeps_the_products_copy_asynchronous_and_spills_nothing():
    # the same of flash_attn.cu's attention_forward_tma_kernel_64, as nanoeuler_cuda builds it on an H100 or H200
    pytest.importorskip("cuda.bindings")
    err, log = ptxas_log(os.path.join(HERE, "flash_attn.cu"))
    assert not err and "C751" not in log, log
    entry = log.split("Function properties for attention_forward_tma_kernel_64")[1]
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in entry.splitlines()[1], entry[:300]
