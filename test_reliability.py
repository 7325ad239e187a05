"""
Faults a training run must survive (issue 15): two runs or two trainers on one
folder, a NaN, broken checkpoint files, signals, a full or read-only disk, a
closed pipe. The signals are sent to real processes and the disk is a real
tmpfs (skipped, with the reason, where the tests cannot mount one).

    python -m pytest -q test_reliability.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "nanoeuler.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:40_000]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


def train_args(out, data, *extra):
    """the small model, a 300-token vocabulary and 4-row batches: a step takes tens of ms"""
    return ["train", "--data", data, "--out", str(out), "--vocab-size", "300", "--batch", "4",
            "--eval-every", "4", "--eval-batches", "2", "--save-every", "4", "--warmup", "2", *extra]


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, PROGRAM, *args], input=stdin, capture_output=True, timeout=300,
                          cwd=HERE)


def default_signals():
    """SIGINT, SIGTERM and SIGHUP at their defaults in a child, whatever the test runner ignores
    (a shell starts what runs in the background with SIGINT ignored, and an ignored signal
    stays ignored across exec: the child would never see the test's Ctrl-C)"""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def start_cli(*args):
    """a training process we can signal; -u so its step lines arrive as they are printed"""
    return subprocess.Popen([sys.executable, "-u", PROGRAM, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=HERE, preexec_fn=default_signals)


def wait_for_step(proc, n):
    """read the process's output until it has printed step n"""
    for line in proc.stdout:
        if (m := re.match(rb"step +(\d+)/", line)) and int(m.group(1)) >= n:
            return
    raise AssertionError(f"the run ended before step {n}: {proc.stderr.read().decode()[-2000:]}")


def one_sentence(r):
    """a refused command: exit code 2, no traceback, and its last line on stderr (after
    any progress lines) the only error line -> that line"""
    err = r.stderr.decode().strip()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in err and errors == err.splitlines()[-1:], err
    return errors[0]


def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus):
    """8 steps, checkpoints at 4 and 8: tests copy it before changing it"""
    root = tmp_path_factory.mktemp("finished")
    ne.main(train_args(root / "run", corpus, "--steps", "8"))
    return root


def copy_of(finished_run, tmp_path):
    """the finished run and its data cache (out/../cache), copied -> the run's folder"""
    shutil.copytree(finished_run, tmp_path / "copy")
    return tmp_path / "copy" / "run"


# -----------------------------------------------------------------------------
# one run per folder

def test_a_second_run_into_a_used_folder_is_refused(finished_run, corpus, tmp_path):
    out = copy_of(finished_run, tmp_path)
    before = files_of(out)
    err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "4", "--lr", "1e-2")))
    assert str(out) in err and "--resume" in err and "another --out" in err
    assert files_of(out) == before                       # log, best model and checkpoints untouched


def test_a_finished_run_resumed_says_it_is_complete(finished_run, corpus, tmp_path):
    out = copy_of(finished_run, tmp_path)
    before = files_of(out)
    r = run_cli(*train_args(out, corpus, "--steps", "8", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    said = r.stdout.decode()
    assert "already complete" in said and "step 8 of 8" in said and str(out / "model_000008.safetensors") in said
    assert "done: 0 steps" not in said and "None" not in said
    assert files_of(out) == before


def test_a_run_killed_before_its_first_save_resumes_with_one_header(corpus, tmp_path):
    out = tmp_path / "run"
    proc = start_cli(*train_args(out, corpus, "--steps", "1000", "--save-every", "1000", "--eval-every", "1000"))
    wait_for_step(proc, 3)
    proc.kill()                                          # no chance to save anything
    proc.wait()
    assert ne.RunFolder(str(out)).latest() is None and (out / "log.csv").exists()
    r = run_cli(*train_args(out, corpus, "--steps", "4", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert b"starting from scratch" in r.stdout
    lines = (out / "log.csv").read_text().splitlines()
    assert lines[0].startswith("step,loss") and [ln.split(",")[0] for ln in lines[1:]] == ["1", "2", "3", "4"]


def test_a_fresh_start_with_resume_keeps_an_earlier_starts_best_model(finished_run, corpus, tmp_path):
    # a run that stopped before its first checkpoint pair (a NaN, say) leaves only its best model
    out = copy_of(finished_run, tmp_path)
    for step in ne.RunFolder(str(out)).steps():
        ne.RunFolder(str(out)).remove(step)
    best = (out / "best.safetensors").read_bytes()
    r = run_cli(*train_args(out, corpus, "--steps", "4", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert b"starting from scratch" in r.stdout and b"best.safetensors.earlier" in r.stderr
    assert (out / "best.safetensors.earlier").read_bytes() == best
    assert (out / "best.safetensors").read_bytes() != best             # this start's own best, at step 4


@pytest.mark.parametrize("name, make", [("log.csv", os.mkfifo), ("best.safetensors", os.mkdir),
                                        ("log.csv", lambda p: os.symlink("/dev/zero", p)),
                                        ("train.lock", lambda p: os.symlink("/nonexistent/lock", p)),
                                        ("train.lock", os.mkfifo)])
def test_a_pipe_or_a_folder_in_place_of_a_run_file_is_refused_before_the_first_step(finished_run, corpus, tmp_path,
                                                                                    name, make):
    # reading a pipe as the log would hang the resume; a folder as best.safetensors would fail
    # the first evaluation's save, after steps that are then lost
    out = copy_of(finished_run, tmp_path)
    (out / name).unlink(missing_ok=True)                # a finished run leaves no train.lock
    make(str(out / name))
    files = lambda: {p.name: p.read_bytes() if p.is_file() else None for p in sorted(out.iterdir())}
    before = files()
    err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "12", "--resume")))
    # need_file says what is there instead: train.lock's link is refused as one (the lock never follows a link),
    # log.csv's link to /dev/zero is followed to the device
    mode = (os.lstat if name == "train.lock" else os.stat)(out / name).st_mode
    says = ("is a folder, not a file" if stat.S_ISDIR(mode) else "is a link, not a file" if stat.S_ISLNK(mode)
            else "is not a file (it is a device, a pipe or a socket)")
    why = ("it is where a run keeps its lock) and run again" if name == "train.lock" else
           f"the run writes its {name} there)")
    assert f"{out / name} {says}; move it away ({why}" in err
    assert files() == before


@pytest.mark.parametrize("cached, make", [("tokenizer_300_", os.mkfifo), ("tokens_", os.mkfifo),
                                          ("tokenizer_300_", os.mkdir), ("tokens_", lambda p: os.symlink("/dev/zero", p))])
def test_a_pipe_or_a_folder_in_place_of_a_cache_file_is_refused(finished_run, corpus, tmp_path, cached, make):
    # reading a named pipe as the cached tokenizer or tokens would hang the run before its first step
    out = copy_of(finished_run, tmp_path)
    cache = out.parent / "cache"
    path = next(p for p in cache.iterdir() if p.name.startswith(cached))
    path.unlink()
    make(str(path))
    r = subprocess.run([sys.executable, PROGRAM, *train_args(out.parent / "new", corpus, "--steps", "4")],
                       capture_output=True, timeout=60, cwd=HERE)
    what = "the tokenizer" if cached.startswith("tokenizer") else "the corpus's tokens"
    says = "is a folder, not a file" if make is os.mkdir else "is not a file (it is a device, a pipe or a socket)"
    assert one_sentence(r) == f"error: {path} {says}; move it away ({what} is cached there)"
    assert not (out.parent / "new").exists()


def test_a_refused_run_leaves_no_folder_it_made(tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    for extra in ([], ["--out", str(tmp_path / "a" / "b" / "c")]):   # the default out/small, then a deep one
        err = one_sentence(subprocess.run([sys.executable, PROGRAM, "train", "--data", "empty.txt", *extra],
                                          capture_output=True, timeout=60, cwd=tmp_path))
        assert err == "error: empty.txt holds no text; give it a UTF-8 text file with something in it"
        assert os.listdir(tmp_path) == ["empty.txt"]


def test_a_second_trainer_refuses_at_once_and_a_stale_lock_is_taken_over(corpus, tmp_path):
    out = tmp_path / "run"
    first = start_cli(*train_args(out, corpus, "--steps", "100000", "--save-every", "100000",
                                  "--eval-every", "100000"))
    try:
        wait_for_step(first, 1)
        for resume in ([], ["--resume"]):                # the lock speaks first, with or without --resume
            err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "4", *resume)))
            assert str(out) in err and f"pid {first.pid}" in err and "another --out" in err
    finally:
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err.decode()[-2000:]     # 128 + SIGINT: stopped, not done
    assert not (out / ne.LOCK_NAME).exists()
    # a run killed with -9 leaves its lock file behind; its pid is dead, so the lock is free
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / ne.LOCK_NAME).write_text(f"{dead.pid}\n")
    step = ne.RunFolder(str(out)).latest()
    r = run_cli(*train_args(out, corpus, "--steps", str(step + 2), "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert ne.RunFolder(str(out)).latest() == step + 2 and not (out / ne.LOCK_NAME).exists()


def test_the_ranks_of_a_gpus_launcher_share_its_lock(tmp_path, monkeypatch):
    # nanoeuler_cuda.py --gpus N: the launcher holds --out (run_command), then starts one
    # process per GPU, which run_command again; those, and only those, share its lock
    code = "import sys, nanoeuler as ne\ntry:\n    with ne.RunFolder(sys.argv[1]).claim(resume=True) as lock:\n" \
           "        print(lock)\nexcept ne.NanoEulerError as e:\n    print(e)"

    def child(**env):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, cwd=HERE,
                           env={**os.environ, **env}, timeout=60)
        return r.stdout.decode().strip()
    monkeypatch.delenv("NANOEULER_RANK", raising=False)
    with ne.RunFolder(str(tmp_path)).claim(resume=False):
        assert child(NANOEULER_RANK="1") == "None"
        assert child() == (f"{tmp_path} is in use by another training run (pid {os.getpid()}); wait for it "
                           "to end, or train into another --out")
    assert not (tmp_path / ne.LOCK_NAME).exists()


def test_a_run_folder_deleted_while_held_is_let_go_without_an_error_or_taking_anothers_lock(tmp_path):
    # rm -r of --out while a run holds it (during data preparation): the loop makes the folder again
    # (RunFolder.begin), so the run's end finds no lock file of its own there, or a later run's
    out = tmp_path / "run"
    with ne.RunFolder(str(out)).claim(resume=False):
        shutil.rmtree(out)
        out.mkdir()
    assert not out.exists()                            # the folder this run made, empty: gone with it
    with contextlib.ExitStack() as other:
        with ne.RunFolder(str(out)).claim(resume=False):
            shutil.rmtree(out)
            out.mkdir()
            other.enter_context(ne.RunFolder(str(out)).claim(resume=False))   # another run took the folder made again
        assert (out / ne.LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with pytest.raises(ne.NanoEulerError, match="in use by another training run"):
            with ne.RunFolder(str(out)).claim(resume=True):                  # still held, by the other run
                pass


def sft_args(model, out, data, *extra):
    return ["sft", "--model", str(model), "--out", str(out), "--data", str(data), "--batch", "2",
            "--eval-every", "2", "--save-every", "2", "--warmup", "1", *extra]


@pytest.fixture(scope="module")
def instructions(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "data.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Say {w}.", "response": w}) + "\n"
                            for w in ("yes", "no", "maybe", "never", "always", "soon")))
    return path


