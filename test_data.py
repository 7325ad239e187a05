"""
Tests of the tokenizer's piece bound and of data preparation: streaming the
tokens to disk on worker processes, documents, the memory-mapped cache, the
train/validation split, and Ctrl-C while tokenizing.

    python -m pytest -q test_data.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import hashlib
import json
import os
import re
import signal
import string
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from test_reliability import default_signals  # SIGINT, SIGTERM, SIGHUP at their defaults in a child

HERE = os.path.dirname(os.path.abspath(__file__))
SHAKESPEARE = os.path.join(HERE, "data", "tinyshakespeare.txt")
EOT = 256


@pytest.fixture(scope="module")
def tok():
    text = open(SHAKESPEARE, encoding="utf-8").read()[:50_000]
    return ne.Tokenizer.train(text + " naïve café 日本語のテキスト 🎉🎉 " * 20, 400, progress=False)


# -----------------------------------------------------------------------------
# the reference encoder: minbpe's, written out again, with the bound

def reference_parts(piece, max_bytes):
    """whole characters gathered while their UTF-8 bytes fit in max_bytes"""
    parts, cur = [], b""
    for ch in piece:
        b = ch.encode("utf-8")
        if len(cur) + len(b) > max_bytes:
            parts.append(cur)
            cur = b""
        cur += b
    return parts + [cur] if cur else parts


def reference_encode(tok, text):
    """minbpe's encode (get_stats, the pair of lowest merge index, merge) per part of each piece"""
    merges = {pair: ne.FIRST_MERGE_ID + i for i, pair in enumerate(tok.merges)}
    out = []
    for piece in ne.SPLIT_PATTERN.findall(text):
        for part in reference_parts(piece, tok.max_piece_bytes):
            ids = list(part)
            while len(ids) >= 2:
                stats = {}
                for pair in zip(ids, ids[1:]):
                    stats[pair] = stats.get(pair, 0) + 1
                pair = min(stats, key=lambda p: merges.get(p, float("inf")))
                if pair not in merges:
                    break
                new, i = [], 0
                while i < len(ids):
                    if i < len(ids) - 1 and (ids[i], ids[i + 1]) == pair:
                        new.append(merges[pair])
                        i += 2
                    else:
                        new.append(ids[i])
                        i += 1
                ids = new
            out += ids
    return out


RUNS = st.sampled_from(["a", "b", " ", "\n", "é", "日", "🎉", "'s", "7", "-", "the", " king"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(RUNS, st.integers(1, 90)), max_size=8), st.sampled_from([4, 5, 16, 128]))
def test_encoder_matches_minbpe_with_the_bound(tok, runs, bound):
    text = "".join(s * n for s, n in runs)                 # long runs cross the bound
    t = ne.Tokenizer(tok.merges, bound)
    assert t.encode(text) == reference_encode(t, text)
    assert t.encode(text) == reference_encode(t, text)     # again, from the cache
    assert t.decode(t.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=300))
def test_encoder_matches_minbpe_on_any_text(tok, text):
    assert tok.encode(text) == reference_encode(tok, text)


def reference_train(text, n_merges, max_bytes):
    """minbpe's training, written out again, with the bound: every round counts every pair in
    every part of every piece afresh (no weights, no heap) and merges the most frequent, ties
    to the smallest pair"""
    seqs = [list(part) for piece in ne.SPLIT_PATTERN.findall(text) for part in reference_parts(piece, max_bytes)]
    merges = []
    while len(merges) < n_merges:
        stats = {}
        for seq in seqs:
            for pair in zip(seq, seq[1:]):
                stats[pair] = stats.get(pair, 0) + 1
        if not stats:
            break
        pair = min(stats, key=lambda p: (-stats[p], p))
        new_id = ne.FIRST_MERGE_ID + len(merges)
        merges.append(pair)
        for k, seq in enumerate(seqs):
            new, i = [], 0
            while i < len(seq):
                if i < len(seq) - 1 and (seq[i], seq[i + 1]) == pair:
                    new.append(new_id)
                    i += 2
                else:
                    new.append(seq[i])
                    i += 1
            seqs[k] = new
    return merges


