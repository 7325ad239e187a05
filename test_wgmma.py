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


# the probe's helpers whose inline PTX the emulator's header defines: wgmma's, cp.async's for the product, and
# mbarriers', TMA's, named barriers' and setmaxnreg for the product fed by TMA
HELPERS = emulator_module().WGMMA_HELPERS + ("cp_async16", "cp_async_commit", "cp_async_wait") + \
    emulator_module().TMA_HELPERS

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
    monkeypatch.setattr(nc, "nvrtc_compile", lambda *args: b"")
    monkeypatch.setattr(nc, "Cublas", lambda stream: emulator.Cublas(nc))
    # the script's own start_gpu on the stand-in driver (its arch, name and SMs asked of it), in the emulator's context
    monkeypatch.setattr(probe_script, "open_device", lambda: (0, None, nc.gpu.stream))
    monkeypatch.setattr(probe_script, "timed", lambda run: (run(), 1.0)[1])
    monkeypatch.setattr(probe_script, "CHECK", (256, 512, 128))
    monkeypatch.setattr(probe_script, "PRODUCTS", [("small", 128, 256, 64)])
    monkeypatch.setattr(probe_script, "CHECK_TN", (256, 512, 384))   # not square: a map with its sides swapped shows
    monkeypatch.setattr(probe_script, "DATA_GRADIENTS", [("small", 128, 256, 64)])
    monkeypatch.setattr(probe_script, "WEIGHT_GRADIENTS", [("small", 128, 256, 512)])
    with pytest.raises(SystemExit) as end:
        probe_script.main()
    out = capsys.readouterr().out
    checked = len(probe_script.GEMMS) - len(probe_script.TIMING_ONLY) + len(probe_script.NN_GEMMS) + 1
    assert "same bits on 5 blocks and on 2" in out, out
    assert end.value.code == 0 and out.count("  OK\n") == len(VARIANTS) + checked, out
    assert out.endswith("all OK\n"), out


# the backward's products' entry points (the data gradient's, the weight gradient's and its sum of the partials)
BACKWARD = [*probe_script.NN_GEMMS, probe_script.SPLITK, "splitk_reduce_add"]


def test_the_probe_compiles_for_sm_90a_with_nvrtc():
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    cubin = nc.nvrtc_compile("wgmma_probe.cu", open(PROBE).read(), "90a")
    for name in [*VARIANTS, *(name for name, _, _ in probe_script.GEMMS), *BACKWARD]:
        assert name.encode() in cubin, name                 # extern "C": the name is in the CUBIN


def ptx_of(text, name):
    """a .cu file's text -> its PTX for sm_90a, by NVRTC with nanoeuler_cuda's options"""
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    _, nvrtc = nc.import_cuda()
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"--use_fast_math"]
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert not err, name
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = bytearray(size)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode(errors="replace")


VARIANTS_DIR = os.path.join(HERE, "dev", "variants")
WGMMA_FILES = sorted(f for f in os.listdir(VARIANTS_DIR)
                     if f.endswith(".cu") and "wgmma.mma_async" in open(os.path.join(VARIANTS_DIR, f)).read())


@pytest.mark.parametrize("file", WGMMA_FILES)
def test_every_register_a_wgmma_reads_is_written_on_every_path_to_it(file):
    # what the emulator cannot run (ptxas's registers): a wgmma's register a left undefined on one path into a loop
    # lost its value to other uses after the wgmma on an H100 (attention_forward_wgmma.cu's q, 2026-12-07)
    pytest.importorskip("cuda.bindings")
    ptx = ptx_of(open(os.path.join(VARIANTS_DIR, file)).read(), file)
    assert ptx.count("wgmma.mma_async") and not emulator_module().wgmma_registers_not_always_written(ptx)