def test_sft_resumed_into_a_pretraining_folder_is_refused(finished_run, instructions, tmp_path):
    out = copy_of(finished_run, tmp_path)
    before = files_of(out)
    err = one_sentence(run_cli(*sft_args(out / "best.safetensors", out, instructions, "--steps", "12", "--resume")))
    assert err == f"error: {out} holds checkpoints of train, which sft cannot continue; give sft its own --out"
    assert files_of(out) == before


def test_pretraining_resumed_into_an_sft_folder_is_refused(finished_run, instructions, corpus, tmp_path, monkeypatch,
                                                           capsys):
    out = tmp_path / "sft"
    r = run_cli(*sft_args(finished_run / "run" / "best.safetensors", out, instructions, "--steps", "2"))
    assert r.returncode == 0 and ne.RunFolder(str(out)).latest() == 2, r.stderr.decode()[-2000:]
    before = files_of(out)
    err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "8", "--resume")))
    assert err == f"error: {out} holds checkpoints of sft, which train cannot continue; give train its own --out"
    assert files_of(out) == before
    r = run_cli(*sft_args(finished_run / "run" / "best.safetensors", out, instructions, "--steps", "4", "--resume"))
    assert r.returncode == 0 and ne.RunFolder(str(out)).latest() == 4, r.stderr.decode()[-2000:]
    # refused from the checkpoint's headers, before the corpus is tokenized (minutes on a large one)
    monkeypatch.setattr(ne, "prepare_data", lambda *a, **k: pytest.fail("tokenized before refusing"))
    with pytest.raises(SystemExit) as stop:
        ne.main(train_args(out, corpus, "--steps", "8", "--resume"))
    assert stop.value.code == 2
    assert "holds checkpoints of sft, which train cannot continue" in capsys.readouterr().err