@pytest.mark.parametrize("bound", [5, 128])
def test_training_matches_minbpe_with_the_bound(bound):
    # words of every frequency, runs that overlap (aaaa), and with a bound of 5 bytes long words
    # cut into parts that other words share (thatch -> that + ch): the trainer's weighted,
    # incremental counts must pick the merges that counting afresh every round picks
    text = open(SHAKESPEARE, encoding="utf-8").read()[:6_000] + " aaaa aaa thatch that chthatch" * 7 + " naïve café"
    tok = ne.Tokenizer.train(text, ne.FIRST_MERGE_ID + 120, progress=False, max_piece_bytes=bound)
    assert tok.merges == reference_train(text, 120, bound)
    assert tok.max_piece_bytes == bound


def doubling_tokenizer(n_merges):
    """merges a+a, aa+aa, ...: merge k makes the run of 2^(k+1) a's"""
    merges = [(97, 97)] + [(ne.FIRST_MERGE_ID + k, ne.FIRST_MERGE_ID + k) for k in range(n_merges - 1)]
    return merges


def test_a_long_run_is_cut_at_the_bound():
    merges = doubling_tokenizer(8)                            # the last one is 256 a's
    a128, a256 = ne.FIRST_MERGE_ID + 6, ne.FIRST_MERGE_ID + 7
    assert ne.Tokenizer(merges, 256).encode("a" * 256) == [a256]
    assert ne.Tokenizer(merges, 128).encode("a" * 256) == [a128, a128]
    assert ne.Tokenizer(merges).encode("a" * 256) == [a128, a128]        # the default bound is 128
    assert ne.MAX_PIECE_BYTES == 128
    # never inside a character: 3-byte characters go 42 to a part (126 bytes), not 42 2/3
    assert [len(p) for p in ne.cut_piece("日" * 100, 128)] == [126, 126, 48]
    assert b"".join(ne.cut_piece("日" * 100, 128)).decode() == "日" * 100


def test_encoding_a_word_without_spaces_is_linear(monkeypatch):
    # A word of letters whose every other pair is a merge of its own: BPE merges
    # one pair a round, about n/2 rounds over a word of n bytes. Count the work
    # (each round's merge walks its sequence once): unbounded, twice the word
    # is about four times the work; cut into parts of 128 bytes, twice.
    letters = [ord(c) for c in string.ascii_letters]
    pairs = [(a, b) for a in letters for b in letters]
    pairs = [pairs[i] for i in np.random.default_rng(0).permutation(len(pairs))]
    word = bytes(x for pair in pairs for x in pair).decode()         # 5,408 letters
    steps = [0]
    merge = ne.merge

    def counting_merge(ids, pair, new_id):
        steps[0] += len(ids)
        return merge(ids, pair, new_id)
    monkeypatch.setattr(ne, "merge", counting_merge)

    def work(tok, n):
        steps[0] = 0
        tok.cache.clear()
        assert tok.decode(tok.encode(word[:n])) == word[:n]
        return steps[0]
    bounded = [work(ne.Tokenizer(pairs, 128), n) for n in (1000, 2000, 4000)]
    assert 1.8 < bounded[1] / bounded[0] < 2.2 and 1.8 < bounded[2] / bounded[1] < 2.2
    unbounded = [work(ne.Tokenizer(pairs, 1 << 20), n) for n in (2000, 4000)]
    assert unbounded[1] / unbounded[0] > 3                  # what the count sees without the bound


