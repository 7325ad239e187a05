"""
Checkpoints written while training goes on (issue 40): RunFolder.save copies the
weights, moments and state, and a thread writes the pair (state first, model last,
each through a temp name) while the next steps run; at most one save is in flight; a
signal, a NaN stop or kill -9 leave a complete pair; --save-every N or --save-minutes M
(the GPU's default, 10); --minutes counts what the saves cost the loop.

A gate holds a background write after its state file until the test opens it, so the
tests wait on what happened (an event, a file, a line), never on time.

    python -m pytest -q test_async_save.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import argparse
import errno
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import nanoeuler_cuda as nc
from test_gpu_host import emulated  # noqa: F401  (a fixture: nanoeuler_cuda on an emulated GPU)
from test_reliability import corpus  # noqa: F401  (a fixture: 40,000 characters of Shakespeare)
from test_reliability import default_signals   # SIGINT, SIGTERM, SIGHUP at their defaults in a child

HERE = os.path.dirname(os.path.abspath(__file__))
CFG = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)


# -----------------------------------------------------------------------------
# common test data

def train_args(out, data, *extra):
    """the small model, a 300-token vocabulary and 4-row batches: a step takes tens of ms"""
    return ["train", "--data", data, "--out", str(out), "--vocab-size", "300", "--batch", "4",
            "--eval-every", "100000", "--eval-batches", "1", "--warmup", "2", *extra]


class Gate:
    """every checkpoint written off the main thread stops after its state file (as
    save_model begins; or before anything, at="start") until open is set; held is set
    when one is held"""

    def __init__(self, monkeypatch, at="model"):
        self.held, self.open = threading.Event(), threading.Event()
        owner, name = (ne, "save_model") if at == "model" else (ne.RunFolder, "write_pair")
        write = getattr(owner, name)

        def gated(path, *args):
            if threading.current_thread() is not threading.main_thread():
                self.held.set()
                assert self.open.wait(120), "the test never opened the gate"
            return write(path, *args)
        monkeypatch.setattr(owner, name, gated)


@pytest.fixture(params=["model"])
def gate(monkeypatch, request):
    g = Gate(monkeypatch, request.param)
    yield g
    g.open.set()                                       # a failed test must not leave a writer waiting
    ne.RunFolder.wait()


@pytest.fixture
def waiting(monkeypatch):
    """an event set when some thread starts waiting for a write that is still in flight"""
    event, wait = threading.Event(), ne.RunFolder.wait.__func__

    def watched(cls):
        if cls.thread is not None and cls.thread.is_alive():
            event.set()
        wait(cls)
    monkeypatch.setattr(ne.RunFolder, "wait", classmethod(watched))
    return event


def start_state():
    fresh = ne.build_parser().parse_args(["train", "--seed", "0"])     # a fresh run's state
    return ne.RunFolder("unused", CFG).resume_or_init(fresh, ne.Tokenizer(), lambda: None)[3]


class Engine:
    """host_weights as a training engine has it: copies, counted"""

    def __init__(self):
        self.flat = ne.init_params(CFG)
        self.m, self.v = np.zeros_like(self.flat), np.ones_like(self.flat)
        self.copies = 0

    def host_weights(self):
        self.copies += 1
        return self.flat.copy(), self.m.copy(), self.v.copy()


def in_thread(work):
    """work() in a thread of its own -> the thread and a list that gets its result or error"""
    out = []

    def run():
        try:
            out.append(work())
        except BaseException as e:                         # noqa: B036 (handed to the test)
            out.append(e)
    t = threading.Thread(target=run)
    t.start()
    return t, out


# -----------------------------------------------------------------------------
# the writer

@pytest.mark.parametrize("gate", ["start", "model"], indirect=True)
def test_the_pair_holds_the_weights_moments_and_state_of_its_step_while_training_changes_them(tmp_path, gate):
    args = argparse.Namespace(clip=1.0, weight_decay=0.1, batch=2, threads=1)
    flat = ne.init_params(CFG)
    engine = ne.CPUEngine(CFG, flat, np.zeros_like(flat), np.zeros_like(flat), args)
    idx, targets = ne.split_rows(np.random.default_rng(0).integers(0, CFG.V, (2, CFG.T + CFG.K)), CFG.T, CFG.K)
    engine.step(idx, targets, 1e-2, 1)
    before = [a.copy() for a in (engine.flat, engine.m, engine.v)]
    state, rng = start_state(), np.random.default_rng(5)
    saves = ne.RunFolder(str(tmp_path), CFG, ne.Tokenizer(), time.monotonic)
    assert saves.save(1, engine, state, rng) == str(tmp_path / "model_000001.safetensors")
    assert gate.held.wait(60)
    # held before the state file or before the model file: no pair yet, and the loop goes on
    assert ne.RunFolder(str(tmp_path)).steps() == []
    engine.step(idx, targets, 1e-2, 2)
    state["best_val"] = 1.5
    assert not np.array_equal(engine.flat, before[0]) and not np.array_equal(engine.v, before[2])
    gate.open.set()
    saves.finish()
    cfg, flat, _, m, v, saved = ne.RunFolder(str(tmp_path)).read_pair(1)
    assert cfg == CFG and all(np.array_equal(a, b) for a, b in zip((flat, m, v), before))
    assert saved["step"] == 1 and "best_val" not in saved and saved["rng"] == np.random.default_rng(5).bit_generator.state
    engine.close()


def test_a_save_waits_for_the_one_in_flight_and_says_so_once(tmp_path, gate, waiting, capsys):
    engine, state, rng = Engine(), start_state(), np.random.default_rng(0)
    saves = ne.RunFolder(str(tmp_path), CFG, ne.Tokenizer(), time.monotonic)
    saves.save(1, engine, state, rng)
    assert gate.held.wait(60)
    t, out = in_thread(lambda: saves.save(2, engine, state, rng))
    assert waiting.wait(60)                                     # the second save waits for the first write
    assert engine.copies == 1 and not os.path.exists(tmp_path / "state_000002.safetensors")
    gate.open.set()
    t.join()
    assert out == [str(tmp_path / "model_000002.safetensors")] and engine.copies == 2
    saves.finish()                                              # step 2's write, through the open gate
    gate.open.clear()
    gate.held.clear()
    waiting.clear()
    saves.save(3, engine, state, rng)                           # held again; then a fourth comes
    t, _ = in_thread(lambda: saves.save(4, engine, state, rng))
    assert waiting.wait(60)
    gate.open.set()
    t.join()
    saves.finish()
    err = capsys.readouterr().err
    assert err.count("still being written") == 1, err
    assert ne.RunFolder(str(tmp_path)).steps() == [4, 3]            # pruned to the newest two


def test_best_is_written_beside_the_steps_and_a_pair_due_meanwhile_waits_for_it_unsaid(tmp_path, gate, waiting,
                                                                                           capsys):
    args = argparse.Namespace(clip=1.0, weight_decay=0.1, batch=2, threads=1)
    flat = ne.init_params(CFG)
    engine = ne.CPUEngine(CFG, flat, np.zeros_like(flat), np.zeros_like(flat), args)
    idx, targets = ne.split_rows(np.random.default_rng(0).integers(0, CFG.V, (2, CFG.T + CFG.K)), CFG.T, CFG.K)
    saves = ne.RunFolder(str(tmp_path), CFG, ne.Tokenizer(), time.monotonic)
    weights = engine.host_params()
    before = weights.copy()
    saves.save_best(weights)
    assert gate.held.wait(60) and not os.path.exists(tmp_path / "best.safetensors")
    engine.step(idx, targets, 1e-2, 1)                              # the loop goes on
    t, out = in_thread(lambda: saves.save(1, engine, start_state(), np.random.default_rng(0)))
    assert waiting.wait(60)                                         # the pair waits for best's write
    gate.open.set()
    t.join()
    saves.finish()
    assert np.array_equal(ne.load_model(str(tmp_path / "best.safetensors"))[1], before)
    assert np.array_equal(ne.load_model(str(tmp_path / "model_000001.safetensors"))[1], engine.flat)
    assert not np.array_equal(engine.flat, before)
    out = capsys.readouterr()
    assert "still being written" not in out.err and out.out.count("saved  ") == 1
    engine.close()


def test_a_write_that_has_ended_is_said_between_steps_and_one_in_flight_is_not(tmp_path, gate, capsys):
    ticks = iter([0.0, 10.0, 10.5, 11.0, 14.0])                 # the writer's clock, read in turn
    saves = ne.RunFolder(str(tmp_path), CFG, ne.Tokenizer(), lambda: next(ticks))
    saves.save(7, Engine(), start_state(), np.random.default_rng(0))   # 10 s in, copied by 10.5
    assert gate.held.wait(60)
    saves.finish(poll=True)
    assert capsys.readouterr().out == ""
    gate.open.set()                                             # written from 11 s to 14 s
    ne.RunFolder.thread.join()
    saves.finish(poll=True)
    assert capsys.readouterr().out == (f"saved  {tmp_path / 'model_000007.safetensors'} (+ state) in 3.5 s, "
                                       "training held 0.50 s\n")
    assert (saves.paused, saves.took) == (0.5, 3.0)


def test_a_failed_background_write_stops_the_loop_with_one_sentence_and_keeps_the_pair_before(tmp_path, gate,
                                                                                                monkeypatch):
    engine, state, rng = Engine(), start_state(), np.random.default_rng(0)
    saves = ne.RunFolder(str(tmp_path), CFG, ne.Tokenizer(), time.monotonic)
    saves.save(2, engine, state, rng, background=False)

    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device")
    write = ne.atomic_write
    monkeypatch.setattr(ne, "atomic_write", lambda path, w: write(path, full if "model_" in path else w))
    gate.open.set()
    saves.save(4, engine, state, rng)
    with pytest.raises(OSError) as e:
        saves.finish()
    assert e.value.filename == str(tmp_path / "model_000004.safetensors") and e.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="model_000006"):            # the last save, written before going on
        saves.save(6, engine, state, rng, background=False)
    assert ne.RunFolder(str(tmp_path)).steps() == [2]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_nan_stop_waits_for_the_save_in_flight_and_names_the_newest_good_pair(tmp_path, gate, waiting):
    engine, state, rng = Engine(), start_state(), np.random.default_rng(0)
    saves = ne.RunFolder(str(tmp_path), CFG, ne.Tokenizer(), time.monotonic)
    saves.save(2, engine, state, rng, background=False)
    saves.save(4, engine, state, rng)                             # written while step 5 runs
    assert gate.held.wait(60)
    # step 5's loss is NaN: step 4's weights gave it, so its pair must go, once it is written
    t, out = in_thread(lambda: saves.stop_if_not_finite({"loss": float("nan")}, 5, made_by=4))
    assert waiting.wait(60)
    gate.open.set()
    t.join()
    assert isinstance(out[0], ne.NanoEulerError)
    assert f"the last good checkpoint is {tmp_path / 'model_000002.safetensors'} (the one of step 4" in str(out[0])
    assert ne.RunFolder(str(tmp_path)).steps() == [2] and not os.path.exists(tmp_path / "model_000004.safetensors")


def test_the_gpu_engine_copies_into_page_locked_buffers_of_its_own(emulated):  # noqa: F811
    nc.init_gpu("fp32")
    cfg = ne.Config(V=64, C=64, Hq=2, Hkv=1, L=2, T=40, F=176, K=3)
    batch = ne.split_rows(np.random.default_rng(0).integers(0, cfg.V, (2, cfg.T + cfg.K)), cfg.T, cfg.K)
    engine = nc.GPUEngine(cfg, ne.init_params(cfg), None, None,
                          argparse.Namespace(batch=2, zero=False, clip=1.0, weight_decay=0.1, no_graph=False))
    engine.step(*batch, 1e-2, 1)
    n, model = ne.num_params(cfg), engine.model
    copies = engine.host_weights()
    want = [model.flat.download()[:n], model.m.download()[:n], model.v.download()[:n]]
    assert all(np.array_equal(a, b) for a, b in zip(copies, want)) and np.abs(want[1]).max() > 0
    pinned = set(nc.cu.host)                                       # the emulated driver's page-locked memory
    assert [a.ctypes.data for a in copies] == [b.ptr for b in engine.saved] and \
        {a.ctypes.data for a in copies} <= pinned
    engine.step(*batch, 1e-2, 2)                                   # the next step leaves the copies alone
    assert all(np.array_equal(a, b) for a, b in zip(copies, want))
    again = engine.host_weights()                                  # the same buffers, refilled
    assert [a.ctypes.data for a in again] == [a.ctypes.data for a in copies]
    assert np.array_equal(again[0], model.flat.download()[:n]) and not np.array_equal(again[0], want[0])
    flat = model.flat.download()[:n]
    del engine, model, copies                                      # an error lets the engine go mid-write:
    gc.collect()                                                   # the writer's arrays keep their memory
    assert {a.ctypes.data for a in again} <= set(nc.cu.host) and np.array_equal(again[0], flat)


# -----------------------------------------------------------------------------
# how often: --save-every, --save-minutes, and --minutes's plan

def test_the_cpu_saves_every_200_steps_and_the_gpu_every_10_minutes_unless_told():
    cpu, gpu, save_interval = ne.build_parser().parse_args, nc.build_parser().parse_args, ne.RunFolder.save_interval
    assert save_interval(cpu(["train"])) == (200, 0) and save_interval(cpu(["sft", "--model", "m"])) == (200, 0)
    assert save_interval(cpu(["train", "--save-minutes", "2.5"])) == (0, 2.5)
    assert save_interval(cpu(["train", "--save-every", "7"])) == (7, 0)
    assert save_interval(gpu(["train"])) == (0, 10) and save_interval(gpu(["sft", "--model", "m"])) == (0, 10)
    assert save_interval(gpu(["train", "--save-every", "500"]))[0] == 500
    assert save_interval(gpu(["train", "--save-minutes", "0.5"])) == (0, 0.5)


@pytest.mark.parametrize("program", ["nanoeuler.py", "nanoeuler_cuda.py"])
@pytest.mark.parametrize("flags", [["--save-every", "10", "--save-minutes", "5"], ["--save-minutes", "0"],
                                   ["--save-minutes", "nan"]])
def test_save_every_and_save_minutes_are_one_or_the_other_and_minutes_are_positive(program, flags):
    r = subprocess.run([sys.executable, os.path.join(HERE, program), "train", *flags], capture_output=True,
                       timeout=120, cwd=HERE)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "Traceback" not in err and "--save-minutes" in err.splitlines()[-1], err


def test_save_minutes_saves_by_the_clock(tmp_path, corpus, monkeypatch, capsys):
    # a fake clock: a step takes 0.25 s (on the main thread), nothing else takes time, so
    # with a save every 0.6 s one falls due after every third step, and the last at 10
    now = [0.0]
    step = ne.CPUEngine.step

    def timed(*args):
        now[0] += 0.25
        return step(*args)
    monkeypatch.setattr(ne.CPUEngine, "step", timed)
    monkeypatch.setattr(ne, "now", lambda: now[0])
    ne.main(train_args(tmp_path / "run", corpus, "--steps", "10", "--save-minutes", "0.01"))
    saved = re.findall(r"saved  \S+model_(\d+).safetensors", capsys.readouterr().out)
    assert sorted(map(int, saved)) == [3, 6, 9, 10]
    assert ne.RunFolder(str(tmp_path / "run")).steps() == [10, 9]


def test_the_gpu_trainer_counts_minutes_from_its_start(monkeypatch):
    # main reads the clock before anything else, as nanoeuler.py's does: --minutes is the whole run
    clock, seen = iter([123.0]), []
    monkeypatch.setattr(ne, "now", lambda: next(clock))
    monkeypatch.setattr(ne, "run_command", lambda command, args: seen.append(args))
    nc.main(["train", "--minutes", "10"])
    assert seen[0].started == 123.0 and seen[0].minutes == 10


def plan_steps(args, step, step_time, eval_time, pause, write, elapsed):
    """RunFolder.plan, `elapsed` s into the run, after an evaluation timed at `eval_time` s and a save
    that held the loop `pause` s and was written in `write` s"""
    run = ne.RunFolder("out", clock=lambda: elapsed)            # the program started at 0
    run.paused, run.took, run.eval_time, run.began = pause, write, eval_time, 0.0
    return run.plan(args, {}, step, step_time)


def test_minutes_plans_with_a_save_every_so_many_minutes():
    # by hand: 3,600 s less 10 s spent; n more steps of 0.5 s and one evaluation of 1 s at
    # the end make r = 0.5 n + 1 s, with s = floor(r / 600) + 1 checkpoints (every 10
    # minutes, and at the end), each holding the loop 2 s while its 30 s write runs beside
    # the steps, and the last one's write waited for: r + 2 s + 30 <= 3,590. n = 7,094:
    # r = 3,548, s = 6: 3,548 + 12 + 30 = 3,590; n = 7,095 is half a second over
    args = ne.build_parser().parse_args(["train", "--minutes", "60", "--save-minutes", "10", "--eval-every", "100000"])
    assert plan_steps(args, 20, 0.5, 1.0, 2.0, 30.0, 10.0) == 20 + 7094
    # a write of 630 s outlasts the 10 minutes to the next save, which waits 30 s for it:
    # r + 2 s + 30 (s - 1) + 630 <= 3,590. n = 5,658: r = 2,830, s = 5: 2,830 + 10 + 120 + 630
    assert plan_steps(args, 20, 0.5, 1.0, 2.0, 630.0, 10.0) == 20 + 5658


@pytest.mark.parametrize("minutes", ["0.001", "1e-310"])
def test_minutes_plans_at_most_a_save_a_step_when_save_minutes_is_shorter_than_a_step(minutes):
    # saves are due only between steps: n steps of 0.5 s and one evaluation of 1 s, a save
    # after each step holding the loop 0.1 s, writes of 0 s: 0.6 n + 1 <= 3,590 s, n = 5,981
    # (1e-310 minutes made the count of saves infinite: a traceback)
    args = ne.build_parser().parse_args(["train", "--minutes", "60", "--save-minutes", minutes, "--eval-every",
                                         "100000"])
    assert plan_steps(args, 20, 0.5, 1.0, 0.1, 0.0, 10.0) == 20 + 5981


# -----------------------------------------------------------------------------
# real processes: signals and kill -9 while a write is held open

GATED = """
import os, sys, threading, time
sys.path.insert(0, {here!r})
import nanoeuler as ne
gate, step = os.environ["GATE"], int(os.environ["GATE_STEP"])
save_model = ne.save_model