def test_minutes_cannot_resume_a_steps_run(finished_run, instructions, corpus, tmp_path, monkeypatch, capsys):
    # a --steps run has no plan, and its cosine is bound to its total. --minutes on --resume used to
    # plan 20 steps on from the resumed step under the --steps default's total (1000; 600 for sft):
    # within 20 steps of it the run stopped there, its total shown as "?", with no plan; past it,
    # "already complete: step 1500 of 1000". Now refused, before the corpus is tokenized
    out = copy_of(finished_run, tmp_path)                # train --steps 8, at step 8
    before = files_of(out)
    err = one_sentence(run_cli(*train_args(out, corpus, "--minutes", "0.1", "--resume")))
    assert err == (f"error: {out} holds a run of --steps 8, at step 8, whose length --minutes cannot plan; resume "
                   "with --steps, or give --minutes another --out")
    assert files_of(out) == before
    sft = tmp_path / "sft"                               # sft: refused once the model and the pair are read
    r = run_cli(*sft_args(finished_run / "run" / "best.safetensors", sft, instructions, "--steps", "2"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    err = one_sentence(run_cli(*sft_args(finished_run / "run" / "best.safetensors", sft, instructions, "--minutes",
                                         "0.1", "--resume")))
    assert err.startswith(f"error: {sft} holds a run of --steps 2, at step 2, whose length --minutes cannot plan")
    # a --minutes run stopped before its plan resumes with --minutes (and plans from there), as before
    mine = tmp_path / "minutes"
    ne.main(train_args(mine, corpus, "--minutes", "5", "--stop-after", "3"))
    ne.main(train_args(mine, corpus, "--minutes", "5", "--stop-after", "2", "--resume"))
    assert ne.RunFolder(str(mine)).latest() == 5 and "step 5/? |" in capsys.readouterr().out
    ne.main(train_args(out, corpus, "--steps", "12", "--resume"))      # what the refusal says to do
    assert ne.RunFolder(str(out)).latest() == 12
    monkeypatch.setattr(ne, "prepare_data", lambda *a, **k: pytest.fail("tokenized before refusing"))
    with pytest.raises(SystemExit) as stop:
        ne.main(train_args(out, corpus, "--minutes", "5", "--resume"))
    assert stop.value.code == 2 and "whose length --minutes cannot plan" in capsys.readouterr().err


def test_mtp_weight_reaches_the_saved_config_and_the_loss(finished_run, corpus, tmp_path):
    # SPEC: mtp_weight = 0.5 by default, shared by the K-1 = 3 extra heads
    cfg, _, _ = ne.load_model(str(finished_run / "run" / "model_000004.safetensors"))
    assert cfg.mtp_weight == 0.5 and ne.mtp_weights(cfg) == [1.0, 0.5 / 3, 0.5 / 3, 0.5 / 3]
    out = tmp_path / "mtp"
    ne.main(train_args(out, corpus, "--steps", "4", "--mtp-weight", "1.5"))
    cfg, _, _ = ne.load_model(str(out / "model_000004.safetensors"))
    assert cfg.mtp_weight == 1.5 and ne.mtp_weights(cfg) == [1.0, 0.5, 0.5, 0.5]
    assert (cfg.V, cfg.C) == (300, 128)                              # --vocab-size still applies


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_mtp_weight_must_be_a_finite_number_at_least_0(bad, capsys):
    import nanoeuler_cuda as nc
    for parser in (ne.build_parser(), nc.build_parser()):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(["train", "--mtp-weight", bad])
        assert stop.value.code == 2
        assert f"argument --mtp-weight: '{bad}' is not a number >= 0" in capsys.readouterr().err
    args = nc.build_parser().parse_args(["train", "big", "--mtp-weight", "0"])
    assert ne.preset_with(ne.PRESETS["big"], args).mtp_weight == 0.0      # 0: head 0 alone is trained
    args = nc.build_parser().parse_args(["train", "big"])
    assert ne.preset_with(ne.PRESETS["big"], args) == ne.PRESETS["big"]


def test_a_huge_mtp_weight_is_refused_before_training(tmp_path, capsys):
    # 1e308 times a cross-entropy is inf: the first loss stopped the run with advice about --model
    # (refused by --mtp-weight's flag type since issue 30 moved the check out of preset_with: argparse's words)
    for weight, ok in (("1000", True), ("1000.5", False), ("1e308", False)):
        argv = ["train", "--mtp-weight", weight, "--out", str(tmp_path / "r")]
        if ok:
            assert ne.preset_with(ne.PRESETS["small"], ne.build_parser().parse_args(argv)).mtp_weight == 1000.0
            continue
        with pytest.raises(SystemExit) as stop:
            ne.main(argv)
        assert stop.value.code == 2
        assert f"error: argument --mtp-weight: {float(weight):g} is more than 1,000; give a smaller weight" \
            in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r" / "log.csv")


def test_pretraining_resumed_with_another_mtp_weight_is_refused(finished_run, corpus, tmp_path, capsys):
    out = copy_of(finished_run, tmp_path)
    before = files_of(out)
    with pytest.raises(SystemExit) as stop:
        ne.main(train_args(out, corpus, "--steps", "12", "--resume", "--mtp-weight", "1.5"))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"the checkpoint at step 8 in {out} was trained with another config or tokenizer (mtp_weight 0.5 " \
           "there, 1.5 here); pass the same --data and settings, or another --out" in err
    assert files_of(out) == before


def test_pretraining_resumed_with_another_config_is_refused_before_tokenizing(finished_run, corpus, tmp_path,
                                                                            monkeypatch, capsys):
    out = copy_of(finished_run, tmp_path)
    before = files_of(out)

    class Tokenizing(Exception):
        pass

    def prepare_data(*args, **kwargs):
        raise Tokenizing
    monkeypatch.setattr(ne, "prepare_data", prepare_data)
    with pytest.raises(SystemExit) as stop:
        ne.main(train_args(out, corpus, "--steps", "12", "--resume", "--model-size", "big"))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"the checkpoint at step 8 in {out} was trained with another config" in err
    assert err.strip().endswith("pass the same --data and settings, or another --out")
    # sft's config and tokenizer come from its --model: that is what to give again
    sft = ne.build_parser().parse_args(["sft", "--model", "m", "--out", str(tmp_path / "sft")])
    cfg, flat, tok = ne.load_model(str(out / "model_000008.safetensors"))
    state = {"step": 8, "rng": np.random.default_rng(0).bit_generator.state, "args": {"command": "sft"}}
    os.makedirs(tmp_path / "sft")                              # an sft run's checkpoint, then another tokenizer
    ne.RunFolder(str(tmp_path / "sft"), cfg, tok).write_pair(8, flat, np.zeros_like(flat), np.zeros_like(flat), state)
    other_tok = ne.Tokenizer()                                 # the same config, another tokenizer's merges
    other_tok.merges = [(1, 2)]
    with pytest.raises(ne.NanoEulerError, match=r"tokenizer; pass the same --model, or another --out$"):
        ne.RunFolder(str(tmp_path / "sft"), cfg, other_tok).refuse_other_run(sft, 8)
    # V alone may differ before tokenizing (a small corpus can end with fewer merges): no refusal yet
    args = train_args(out, corpus, "--steps", "12", "--resume")
    with pytest.raises(Tokenizing):
        ne.main(args[:args.index("--vocab-size")] + args[args.index("--vocab-size") + 2:])
    assert files_of(out) == before


WRITER = """
import sys
import nanoeuler as ne

def write(f):                      # half the file, then wait until the parent has written its own
    f.write(b"child " * 1000)
    print("half", flush=True)
    sys.stdin.readline()
    f.write(b"child " * 1000)

ne.atomic_write(sys.argv[1], write)
"""


def test_two_writers_never_share_a_temp_file(tmp_path):
    path = tmp_path / "model.safetensors"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE)
    assert child.stdout.readline() == b"half\n"
    ne.atomic_write(str(path), b"parent " * 100)   # while the child's file is half written
    assert path.read_bytes() == b"parent " * 100
    _, err = child.communicate(b"go\n", timeout=60)
    assert child.returncode == 0, err.decode()
    assert path.read_bytes() == b"child " * 2000         # the last rename wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


# -----------------------------------------------------------------------------
# a diverged run

def test_the_nan_stop_names_a_checkpoint_whose_loss_was_finite(corpus, tmp_path):
    out = tmp_path / "run"
    # lr 1e4 without clipping diverges within a few steps; a checkpoint after every step
    r = run_cli(*train_args(out, corpus, "--steps", "40", "--lr", "1e4", "--clip", "-1", "--warmup", "1",
                            "--save-every", "1"))
    err = one_sentence(r)
    assert err.startswith("error: the loss became nan at step "), err
    bad = int(err.split("at step ")[1].split(",")[0])    # the step whose loss was NaN
    good = ne.RunFolder(str(out)).latest()
    assert str(out / f"model_{good:06d}.safetensors") in err and "--resume" in err
    # the log shows a finite loss for the step after the named checkpoint (its weights gave it),
    # and the checkpoint whose weights gave the NaN (step bad - 1) is gone
    log = {int(row.split(",")[0]): float(row.split(",")[1]) for row in (out / "log.csv").read_text().splitlines()[1:]}
    assert good + 1 in log and np.isfinite(log[good + 1])
    assert good < bad - 1 and not (out / f"model_{bad - 1:06d}.safetensors").exists()
    # resuming from it with a lower lr trains on
    r = run_cli(*train_args(out, corpus, "--steps", str(bad + 4), "--lr", "1e-4", "--warmup", "1", "--resume"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert f"resuming from {out / f'model_{good:06d}.safetensors'} at step {good}".encode() in r.stdout
    assert ne.RunFolder(str(out)).latest() == bad + 4


def test_weights_that_are_not_finite_are_never_saved(finished_run, corpus, tmp_path):
    # a weight decay of 1e308 sends the matrices to infinity in one update, after a finite loss
    out = copy_of(finished_run, tmp_path)
    best = (out / "best.safetensors").read_bytes()
    r = run_cli(*train_args(out, corpus, "--steps", "12", "--resume", "--weight-decay", "1e308", "--save-every", "1",
                            "--eval-every", "1"))
    err = one_sentence(r)
    assert re.search(r"became (nan|NaN or infinite) at step 9,", err) and "--weight-decay" in err, err
    assert str(out / "model_000008.safetensors") in err
    assert (out / "best.safetensors").read_bytes() == best
    assert ne.RunFolder(str(out)).steps() == [8, 4]
    r = run_cli(*train_args(tmp_path / "fresh", corpus, "--steps", "4", "--weight-decay", "1e308", "--save-every",
                            "1", "--eval-every", "1"))
    assert "before any good checkpoint" in one_sentence(r)
    assert not [f for f in os.listdir(tmp_path / "fresh") if f.endswith(".safetensors")]


def test_a_checkpoint_of_weights_that_are_not_finite_is_refused(tmp_path):
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)
    flat = ne.init_params(cfg)
    flat[5] = np.inf

    class Engine:
        def host_weights(self):
            return flat, np.zeros_like(flat), np.zeros_like(flat)

        def host_params(self):
            return flat

        def evaluate(self, batches, token_bytes):
            return 1.0, 1.0                               # a finite loss: the weights must still be checked
    state = ne.RunFolder(str(tmp_path), cfg).resume_or_init(ne.build_parser().parse_args(["train", "--seed", "0"]),
                                                            ne.Tokenizer(), lambda: None)[3]
    rng = np.random.default_rng(0)
    with pytest.raises(ne.NanoEulerError, match="weights became NaN or infinite at step 3"):
        ne.RunFolder(str(tmp_path), cfg, ne.Tokenizer(), lambda: 0.0).save(3, Engine(), state, rng)
    with pytest.raises(ne.NanoEulerError, match="weights became NaN or infinite at step 3"):
        ne.run_validation(Engine(), [], cfg, ne.Tokenizer(), ne.RunFolder(str(tmp_path), cfg, ne.Tokenizer(),
                                                                           lambda: 0.0), state, 3, 10, [0], lambda: "0 s")
    assert os.listdir(tmp_path) == []


def test_the_step_line_by_hand(capsys):
    # step 7 of 100 in 0.25 s of 2,048 tokens; the last 50 step times (of 60) average 0.5 s:
    # 93 steps left take 46.5 s; before any time is kept, the step's own 0.25 s counts
    times = [9.0] * 10 + [0.5] * 50
    ne.log_step(7, 100, [2.5, 3.0], 1e-3, 0.75, 0.25, times, 2048, 0.125)
    ne.log_step(7, 100, [2.5, 3.0], 1e-3, 0.75, 0.25, [], 2048, None)
    ne.log_step(7, "?", [2.5, 3.0], 1e-3, 0.75, 0.25, times, 2048, 0.125)     # --minutes before its plan: no eta
    assert capsys.readouterr().out.splitlines() == [
        "step   7/100 | loss 2.5000 | lr 1.00e-03 | norm  0.750 |   250.0 ms |   8,192 tok/s | mfu 12.5% | eta 0m46s",
        "step   7/100 | loss 2.5000 | lr 1.00e-03 | norm  0.750 |   250.0 ms |   8,192 tok/s | eta 0m23s",
        "step 7/? | loss 2.5000 | lr 1.00e-03 | norm  0.750 |   250.0 ms |   8,192 tok/s | mfu 12.5%"]
    assert [ne.fmt_time(s) for s in (59.9, 61, 3599, 3600, 90061)] == ["0m59s", "1m01s", "59m59s", "1h00m", "25h01m"]


def test_the_last_line_splits_the_time_into_steps_and_the_rest(capsys):
    # 3 timed steps of 0.25, 0.5 and 0.75 s: 1.5 s of steps, 500 ms a step
    state = {"best_val": 2.5, "best_bpb": 1.25, "best_step": 3}
    ne.print_summary(4, "0m09s", [0.25, 0.5, 0.75], state, "run", "run/model_000004.safetensors")
    ne.print_summary(0, "0m01s", [], {}, "run", None)
    assert capsys.readouterr().out.splitlines() == [
        "done: 4 steps in 0m09s: 1.5 s of steps (500.0 ms/step), the rest validation, samples and checkpoints; "
        f"best val loss 2.5000 (bpb 1.250) at step 3, kept as {os.path.join('run', 'best.safetensors')}; "
        "last checkpoint run/model_000004.safetensors",
        "done: 0 steps in 0m01s; no validation yet; last checkpoint None"]


def test_a_log_row_by_hand():
    # step 7: CE_0 2.5, lr 3e-4, norm 1.25, 0.5 s for 1,000 tokens (2,000 a second), no MFU;
    # then a row with validation 3.25 / 1.5 bpb read back as (step, loss, val_loss)
    f = io.StringIO()
    ne.log_csv(f, 7, [2.5, 9.0], 3e-4, 1.25, 0.5, 1000, None)
    ne.log_csv(f, 8, [2.25, 9.0], 3e-4, 1.25, 0.5, 1000, 0.375, 3.25, 1.5)
    assert f.getvalue() == ("7,2.500000,3.000000e-04,1.250000,500.00,2000.0,,,\n"
                            "8,2.250000,3.000000e-04,1.250000,500.00,2000.0,0.3750,3.250000,1.500000\n")
    assert [ne.log_row(ln + "\n") for ln in f.getvalue().splitlines()] == [(7, 2.5, None), (8, 2.25, 3.25)]
    assert ne.LOG_HEADER.strip().split(",")[7:] == ["val_loss", "val_bpb"]


def test_a_folder_with_only_a_log_holds_another_run(tmp_path, monkeypatch):
    # a run killed before its first save leaves log.csv alone: still a run, not an empty folder
    monkeypatch.delenv("NANOEULER_RANK", raising=False)
    (tmp_path / "log.csv").write_text(ne.LOG_HEADER + "1,5.0,1e-3,1.0,10.0,100.0,,,\n")
    with pytest.raises(ne.NanoEulerError, match="holds another run; continue it with --resume"):
        with ne.RunFolder(str(tmp_path)).claim(resume=False):
            pass


def test_check_state_refuses_another_step_and_zero_counts():
    rng = np.random.default_rng(0).bit_generator.state
    good = {"step": 5, "rng": rng, "best_val": 1.0, "best_bpb": 1.0, "best_step": 3, "planned_steps": 9}
    ne.check_state(good, 5)
    with pytest.raises(ValueError, match="it says step 4"):
        ne.check_state({**good, "step": 4}, 5)
    for name in ("best_step", "planned_steps"):
        with pytest.raises(ValueError, match=f"its {name} = 0 is not a whole number from 1 to 1,000,000,000"):
            ne.check_state({**good, name: 0}, 5)


def test_an_infinite_gradient_norm_stops_the_run_like_a_nan_loss(tmp_path):
    with pytest.raises(ne.NanoEulerError, match="^the gradient norm became inf at step 5, so training stopped"):
        ne.RunFolder(str(tmp_path)).stop_if_not_finite({"loss": 1.0, "gradient norm": math.inf}, 5, made_by=4)
    ne.RunFolder(str(tmp_path)).stop_if_not_finite({"loss": 1.0, "gradient norm": 2.0}, 5, made_by=4)  # finite: nothing


def test_best_model_is_the_first_of_equal_losses(tmp_path):
    # validation losses 3, 2, 2, 2.5, 1.5: the best is step 2's until step 5's, a tie keeps the
    # earlier model (and its step), a worse one changes nothing
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)
    losses = iter([3.0, 2.0, 2.0, 2.5, 1.5])

    class Engine:
        def host_params(self):
            return np.full(ne.num_params(cfg), float(step), np.float32)    # the step, in the weights

        def evaluate(self, batches, token_bytes):
            return next(losses), 0.5
    state = ne.RunFolder(str(tmp_path), cfg).resume_or_init(ne.build_parser().parse_args(["train", "--seed", "0"]),
                                                            ne.Tokenizer(), lambda: None)[3]
    best, saves = [], ne.RunFolder(str(tmp_path), cfg, ne.Tokenizer(), lambda: 0.0)
    for step in range(1, 6):
        ne.run_validation(Engine(), [], cfg, ne.Tokenizer(), saves, state, step, 5, [0], lambda: "0 s")
        saves.finish()                                    # best.safetensors is written beside the steps
        weights = ne.load_model(str(tmp_path / "best.safetensors"))[1]
        best.append((state["best_step"], state["best_val"], float(weights[0])))
    assert best == [(1, 3.0, 1.0), (2, 2.0, 2.0), (2, 2.0, 2.0), (2, 2.0, 2.0), (5, 1.5, 5.0)]


def test_the_last_step_is_evaluated_when_it_is_no_multiple_of_eval_every(tmp_path, corpus):
    r = run_cli(*train_args(tmp_path / "run", corpus, "--steps", "6"))      # --eval-every 4
    assert r.returncode == 0, r.stderr.decode()
    assert re.findall(r"^val +(\d+)/6", r.stdout.decode(), re.M) == ["4", "6"]


# -----------------------------------------------------------------------------
# broken checkpoint files

def truncate(path, n=1000):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - n])


