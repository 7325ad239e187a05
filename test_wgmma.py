"""
Hopper's warpgroup MMA (wgmma.mma_async, sm_90a) on tools/emulate_cuda.py's CPU emulator:
dev/variants/wgmma_probe.cu's one-warpgroup products c (64, N) = a @ b, bf16 operands read from
shared memory through matrix descriptors (no swizzle, 32-, 64- and 128-byte swizzles; K-major and
MN-major operands, or a from registers; N = 64 and 128; two groups waited for one at a time), against
numpy in float64, within the error of summing in fp32.
A wrong accumulator layout, descriptor field, stride or swizzle in the emulator gives errors of the
size of the products themselves (`python tools/mutate.py --set wgmma` puts such bugs in). The same
probe runs on a GPU with `python dev/variants/wgmma_probe.py`.
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
PROBE = os.path.join(HERE, "dev", "variants", "wgmma_probe.cu")
_spec = importlib.util.spec_from_file_location("wgmma_probe", os.path.join(HERE, "dev", "variants", "wgmma_probe.py"))
probe_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe_script)
# the variants and their operands, as the GPU script runs them
VARIANTS, bf16_bits, operands, fp32_bound = (probe_script.VARIANTS, probe_script.bf16_bits, probe_script.operands,
                                             probe_script.fp32_bound)


def emulator_module():
    spec = importlib.util.spec_from_file_location("emulate_cuda", os.path.join(HERE, "tools", "emulate_cuda.py"))
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    return emulator


# the probe's helpers whose inline PTX the emulator's header defines: wgmma's, and cp.async's for the product
HELPERS = emulator_module().WGMMA_HELPERS + ("cp_async16", "cp_async_commit", "cp_async_wait")

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")


def run(lib, name, a, b, N, K):
    """the probe `name` on the emulator, one block of 128 threads -> c (64, N)"""
    c = np.full((64, N), np.nan, np.float32)
    args = [ctypes.c_void_p(c.ctypes.data), ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(b.ctypes.data),
            ctypes.c_int(K)]
    params = (ctypes.c_void_p * 4)(*[ctypes.addressof(x) for x in args])
    launch = lib.emu_launch(lib.emu_kernel(name.encode()), 1, 1, 1, 128, params)
    fault = lib.emu_run(launch)
    lib.emu_free(launch)
    assert not fault, f"{name} read or wrote outside its arrays"
    return c


@pytest.fixture(scope="module")
def probe():
    emulator = emulator_module()
    return emulator.load(PROBE, select=lambda text: emulator.without_helpers(text, HELPERS))


@needs_gxx
@pytest.mark.parametrize("name", VARIANTS)
def test_wgmma_probe_on_the_emulator_against_float64(probe, name):
    N, K, a_mn, b_mn = VARIANTS[name]
    a, b, A, B = operands(N, K, a_mn, b_mn, seed=len(name))
    c = run(probe, name, a, b, N, K)
    ref = A @ B
    assert np.all(np.abs(c - ref) <= fp32_bound(A, B)), (name, np.nanmax(np.abs(c - ref)))


@needs_gxx
def test_each_accumulator_lands_on_its_own_row_and_column(probe):
    # c[i, j] = 64 i + j exactly (a's rows (i, 1, 0, ...), b's rows (64, j, 0, ...)): a register the
    # emulator puts in the wrong place is named by where it went
    N, K = 64, 64
    a, b = np.zeros((64, K), np.float32), np.zeros((N, K), np.float32)
    a[:, 0], a[:, 1] = np.arange(64), 1
    b[:, 0], b[:, 1] = 64, np.arange(N)
    c = run(probe, "wgmma_n64_interleave_ak_bk", bf16_bits(a), bf16_bits(b), N, K)
    want = 64 * np.arange(64)[:, None] + np.arange(N)[None, :]
    wrong = [(i, j, c[i, j]) for i, j in zip(*np.nonzero(c != want))]
    assert not wrong, f"{len(wrong)} elements wrong, the first (row, column, value): {wrong[:4]}"


@needs_gxx
@pytest.mark.parametrize("old, new, refusal", [
    ("    wgmma_wait<0>();\n    fence_registers<N / 2>(d);", "    fence_registers<N / 2>(d);",
     "a thread exits with a wgmma not waited for"),
    ("    wgmma_fence();\n    int half", "    int half",
     "a wgmma.mma_async with no wgmma.fence since the thread last waited")])
def test_what_a_gpu_leaves_undefined_is_refused_by_name(tmp_path, old, new, refusal):
    # the probe without its wait, or without its fence: the launch fails, named (in a process of its own: the
    # emulator aborts)
    text = open(PROBE).read()
    assert text.count(old) == 1
    (tmp_path / "broken.cu").write_text(text.replace(old, new))
    code = f"""