def test_ptxas_keeps_the_products_wgmma_asynchronous_and_spills_nothing():
    # ptxas serializes wgmma it cannot prove safe (C7514, C7519: an accumulator read or a wgmma under a branch
    # before its wait) or injects waits (C7517), naming the function: for a product that is its rate gone without a
    # word but this one (the one-warpgroup probes above are serialized, their loop over a runtime K: not timed)
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, HERE)
    import nanoeuler_cuda as nc
    _, nvrtc = nc.import_cuda()
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"--use_fast_math", b"--ptxas-options=-v"]
    err, prog = nvrtc.nvrtcCreateProgram(open(PROBE).read().encode(), b"wgmma_probe.cu", 0, [], [])
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    log = log.decode(errors="replace")
    assert not err, log
    sections = {part.split("'")[0]: part for part in log.split("Compiling entry function '")[1:]}
    for name in [*(name for name, _, _ in probe_script.GEMMS), *BACKWARD]:
        assert " 0 bytes spill stores" in sections[name] and f"the function '{name}'" not in log, sections[name]


def tensor_map(x, rows, cols, box_rows):
    """the stand-in driver's tensor map of the bf16 matrix x (rows, cols), boxes of 64 columns x box_rows, 128-byte
    swizzle, as 128 bytes to pass by value"""
    from cuda.bindings import driver as real
    u64, u32 = real.cuuint64_t, real.cuuint32_t                 # as cuda-python's takes them
    _, m = emulator_module().Driver(real).cuTensorMapEncodeTiled(
        real.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x.ctypes.data, [u64(cols), u64(rows)],
        [u64(cols * 2)], [u32(64), u32(box_rows)], [u32(1), u32(1)],
        real.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, real.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        real.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
        real.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return (ctypes.c_uint64 * 16)(*[int(w) for w in m.opaque])


def tma_product(lib, BN, M, N, K, seed=0, name=None, blocks=None):
    """the probe's product fed by TMA (wgmma_tma_gemm_bn*, or the entry point `name` of the script's TMA_GEMMS or
    NN_GEMMS) on the emulator, its tensor maps made by the stand-in driver's cuTensorMapEncodeTiled; a persistent one
    on `blocks` blocks -> c (M, N) as float32, a @ b.T (NN_GEMMS: a @ b, b (K, N)) in float64, the bound"""
    rng = np.random.default_rng(seed)
    nn = name in probe_script.NN_GEMMS
    a, b = bf16_bits(rng.normal(size=(M, K))), bf16_bits(rng.normal(size=(K, N) if nn else (N, K)))
    A, B = probe_script.from_bf16(a).astype(np.float64), probe_script.from_bf16(b).astype(np.float64)
    B = B if nn else B.T
    c = np.full((M, N), 0xFFFF, np.uint16)                            # NaN: what the kernel does not write shows
    name = name or f"wgmma_tma_gemm_bn{BN}"
    maps = [tensor_map(a, M, K, 128), tensor_map(b, K, N, 64) if nn else tensor_map(b, N, K, BN)]
    if {**probe_script.TMA_GEMMS, **probe_script.NN_GEMMS}[name][2]:      # persistent: c's map too, and M
        args = [ctypes.c_void_p(c.ctypes.data), *maps, tensor_map(c, M, N, 64), ctypes.c_int(M), ctypes.c_int(N),
                ctypes.c_int(K)]
        grid = (blocks, 1)
    else:
        args, grid = [ctypes.c_void_p(c.ctypes.data), *maps, ctypes.c_int(N), ctypes.c_int(K)], (N // BN, M // 128)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
    launch = lib.emu_launch(lib.emu_kernel(name.encode()), *grid, 1, 384, params)
    assert not lib.emu_run(launch)
    lib.emu_free(launch)
    ref = A @ B
    return probe_script.from_bf16(c), ref, fp32_bound(A, B) + 2.0 ** -8 * np.abs(ref)


@needs_gxx
@pytest.mark.parametrize("BN, reverse", [(128, 0), (256, 0), (128, 1)])
def test_the_tma_product_on_the_emulator_against_float64(BN, reverse):
    # 8 steps of 64 k through the 4 stages: each stage's full and empty mbarriers go through phases 0 and 1 (the
    # producer waits for an empty one from step 4 on), 2 x 2 or 1 x 2 blocks of a producer and two consumers;
    # once with the threads in reverse order (the consumers first)
    # (in a process of its own, so that what the emulator refuses is named here, not a crash of pytest)
    pytest.importorskip("cuda.bindings")
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {HERE!r})
import test_wgmma as t
emulator = t.emulator_module()
lib = emulator.load(t.PROBE, select=lambda text: emulator.without_helpers(text, t.HELPERS))
lib.emu_set_reverse({reverse})                        # blocks, and threads between waits, in reverse order
c, ref, bound = t.tma_product(lib, {BN}, 256, 256, 512, seed={BN})
assert np.all(np.abs(c - ref) <= bound), np.nanmax(np.abs(c - ref))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:].decode()