def gated(path, *args):                      # the write of GATE_STEP's pair holds after its state file
    if threading.current_thread() is not threading.main_thread() and path.endswith(f"model_{{step:06d}}.safetensors"):
        open(os.path.join(gate, "held"), "w").close()
        while not os.path.exists(os.path.join(gate, "open")):
            time.sleep(0.01)
    return save_model(path, *args)
ne.save_model = gated
try:
    ne.main()
except SystemExit as e:                      # as nanoeuler.py's own __main__
    if isinstance(e.code, int) and e.code > 128:
        ne.exit_now_if_threads_work_on(e.code)
    raise
"""


def start_gated(tmp_path, step, *args):
    """train (args) in a process whose background write of `step`'s pair holds until
    tmp_path/gate/open exists -> the process, the gate folder, its stdout and stderr files"""
    gate = tmp_path / "gate"
    gate.mkdir()
    out, err = open(tmp_path / "stdout", "wb"), open(tmp_path / "stderr", "wb")
    proc = subprocess.Popen([sys.executable, "-u", "-c", GATED.format(here=HERE), *args], stdout=out, stderr=err,
                            cwd=HERE, env={**os.environ, "GATE": str(gate), "GATE_STEP": str(step)},
                            preexec_fn=default_signals)
    return proc, gate, tmp_path / "stdout", tmp_path / "stderr"


def wait_until(condition, proc, what):
    """poll condition() while the process runs (an event, not a time, ends the wait)"""
    deadline = time.monotonic() + 240
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in 240 s"
        time.sleep(0.02)


def last_step(path):
    steps = re.findall(rb"^step +(\d+)/", path.read_bytes(), re.M)
    return int(steps[-1]) if steps else 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_training_goes_on_while_a_pair_is_written_and_a_signal_keeps_both_pairs(tmp_path, corpus, sig):
    run = tmp_path / "run"
    proc, gate, stdout, stderr = start_gated(tmp_path, 3, *train_args(run, corpus, "--steps", "100000",
                                                                      "--save-every", "3"))
    try:
        wait_until(lambda: (gate / "held").exists(), proc, "held write")
        wait_until(lambda: last_step(stdout) >= 5, proc, "step 5")           # the steps go on meanwhile
        assert (run / "state_000003.safetensors").exists() and ne.RunFolder(str(run)).steps() == []
        wait_until(lambda: b"still being written" in stderr.read_bytes(), proc, "note")   # step 6's save waits
        assert last_step(stdout) == 6 and not (run / "state_000006.safetensors").exists()
        proc.send_signal(sig)
        wait_until(lambda: b"then saving a checkpoint" in stderr.read_bytes(), proc, "signal's line")
        (gate / "open").touch()
        assert proc.wait(timeout=240) == 128 + sig
    finally:
        proc.kill()
    err = stderr.read_text().strip()
    assert "Traceback" not in err and err.count("still being written") == 1
    assert err.splitlines()[-1].endswith(f"stopped at step 6, saved as {run / 'model_000006.safetensors'}; "
                                         "continue with --resume")
    assert ne.RunFolder(str(run)).steps() == [6, 3] and [int(s) for s in re.findall(
        r"saved  \S+model_(\d+)", stdout.read_text())] == [3, 6]
    assert not [f for f in os.listdir(run) if f.endswith(".tmp")]
    for step in (3, 6):
        assert ne.RunFolder(str(run)).read_pair(step)[5]["step"] == step


def test_kill_9_during_a_background_write_leaves_the_pair_before_and_resume_is_bit_identical(tmp_path, corpus):
    straight = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"),
                               *train_args(tmp_path / "straight", corpus, "--steps", "12", "--save-every", "4")],
                              capture_output=True, timeout=300, cwd=HERE)
    assert straight.returncode == 0, straight.stderr.decode()
    run = tmp_path / "run"
    proc, gate, stdout, _ = start_gated(tmp_path, 8, *train_args(run, corpus, "--steps", "12", "--save-every", "4"))
    try:
        wait_until(lambda: (gate / "held").exists(), proc, "held write")
        proc.kill()                                                     # SIGKILL: no handler runs
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert ne.RunFolder(str(run)).steps() == [4] and (run / "state_000008.safetensors").exists()
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"),
                        *train_args(run, corpus, "--steps", "12", "--save-every", "4", "--resume")],
                       capture_output=True, timeout=300, cwd=HERE)
    assert r.returncode == 0, r.stderr.decode()
    assert f"resuming from {run / 'model_000004.safetensors'} at step 4".encode() in r.stdout
    name = "model_000012.safetensors"
    assert (tmp_path / "straight" / name).read_bytes() == (run / name).read_bytes()
    (a, _), (b, _) = (ne.read_safetensors(str(folder / "state_000012.safetensors")) for folder in (tmp_path / "straight", run))
    assert a["m"].tobytes() == b["m"].tobytes() and a["v"].tobytes() == b["v"].tobytes()


def test_a_second_signal_quits_at_once_while_a_write_is_held_and_the_pair_before_stays(tmp_path, corpus):
    run = tmp_path / "run"
    proc, gate, stdout, stderr = start_gated(tmp_path, 6, *train_args(run, corpus, "--steps", "100000",
                                                                      "--save-every", "3"))
    try:
        wait_until(lambda: (gate / "held").exists(), proc, "held write")
        wait_until(lambda: b"still being written" in stderr.read_bytes(), proc, "note")    # step 9 waits for 6
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: b"then saving a checkpoint" in stderr.read_bytes(), proc, "signal's line")
        proc.send_signal(signal.SIGINT)                                   # the gate stays shut
        assert proc.wait(timeout=240) == 130
    finally:
        proc.kill()
    err = stderr.read_text().strip()
    assert "Traceback" not in err and err.splitlines()[-1] == (
        f"Ctrl-C: interrupted; the last complete checkpoint is {run / 'model_000003.safetensors'}, continue with "
        "--resume")
    assert ne.RunFolder(str(run)).steps() == [3] and not (run / "model_000006.safetensors").exists()
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"),
                        *train_args(run, corpus, "--steps", "5", "--save-every", "3", "--resume")],
                       capture_output=True, timeout=300, cwd=HERE)
    assert r.returncode == 0 and b"at step 3" in r.stdout, r.stderr.decode()
    assert not [f for f in os.listdir(run) if f.endswith(".tmp")] and ne.RunFolder(str(run)).steps() == [5, 3]
