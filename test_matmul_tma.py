"""
flash_attn.cu's bf16 product on Hopper (matmul_forward_tma_kernel: c = a @ b.T by TMA-fed warpgroup MMA, persistent
blocks, c through TMA stores; dev/variants/wgmma_probe.cu's `_persistent_store_bn256`), launched by nanoeuler_cuda's
matmul, and its SwiGLU version (matmul_swiglu_forward_tma_kernel: gu and s = silu(gate) * up in one pass) by
matmul_swiglu_forward, on tools/emulate_cuda.py's CPU emulator (compute capability 9.0, the stand-in driver's tensor
maps), against numpy in float64: several tiles a persistent block, M, N, K and F that end inside a tile, the threads
in order, reversed, and each warp ahead of the next (--warps-ahead, in order and reversed); nothing written past M
rows or N columns; s the same bits as swiglu_forward's from gu; the switch off gives cuBLAS (and swiglu_forward);
ptxas keeps their wgmma asynchronous and spills nothing. Likewise the backward's data gradients
(matmul_backward_tma_kernel: c = a @ b, b row-major, `_persistent_store_nn_bn256`) and w_down's with swiglu_backward
in its epilogue (matmul_swiglu_backward_tma_kernel: dgu the same bits as matmul + swiglu_backward), by
PRODUCT_TMA_BACKWARD's switch.

    python -m pytest -q test_matmul_tma.py
"""

import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nanoeuler as ne  # noqa: E402
import nanoeuler_cuda as nc  # noqa: E402
from test_attention_tma import ptxas_log  # noqa: E402  (flash_attn.cu through NVRTC for sm_90a: the log)

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")
SMS = 2                 # persistent blocks: fewer than the tiles, so each walks several (and its stages' rounds)
SHARED = 4 * (128 + 256) * 64 * 2 + 4 * 8192 + 1024 + 8 * 8     # 4 stages, 4 boxes, 1024 to align, 8 mbarriers


def emulator_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("emulate_cuda", os.path.join(HERE, "tools", "emulate_cuda.py"))
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    return emulator


# the emulator's schedules: the warps of a block a barrier at a time in order, in reverse, and each warp as far as it
# can before the next (warps ahead: a missing barrier lets a warp overwrite a box another has still to store), in
# order and reversed (the last warps first: a barrier after what the first warp sets up)
@pytest.fixture(params=[(False, False), (True, False), (False, True), (True, True)],
                ids=["in order", "threads in reverse", "warps ahead", "warps ahead, reversed"])
def driver(request, monkeypatch):
    """nanoeuler_cuda on the emulator, SMS SMs; its launches recorded (kernel, grid, threads, shared bytes)"""
    pytest.importorskip("cuda.bindings")
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    monkeypatch.setattr(nc, "PRODUCT_TMA", True)                   # the product's default, pinned here
    monkeypatch.setattr(nc, "PRODUCT_TMA_BACKWARD", True)          # on here (off by default until a GPU times it)
    reverse, ahead = request.param
    driver = emulator_module().install(nc, sms=SMS, reverse=reverse, warps_ahead=ahead)
    driver.kernels, launch = [], driver.cuLaunchKernel
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda f, gx, gy, gz, bx, *rest: (
        driver.kernels.append((f.name, gx, bx, rest[2])), launch(f, gx, gy, gz, bx, *rest))[1])
    return driver


def operands(M, N, K, seed=0):
    """a (M, K) and b (N, K) rounded to bf16 (float32), their bf16 copies on the GPU, and a @ b.T in float64"""
    rng = np.random.default_rng(seed)
    a, b = nc.bf16_round(rng.normal(size=(M, K))), nc.bf16_round(rng.normal(size=(N, K)))
    return nc.activation(a, True), nc.activation(b, True), a.astype(np.float64) @ b.astype(np.float64).T


def padded(M, N):
    """an output of M rows of N bf16 with 8 rows past them, all NaN: what is not written stays NaN"""
    return nc.DeviceArray((M + 8, N), np.uint16).fill_bits(0xFFFF)