def test_the_bound_is_saved_with_the_tokenizer(tmp_path):
    t = ne.Tokenizer(doubling_tokenizer(3), 64)
    assert ne.read_tokenizer(t.to_json()).max_piece_bytes == 64
    old = json.loads(t.to_json())
    del old["max_piece_bytes"]                               # a tokenizer saved before the bound
    assert ne.read_tokenizer(json.dumps(old)).max_piece_bytes == 128
    cfg = ne.Config(V=t.vocab_size, C=16, Hq=4, Hkv=2, L=1, T=8, F=48, K=2)
    path = str(tmp_path / "m.safetensors")
    ne.save_model(path, cfg, ne.init_params(cfg), t)
    assert json.loads(ne.read_safetensors(path)[1]["tokenizer"])["max_piece_bytes"] == 64
    assert ne.load_model(path)[2].max_piece_bytes == 64
    with pytest.raises(ValueError):
        ne.Tokenizer(t.merges, 3)                             # a 4-byte character would not fit
    with pytest.raises(ValueError, match="from 4 to 1,048,576"):
        ne.Tokenizer(t.merges, (1 << 20) + 1)                 # what a saved tokenizer may not say either


# -----------------------------------------------------------------------------
# documents and streaming

def expected_tokens(tok, files):
    """what the files should tokenize to, computed from their whole text"""
    ids = []
    for path in files:
        text = open(path, encoding="utf-8").read()
        if not text:
            continue
        docs = text.split("\n<|endoftext|>\n")
        for doc in docs[:-1]:
            ids += reference_encode(tok, doc) + [EOT]
        if docs[-1]:                                         # a book, or a shard's unmarked end
            ids += reference_encode(tok, docs[-1]) + [EOT]
    return ids


def write_corpus(folder):
    folder.mkdir()
    text = open(SHAKESPEARE, encoding="utf-8").read()
    (folder / "a_book.txt").write_text(text[:30_000] + "\nthe end, no newline", encoding="utf-8")
    docs = [text[i:i + 700].strip() for i in range(30_000, 40_000, 700)] + ["naïve 日本語", "", "x"]
    (folder / "b_shard.txt").write_text("".join(d + "\n<|endoftext|>\n" for d in docs), encoding="utf-8")
    (folder / "c_chinese.txt").write_text("日本語のテキスト。" * 1000 + "\n<|endoftext|>\n" + "中文" * 300,
                                          encoding="utf-8")
    (folder / "d_empty.txt").write_text("")
    return sorted(str(p) for p in folder.iterdir())


def test_tokens_on_disk_are_the_encoding_of_the_documents(tmp_path, tok, monkeypatch):
    files = write_corpus(tmp_path / "corpus")
    monkeypatch.setattr(ne, "CHUNK_BYTES", 1000)              # many chunks, cut inside documents
    path = str(tmp_path / "tokens.npy")
    ne.write_tokens(path, files, tok, workers=1, progress=False)
    tokens = np.load(path)
    assert tokens.dtype == np.uint16
    want = expected_tokens(tok, files)
    chinese = files.index(next(f for f in files if "chinese" in f))
    # a chunk cut inside text without spaces may split pieces differently there;
    # everything else is exact, and all of it decodes back
    exact = expected_tokens(tok, files[:chinese])
    assert tokens[:len(exact)].tolist() == exact
    assert tok.decode(tokens.tolist()) == tok.decode(want)
    assert tokens.tolist().count(EOT) == want.count(EOT) == 1 + 18 + 2


PARTS = st.one_of(st.sampled_from(["\n<|endoftext|>\n", "<|endoftext|>", " the", " word", "said", "\n", " ",
                                    "日本語", "é", "x y", "<|end"]), st.text(max_size=12))


