"""
A new user's first hour: the loss picture with no package (log.svg), `plot`, the
chat REPL (line editing, /help, Ctrl-D, a cut reply), --speculative's report,
and starting over in a folder that holds a run (--fresh).
"""

import errno
import os
import pty
import re
import select
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import nanoeuler as ne

HERE = os.path.dirname(os.path.abspath(__file__))
SVG = "{http://www.w3.org/2000/svg}"


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), *args], input=stdin,
                          capture_output=True, timeout=300, cwd=HERE)


def write_log(path, rows):
    """log.csv rows (step, loss, val or None), the other columns filler"""
    path.write_text(ne.LOG_HEADER + "".join(f"{s},{loss},0.001,1.0,10,100,0.1,{'' if v is None else v},"
                                            f"{'' if v is None else 2.0}\n" for s, loss, v in rows))


def test_the_loss_picture_is_drawn_to_scale(tmp_path):
    # steps 1..3 with losses 3, 2, 1 and a validation point (3, 1.5): on a 640 x 360
    # picture with margins left 60, right 10, top 10, bottom 40, step 1 is at x = 60
    # and step 3 at x = 630; loss 3 at y = 10 and loss 1 at y = 320
    write_log(tmp_path / "log.csv", [(1, 3.0, None), (2, 2.0, None), (3, 1.0, 1.5)])
    r = run_cli("plot", str(tmp_path))
    assert r.returncode == 0, r.stderr.decode()
    assert f"loss curve: {tmp_path / 'log.svg'}" in r.stdout.decode()
    svg = ET.parse(tmp_path / "log.svg").getroot()
    line = [tuple(map(float, p.split(","))) for p in svg.find(f"{SVG}polyline").get("points").split()]
    assert line == [(60.0, 10.0), (345.0, 165.0), (630.0, 320.0)]
    (dot,) = svg.findall(f"{SVG}circle")
    assert (float(dot.get("cx")), float(dot.get("cy"))) == (630.0, 242.5)
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert "step" in texts and "loss (nats per token)" in texts
    assert {"1", "2", "3"} <= set(texts) and {"1.000", "2.000", "3.000"} <= set(texts)     # both axes' ticks


def test_plot_takes_a_log_csv_and_refuses_what_is_not_one(tmp_path):
    write_log(tmp_path / "log.csv", [(5, 4.0, 4.1), (10, 3.0, None)])
    assert run_cli("plot", str(tmp_path / "log.csv")).returncode == 0
    assert (tmp_path / "log.svg").exists()
    (tmp_path / "empty.csv").write_text(ne.LOG_HEADER)                 # a run's log before its first step
    (tmp_path / "noise").mkdir()                                          # random bytes: no log.csv's header
    for name in ("noise.csv", "noise/log.csv"):
        (tmp_path / name).write_bytes(np.random.default_rng(0).bytes(4096))
    not_a_log = "is not a run's log (its first line is not log.csv's header); give a run folder (like out/small) " \
        "or its log.csv"
    for given, named, words in (("none", "none", "is not there"), ("empty.csv", "empty.csv", "holds no step yet"),
                                ("noise.csv", "noise.csv", not_a_log), ("noise", "noise/log.csv", not_a_log)):
        r = run_cli("plot", str(tmp_path / given))
        err = r.stderr.decode()
        assert r.returncode == 2 and f"error: {tmp_path / named} {words}" in err, err
        assert "Traceback" not in err and err.count("\n") == 1, err
    err = run_cli("plot", "").stderr.decode()           # an empty path: it read "error:  is not there"
    assert err == "error: '' is not there; give a run folder (like out/small) or its log.csv\n", err


def test_a_training_run_ends_with_its_picture(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:40_000])
    ne.main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--vocab-size", "300", "--batch", "2",
             "--steps", "6", "--eval-every", "3", "--eval-batches", "1", "--save-every", "6", "--warmup", "1"])
    svg = ET.parse(tmp_path / "run" / "log.svg").getroot()
    assert len(svg.find(f"{SVG}polyline").get("points").split()) == 6      # every step
    assert len(svg.findall(f"{SVG}circle")) == 2                            # validation at 3 and 6


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """a random model with draft heads: its replies are noise, but noise of a known length"""
    path = str(tmp_path_factory.mktemp("chat") / "m.safetensors")
    cfg = ne.Config(V=260, C=16, Hq=2, Hkv=1, L=1, T=64, F=32, K=2)
    ne.save_model(path, cfg, ne.init_params(cfg, seed=1), ne.Tokenizer())
    return path