def bad_state_json(path):
    tensors, meta = ne.read_safetensors(str(path))
    ne.write_safetensors(str(path), list(tensors.items()), dict(meta, state='{"step": 8, "rng": '))


def edit_state(change=None, m=None, drop=()):
    """a spoiler of a state file: its JSON updated with change (keys in drop removed), or its m replaced by m(m)"""
    def spoil(path):
        tensors, meta = ne.read_safetensors(str(path))
        state = {**json.loads(meta["state"]), **(change or {})}
        assert all(state.pop(key) is not None for key in drop)
        tensors = dict(tensors, m=m(tensors["m"].copy()) if m else tensors["m"])
        ne.write_safetensors(str(path), list(tensors.items()), dict(meta, state=json.dumps(state)))
    return spoil


def with_nan(a):
    a[3] = np.nan
    return a


DAMAGE = {"truncated model": ("model", truncate), "truncated state": ("state", truncate),
          "state that is not JSON": ("state", bad_state_json),
          "rng of another state": ("state", edit_state({"rng": {"bit_generator": "PCG64", "state": {
              "state": "x", "inc": 1}, "has_uint32": 0, "uinteger": 0}})),
          "rng that is no state": ("state", edit_state({"rng": {"foo": 1}})),
          "rng of another generator": ("state", edit_state({"rng": {"bit_generator": "MT19937",
                                                                    "state": {"key": [1], "pos": 0}}})),
          "best_val that is text": ("state", edit_state({"best_val": "abc"})),
          "planned_steps that is text": ("state", edit_state({"planned_steps": "x"})),
          "best_val that is NaN": ("state", edit_state({"best_val": math.nan})),     # never beaten again
          "best_val without best_bpb": ("state", edit_state(drop=["best_bpb"])),
          "planned_steps past 10^9": ("state", edit_state({"planned_steps": 10 ** 9 + 1})),
          "args that are a list": ("state", edit_state({"args": [1]})),
          "step that is a bool": ("state", edit_state({"step": True})),
          "m of another shape": ("state", edit_state(m=lambda a: a.reshape(-1, 2))),
          "m that holds a NaN": ("state", edit_state(m=with_nan))}


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_falls_back_to_the_newest_pair_that_reads(finished_run, corpus, tmp_path, damage):
    out = copy_of(finished_run, tmp_path)
    kind, spoil = DAMAGE[damage]
    spoil(out / f"{kind}_000008.safetensors")
    r = run_cli(*train_args(out, corpus, "--steps", "12", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    said = [ln for ln in r.stderr.decode().splitlines() if "skipped" in ln]
    assert len(said) == 1 and f"{kind}_000008.safetensors" in said[0] and "re-run with --resume" not in said[0]
    assert f"resuming from {out / 'model_000004.safetensors'} at step 4".encode() in r.stdout
    assert ne.RunFolder(str(out)).latest() == 12
    assert (out / f"{kind}_000008.safetensors.broken").exists()   # set aside, not deleted


def test_resume_names_the_files_it_set_aside_as_they_are_named(finished_run, corpus, tmp_path):
    # a .broken from an earlier --resume is kept too: this pair becomes .broken.1, and the line says so
    out = copy_of(finished_run, tmp_path)
    (out / "model_000008.safetensors.broken").write_bytes(b"an earlier one")
    (out / "state_000008.safetensors").write_bytes(b"not a state")
    r = run_cli(*train_args(out, corpus, "--steps", "12", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert ("its files are kept as model_000008.safetensors.broken.1 and state_000008.safetensors.broken"
            in r.stderr.decode())
    assert (out / "model_000008.safetensors.broken").read_bytes() == b"an earlier one"


def test_resume_refuses_a_checkpoint_of_another_tokenizer_of_the_same_size(finished_run, corpus, tmp_path):
    # the same V, other merges (the corpus was changed, its tokenizer trained again): the
    # checkpoint's ids mean other text, so it cannot go on
    out = copy_of(finished_run, tmp_path)
    path = out / "model_000008.safetensors"
    tensors, meta = ne.read_safetensors(str(path))
    tok = json.loads(meta["tokenizer"])
    tok["merges"][-1] = [98, 97] if tok["merges"][-1] != [98, 97] else [97, 98]     # the last merge, another pair
    ne.write_safetensors(str(path), list(tensors.items()), dict(meta, tokenizer=json.dumps(tok)))
    err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "12", "--resume")))
    assert f"the checkpoint at step 8 in {out} was trained with another config or tokenizer" in err


def test_resume_takes_a_state_that_names_no_command(finished_run, corpus, tmp_path):
    # a state whose args name no command (an older version wrote none) is no other command's
    out = copy_of(finished_run, tmp_path)
    edit_state({"args": {}})(out / "state_000008.safetensors")
    r = run_cli(*train_args(out, corpus, "--steps", "10", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert f"resuming from {out / 'model_000008.safetensors'} at step 8".encode() in r.stdout


def test_resume_sets_a_model_without_its_state_aside_and_prunes_only_pairs(finished_run, corpus, tmp_path):
    # we write the state first and delete the model first, so a lone model file is none of ours
    # (here: its state deleted by hand); it must be neither overwritten at its step nor pruned
    out = copy_of(finished_run, tmp_path)
    (out / "state_000008.safetensors").unlink()
    lone = (out / "model_000008.safetensors").read_bytes()
    r = run_cli(*train_args(out, corpus, "--steps", "16", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert f"resuming from {out / 'model_000004.safetensors'} at step 4".encode() in r.stdout
    said = [ln for ln in r.stderr.decode().splitlines() if "no checkpoint" in ln]
    assert len(said) == 1 and "model_000008.safetensors has no state_000008.safetensors" in said[0], said
    assert (out / "model_000008.safetensors.lone").read_bytes() == lone
    assert ne.RunFolder(str(out)).steps() == [16, 12]             # 4 and 8 pruned as pairs


def test_resume_passes_over_files_named_like_checkpoints_that_it_never_writes(finished_run, corpus, tmp_path):
    # step 8's pair renamed by hand (model_8, 7 digits, full-width digits): no name RunFolder.path makes, so
    # --resume neither takes them for step 8's files (it stopped on "model_000008.safetensors: no such file")
    # nor touches them
    out = copy_of(finished_run, tmp_path)
    names = ["model_8.safetensors", "state_8.safetensors", "model_0000008.safetensors", "model_\uff18.safetensors"]
    for name in names:
        shutil.copy(out / f"{name[:5]}_000008.safetensors", out / name)
    for kind in ("model", "state"):
        (out / f"{kind}_000008.safetensors").unlink()
    r = run_cli(*train_args(out, corpus, "--steps", "10", "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert f"resuming from {out / 'model_000004.safetensors'} at step 4".encode() in r.stdout
    assert all((out / name).exists() for name in names) and not list(out.glob("*.lone"))


def test_pruning_deletes_only_complete_pairs(tmp_path):
    for step in (1, 2, 3, 4):
        for kind in ("model", "state"):
            if (step, kind) != (3, "state"):
                (tmp_path / f"{kind}_{step:06d}.safetensors").write_bytes(b"x")
    ne.RunFolder(str(tmp_path)).prune(keep=2)
    assert sorted(os.listdir(tmp_path)) == ["model_000002.safetensors", "model_000003.safetensors",
                                            "model_000004.safetensors", "state_000002.safetensors",
                                            "state_000004.safetensors"]


def test_setting_aside_overwrites_nothing_set_aside_before(tmp_path):
    for text in ("first", "second", "third"):
        (tmp_path / "model_000002.safetensors").write_text(text)
        ne.set_aside(str(tmp_path / "model_000002.safetensors"), ".lone")
    assert [(tmp_path / f"model_000002.safetensors.lone{n}").read_text() for n in ("", ".1", ".2")] == \
        ["first", "second", "third"]


def test_a_model_copied_into_the_folder_is_kept_when_resume_starts_afresh(finished_run, instructions, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    shutil.copy(finished_run / "run" / "model_000004.safetensors", out)
    mine = (out / "model_000004.safetensors").read_bytes()
    r = run_cli("sft", "--model", str(out / "model_000004.safetensors"), "--data", str(instructions), "--out", str(out),
                "--steps", "6", "--save-every", "1", "--resume")
    assert r.returncode == 0, r.stderr.decode()
    assert (out / "model_000004.safetensors.lone").read_bytes() == mine
    assert ne.RunFolder(str(out)).steps() == [6, 5]


def test_resume_with_no_readable_pair_says_so(finished_run, corpus, tmp_path):
    out = copy_of(finished_run, tmp_path)
    for step in (4, 8):
        truncate(out / f"model_{step:06d}.safetensors")
    err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "12", "--resume")))
    assert "model_000008.safetensors" in err and "re-run with --resume" not in err and "another --out" in err


# -----------------------------------------------------------------------------
# signals

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_the_tokenizer_trains_says_so_and_frees_the_folder(tmp_path, sig):
    out = tmp_path / "run"
    # the whole of Shakespeare and a 4,096-token vocabulary: the tokenizer trains for seconds
    proc = start_cli("train", "--data", os.path.join(HERE, "data", "tinyshakespeare.txt"), "--out", str(out),
                     "--vocab-size", "4096")
    for line in proc.stderr:
        if line.startswith(b"tokenizer: "):
            break
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    name = {signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}[sig]
    assert proc.returncode == 128 + sig and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"{name}: interrupted"
    assert not out.exists()                       # train.lock removed, and the folder the run made empty


STEP_HELD = """
import os, runpy, sys, time
from concurrent.futures import ThreadPoolExecutor
gate, program = sys.argv[1:3]
submit = ThreadPoolExecutor.submit

def held(work):                               # a worker thread's share of the step holds until gate/open exists
    def run(*args):
        open(os.path.join(gate, "held"), "w").close()
        while not os.path.exists(os.path.join(gate, "open")):
            time.sleep(0.01)
        return work(*args)
    return run

def submit_held(pool, fn, *args):             # once gate/armed exists, each step's gradients hold
    name = getattr(getattr(fn, "func", None), "__name__", "")       # functools.partial(grads_of_parts, ..)
    if name == "grads_of_parts" and os.path.exists(os.path.join(gate, "armed")):
        fn = held(fn)
    return submit(pool, fn, *args)
ThreadPoolExecutor.submit = submit_held
sys.argv = sys.argv[2:]
runpy.run_path(program, run_name="__main__")  # nanoeuler.py's own __main__, its exit included
"""


@pytest.mark.skipif(ne.CORES < 2, reason="one core: a step runs on no worker threads")
def test_a_second_signal_quits_without_waiting_for_the_step_in_flight(corpus, tmp_path):
    # the step in flight holds in its worker threads until the test opens a gate, which it never does:
    # waiting for those threads (Python joins them at exit) would never end, where a large --batch's
    # step takes minutes; the first SIGTERM asks for a save after the step, the second must quit at once
    out, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    proc = subprocess.Popen([sys.executable, "-u", "-c", STEP_HELD, str(gate), PROGRAM,
                             *train_args(out, corpus, "--steps", "100", "--threads", "2", "--eval-every", "100",
                                         "--save-every", "100")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE, preexec_fn=default_signals)
    try:
        wait_for_step(proc, 1)
        (gate / "armed").touch()
        while not (gate / "held").exists():                      # a later step is under way, in its threads
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        for line in proc.stderr:                                 # the first is taken: a save after this step
            if line.startswith(b"SIGTERM: finishing this step"):
                break
        else:
            raise AssertionError("the run ended without taking the first SIGTERM")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)                                   # the step never ends: only leaving it does
        err = proc.stderr.read().decode()
        assert proc.returncode == 143 and err.strip().splitlines()[-1] == "SIGTERM: interrupted", err[-2000:]
        assert "Traceback" not in err and not (gate / "open").exists()
        assert not (out / "train.lock").exists()
    finally:
        proc.kill()
        proc.wait()


def test_an_interrupted_save_names_the_last_complete_checkpoint(finished_run, tmp_path, capsys):
    out = copy_of(finished_run, tmp_path)
    flag = ne.RunFolder(str(out))
    flag.handle(signal.SIGTERM, None)                             # the first asks for a save
    with pytest.raises(ne.Interrupted) as e:
        flag.handle(signal.SIGTERM, None)                         # the second quits at once
    assert e.value.signum == signal.SIGTERM

    def interrupted_save(args):                                   # a state file written, its model not yet
        (out / "state_000012.safetensors").write_bytes(b"half")
        raise e.value
    handlers = {sig: signal.getsignal(sig) for sig in ne.SIGNALS}
    try:
        with pytest.raises(SystemExit) as done:
            ne.run_command(interrupted_save, ne.build_parser().parse_args(["train", "--out", str(out), "--resume"]))
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN     # the last words cannot be cut
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert done.value.code == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"SIGTERM: interrupted; the last complete checkpoint is {out / 'model_000008.safetensors'}, "
                    "continue with --resume")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_saves_a_checkpoint_and_the_run_resumes(corpus, tmp_path, sig):
    out = tmp_path / "run"
    proc = start_cli(*train_args(out, corpus, "--steps", "100000", "--save-every", "100000",
                                 "--eval-every", "100000"))
    wait_for_step(proc, 3)
    proc.send_signal(sig)
    said, err = proc.communicate(timeout=120)
    # the shell's convention: a process a signal ended exits 128 + its number (130, 143, 129)
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}[sig], err.decode()
    step = ne.RunFolder(str(out)).latest()
    assert step is not None and step >= 3 and f"model_{step:06d}.safetensors".encode() in said
    last = err.decode().strip().splitlines()[-1]
    assert f"stopped at step {step}, saved as {out / f'model_{step:06d}.safetensors'}" in last and "--resume" in last
    assert b"saving a checkpoint" in err and b"Traceback" not in err and b"done:" not in said
    r = run_cli(*train_args(out, corpus, "--steps", str(step + 2), "--resume"))
    assert r.returncode == 0, r.stderr.decode()
    assert f"at step {step}".encode() in r.stdout and ne.RunFolder(str(out)).latest() == step + 2


def test_a_hangup_that_was_ignored_at_start_stays_ignored(corpus, tmp_path):
    # nohup starts a program with SIGHUP ignored, so that it outlives the terminal
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-u", PROGRAM, *train_args(out, corpus, "--steps", "100000",
                                                                        "--save-every", "100000",
                                                                        "--eval-every", "100000")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_for_step(proc, 3)
    proc.send_signal(signal.SIGHUP)
    wait_for_step(proc, 6)                               # still training
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and b"SIGHUP" not in err, err.decode()[-2000:]
    assert ne.RunFolder(str(out)).latest() >= 6


def test_a_closed_terminal_saves_a_checkpoint(corpus, tmp_path):
    # the program's terminal is a pseudo-terminal whose other end we close, as a closed
    # ssh session does: the kernel sends SIGHUP and every later write fails (EIO)
    import fcntl
    import pty
    import termios
    out = tmp_path / "run"
    master, slave = pty.openpty()

    def own_terminal():                                  # a session whose controlling terminal is the pty
        default_signals()                                # (the kernel's SIGHUP must not find it ignored)
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    proc = subprocess.Popen([sys.executable, "-u", PROGRAM, *train_args(out, corpus, "--steps", "100000",
                                                                        "--save-every", "100000",
                                                                        "--eval-every", "100000")],
                            stdin=slave, stdout=slave, stderr=slave, cwd=HERE, preexec_fn=own_terminal)
    os.close(slave)
    seen = b""
    while not re.search(rb"step +3/", seen):
        chunk = os.read(master, 4096)
        assert chunk, seen.decode()[-2000:]
        seen += chunk
    os.close(master)                                     # the terminal hangs up
    proc.wait(timeout=120)
    assert proc.returncode == 129
    step = ne.RunFolder(str(out)).latest()
    assert step is not None and step >= 3
    r = run_cli(*train_args(out, corpus, "--steps", str(step + 1), "--resume"))
    assert r.returncode == 0 and ne.RunFolder(str(out)).latest() == step + 1, r.stderr.decode()


def test_a_closed_pipe_saves_a_checkpoint_and_ends_quietly(corpus, tmp_path):
    out = tmp_path / "run"
    proc = start_cli(*train_args(out, corpus, "--steps", "100000", "--save-every", "100000",
                                 "--eval-every", "100000"))
    wait_for_step(proc, 3)
    proc.stdout.close()                                  # as `| head` does when it has its lines
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err and "error" not in err, err[-2000:]
    step = ne.RunFolder(str(out)).latest()
    assert step is not None and step >= 3
    rows = [ln.split(",")[0] for ln in (out / "log.csv").read_text().splitlines()[1:]]
    assert rows == [str(s) for s in range(1, len(rows) + 1)] and len(rows) >= step - 1


def test_a_stop_saves_before_any_evaluation_or_sample(corpus, tmp_path, capsys, monkeypatch):
    # the signal comes during step 4, a step that evaluates and saves: it saves and no more
    calls = []
    step = ne.CPUEngine.step

    def step_and_signal(self, idx, targets, lr, n):
        if n == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, idx, targets, lr, n)
    evaluate = ne.CPUEngine.evaluate
    monkeypatch.setattr(ne.CPUEngine, "step", step_and_signal)
    monkeypatch.setattr(ne.CPUEngine, "evaluate", lambda self, *a: calls.append("evaluate") or evaluate(self, *a))
    monkeypatch.setattr(ne, "sample_text_for_log", lambda *a, **k: calls.append("sample") or "")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        ne.main(train_args(out, corpus, "--steps", "100", "--eval-every", "2", "--save-every", "100"))
    assert e.value.code == 143
    said = capsys.readouterr()
    assert calls == ["evaluate", "sample"]               # step 2's only
    assert re.search(r"val +2/100", said.out) and not re.search(r"val +4/100", said.out)
    assert ne.RunFolder(str(out)).latest() == 4 and "stopped at step 4" in said.err
    assert (out / "log.csv").read_text().splitlines()[-1].startswith("4,")


@pytest.mark.parametrize("during", ["step", "evaluate", "host_weights"])
def test_a_stop_at_the_minutes_plan_saves_and_makes_no_plan(corpus, tmp_path, capsys, monkeypatch, during):
    # --minutes plans at step PLAN_AFTER (20) from an evaluation and a save it times; the
    # signal comes during that step, that timed evaluation or that timed save's copy (the
    # run's first evaluation and save: --eval-every and --save-every 1000): the run saves
    # step 20 and stops as at any other step, and makes no plan (said or kept)
    calls = []
    work = getattr(ne.CPUEngine, during)

    def signal_at_20(self, *args):
        calls.append(during)
        if during != "step" or args[-1] == ne.PLAN_AFTER:
            os.kill(os.getpid(), signal.SIGTERM)
        return work(self, *args)
    monkeypatch.setattr(ne.CPUEngine, during, signal_at_20)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        ne.main(train_args(out, corpus, "--minutes", "60", "--eval-every", "1000", "--save-every", "1000"))
    assert e.value.code == 143
    said = capsys.readouterr()
    assert "plan |" not in said.out and "stopped at step 20" in said.err
    # a signal in the step comes before the evaluation: there is none (the save comes first)
    assert bool(re.search(r"val +20/", said.out)) == (during != "step")
    assert calls.count(during) == (20 if during == "step" else 1)
    cfg, flat, tok, m, v, state = ne.RunFolder(str(out)).read_pair(20)
    assert state["step"] == 20 and "planned_steps" not in state
    assert ne.RunFolder(str(out)).latest() == 20


def test_a_garbled_log_never_stops_a_resume(finished_run, corpus, tmp_path):
    out = copy_of(finished_run, tmp_path)
    log = out / "log.csv"
    good = log.read_bytes()
    # bytes that are not UTF-8, a step that str.isdigit takes but int() does not, a row cut short
    log.write_bytes(good + b"\xff\xfe\x00garbage\n" + "²,1.0,1,1,1,1,,,\n".encode() + b"3,\xff,,,,,,,\n9,2.5")
    r = run_cli(*train_args(out, corpus, "--steps", "12", "--resume"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert log.read_bytes().startswith(good)
    assert [ln.split(",")[0] for ln in log.read_text().splitlines()[1:]] == [str(s) for s in range(1, 13)]


# -----------------------------------------------------------------------------
# memory

def activation_bytes(cfg, rows):
    """the activations check_config counts for a thread of `rows` rows, as its docstring lists them (the formula
    again: within 10% of the measured peak, pinned below, and the refusal's threshold, pinned by the batch tests)"""
    C, D, Hq, Hkv, T, F, V, K, L = cfg.C, cfg.D, cfg.Hq, cfg.Hkv, cfg.T, cfg.F, cfg.V, cfg.K, cfg.L
    per_token = L * (5 * C + (4 * Hq + 3 * Hkv) * D + Hq * T + 5 * F) + 2 * Hq * T + (K + 1) * V + 4 * F + 8 * C
    return 4 * (rows * T * per_token + (K + 1) * V * C + 2 * F * C)


@pytest.mark.parametrize("cfg, rows", [(ne.PRESETS["small"], 1), (ne.PRESETS["small"], 8),
                                       (ne.Config(V=260, C=64, Hq=4, Hkv=1, L=3, T=256, F=176, K=2), 4)])
def test_the_activation_estimate_is_within_10_percent_of_the_measured_peak(cfg, rows):
    import tracemalloc                                   # numpy reports its arrays to it
    flat = ne.init_params(cfg)
    grads = [np.zeros_like(flat)]
    idx, targets = ne.split_rows(np.random.default_rng(0).integers(0, cfg.V, (rows, cfg.T + cfg.K)), cfg.T, cfg.K)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ne.loss_and_grads(flat, cfg, idx, targets, grads)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak <= activation_bytes(cfg, rows) <= 1.1 * peak


def test_a_batch_beyond_memory_is_refused_before_anything_is_allocated(monkeypatch):
    monkeypatch.setattr(ne, "CORES", 2)    # the threads below, on any machine
    cfg = ne.PRESETS["small"]
    P = ne.num_params(cfg)
    # 64 rows on 2 threads: 8 micro-batches of 8 rows (workers_for), two at a time, each
    # thread adding its micro-batches' gradients into a buffer of its own; the weights, m, v,
    # the decay mask, the checkpoint's copies of the weights, m and v, and a validation's copy
    # of the weights are P float32 each
    need = 4 * (8 + 2) * P + 2 * activation_bytes(cfg, 8) + 64 * (cfg.T + cfg.K) * 8 * (cfg.K + 2)
    ne.check_config(cfg, batch=64, threads=2, available=lambda: need)
    with pytest.raises(ne.NanoEulerError) as e:
        ne.check_config(cfg, batch=64, threads=2, available=lambda: need - 1)
    assert str(e.value).startswith(f"--batch 64 needs about {need / 1e9:.1f} GB of memory")
    assert str(e.value).endswith("lower --batch or --threads")     # a gradient buffer a thread
    with pytest.raises(ne.NanoEulerError, match="lower --batch$"):
        ne.check_config(cfg, batch=64, threads=1, available=lambda: 1)
    ne.check_config(cfg, batch=10 ** 9, threads=2, available=lambda: None)    # no /proc/meminfo: no check


def test_available_memory_is_the_least_of_meminfo_and_every_cgroup_limit_above_us(tmp_path):
    def machine(meminfo_kb=None, cgroup="0::/\n", folders=()):
        """a fake root: /proc/meminfo, /proc/self/cgroup, and cgroup folders (path under
        /sys/fs/cgroup, limit, usage, memory.stat text or None)"""
        root = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        (root / "proc/self").mkdir(parents=True)
        if meminfo_kb is not None:
            (root / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {meminfo_kb} kB\n")
        (root / "proc/self/cgroup").write_bytes(cgroup if isinstance(cgroup, bytes) else cgroup.encode())
        for path, limit, usage, stat in folders:
            folder = root / "sys/fs/cgroup" / path
            folder.mkdir(parents=True, exist_ok=True)
            v1 = path.startswith("memory")
            (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{limit}\n")
            (folder / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{usage}\n")
            if stat is not None:
                (folder / "memory.stat").write_text(stat)
        return ne.available_memory(str(root / "proc/meminfo"), ne.cgroups(str(root)))   # the folders, as at import

    GB = 10 ** 9
    assert machine(8_000_000) == 8_192_000_000                                  # no limit: MemAvailable
    # a container (cgroup namespace: its own cgroup at the mount's root), v2: 2 GB, 0.5 GB in use
    # of which 0.1 GB page cache the kernel would drop
    assert machine(8_000_000, folders=[("", 2 * GB, GB // 2, "anon 1\ninactive_file 100000000\n")]) == 1_600_000_000
    assert machine(8_000_000, folders=[("", "max", GB // 2, None)]) == 8_192_000_000   # v2 without a limit
    # a batch job's cgroup, no namespace: the limit of the job's own folder and of one above it
    job = "0::/jobs/42/step\n"
    assert machine(8_000_000, job, [("jobs/42/step", 3 * GB, GB, None), ("jobs/42", "max", GB, None)]) == 2 * GB
    assert machine(8_000_000, job, [("jobs/42/step", "max", GB, None), ("jobs", 1_500_000_000, GB, None)]) == GB // 2
    # cgroup v1, the memory controller's line: v1's "no limit" is a huge number; total_inactive_file
    v1 = "4:memory:/box\n3:cpu:/\n0::/\n"
    assert machine(8_000_000, v1, [("memory/box", 9223372036854771712, 10, None)]) == 8_192_000_000
    assert machine(8_000_000, v1, [("memory/box", 3 * GB, GB, "inactive_file 7\ntotal_inactive_file 500000000\n")]) \
        == 2_500_000_000
    assert machine(None, folders=[("", GB, 2 * GB, None)]) == 0                     # over its limit already
    assert machine(cgroup="") is None                                              # nothing to read: no check
    assert machine(8_000_000, b"0::/\xff\xfe\n", [("", GB, 0, None)]) == 8_192_000_000   # not UTF-8: MemAvailable


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_huge_batch_is_one_sentence(finished_run, corpus, tmp_path, command):
    # a billion rows: their token ids and targets alone take terabytes, more than any machine has
    args = ["--batch", str(10 ** 9), "--out", str(tmp_path / "run")]
    r = run_cli(*(["train", "--data", corpus] if command == "train" else
                  ["sft", "--model", str(finished_run / "run" / "best.safetensors")]), *args)
    err = one_sentence(r)
    assert "--batch 1000000000 needs about" in err and "lower --batch" in err
    assert not (tmp_path / "cache").exists()             # refused before the data is prepared
    assert not (tmp_path / "run").exists()               # and no empty --out left behind


def test_prepare_into_an_out_that_is_a_file_names_the_flag(corpus, tmp_path):
    (tmp_path / "afile").write_text("mine")
    err = one_sentence(run_cli("prepare", "--data", corpus, "--out", str(tmp_path / "afile")))
    assert err.startswith(f"error: --out {tmp_path / 'afile'} is a file, not a folder")
    assert (tmp_path / "afile").read_text() == "mine"


def test_out_of_memory_is_one_sentence(capsys, tmp_path):
    def allocate(args):
        np.ones(1 << 62, dtype=np.uint8)                 # 4 EiB: no machine has it
    with pytest.raises(SystemExit) as e:
        ne.run_command(allocate, ne.build_parser().parse_args(["check"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: out of memory (")
    assert err[0].endswith("; free some memory")                 # check has no --batch to lower
    with pytest.raises(SystemExit) as e:
        ne.run_command(allocate, ne.build_parser().parse_args(["train", "--out", str(tmp_path / "run")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[0].endswith("lower --batch, or free some memory")

    def fail(args):
        raise MemoryError                                        # a MemoryError that says nothing
    with pytest.raises(SystemExit):
        ne.run_command(fail, ne.build_parser().parse_args(["check"]))
    assert capsys.readouterr().err.strip() == "error: out of memory (an allocation failed); free some memory"


# -----------------------------------------------------------------------------
# the disk

@pytest.fixture
def tmpfs(tmp_path):
    """-> mount(size) giving a fresh tmpfs folder of that size, unmounted afterwards"""
    if os.geteuid() != 0:
        pytest.skip("a small tmpfs needs root to mount (the full and read-only disk tests run as root)")
    mounted = []

    def mount(size):
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
        mounted.append(point)
        return point
    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], capture_output=True)


def test_a_full_disk_gives_one_sentence_and_leaves_no_partial_file(corpus, tmpfs):
    disk = tmpfs("6m")                                   # the cache, the log and best.safetensors (3.7 MB)
    out = disk / "run"                                   # fit; state_000004 (7.3 MB) does not
    err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "4")))
    assert "state_000004.safetensors" in err and "disk is full" in err
    files = [os.path.join(d, f) for d, _, fs in os.walk(disk) for f in fs]
    assert not [f for f in files if f.endswith(".tmp")]
    st = os.statvfs(disk)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert used <= sum(os.path.getsize(f) for f in files) + (256 << 10)   # nothing half-written holds space


def test_a_read_only_disk_gives_one_sentence(corpus, tmpfs):
    disk = tmpfs("32m")
    out = disk / "run"
    r = run_cli(*train_args(out, corpus, "--steps", "4"))
    assert r.returncode == 0, r.stderr.decode()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    for folder, resume in ((out, ["--resume"]), (disk / "new", [])):
        err = one_sentence(run_cli(*train_args(folder, corpus, "--steps", "8", *resume)))
        assert "read-only" in err and str(folder) in err


@pytest.mark.parametrize("make, path, says", [
    (lambda t: (t / "afile").write_text("x"), "afile/run", "not a folder; give a path through folders"),
    (lambda t: (t / "cache").write_text("x"), "run", "cache: a file is there where a folder should be; move it away"),
    (lambda t: (t / "run" / "train.lock").mkdir(parents=True), "run",
     "train.lock is a folder, not a file; move it away (it is where a run keeps its lock) and run again"),
])
def test_a_path_of_the_wrong_kind_says_what_to_do(corpus, tmp_path, make, path, says):
    make(tmp_path)
    err = one_sentence(run_cli(*train_args(tmp_path / path, corpus, "--steps", "4")))
    assert says in err, err


def test_out_that_is_a_file_gives_one_sentence(corpus, tmp_path):
    out = tmp_path / "run"
    out.write_text("not a folder")
    err = one_sentence(run_cli(*train_args(out, corpus, "--steps", "4")))
    assert str(out) in err and "not a folder" in err
    assert out.read_text() == "not a folder"


# -----------------------------------------------------------------------------
# generation

def test_sample_into_a_closed_pipe_ends_quietly(finished_run):
    model = str(finished_run / "run" / "model_000008.safetensors")
    proc = subprocess.Popen([sys.executable, PROGRAM, "sample", "--model", model, "--prompt", "KING:",
                             "--max-new-tokens", "2000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE)
    assert proc.stdout.read(5) == b"KING:"
    proc.stdout.close()                                  # as `| head -c 5` does
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert err == b"" and proc.returncode == 1


@pytest.mark.parametrize("command, stdin", [("sample", None), ("chat", b"to be or not to be\n")])
def test_output_on_a_full_disk_says_the_output_could_not_be_written(finished_run, tmpfs, command, stdin):
    disk = tmpfs("64k")
    with open(disk / "filler", "wb", buffering=0) as f:    # fill it: the first block of output finds no room
        with contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 4096)
    model = str(finished_run / "run" / "model_000008.safetensors")
    with open(disk / "out.txt", "wb") as out:
        r = subprocess.run([sys.executable, PROGRAM, command, "--model", model, "--max-new-tokens", "300"],
                           input=stdin, stdout=out, stderr=subprocess.PIPE, cwd=HERE, timeout=300)
    assert one_sentence(r) == ("error: the output could not be written (no space left on device); "
                               "free some space, or send it elsewhere")


def test_chat_says_when_a_question_is_longer_than_the_context(finished_run):
    model = str(finished_run / "run" / "model_000008.safetensors")
    r = run_cli("chat", "--model", model, "--max-new-tokens", "8", "--seed", "1", stdin=b"to be or not " * 100 + b"\n")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    # room for the question: T - 1 less the reply's max_new_tokens = 128 - 1 - 8
    assert "more than fit in the context of 128 with room for a reply of 8; keeping its last 119 tokens" in err


def test_a_first_signal_after_lost_output_still_lets_the_save_finish():
    """lost output sets stop without a signal: the first SIGTERM after it is a first signal
    (it finishes the step and saves), only a second one quits at once"""
    flag = ne.RunFolder("run")
    flag.stop = True                                   # what RunFolder.begin does when stdout is gone
    flag.handle(signal.SIGTERM, None)                  # must not raise
    assert flag.signum == signal.SIGTERM
    with pytest.raises(ne.Interrupted):
        flag.handle(signal.SIGTERM, None)


def test_ctrl_c_during_a_reply_stops_the_reply_not_the_chat(tmp_path, monkeypatch, capsys):
    tok = ne.Tokenizer()
    cfg = ne.Config(V=tok.vocab_size, C=16, Hq=2, Hkv=1, L=1, T=64, F=48, K=2)
    model = str(tmp_path / "m.safetensors")
    ne.save_model(model, cfg, ne.init_params(cfg), tok)
    said, histories = [ord("a"), ord("b"), ord("c")], []

    def gen(params, cfg_, history, *args, **kwargs):             # the first reply is stopped after "ab"
        histories.append(list(history))
        for i, t in enumerate(said):
            if len(histories) == 1 and i == 2:
                raise KeyboardInterrupt
            yield t

    args = ne.build_parser().parse_args(["chat", "--model", model])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\ntwo\n")))
    ne.cmd_chat(args, gen=gen)
    out = capsys.readouterr().out
    assert "bot> ab\n(reply stopped; Ctrl-C at the prompt, /quit or Ctrl-D leaves)\nyou> two\nbot> abc\nbye" in out
    end = tok.special("<|end|>")
    first, _ = ne.render_turn(tok, "one")
    second, _ = ne.render_turn(tok, "two")
    assert histories[1] == first + [ord("a"), ord("b"), end] + second       # what was said stays in the history

    def stopped(*args, **kwargs):                                # SIGTERM / SIGHUP still end the command
        raise ne.Interrupted(15)
        yield
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\ntwo\n")))
    with pytest.raises(ne.Interrupted):
        ne.cmd_chat(args, gen=stopped)