@settings(max_examples=100, deadline=None)
@given(st.lists(PARTS, max_size=40), st.integers(8, 64))
def test_chunks_keep_every_document_and_all_the_text(tok, tmp_path_factory, parts, chunk_bytes):
    text = "".join(parts)
    path = tmp_path_factory.mktemp("c") / "f.txt"
    path.write_bytes(text.encode("utf-8"))
    docs = re.split(r"\n?<\|endoftext\|>\n?", text)         # the contract: split on the marker
    ends_with_marker = re.search(r"<\|endoftext\|>\n*\Z", text)
    want = "<|endoftext|>".join(docs) + ("" if ends_with_marker or not text else "<|endoftext|>")
    old, ne.CHUNK_BYTES = ne.CHUNK_BYTES, chunk_bytes           # tiny chunks: cuts everywhere
    try:
        ids = [i for chunk in ne.text_chunks([str(path)]) for i in ne.encode_chunk(tok, *chunk).tolist()]
    finally:
        ne.CHUNK_BYTES = old
    assert tok.decode(ids) == want
    assert ids.count(EOT) == want.count("<|endoftext|>")


def test_blank_lines_after_the_last_marker_are_no_document(tmp_path, monkeypatch):
    # "a\n<|endoftext|>\n\n": the separator takes one newline, the other is text (10),
    # and no <|endoftext|> follows it; chunks of 16 bytes end the file with a chunk "\n"
    path = tmp_path / "shard.txt"
    path.write_bytes(b"a\n<|endoftext|>\n\n")
    for chunk_bytes in (1 << 10, 16):
        monkeypatch.setattr(ne, "CHUNK_BYTES", chunk_bytes)
        chunks = ne.text_chunks([str(path)])
        assert [i for c in chunks for i in ne.encode_chunk(ne.Tokenizer(), *c).tolist()] == [97, 256, 10]


def test_workers_give_the_same_tokens_and_are_not_forked(tmp_path, tok, monkeypatch):
    # forking a process that runs threads (training's, CUDA's) can deadlock the
    # child, and Python 3.12 warns of it; the workers must be spawned
    files = write_corpus(tmp_path / "corpus")
    monkeypatch.setattr(ne, "CHUNK_BYTES", 4000)

    def no_fork():
        raise AssertionError("os.fork called")
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait)                # this process runs a thread
    busy.start()
    try:
        monkeypatch.setattr(os, "fork", no_fork)
        one, two = [], []
        ne.tokenize_files(files, tok, one.append, workers=1, progress=False)
        ne.tokenize_files(files, tok, two.append, workers=2, progress=False)
    finally:
        stop.set()
        busy.join()
    assert np.concatenate(two).tolist() == np.concatenate(one).tolist()


def test_tokenizer_sample_leaves_out_the_markers(tmp_path):
    files = write_corpus(tmp_path / "corpus")
    text = ne.tokenizer_sample(files, max_bytes=1 << 20)
    assert "<|endoftext|>" not in text and "naïve 日本語\n" in text and "the end, no newline" in text
    share = ne.tokenizer_sample(files, max_bytes=4000)            # 1000 bytes from the start of each file
    assert share.startswith(open(files[0], encoding="utf-8").read()[:900]) and len(share.encode()) <= 4000


def test_progress_says_mb_done_speed_and_time_left():
    # 300 of 1,000 MB in 10 s: 30 MB/s, 700 MB left, 23.3 s
    assert ne.progress_text(300e6, 1000e6, 10.0) == "tokenizing: 300/1,000 MB, 30.0 MB/s, 0m23s left"


# -----------------------------------------------------------------------------
# the cache, memory-mapped, and the split