def test_a_line_of_input_past_1_mb_is_one_sentence_not_all_memory(chat_model):
    # /dev/zero has no newline: readline alone would hold it all
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "chat", "--model", chat_model],
                       stdin=open("/dev/zero", "rb"), capture_output=True, cwd=HERE)
    assert r.returncode == 2 and r.stderr.decode().strip().splitlines() == [
        "error: a line of chat's input is over 1 MB; chat reads one turn a line"], r.stderr.decode()[-2000:]
    ok = run_cli("chat", "--model", chat_model, "--max-new-tokens", "1", stdin=b"x" * ((1 << 20) - 1) + b"\n/quit\n")
    assert ok.returncode == 0, ok.stderr.decode()[-2000:]           # 1 MB with its newline is a turn


def test_chat_commands_are_answered_not_sent(chat_model):
    r = run_cli("chat", "--model", chat_model, "--max-new-tokens", "3", "--temperature", "0",
                stdin=b"/help\n/whatever\n/quit\n")
    out = r.stdout.decode()
    assert r.returncode == 0 and "bot> " not in out, out                 # nothing went to the model
    assert out.count("/reset  forget the conversation") == 2 and "unknown command /whatever" in out
    assert "/help lists the commands" in out


def test_a_reply_cut_by_max_new_tokens_says_so(chat_model, monkeypatch, capsys):
    # a model that never says <|end|> within 3 tokens: the reply is cut, and says so once
    args = ne.build_parser().parse_args(["chat", "--model", chat_model, "--max-new-tokens", "3"])
    out, reply = ne.io.StringIO(), []
    ne.chat_reply(None, None, ne.Tokenizer(), [], args, out, reply, gen=lambda *a, **kw: iter([104, 105, 33]))
    assert reply == [104, 105, 33] and out.getvalue() == "hi!\n"
    assert capsys.readouterr().out == "(reply cut at --max-new-tokens 3; give a larger one for longer replies)\n"
    # ended by <|end|> or by the generator before the limit: no word
    for ids in ([104, ne.Tokenizer().special("<|end|>")], [104]):
        ne.chat_reply(None, None, ne.Tokenizer(), [], args, ne.io.StringIO(), [], gen=lambda *a, **kw: iter(ids))
        assert capsys.readouterr().out == ""


def test_speculative_says_how_many_drafts_were_accepted(chat_model):
    r = run_cli("sample", "--model", chat_model, "--speculative", "--temperature", "0", "--max-new-tokens", "20",
                "--prompt", "ab")
    err = r.stderr.decode()
    m = re.search(r"speculative: ([0-9.]+) tokens a pass \(([0-9]+) passes, ([0-9]+) drafts accepted\)", err)
    assert r.returncode == 0 and m, err
    ratio, passes, accepted = float(m[1]), int(m[2]), int(m[3])
    assert ratio == pytest.approx((passes + accepted) / passes, abs=0.005) and 1 <= ratio <= 2
    assert "speculative:" not in run_cli("sample", "--model", chat_model, "--max-new-tokens", "5").stderr.decode()


def read_until(fd, marker, seen, after=b""):
    """the terminal's output until marker appears (after `after`, when given; no sleeps:
    select waits for bytes)"""
    while marker not in seen[0][seen[0].find(after) + len(after) if after in seen[0] else len(seen[0]) + 1:]:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, f"no {marker!r} in {seen[0]!r}"
        try:
            seen[0] += os.read(fd, 4096)
        except OSError:                                   # the child closed the terminal
            break
    return seen[0]