# the tuned products (issue 36's steps toward cuBLAS's rate), each against numpy and a mutant of it: (entry point, the
# emulator's blocks for a persistent one, threads in reverse order)
TUNED = [("wgmma_tma_gemm_bn128_s6", None, 0), ("wgmma_tma_persistent_bn256", 3, 0),
         ("wgmma_tma_persistent_bn128_s6", 3, 1), ("wgmma_tma_persistent_store_bn256", 3, 1),
         ("wgmma_tma_persistent_store_bn128_s6", 2, 0), ("wgmma_tma_persistent_store_bn256_split", 3, 1),
         ("wgmma_tma_pingpong_bn128_s6", 3, 1), ("wgmma_tma_pingpong_bn128_s6", 1, 0),
         ("wgmma_tma_persistent_store_nn_bn256", 3, 0), ("wgmma_tma_persistent_store_nn_bn256", 2, 1)]


def run_tuned(tmp_path, name, blocks, reverse, mutation=None):
    """the product `name` at 384 x 512 x 448 on the emulator, in a process of its own (what the emulator refuses
    aborts it), the probe's text with mutation (old, new, from where: old's first place after it) -> its exit code
    and stderr, "c is wrong" there when c is not within its bound"""
    text = open(PROBE).read()
    if mutation:
        old, new, start = mutation
        at = text.index(start)
        assert old in text[at:], old
        text = text[:at] + text[at:].replace(old, new, 1)
    (tmp_path / "probe.cu").write_text(text)
    BN = {**probe_script.TMA_GEMMS, **probe_script.NN_GEMMS}[name][0]
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {HERE!r})
import test_wgmma as t
emulator = t.emulator_module()
lib = emulator.load({str(tmp_path / "probe.cu")!r}, cache_dir={str(tmp_path)!r},
                    select=lambda text: emulator.without_helpers(text, t.HELPERS))
lib.emu_set_reverse({reverse})
c, ref, bound = t.tma_product(lib, {BN}, 384, 512, 448, seed=1, name={name!r}, blocks={blocks})
if not np.all(np.abs(c - ref) <= bound):
    sys.exit(f"c is wrong: {{np.nanmax(np.abs(c - ref) / bound)}} x its bound")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=600)
    return r.returncode, r.stderr.decode()


@needs_gxx
@pytest.mark.parametrize("name, blocks, reverse", TUNED)
def test_each_tuned_tma_product_on_the_emulator_against_float64(tmp_path, name, blocks, reverse):
    # 7 steps of 64 k a tile through 4 or 6 stages; persistent: 2 or 3 blocks walk the 6 (BN 256) or 12 (BN 128)
    # tiles of 384 x 512, so a block's steps run on through its stages across tiles (a tile's first step in any
    # stage, each mbarrier through phases 0 and 1 several times) and a consumer's two c boxes are reused
    pytest.importorskip("cuda.bindings")
    code, err = run_tuned(tmp_path, name, blocks, reverse)
    assert code == 0, err[-2000:]



@needs_gxx
@pytest.mark.parametrize("name", ["wgmma_tma_persistent_bn256_no_store", "wgmma_tma_persistent_bn256_copies_only"])
def test_the_products_timed_alone_run_through_and_write_nothing(tmp_path, name):
    # the script's TIMING_ONLY: every stage freed and the block ended (no deadlock), c left as it was (NaN)
    pytest.importorskip("cuda.bindings")
    code, err = run_tuned(tmp_path, name, 3, 0)
    assert code != 0 and "c is wrong: nan" in err, err[-2000:]

PERSISTENT = "template <int BN, int STAGES, int EPILOGUE, int SPLIT = 0, int PINGPONG = 0, int B_MN = 0>"