def test_prepared_tokens_are_memory_mapped_and_keyed_by_corpus_and_tokenizer(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(open(SHAKESPEARE, encoding="utf-8").read()[:20_000], encoding="utf-8")
    cache, run = str(tmp_path / "cache"), str(tmp_path / "run")       # a run's cache is beside it
    tok, tokens = ne.prepare_data(str(corpus), 300, run, progress=False)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert tokens.tolist() == expected_tokens(tok, [str(corpus)])
    train, val = ne.split_train_val(tokens, 13)
    assert isinstance(train, np.memmap) and isinstance(val, np.memmap)   # views, not copies
    # another tokenizer for the same corpus: the tokens are made again for it
    tok_file = next(p for p in os.listdir(cache) if p.startswith("tokenizer_"))
    fewer = ne.Tokenizer(tok.merges[:10])
    (tmp_path / "cache" / tok_file).write_text(fewer.to_json())
    tok2, tokens2 = ne.prepare_data(str(corpus), 300, run, progress=False)
    assert tok2.merges == fewer.merges and tokens2.tolist() == expected_tokens(fewer, [str(corpus)])
    # a damaged tokenizer file: trained again
    (tmp_path / "cache" / tok_file).write_text('{"merges": [[1')
    tok4, tokens4 = ne.prepare_data(str(corpus), 300, run, progress=False)
    assert tok4.merges == tok.merges and np.array_equal(tokens4, tokens)
    # one nested past the parser's depth, or with more tokens than asked for: trained again too
    for damaged in ("[" * 100_000 + "]" * 100_000, ne.Tokenizer(tok.merges + [[97, 97]]).to_json()):
        (tmp_path / "cache" / tok_file).write_text(damaged)
        tok5, _ = ne.prepare_data(str(corpus), 300, run, progress=False)
        assert tok5.merges == tok.merges and tok5.vocab_size == 300
    # a changed corpus: both again
    corpus.write_text("something else entirely " * 500, encoding="utf-8")
    tok3, tokens3 = ne.prepare_data(str(corpus), 300, run, progress=False)
    assert tok3.decode(tokens3.tolist()) == "something else entirely " * 500 + "<|endoftext|>"
    assert not [p for p in os.listdir(cache) if p.endswith(".tmp")]


TOKEN_WRITER = """
import sys
import numpy as np
import nanoeuler as ne

def tokenize_files(files, tok, write, workers=None, progress=True):   # half the ids, then wait for the parent
    write(np.arange(0, 50, dtype=np.uint16))
    print("half", flush=True)
    sys.stdin.readline()
    write(np.arange(50, 100, dtype=np.uint16))
    return 100

ne.tokenize_files = tokenize_files
ne.write_tokens(sys.argv[1], [], ne.Tokenizer(), progress=False)
"""


def test_two_runs_sharing_the_cache_write_their_own_token_files(tmp_path):
    path = tmp_path / "tokens.npy"
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be or not to be", encoding="utf-8")
    child = subprocess.Popen([sys.executable, "-c", TOKEN_WRITER, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE)
    assert child.stdout.readline() == b"half\n"
    tok = ne.Tokenizer()                                 # bytes only: the ids are the UTF-8 bytes
    ne.write_tokens(str(path), [str(corpus)], tok, workers=1, progress=False)   # while the child's is half written
    assert np.load(path).tolist() == list(b"to be or not to be") + [EOT]
    _, err = child.communicate(b"go\n", timeout=60)
    assert child.returncode == 0, err.decode()
    assert np.load(path).tolist() == list(range(100))   # the last rename wins, whole
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_temp_files_of_killed_runs_are_removed_and_never_read(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - ne.STALE_TMP_SECONDS - 60
    stale = tmp_path / f"tokens_x.npy.{dead.pid}.tmp"   # a killed run's, untouched for long
    recent = tmp_path / f"tokens_y.npy.{dead.pid}.tmp"  # perhaps another container's writer, still writing
    alive = tmp_path / f"tokens_z.npy.{os.getppid()}.tmp"
    for p in (stale, recent, alive):
        p.write_bytes(b"\x93NUMPY half a file")
    os.utime(stale, (old, old))
    os.utime(alive, (old, old))
    ne.remove_stale_tmp(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([recent.name, alive.name])
    # prepare never takes a temp file for the cache: it tokenizes, and the result is whole
    corpus = tmp_path / "c.txt"
    corpus.write_text(open(SHAKESPEARE, encoding="utf-8").read()[:5_000], encoding="utf-8")
    tok, tokens = ne.prepare_data(str(corpus), 270, str(tmp_path / "run"), progress=False)
    digest = hashlib.sha256(b"c.txt" + corpus.read_bytes()).hexdigest()[:16]   # the cache key: names and contents
    leftover = tmp_path / "cache" / (os.path.basename(tokens.filename) + f".{dead.pid}.tmp")
    os.remove(tokens.filename)
    leftover.write_bytes(b"\x93NUMPY half a file")
    tok2, tokens2 = ne.prepare_data(str(corpus), 270, str(tmp_path / "run"), progress=False)
    assert digest in tokens2.filename and tokens2.tolist() == expected_tokens(tok, [str(corpus)])


def test_a_run_folder_takes_away_the_temp_files_of_dead_writers_only(tmp_path, monkeypatch):
    # the lock holder's folder is its own, but another process may still be writing there
    # (a folder that is also some run's cache): only a temp file whose pid is gone is left over
    monkeypatch.delenv("NANOEULER_RANK", raising=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"model_000004.safetensors.{dead.pid}.tmp"
    writing = tmp_path / f"tokens_z.npy.{os.getppid()}.tmp"
    for p in (left, writing):
        p.write_bytes(b"half a file")
    with ne.RunFolder(str(tmp_path)).claim(resume=True):
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([writing.name, ne.LOCK_NAME])
    with pytest.raises(ne.NanoEulerError, match="^--out out/cache is where runs beside it cache their tokens; "):
        ne.prepare_data("unused.txt", 300, "out/cache")


def test_every_chunk_of_the_token_file_is_checked_to_its_last_id(tmp_path, capsys):
    path = str(tmp_path / "t.npy")
    np.save(path, np.array([1, 2, 3, 300], np.uint16))
    assert ne.cached(path, None, 301, chunk=2).tolist() == [1, 2, 3, 300]
    # (read_cache, merged into cached: its ValueError is the line that says the file is made again)
    remade = ne.cached(path, lambda p: np.save(p, np.array([1, 2], np.uint16)), 300, chunk=2)
    assert remade.tolist() == [1, 2]
    assert capsys.readouterr().err == f"{path} is damaged (it holds the id 300, beyond the tokenizer's 300 ids); " \
                                      "tokenizing again\n"


def test_the_cached_tokenizer_is_one_per_vocabulary_size(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(open(SHAKESPEARE, encoding="utf-8").read()[:20_000], encoding="utf-8")
    run = str(tmp_path / "run")
    assert ne.prepare_data(str(corpus), 280, run, progress=False)[0].vocab_size == 280
    assert ne.prepare_data(str(corpus), 300, run, progress=False)[0].vocab_size == 300     # 260 + 40 merges


def test_a_corpus_folder_is_read_in_sorted_order_to_its_depths(tmp_path, monkeypatch):
    for name in ("b.txt", "a.txt", "sub/c.txt", "sub/deeper/d.txt", "sub/notes.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    want = [str(tmp_path / n) for n in ("a.txt", "b.txt", "sub/c.txt", "sub/deeper/d.txt")]
    assert ne.corpus_files(str(tmp_path)) == want
    walk = os.walk
    monkeypatch.setattr(os, "walk", lambda p: reversed(list(walk(p))))      # whatever order the disk gives
    assert ne.corpus_files(str(tmp_path)) == want


def damage_token_file(path, how):
    data = open(path, "rb").read()
    if how == "truncated":
        data = data[:-7]
    elif how == "longer than its header":
        data += b"\x00\x00"
    elif how == "an id beyond the vocabulary":
        ids = np.frombuffer(data[128:], dtype="<u2").copy()
        ids[len(ids) // 2] = 300                         # the tokenizer has 270 ids
        data = data[:128] + ids.tobytes()
    elif how == "int64 ids":
        ids = np.frombuffer(data[128:], dtype="<u2").astype("<i8")
        np.save(path, ids)
        return
    elif how == "not a .npy file":
        data = b"garbage " * 100
    elif how in ("a column of ids", "a version 2.0 file"):      # the same ids, of the right dtype
        ids = np.frombuffer(data[128:], dtype="<u2")
        with open(path, "wb") as f:
            if how == "a column of ids":
                np.lib.format.write_array(f, ids.reshape(-1, 1), version=(1, 0))
            else:
                np.lib.format.write_array(f, ids, version=(2, 0))
        return
    open(path, "wb").write(data)


@pytest.mark.parametrize("how, words", [
    ("truncated", ["header says", "its data is"]), ("longer than its header", ["header says"]),
    ("an id beyond the vocabulary", ["the id 300", "270 ids"]), ("int64 ids", ["int64"]),
    ("not a .npy file", ["the magic string is not correct; expected b'\\x93NUMPY', got b'garbag'"]),
    ("a column of ids", ["uint16 of shape (", ", 1)"]),
    ("a version 2.0 file", ["not a version 1.0 .npy file"]),
])
def test_a_damaged_token_cache_is_said_and_made_again(tmp_path, capsys, how, words):
    corpus = tmp_path / "c.txt"
    corpus.write_text(open(SHAKESPEARE, encoding="utf-8").read()[:5_000], encoding="utf-8")
    tok, tokens = ne.prepare_data(str(corpus), 270, str(tmp_path / "run"), progress=False)
    path = tokens.filename
    del tokens
    damage_token_file(path, how)
    capsys.readouterr()
    tok2, tokens2 = ne.prepare_data(str(corpus), 270, str(tmp_path / "run"), progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{path} is damaged (") and err[0].endswith("; tokenizing again")
    assert all(w in err[0] for w in words), err[0]
    assert tokens2.tolist() == expected_tokens(tok, [str(corpus)])


def test_training_rows_never_overlap_validation_rows():
    tokens = np.arange(10_000)                               # each token names its position
    rows_len = 17
    train, val = ne.split_train_val(tokens, rows_len)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        rows = ne.get_batch(train, 8, rows_len, rng)
        assert (np.diff(rows, axis=1) == 1).all()             # consecutive tokens
        seen.update(rows.ravel().tolist())
    val_seen = set(np.concatenate(ne.fixed_rows(val, 8, rows_len, 50)).ravel().tolist())
    assert max(seen) < min(val_seen) and not seen & val_seen
    assert max(seen) > 8_900 - rows_len and min(val_seen) == 9_000   # the split is at 90%


# -----------------------------------------------------------------------------
# Ctrl-C while tokenizing

SLOW_WORKERS = """
import os, sys, time
sys.path.insert(0, {here!r})
import nanoeuler as ne

# spawn runs this file again in every worker, so they too encode slowly
encode_chunk = ne.encode_chunk
def slow_encode_chunk(*chunk):
    open({started!r}, "w").close()
    time.sleep(1.0)
    return encode_chunk(*chunk)
ne.encode_chunk = slow_encode_chunk

if __name__ == "__main__":
    ne.main(sys.argv[1:])
"""


def start_slow_prepare(tmp_path, workers=2):
    """`prepare` on `workers` workers that take a second a chunk, in a process group of its
    own (a terminal's Ctrl-C reaches every process of the job); returns once a
    worker is encoding"""
    corpus = tmp_path / "c.txt"
    corpus.write_text(open(SHAKESPEARE, encoding="utf-8").read(), encoding="utf-8")   # 1.1 MB: 5 chunks
    started = tmp_path / "started"
    driver = tmp_path / "driver.py"
    driver.write_text(SLOW_WORKERS.format(here=HERE, started=str(started)))
    p = subprocess.Popen([sys.executable, str(driver), "prepare", "--data", str(corpus), "--vocab-size", "270",
                          "--out", str(tmp_path / "out" / "run"), "--workers", str(workers)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         preexec_fn=default_signals)
    deadline = time.time() + 120
    while not started.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not started.exists():
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(p.communicate()[1].decode())
    return p


def assert_group_ends(p):
    """every process of p's group ends (a worker may still be starting: spawn imports this file; the 120 s cap only
    ends a broken test)"""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)
    pytest.fail("a worker process outlived its run")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sighup", "group-sigterm", "group-sighup"])
def test_ctrl_c_while_tokenizing_stops_cleanly(tmp_path, how):
    p = start_slow_prepare(tmp_path)
    if how == "ctrl-c":
        os.killpg(p.pid, signal.SIGINT)                      # a terminal's Ctrl-C: every process of the job
    elif how.startswith("group-"):
        os.killpg(p.pid, signal.SIGTERM if how == "group-sigterm" else signal.SIGHUP)
    else:                                                    # docker stop, a scheduler, a closed terminal
        os.kill(p.pid, signal.SIGTERM if how == "sigterm" else signal.SIGHUP)
    try:
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = err.decode()
    how = how.replace("group-", "")
    sig = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sighup": signal.SIGHUP}[how]
    assert p.returncode == 128 + sig, err                    # as the signal's killing would have: 130, 143, 129
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    name = {"ctrl-c": "Ctrl-C", "sigterm": "SIGTERM", "sighup": "SIGHUP"}[how]
    assert [line for line in err.splitlines() if line.strip()][-1] == f"{name}: interrupted"
    assert err.count("interrupted") == 1
    cache = tmp_path / "out" / "cache"
    assert not [f for f in os.listdir(cache) if f.startswith("tokens_")]          # no partial token file
    assert_group_ends(p)


def test_ctrl_c_while_tokenizing_on_one_worker_stops_cleanly(tmp_path):
    p = start_slow_prepare(tmp_path, workers=1)             # a small corpus's way: a thread of the main process
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.decode().strip().splitlines()[-1] == "Ctrl-C: interrupted", err.decode()
    assert not [f for f in os.listdir(tmp_path / "out" / "cache") if f.startswith("tokens_")]


def test_workers_end_when_the_main_process_is_killed(tmp_path):
    p = start_slow_prepare(tmp_path)
    os.kill(p.pid, signal.SIGKILL)                           # out of memory, kill -9: no clean-up runs
    p.wait(timeout=60)
    assert_group_ends(p)
    assert not [f for f in os.listdir(tmp_path / "out" / "cache") if f.endswith(".npy")]   # only a .tmp


def test_a_corpus_file_whose_name_is_not_utf8_is_read_and_keyed_by_its_bytes(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    text = open(SHAKESPEARE, encoding="utf-8").read()[:3_000]
    name = b"bad\xffname.txt"
    with open(os.path.join(os.fsencode(folder), name), "wb") as f:
        f.write(text.encode())
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "prepare", "--data", str(folder),
                        "--vocab-size", "270", "--out", str(tmp_path / "run")], capture_output=True, timeout=120)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")
    key = hashlib.sha256(name + text.encode()).hexdigest()[:16]
    assert [f for f in os.listdir(tmp_path / "cache") if key in f]


def test_a_cached_token_file_with_an_id_at_the_vocabulary_size_is_refused(tmp_path):
    # ids run from 0 to vocab_size - 1: vocab_size itself would index past the embedding
    path = str(tmp_path / "tokens.npy")
    for top, ok in ((511, True), (512, False)):
        np.save(path, np.array([0, 5, top, 7], dtype=ne.TOKEN_DTYPE))
        if ok:
            assert ne.cached(path, None, 512, chunk=2).tolist() == [0, 5, top, 7]
        else:                                            # made again, and read back: still the id 512, refused
            with pytest.raises(ne.NanoEulerError, match="cannot be read back \\(it holds the id 512, beyond the "
                                                         "tokenizer's 512 ids\\); delete it and run again$"):
                ne.cached(path, lambda p: None, 512, chunk=2)