def test_chat_in_a_terminal_edits_lines_and_leaves_on_ctrl_d(chat_model):
    # in a real terminal (a pty): "/hep", the left arrow, "l" is "/help" only with line editing
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, os.path.join(HERE, "nanoeuler.py"), "chat", "--model", chat_model,
                                  "--max-new-tokens", "2"])
    seen = [b""]
    read_until(fd, b"you> ", seen)
    os.write(fd, b"/hep\x1b[Dl\r")
    read_until(fd, b"this list", seen)
    read_until(fd, b"you> ", seen, after=b"this list")
    os.write(fd, b"\x04")                                 # Ctrl-D at the prompt
    out = read_until(fd, b"bye", seen, after=b"this list")
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert re.search(rb"you> \r?\nbye", out), out          # "bye" on a line of its own


def test_fresh_starts_over_and_keeps_the_old_run(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:20_000])
    out = tmp_path / "run"
    train = ["train", "--data", str(data), "--out", str(out), "--vocab-size", "280", "--batch", "2", "--steps", "2",
             "--eval-every", "2", "--eval-batches", "1", "--save-every", "2", "--warmup", "1"]
    ne.main(train)
    first = (out / "model_000002.safetensors").read_bytes()
    r = run_cli(*train)                                     # a second run: refused, and told the way
    err = r.stderr.decode()
    assert r.returncode == 2 and "start over with --fresh" in err and err.count("\n") == 1, err
    r = run_cli(*train, "--resume")                         # complete: nothing to do, and the way again
    assert r.returncode == 0 and "--fresh starts it over" in r.stdout.decode()
    for n, aside in enumerate(["run.old", "run.old.1"]):    # twice: nothing set aside is overwritten
        r = run_cli(*train, "--fresh", "--seed", str(7 + n))
        assert r.returncode == 0, r.stderr.decode()
        assert f"--fresh: the run that was in {out} is kept in {tmp_path / aside}" in r.stderr.decode()
        assert (tmp_path / aside / "log.csv").exists() and not (tmp_path / aside / "train.lock").exists()
    assert (tmp_path / "run.old" / "model_000002.safetensors").read_bytes() == first
    assert (out / "model_000002.safetensors").read_bytes() != first and (out / "log.svg").exists()
    r = run_cli(*train, "--fresh", "--resume")
    assert r.returncode == 2 and b"not allowed with argument" in r.stderr


def test_fresh_is_refused_while_another_run_holds_the_folder(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "log.csv").write_text(ne.LOG_HEADER)
    with ne.RunFolder(str(out)).claim(resume=True):                     # another run holds it
        r = run_cli("train", "--out", str(out), "--fresh", "--steps", "1")
    err = r.stderr.decode()
    assert r.returncode == 2 and "in use by another training run" in err, err
    assert (out / "log.csv").exists() and not (tmp_path / "busy.old").exists()


def test_fresh_refuses_when_another_run_takes_the_new_folder_first(tmp_path, monkeypatch, capsys):
    # a run that starts in the new folder between --fresh's rename and its lock's move: refused in one sentence
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.csv").write_text(ne.LOG_HEADER)

    def link(src, dst):
        raise FileExistsError(errno.EEXIST, "File exists", dst)
    monkeypatch.setattr(os, "link", link)
    with pytest.raises(ne.NanoEulerError, match=f"^{out} is in use by another training run; train into another --out$"):
        with ne.RunFolder(str(out)).claim(resume=False, fresh=True):
            pass
    assert (tmp_path / "run.old" / "log.csv").exists()                 # the old run kept, and said where
    assert f"the run that was in {out} is kept in {out}.old" in capsys.readouterr().err


@pytest.mark.parametrize("no_links", [False, True])
def test_fresh_holds_the_new_folder_as_it_held_the_old(tmp_path, monkeypatch, no_links):
    # --fresh renames the locked folder aside, then its locked train.lock moves into the new one: no run slips in;
    # on a file system without hard links (vfat: EPERM) the lock file is renamed into it instead
    if no_links:
        def link(src, dst):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", link)
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.csv").write_text(ne.LOG_HEADER)
    with ne.RunFolder(str(out)).claim(resume=False, fresh=True):
        assert (out / ne.LOCK_NAME).read_text() == f"{os.getpid()}\n"
        assert not (tmp_path / "run.old" / ne.LOCK_NAME).exists()
        with pytest.raises(ne.NanoEulerError, match="in use by another training run"):
            with ne.RunFolder(str(out)).claim(resume=True):
                pass
    assert not (out / ne.LOCK_NAME).exists() and (tmp_path / "run.old" / "log.csv").exists()