@needs_gxx
@pytest.mark.parametrize("name, blocks, reverse, mutation, failure", [
    # 6 stages with the mbarriers of 4 set up
    ("wgmma_tma_gemm_bn128_s6", None, 0, ("for (int s = 0; s < STAGES; s++)", "for (int s = 0; s < 4; s++)",
                                          "wgmma_tma_gemm("), "an mbarrier operation on 8 bytes that mbarrier.init"),
    # a tile's last stage never freed: the producer waits for it a round later
    ("wgmma_tma_persistent_bn256", 3, 0,
     ("if (lead) mbarrier_arrive(&empty[((n + 1) * steps - 1) % STAGES]);", "", PERSISTENT),
     "wait at an mbarrier's try_wait.parity"),
    # the accumulators zeroed at the block's first step only: a block's second tile adds to its first
    ("wgmma_tma_persistent_bn128_s6", 3, 0, ("(bs, BN, GEMM_BK, kk), kt > 0 || kk > 0);",
                                             "(bs, BN, GEMM_BK, kk), it > 0 || kk > 0);", PERSISTENT), "c is wrong"),
    # the box of two boxes ago written before its store read it
    ("wgmma_tma_persistent_store_bn256", 3, 0, ("bulk_wait_read<1>();", "bulk_wait_read<2>();", PERSISTENT),
     "c is wrong"),
    # written unswizzled, read by the store as swizzled
    ("wgmma_tma_persistent_store_bn128_s6", 2, 0, ("(chunk ^ row % 8) * 16", "chunk * 16", PERSISTENT), "c is wrong"),
    # 128 x 128 consumers: both m64n128k16 read a's first 64 rows
    ("wgmma_tma_persistent_store_bn256_split", 3, 0,
     ("operand_descriptor<128, 0>(as + h * 64 * GEMM_BK,", "operand_descriptor<128, 0>(as,", PERSISTENT),
     "c is wrong"),
    # ping-pong: both consumers on the same tiles
    ("wgmma_tma_pingpong_bn128_s6", 3, 0, ("n = PINGPONG ? wg - 1 : 0", "n = 0", PERSISTENT), "a deadlock"),
    # ping-pong without turns: consumer 2 waits for its first tile's copies a round ahead, and parity passes it
    ("wgmma_tma_pingpong_bn128_s6", 1, 0, ("if (PINGPONG && n > 0) named_barrier_sync(3 + wg, 256);", "",
                                           PERSISTENT), "wait at an mbarrier's try_wait.parity"),
    # the block ends with its last stores still reading the boxes
    ("wgmma_tma_persistent_store_bn128_s6", 2, 0,
     ("    if (EPILOGUE == 1 && lead) bulk_wait_read<0>();", "", PERSISTENT),
     "a thread exits with a TMA store not waited for"),
    # a copy, or a store, whose first element is 4 bf16 columns on (8 bytes: no multiple of 16): refused by name, as
    # an H100 stops such a kernel (CUDA_ERROR_ILLEGAL_INSTRUCTION; the likely cause of the TMA dk/dv pass's fault at
    # T 150, dev/LOG.md)
    ("wgmma_tma_gemm_bn128", None, 0, ("tma_load_2d(stage, map_a, kt * GEMM_BK, m0,",
                                       "tma_load_2d(stage, map_a, kt * GEMM_BK + 4, m0,", "wgmma_tma_gemm("),
     "a TMA copy whose first element is not 16-byte aligned"),
    ("wgmma_tma_persistent_store_bn128_s6", 2, 0,
     ("tma_store_2d(map_c, box, x, y)", "tma_store_2d(map_c, box, x + 4, y)", PERSISTENT),
     "a TMA store whose first element is not 16-byte aligned"),
    # the data gradient's b (K, N) read as if K-major: the transpose-b bit clear
    ("wgmma_tma_persistent_store_nn_bn256", 3, 0, ("wgmma_bf16<BN, 0, B_MN>(d,", "wgmma_bf16<BN, 0, 0>(d,", PERSISTENT),
     "c is wrong"),
    # every box of b at the tile's first 64 columns
    ("wgmma_tma_persistent_store_nn_bn256", 3, 0,
     ("tile % columns * BN + 64 * j, kt * GEMM_BK", "tile % columns * BN, kt * GEMM_BK", PERSISTENT), "c is wrong"),
    # b's descriptor with the 64-byte swizzle (and its strides) where TMA wrote the 128-byte one
    ("wgmma_tma_persistent_store_nn_bn256", 3, 0,
     ("operand_descriptor<128, B_MN>(bs, BN, GEMM_BK, kk)", "operand_descriptor<64, B_MN>(bs, BN, GEMM_BK, kk)",
      PERSISTENT), "c is wrong"),
    # b's 64-column groups 16 KB apart (LBO of 128 k), not 8 KB
    ("wgmma_tma_persistent_store_nn_bn256", 3, 0,
     ("operand_descriptor<128, B_MN>(bs, BN, GEMM_BK, kk)", "operand_descriptor<128, B_MN>(bs, BN, 2 * GEMM_BK, kk)",
      PERSISTENT), "c is wrong")])
