"""
tools/emulate_cuda.py's concurrent grids: a kernel named as emulate_cuda.CONCURRENT says (decode_layers_...) runs
each block of its grid in a process of its own, all at once, so blocks that wait on each other through kernels.cu's
stage counters (stage_arrive, stage_wait, stage_arrive_last: their definitions taken from kernels.cu, dropped for
the emulator's as its builds of kernels.cu drop them) get past their waits. A small kernel of stages checks it: the
right rows in any order; a wait with a target one too low, or none, reads a row before it is written (a block held
back makes that certain); a wait never met is a named deadlock; a kernel run one block after another that waits on
another block fails at once, named; a fault in one block fails the launch, named, and the rest of the grid ends
with it; the last stage's last arrival zeroes the counters.
"""

import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "kernels.cu")


def emulator_module():
    spec = importlib.util.spec_from_file_location("emulate_cuda", os.path.join(HERE, "tools", "emulate_cuda.py"))
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    return emulator


emulator = emulator_module()
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")


def kernels_cu_definitions():
    """kernels.cu's definitions of stage_arrive, stage_arrive_last and stage_wait, as they stand there"""
    found = re.findall(r"^__device__ __forceinline__ void (?:stage_arrive|stage_arrive_last|stage_wait)\(.*?\n}\n",
                       open(KERNELS).read(), re.S | re.M)
    assert len(found) == 3, found
    return found


def kernels_cu_helpers():
    return "\n".join(kernels_cu_definitions())


# rows 0 .. stages - 1 of out, a value a block: block b writes out[s][b] = (row s - 1's sum) + b + 1 once every
# block has written row s - 1 (row -1 sums to 0); after reading row 0 each block arrives at counters[stages]. hold:
# the last block writes row 0 only once the others have read it (counters[stages] at blocks - 1), which a kernel
# that waits for row 0 never lets happen (a deadlock) and one that does not wait for it shows every time (the
# others read its NaN). fault >= 0: block 1 first writes out[fault]
KERNEL = r"""
extern "C" __global__ void decode_layers_test_kernel(float* out, int* counters, int stages, int hold, int fault) {
    __shared__ float row[32];
    int blocks = gridDim.x, b = blockIdx.x;
    if (b == 1 && fault >= 0 && threadIdx.x == 0) out[fault] = 0.0f;
    if (hold && b == blocks - 1) stage_wait(counters + stages, blocks - 1);
    for (int s = 0; s < stages; s++) {
        float sum = 0.0f;
        if (s > 0) {
            stage_wait(counters + s - 1, blocks);
            if (threadIdx.x < blocks) row[threadIdx.x] = out[(s - 1) * blocks + threadIdx.x];
            __syncthreads();
            for (int j = 0; j < blocks; j++) sum += row[j];
        }
        if (s == 1) stage_arrive(counters + stages);
        if (threadIdx.x == 0) out[s * blocks + b] = sum + b + 1;
        stage_arrive(counters + s);
    }
}
"""
NAME = "decode_layers_test_kernel"
WAIT = "            stage_wait(counters + s - 1, blocks);\n"


def build(cache, kernel=KERNEL):
    """the emulator's library for kernels.cu's stage helpers and kernel, the helpers' definitions dropped as the
    emulator's builds of kernels.cu drop them"""
    text = kernels_cu_helpers() + kernel
    path = os.path.join(cache, f"stages_{hashlib.sha256(text.encode()).hexdigest()[:12]}.cu")
    with open(path, "w") as f:
        f.write(text)
    return emulator.load(path, cache_dir=cache,
                         select=lambda t: emulator.without_helpers(t, emulator.KERNELS_HELPERS))


def run_stages(lib, name=NAME, blocks=4, stages=3, hold=0, fault=-1, reverse=0, warps_ahead=0, stall=60.0):
    """the kernel on the stand-in driver (its memory shared with the blocks' processes), blocks of 64 threads ->
    out (stages, blocks), the counters; a launch that fails raises AssertionError"""
    lib.emu_set_reverse(reverse)
    lib.emu_set_warps_ahead(warps_ahead)
    lib.emu_set_stall_seconds(stall)
    driver = emulator.Driver(None)
    out, counters = driver.alloc(4 * stages * blocks, 0xFF), driver.alloc(4 * (stages + 1), 0)    # NaN, zeros
    args = [ctypes.c_void_p(out), ctypes.c_void_p(counters), ctypes.c_int(stages), ctypes.c_int(hold),
            ctypes.c_int(fault)]
    params = (ctypes.c_void_p * 5)(*[ctypes.addressof(a) for a in args])
    driver.launch(emulator.Function(lib, lib.emu_kernel(name.encode()), name), (blocks, 1, 1), 64, params)
    read = lambda ptr, ctype, n: np.ctypeslib.as_array((ctype * n).from_address(ptr)).copy()
    return read(out, ctypes.c_float, stages * blocks).reshape(stages, blocks), read(counters, ctypes.c_int, stages + 1)


def want(blocks, stages):
    rows = [np.arange(1, blocks + 1, dtype=np.float32)]
    for _ in range(1, stages):
        rows.append(rows[-1].sum() + np.arange(1, blocks + 1, dtype=np.float32))
    return np.array(rows)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emulator"))


@pytest.fixture(scope="module")
def lib(cache):
    return build(cache)