import sys
sys.path.insert(0, {HERE!r})
import test_wgmma as t
emulator = t.emulator_module()
lib = emulator.load({str(tmp_path / "broken.cu")!r}, cache_dir={str(tmp_path)!r},
                    select=lambda text: emulator.without_helpers(text, t.HELPERS))
a, b, _, _ = t.operands(64, 64, False, False, 0)
t.run(lib, "wgmma_n64_interleave_ak_bk", a, b, 64, 64)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=300)
    assert r.returncode != 0 and refusal.encode() in r.stderr, r.stderr[-2000:]


@needs_gxx
@pytest.mark.parametrize("BN", [128, 256])
def test_the_multi_tile_product_on_the_emulator_against_float64(probe, BN):
    # 4 steps of 64 k through the 4 stages (each reused from step 2 on), 2 x 2 or 1 x 2 blocks; c rounded to bf16
    M, N, K = 256, 256, 256
    rng = np.random.default_rng(BN)
    a, b = bf16_bits(rng.normal(size=(M, K))), bf16_bits(rng.normal(size=(N, K)))
    A, B = probe_script.from_bf16(a).astype(np.float64), probe_script.from_bf16(b).astype(np.float64).T
    c = np.full((M, N), 0xFFFF, np.uint16)                            # NaN: what the kernel does not write shows
    args = [ctypes.c_void_p(c.ctypes.data), ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(b.ctypes.data),
            ctypes.c_int(N), ctypes.c_int(K)]
    params = (ctypes.c_void_p * 5)(*[ctypes.addressof(x) for x in args])
    launch = probe.emu_launch(probe.emu_kernel(f"wgmma_gemm_bn{BN}".encode()), N // BN, M // 128, 1, 256, params)
    assert not probe.emu_run(launch)
    probe.emu_free(launch)
    ref = A @ B
    err = np.abs(probe_script.from_bf16(c) - ref)
    assert np.all(err <= fp32_bound(A, B) + 2.0 ** -8 * np.abs(ref)), np.nanmax(err)


@needs_gxx
def test_the_gpu_script_runs_on_the_emulator(probe, monkeypatch, capsys):
    # `python dev/variants/wgmma_probe.py` as the lead runs it on a GPU, its host code on the emulator's
    # stand-in driver: launches, shared memory sizes, grids, the checks (small shapes; the timings are 0 here)
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    emulator = emulator_module()
    driver = emulator.install(nc)
    nc.gpu.arch = "90"
    monkeypatch.setattr(driver, "cuModuleLoadData", lambda cubin: (0, probe), raising=False)
    monkeypatch.setattr(driver, "cuFuncSetAttribute", lambda f, attribute, value: (0,), raising=False)
    monkeypatch.setattr(nc, "nvrtc_compile", lambda *args: b"")
    monkeypatch.setattr(nc, "Cublas", lambda stream: emulator.Cublas(nc))
    monkeypatch.setattr(probe_script, "start_gpu", lambda: nc.gpu)
    monkeypatch.setattr(probe_script, "timed", lambda run: (run(), 1.0)[1])
    monkeypatch.setattr(probe_script, "CHECK", (256, 256, 128))
    monkeypatch.setattr(probe_script, "PRODUCTS", [("small", 128, 256, 64)])
    with pytest.raises(SystemExit) as end:
        probe_script.main()
    out = capsys.readouterr().out
    assert end.value.code == 0 and out.count("  OK\n") == len(VARIANTS) + 2 and out.endswith("all OK\n"), out


def test_the_probe_compiles_for_sm_90a_with_nvrtc():
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    cubin = nc.nvrtc_compile("wgmma_probe.cu", open(PROBE).read(), "90a")
    for name in [*VARIANTS, "wgmma_gemm_bn128", "wgmma_gemm_bn256"]:
        assert name.encode() in cubin, name                 # extern "C": the name is in the CUBIN