def test_a_mutant_of_each_tuned_product_fails(tmp_path, name, blocks, reverse, mutation, failure):
    pytest.importorskip("cuda.bindings")
    code, err = run_tuned(tmp_path, name, blocks, reverse, mutation)
    assert code != 0 and failure in err, err[-2000:]


@needs_gxx
@pytest.mark.parametrize("old, new, refusal", [
    # expect_tx announces 16 bytes more than the copies bring: the full barrier's phase never completes
    ("mbarrier_arrive_expect_tx(&full[s], STAGE * 2);", "mbarrier_arrive_expect_tx(&full[s], STAGE * 2 + 16);",
     "tx-count 16 bytes"),
    # or 16 fewer: the copies' bytes outrun it
    ("mbarrier_arrive_expect_tx(&full[s], STAGE * 2);", "mbarrier_arrive_expect_tx(&full[s], STAGE * 2 - 16);",
     "more bytes (complete_tx) than expect_tx announced"),
    # the consumers never free a stage: the producer waits at step 4 for a phase that never completes
    ("if (kt > 0 && threadIdx.x % 128 == 0) mbarrier_arrive(", "if (kt < 0) mbarrier_arrive(",
     "1 thread(s) from thread 0 wait at an mbarrier's try_wait.parity 0"),
    # the consumers' named barrier counts the producer's threads, which never come
    ("named_barrier_sync(1, 256);", "named_barrier_sync(1, 384);", "named barrier 1 (256 of 384 threads arrived)"),
    ("named_barrier_sync(1, 256);", "named_barrier_sync(1, 200);", "a named barrier's thread count not a multiple"),
    # an mbarrier that mbarrier.init never set up
    ("mbarrier_init(&full[s], 1), ", "", "an mbarrier operation on 8 bytes that mbarrier.init did not set up")])
def test_mbarrier_and_named_barrier_misuse_is_refused_by_name(tmp_path, old, new, refusal):
    # the TMA product with one thing wrong: the launch fails, named, instead of hanging or computing garbage (in a
    # process of its own: the emulator aborts)
    pytest.importorskip("cuda.bindings")
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
t.tma_product(lib, 128, 128, 128, 512)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=300)
    assert r.returncode != 0 and refusal.encode() in r.stderr, r.stderr[-2000:]


def test_cu_tensor_map_encode_tiled_holds_to_the_driver_rules():
    # the stand-in driver's tensor maps: what the real driver refuses (or the emulator does not do) raises, named
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as real
    driver = emulator_module().Driver(real)
    T = real.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    rest = (real.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            real.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            real.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
            real.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)

    def encode(rank, address, dims, strides, box, element_strides=(1, 1)):
        return driver.cuTensorMapEncodeTiled(T, rank, address, [real.cuuint64_t(v) for v in dims],
                                             [real.cuuint64_t(v) for v in strides], [real.cuuint32_t(v) for v in box],
                                             [real.cuuint32_t(v) for v in element_strides], *rest)

    err, m = encode(2, 4096, [64, 128], [128], [64, 128])
    assert err == 0 and [int(w) for w in m.opaque[:10]] == [driver.TMAP_TAG, 4096, 2, 2, 64, 128, 128, 64, 128, 128]
    for args, why in [((2, 4104, [64, 128], [128], [64, 128]), "not 16-byte aligned"),
                      ((2, 4096, [64, 128], [136], [64, 128]), "not a multiple of 16 bytes"),
                      ((2, 4096, [128, 128], [256], [128, 128]), "wider than the swizzle"),
                      ((2, 4096, [64, 512], [128], [64, 512]), "outside 1 .. 256"),
                      ((2, 4096, [64, 128], [128], [64, 128], [2, 1]), "element strides are not 1"),
                      ((3, 4096, [64, 128, 2], [128, 256], [64, 128, 1], [1, 1, 1]), "rank is not 2")]:
        with pytest.raises(ValueError, match=why):
            encode(*args)
    with pytest.raises(TypeError, match="cuuint64_t"):                  # plain ints, as cuda-python refuses them
        driver.cuTensorMapEncodeTiled(T, 2, 4096, [64, 128], [128], [64, 128], [1, 1], *rest)