def written(out, M):
    """out's first M rows as float64, after checking that the rows past them are still NaN"""
    got = nc.values(out)
    assert np.isnan(got[M:]).all(), "the product wrote past its M rows"
    return got[:M]


# M, N, K: 6 tiles of 128 x 256 on 2 blocks, the last row tile 72 rows, the last column tile 8 columns, 3 k-steps
# (the last 8 k): every stage's mbarriers through both parities; one tile, one k-step; 3 tiles of 8 rows, 5
# k-steps (the ring of 4 stages wraps within a tile)
SHAPES = [(200, 520, 136), (64, 256, 64), (8, 768, 264)]


@needs_gxx
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M%d_N%d_K%d" % s)
def test_the_product_against_float64(driver, shape):
    M, N, K = shape
    a, b, ref = operands(M, N, K)
    out = padded(M, N)
    assert nc.product_tma(out, a, b, N, K)
    nc.matmul(out, a, b, M, N, K, trans_b=True)
    got = written(out, M)
    assert np.isfinite(got).all()
    # the one rounding of each output to bf16, and fp32 sums: a relative 2^-9 at most, far less in the norm
    assert nc.rel_diff(got, nc.bf16_round(ref)) < 1e-4
    tiles = -(-M // 128) * -(-N // 256)
    assert driver.kernels == [("matmul_forward_tma_kernel", min(tiles, SMS), 384, SHARED)]


# M, F, K: 3 x 3 tiles of 128 rows and 128 features on 2 blocks, F = 264 ending 8 features into its last tile (the
# gate box there reads up rows, never stored: gu's halves stop at F), 2 k-steps; one tile of F 128 (no ragged edge)
SWIGLU_SHAPES = [(300, 264, 72), (128, 128, 64)]


@needs_gxx
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=lambda s: "M%d_F%d_K%d" % s)
def test_the_swiglu_product_against_float64_and_swiglu_forward(driver, shape):
    M, F, K = shape
    a, w, ref = operands(M, 2 * F, K, seed=1)
    gu, s, s_alone = padded(M, 2 * F), padded(M, F), padded(M, F)
    nc.matmul_swiglu_forward(gu, s, a, w, M, F, K)
    gu_ref = nc.bf16_round(ref)                                     # gate then up, as gu holds them
    assert nc.rel_diff(written(gu, M), gu_ref) < 1e-4
    s_ref, _ = ne.swiglu_forward(gu_ref.astype(np.float64))
    assert nc.rel_diff(written(s, M), nc.bf16_round(s_ref)) < 1e-4
    nc.swiglu_forward(s_alone, gu, M, F)                            # the same math on the same bf16 gate and up
    assert np.array_equal(s.download()[:M], s_alone.download()[:M])
    tiles = -(-M // 128) * -(-F // 128)
    assert driver.kernels[0] == ("matmul_swiglu_forward_tma_kernel", min(tiles, SMS), 384, SHARED)


@needs_gxx
def test_the_switch_off_or_other_operands_run_cublas(driver, monkeypatch):
    M, N, K = 72, 256, 64
    a, b, ref = operands(M, N, K)
    out = padded(M, N)
    assert not nc.product_tma(nc.DeviceArray((M, N)), a, b, N, K)      # an fp32 output: cuBLAS
    assert not nc.product_tma(out, a, b, N, 60)                         # rows of K not 16-byte aligned
    monkeypatch.setattr(nc, "PRODUCT_TMA", False)
    assert not nc.product_tma(out, a, b, N, K)
    nc.matmul(out, a, b, M, N, K, trans_b=True)
    assert driver.kernels == []                                         # cuBLAS's product
    assert nc.rel_diff(written(out, M), nc.bf16_round(ref)) < 1e-4


@needs_gxx
def test_the_swiglu_product_switched_off_is_cublas_and_swiglu_forward(driver, monkeypatch):
    M, F, K = 72, 128, 64
    a, w, ref = operands(M, 2 * F, K)
    gu, s = padded(M, 2 * F), padded(M, F)
    monkeypatch.setattr(nc, "PRODUCT_TMA", False)
    nc.matmul_swiglu_forward(gu, s, a, w, M, F, K)
    assert [name for name, *_ in driver.kernels] == ["swiglu_forward_kernel"]    # and cuBLAS's product
    assert nc.rel_diff(written(gu, M), nc.bf16_round(ref)) < 1e-4


def nn_operands(M, N, K, seed=2):
    """a (M, K) and b (K, N) (row-major: a weight as dx = dy @ W reads it) rounded to bf16, their bf16 copies on
    the GPU, and a @ b in float64"""
    rng = np.random.default_rng(seed)
    a, b = nc.bf16_round(rng.normal(size=(M, K))), nc.bf16_round(rng.normal(size=(K, N)))
    return nc.activation(a, True), nc.activation(b, True), a.astype(np.float64) @ b.astype(np.float64)


# M, N, K: 6 tiles on 2 blocks, the last row tile 72 rows, the last column tile 8 columns (b's boxes 1 to 3 there
# wholly past N: not loaded), 3 k-steps (the last 8 k); one tile, one k-step; 2 tiles of 8 rows, the second 8
# columns, 5 k-steps (the ring of 4 stages wraps within a tile)
NN_SHAPES = [(200, 520, 136), (64, 256, 64), (8, 264, 264)]


@needs_gxx
@pytest.mark.parametrize("shape", NN_SHAPES, ids=lambda s: "M%d_N%d_K%d" % s)
def test_the_backward_product_against_float64(driver, shape):
    M, N, K = shape
    a, b, ref = nn_operands(M, N, K)
    out = padded(M, N)
    assert nc.product_tma(out, a, b, N, K, backward=True)
    nc.matmul(out, a, b, M, N, K)
    got = written(out, M)
    assert np.isfinite(got).all()
    assert nc.rel_diff(got, nc.bf16_round(ref)) < 1e-4
    tiles = -(-M // 128) * -(-N // 256)
    assert driver.kernels == [("matmul_backward_tma_kernel", min(tiles, SMS), 384, SHARED)]


# M, F, K: 3 x 2 tiles of 128 rows and 256 features on 2 blocks, F = 264 ending 8 features into its last tile (up
# 264 columns after gate: a wrong offset of up reads other features), 2 k-steps; one tile of F 256
SWIGLU_BACKWARD_SHAPES = [(300, 264, 72), (128, 256, 64)]


@needs_gxx
@pytest.mark.parametrize("shape", SWIGLU_BACKWARD_SHAPES, ids=lambda s: "M%d_F%d_K%d" % s)
def test_the_swiglu_backward_product_against_float64_and_swiglu_backward(driver, shape):
    M, F, K = shape
    dx, w, ds_ref = nn_operands(M, F, K, seed=3)
    gu_f = nc.bf16_round(np.random.default_rng(4).normal(size=(M, 2 * F)))
    gu = nc.activation(gu_f, True)
    dgu, ds, dgu_alone, ds_alone = padded(M, 2 * F), padded(M, F), padded(M, 2 * F), padded(M, F)
    nc.matmul_swiglu_backward(dgu, ds, dx, w, gu, M, F, K)
    tiles = -(-M // 128) * -(-F // 256)
    assert driver.kernels == [("matmul_swiglu_backward_tma_kernel", min(tiles, SMS), 384, SHARED)]
    assert np.isnan(nc.values(ds)).all()                            # ds is not written
    _, cache = ne.swiglu_forward(gu_f.astype(np.float64))
    dgu_ref = nc.bf16_round(ne.swiglu_backward(nc.bf16_round(ds_ref).astype(np.float64), cache))
    assert nc.rel_diff(written(dgu, M), dgu_ref) < 1e-3
    nc.matmul(ds_alone, dx, w, M, F, K)                             # the two passes: the same ds, the same math
    nc.swiglu_backward(dgu_alone, ds_alone, gu, M, F)
    assert [name for name, *_ in driver.kernels[1:]] == ["matmul_backward_tma_kernel", "swiglu_backward_kernel"]
    assert np.array_equal(dgu.download()[:M], dgu_alone.download()[:M])


@needs_gxx
def test_the_backward_products_switched_off_are_cublas_and_swiglu_backward(driver, monkeypatch):
    M, F, K = 72, 128, 64
    dx, w, ref = nn_operands(M, F, K)
    gu = nc.activation(nc.bf16_round(np.random.default_rng(4).normal(size=(M, 2 * F))), True)
    ds, dgu = padded(M, F), padded(M, 2 * F)
    assert not nc.product_tma(ds, dx, w, F, 60, backward=True)          # rows of K not 16-byte aligned
    monkeypatch.setattr(nc, "PRODUCT_TMA_BACKWARD", False)
    assert not nc.product_tma(ds, dx, w, F, K, backward=True)
    assert nc.product_tma(ds, dx, w, F, K)                              # the forward's switch is another
    nc.matmul(ds, dx, w, M, F, K)
    assert driver.kernels == []                                         # cuBLAS's product
    assert nc.rel_diff(written(ds, M), nc.bf16_round(ref)) < 1e-4
    nc.matmul_swiglu_backward(dgu, ds, dx, w, gu, M, F, K)
    assert [name for name, *_ in driver.kernels] == ["swiglu_backward_kernel"]    # and cuBLAS's product into ds
    assert np.isfinite(written(dgu, M)).all()


def test_check_runs_the_products_with_the_switch_off(driver, monkeypatch):
    # check covers the TMA products whichever PRODUCT_TMA and PRODUCT_TMA_BACKWARD are, as it runs both attention
    # passes; the switches are put back
    monkeypatch.setattr(nc, "PRODUCT_TMA", False)
    monkeypatch.setattr(nc, "PRODUCT_TMA_BACKWARD", False)
    monkeypatch.setattr(nc, "PRODUCT_CHECKS", {"wo": (72, 256, 64), "w_gate_up": (72, 512, 64),
                                               "w_down": (72, 64, 136)})
    lines = []
    nc.check_products(np.random.default_rng(0), lambda what, err: lines.append((what, err)))
    swiglu, backward = "product w_gate_up + swiglu: ", "product w_down dx + swiglu_backward: "
    assert [what for what, _ in lines] == ["product wo 72x256x64 (TMA)", "product wo dx 72x64x256 (TMA)",
                                           "product w_gate_up 72x512x64 (TMA)", swiglu + "gu (TMA)",
                                           swiglu + "s (TMA)", swiglu + "s == swiglu_forward's (bits)",
                                           "product w_gate_up dx 72x64x512 (TMA)", "product w_down 72x64x136 (TMA)",
                                           "product w_down dx 72x136x64 (TMA)", backward + "dgu (TMA)",
                                           backward + "dgu == swiglu_backward's (bits)"], lines
    bits = [err for what, err in lines if what.endswith("(bits)")]
    assert all(err < 1e-2 for what, err in lines if not what.endswith("(bits)")) and bits == [0.0, 0.0], lines
    assert {k for k, *_ in driver.kernels} == {"matmul_forward_tma_kernel", "matmul_swiglu_forward_tma_kernel",
                                               "swiglu_forward_kernel", "matmul_backward_tma_kernel",
                                               "matmul_swiglu_backward_tma_kernel", "swiglu_backward_kernel"}
    assert nc.PRODUCT_TMA is False and nc.PRODUCT_TMA_BACKWARD is False


def test_ptxas_keeps_the_products_wgmma_asynchronous_and_spills_nothing():
    # as nanoeuler_cuda builds flash_attn.cu on an H100 or H200: ptxas serializes wgmma it cannot prove safe (C7514,
    # C7519) or injects waits (C7517) without failing; a spill would put the 128 accumulators through local memory
    pytest.importorskip("cuda.bindings")
    err, log = ptxas_log(os.path.join(HERE, "flash_attn.cu"))
    assert not err and "C751" not in log, log
    for entry in ("matmul_forward_tma_kernel", "matmul_swiglu_forward_tma_kernel", "matmul_backward_tma_kernel",
                  "matmul_swiglu_backward_tma_kernel"):
        props = log.split(f"Function properties for {entry}\n")[1]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in props.splitlines()[0], props[:300]