def test_the_emulators_builds_of_kernels_cu_drop_its_stage_helpers():
    # each definition, from its first line to its lone closing brace, and nothing else: the callers stay
    text = open(KERNELS).read()
    for module in ("kernels.cu", "kernels.cu bf16"):
        kept = emulator.SOURCES[module][2](text)
        lines = sum(d.count("\n") for d in kernels_cu_definitions())
        assert text.count("\n") - kept.count("\n") == lines, module
        assert not re.search(r"void stage_(arrive|arrive_last|wait)\(", kept) and "red.release" not in kept, module
        assert "atom.acq_rel" not in kept, module
        assert "stage_wait(ready, blocks)" in kept, module


@needs_gxx
@pytest.mark.parametrize("reverse", [0, 1])
def test_the_last_arrival_zeroes_the_counters_for_the_next_pass(cache, reverse):
    # decode_layers' last stage (stage_arrive_last): the block that arrives last, when every block is past every
    # wait, sets the stage counters to 0; the one they skip (counters[stages], which every block added 1 to) stays
    last = KERNEL.replace("        stage_arrive(counters + s);\n",
                          "        if (s < stages - 1) stage_arrive(counters + s);\n"
                          "        else stage_arrive_last(counters, stages);\n")
    assert last != KERNEL
    out, counters = run_stages(build(cache, last), blocks=4, reverse=reverse)
    assert np.array_equal(out, want(4, 3)), out
    assert counters.tolist() == [0, 0, 0, 4]


@needs_gxx
@pytest.mark.parametrize("blocks, reverse, warps_ahead", [(4, 0, 0), (4, 1, 0), (4, 0, 1), (3, 1, 1)])
def test_the_stages_meet_with_every_block_at_once(lib, blocks, reverse, warps_ahead):
    out, counters = run_stages(lib, blocks=blocks, reverse=reverse, warps_ahead=warps_ahead)
    assert np.array_equal(out, want(blocks, 3)), out
    assert counters.tolist() == [blocks] * 4


@needs_gxx
@pytest.mark.parametrize("mutation", [WAIT.replace("blocks);", "blocks - 1);"), ""])
def test_a_wait_one_short_or_none_reads_a_row_before_it_is_written(cache, mutation):
    # the last block held back until the others have read row 0: they read its NaN, every time
    assert KERNEL.count(WAIT) == 1
    out, _ = run_stages(build(cache, KERNEL.replace(WAIT, mutation)), hold=1)
    assert np.isnan(out[1, :3]).all() and not np.array_equal(out, want(4, 3)), out


@needs_gxx
def test_a_wait_never_met_is_a_named_deadlock(lib, capfd):
    # the right kernel, the last block held back: it waits for the others, they for it
    with pytest.raises(AssertionError, match=f"{NAME} failed in a block of its concurrent grid"):
        run_stages(lib, hold=1, stall=0.3)
    err = capfd.readouterr().err
    assert re.search(r"a deadlock at stage_wait: counter at (3, waiting for 4|0, waiting for 3)", err), err


@needs_gxx
def test_a_kernel_run_block_after_block_that_waits_on_another_block_fails_at_once(cache):
    other = KERNEL.replace(NAME, "stages_test_kernel")
    lib = build(cache, other)
    out, _ = run_stages(lib, "stages_test_kernel", blocks=1)        # a block's own arrivals meet its waits
    assert np.array_equal(out, want(1, 3)), out
    code = f"""
import sys
sys.path.insert(0, {HERE!r})
import test_emulator_stages as t
t.run_stages(t.build({cache!r}, t.KERNEL.replace(t.NAME, "stages_test_kernel")), "stages_test_kernel")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=120)   # the emulator aborts
    assert r.returncode != 0 and b"a block waits at stage_wait for other blocks, which run one after another here " \
        b"(counter at 1, waiting for 4)" in r.stderr, r.stderr.decode()[-2000:]


@needs_gxx
def test_a_fault_in_one_block_fails_the_launch_and_ends_the_grid(lib):
    # block 1 writes 20 bytes past the end of out (48 bytes, 64 with the canary) before it arrives anywhere: the
    # others, waiting for it, end with it rather than at the deadlock's 60 s
    start = time.monotonic()
    with pytest.raises(AssertionError, match=f"{NAME} read or wrote memory past the end of an allocation, or none "
                                             r"of them \(address 0x[0-9a-f]+, 20 bytes past the end of an allocation "
                                             "of 48 bytes"):
        run_stages(lib, fault=17)
    assert time.monotonic() - start < 30
    out, _ = run_stages(lib)                                          # and this process goes on
    assert np.array_equal(out, want(4, 3))


def test_the_driver_gives_a_persistent_grid_of_two_blocks_an_sm():
    driver = emulator.Driver(None, sms=2)
    assert driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(None, 256, 48 * 1024) == (0, 2)
    real = pytest.importorskip("cuda.bindings.driver")
    assert real.cuOccupancyMaxActiveBlocksPerMultiprocessor.__doc__.startswith(
        "cuOccupancyMaxActiveBlocksPerMultiprocessor(func, int blockSize, size_t dynamicSMemSize)")
    f = emulator.Function(None, 0, NAME)
    with pytest.raises(AssertionError, match="a grid of 5 blocks, more than are resident at once"):
        driver.launch(f, (5, 1, 1), 64, None)