NAMED = r"""
// warps 0 and 1 write 64 values and arrive at named barrier 1 without waiting; warps 2 and 3 wait there for
// all 128, then read them; warp 4 waits at no barrier and leaves
extern "C" __global__ void named_barrier_probe(float* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* values = (float*)smem;
    if (threadIdx.x < 64) {
        values[threadIdx.x] = 1.0f + threadIdx.x;
        named_barrier_arrive(1, 128);
    } else if (threadIdx.x < 128) {
        named_barrier_sync(1, 128);
        out[threadIdx.x - 64] = values[127 - threadIdx.x];
    }
}
"""


@needs_gxx
@pytest.mark.parametrize("reverse", [0, 1])
def test_a_named_barrier_orders_bar_arrive_before_bar_sync(tmp_path, reverse):
    # in reverse order the readers come first: bar.sync must hold them until the writers' bar.arrive
    emulator = emulator_module()
    (tmp_path / "named.cu").write_text(open(PROBE).read() + NAMED)
    lib = emulator.load(str(tmp_path / "named.cu"), cache_dir=str(tmp_path),
                        select=lambda text: emulator.without_helpers(text, HELPERS))
    lib.emu_set_reverse(reverse)
    out = np.full(64, np.nan, np.float32)
    arg = ctypes.c_void_p(out.ctypes.data)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    launch = lib.emu_launch(lib.emu_kernel(b"named_barrier_probe"), 1, 1, 1, 160, params)
    assert not lib.emu_run(launch)
    lib.emu_free(launch)
    assert np.array_equal(out, 64.0 - np.arange(64)), out


TMA_PROBE = r"""
// one TMA copy of the map's box at (x, y) into shared memory (1024-byte aligned), waited for on an mbarrier, then
// the tile's bytes as they landed (swizzle and all) copied out
extern "C" __global__ void tma_probe(unsigned short* out, const __grid_constant__ TensorMap map, int x, int y,
                                     int bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* tile = smem + (1024 - shared_address(smem) % 1024) % 1024;
    unsigned long long* bar = (unsigned long long*)(tile + bytes);
    if (threadIdx.x == 0) {
        mbarrier_init(bar, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(bar, bytes);
        tma_load_2d(tile, &map, x, y, bar);
    }
    mbarrier_wait(bar, 0);
    for (int i = threadIdx.x; i < bytes / 2; i += blockDim.x) out[i] = ((const unsigned short*)tile)[i];
}
"""


@needs_gxx
@pytest.mark.parametrize("swizzle, box, x, y", [(128, (64, 16), 16, 30), (0, (32, 8), -8, -3), (64, (32, 8), 40, 0),
                                                (32, (16, 8), 0, 36)])
def test_a_tma_copy_lands_swizzled_with_zeros_outside_the_tensor(tmp_path, swizzle, box, x, y):
    # a (40, 72) matrix of distinct values, a box reaching past its edges (or before its start): element (r, e) of
    # the box at byte 2 (r box[0] + e) of the tile, its 16-byte chunk XORed with the row of 128 bytes mod the
    # swizzle's 16-byte chunks, 0 outside the tensor; the expect_tx of the whole box's bytes completes the phase
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as real
    emulator = emulator_module()
    (tmp_path / "tma.cu").write_text(open(PROBE).read() + TMA_PROBE)
    lib = emulator.load(str(tmp_path / "tma.cu"), cache_dir=str(tmp_path),
                        select=lambda text: emulator.without_helpers(text, HELPERS))
    rows, cols = 40, 72
    g = (np.arange(rows * cols) + 1).astype(np.uint16).reshape(rows, cols)
    names = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
    _, m = emulator.Driver(real).cuTensorMapEncodeTiled(
        real.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, g.ctypes.data,
        [real.cuuint64_t(cols), real.cuuint64_t(rows)], [real.cuuint64_t(2 * cols)],
        [real.cuuint32_t(box[0]), real.cuuint32_t(box[1])], [real.cuuint32_t(1), real.cuuint32_t(1)],
        real.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(real.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{names[swizzle]}"),
        real.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
        real.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    n = box[0] * box[1]
    out = np.full(n, 0xFFFF, np.uint16)
    args = [ctypes.c_void_p(out.ctypes.data), (ctypes.c_uint64 * 16)(*[int(w) for w in m.opaque]), ctypes.c_int(x),
            ctypes.c_int(y), ctypes.c_int(2 * n)]
    params = (ctypes.c_void_p * 5)(*[ctypes.addressof(a) for a in args])
    launch = lib.emu_launch(lib.emu_kernel(b"tma_probe"), 1, 1, 1, 64, params)
    assert not lib.emu_run(launch)
    lib.emu_free(launch)
    want = np.zeros(n, np.uint16)
    for r in range(box[1]):
        for e in range(box[0]):
            at = 2 * (r * box[0] + e)
            at ^= (at >> 7 & (swizzle // 16 - 1)) << 4 if swizzle else 0
            inside = 0 <= y + r < rows and 0 <= x + e < cols
            want[at // 2] = g[y + r, x + e] if inside else 0
    assert np.array_equal(out, want), np.nonzero(out != want)[0][:8]


# ---- the weight gradient: split over K, the partials summed in a fixed order

def splitk_product(lib, M, N, K, splits, blocks, seed=0):
    """the script's weight gradient on the emulator, c (M, N) fp32 += a.T @ b, a (K, M) and b (K, N) bf16: the split
    product on `blocks` persistent blocks, then splitk_reduce_add -> c, c0 + a.T @ b in float64, the bound"""
    rng = np.random.default_rng(seed)
    a, b = bf16_bits(rng.normal(size=(K, M))), bf16_bits(rng.normal(size=(K, N)))
    c0 = rng.normal(size=(M, N)).astype(np.float32)
    A, B = probe_script.from_bf16(a).astype(np.float64), probe_script.from_bf16(b).astype(np.float64)
    c, partials = c0.copy(), np.full((splits, M, N), np.nan, np.float32)   # NaN: a partial not written shows
    for name, grid, block, args in [
            (probe_script.SPLITK, blocks, 384, [ctypes.c_void_p(partials.ctypes.data), tensor_map(a, K, M, 64),
                                                tensor_map(b, K, N, 64), ctypes.c_int(M), ctypes.c_int(N),
                                                ctypes.c_int(K), ctypes.c_int(splits)]),
            ("splitk_reduce_add", -(-M * N // 1024), 256, [ctypes.c_void_p(c.ctypes.data),
                                                           ctypes.c_void_p(partials.ctypes.data),
                                                           ctypes.c_int(M * N), ctypes.c_int(splits)])]:
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
        launch = lib.emu_launch(lib.emu_kernel(name.encode()), grid, 1, 1, block, params)
        assert not lib.emu_run(launch), name
        lib.emu_free(launch)
    ref = c0 + A.T @ B
    return c, ref, fp32_bound(A.T, B) + 2.0 ** -23 * (np.abs(c0) + np.abs(A.T) @ np.abs(B))


SPLITK_SHAPE = (256, 512, 448)        # 2 x 2 tiles of 128 x 256, 7 steps of 64 k


def run_splitk(tmp_path, runs, mutation=None):
    """the weight gradient at SPLITK_SHAPE on the emulator, in a process of its own, the probe's text with mutation
    (old, new: old's first place after the split product's template) -> its exit code and stderr; runs: (splits,
    blocks, reverse) each, "c is wrong" when one is not within its bound, "bits differ" when two runs' c differ"""
    text = open(PROBE).read()
    if mutation:
        old, new = mutation
        at = text.index("__device__ void wgmma_tma_splitk_tn(")
        assert old in text[at:], old
        text = text[:at] + text[at:].replace(old, new, 1)
    (tmp_path / "probe.cu").write_text(text)
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {HERE!r})
import test_wgmma as t
emulator = t.emulator_module()
lib = emulator.load({str(tmp_path / "probe.cu")!r}, cache_dir={str(tmp_path)!r},
                    select=lambda text: emulator.without_helpers(text, t.HELPERS))
first = None
for splits, blocks, reverse in {runs!r}:
    lib.emu_set_reverse(reverse)
    c, ref, bound = t.splitk_product(lib, *t.SPLITK_SHAPE, splits, blocks, seed=2)
    if not np.all(np.abs(c - ref) <= bound):
        sys.exit(f"c is wrong ({{splits}} splits): {{np.nanmax(np.abs(c - ref) / bound)}} x its bound")
    if first is not None and not np.array_equal(c.view(np.uint32), first.view(np.uint32)):
        sys.exit(f"bits differ: {{splits}} splits on {{blocks}} blocks")
    first = c
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=600)
    return r.returncode, r.stderr.decode()


@needs_gxx
@pytest.mark.parametrize("splits, blocks, reverse", [(3, 5, 0), (1, 3, 1), (7, 3, 0), (2, 1, 1)])
def test_the_split_weight_gradient_on_the_emulator_against_float64(tmp_path, splits, blocks, reverse):
    # 4 tiles x splits units walked by 1 to 5 blocks: units of 2 or 3 steps (3 splits of 7), of 7 (one), of 1 (7:
    # every unit starts its accumulators and frees its stage at once); a block's steps run on through the 4 stages
    # across units, every mbarrier through phases 0 and 1
    pytest.importorskip("cuda.bindings")
    code, err = run_splitk(tmp_path, [(splits, blocks, reverse)])
    assert code == 0, err[-2000:]


@needs_gxx
def test_the_split_weight_gradient_has_the_same_bits_on_any_grid(tmp_path):
    # the partials' sum does not depend on which block made which partial, nor on the order blocks run in: the same
    # 3 splits on 1, 2 and 5 blocks, forwards and in reverse, give the same bits
    pytest.importorskip("cuda.bindings")
    code, err = run_splitk(tmp_path, [(3, 1, 0), (3, 2, 1), (3, 5, 0), (3, 5, 1)])
    assert code == 0, err[-2000:]


@needs_gxx
@pytest.mark.parametrize("mutation, failure", [
    # a (K, M) read as if K-major: the transpose-a bit clear
    (("wgmma_bf16<BN, 1, 1>(d,", "wgmma_bf16<BN, 0, 1>(d,"), "c is wrong"),
    # b (K, N) read as if K-major
    (("wgmma_bf16<BN, 1, 1>(d,", "wgmma_bf16<BN, 1, 0>(d,"), "c is wrong"),
    # both boxes of a at the tile's first 64 columns: the second consumer multiplies the first's rows of c
    (("m0 + 64 * j, kt * GEMM_BK", "m0, kt * GEMM_BK"), "c is wrong"),
    # b's descriptor with the 32-byte swizzle where TMA wrote the 128-byte one
    (("operand_descriptor<128, 1>(bs, BN, GEMM_BK, kk)", "operand_descriptor<32, 1>(bs, BN, GEMM_BK, kk)"),
     "c is wrong"),
    # the first partial summed twice
    (("for (int s = 1; s < splits; s++)", "for (int s = 0; s < splits; s++)"), "c is wrong"),
    # every unit's partial into split 0's: the others stay NaN
    (("float* p = partials + (long)split * M * N;", "float* p = partials;"), "c is wrong"),
    # a unit's accumulators started at the first step of K, not of its split: it adds to the unit before
    (("kt > k0 || kk > 0);", "kt > 0 || kk > 0);"), "c is wrong"),
    # a unit's last stage never freed: the producer waits for it a round later
    (("        if (lead) mbarrier_arrive(&empty[(it - 1) % STAGES]);   // the unit's last stage", ""),
     "wait at an mbarrier's try_wait.parity")])
def test_a_mutant_of_the_split_weight_gradient_fails(tmp_path, mutation, failure):
    pytest.importorskip("cuda.bindings")
    code, err = run_splitk(tmp_path, [(3, 2, 0)], mutation)
    assert code != 0 and failure in err, err[-2000:]
