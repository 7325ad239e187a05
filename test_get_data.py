"""get_data.sh, offline: every download comes from a fixture server on 127.0.0.1.

The expected files are written out by hand (books, Alpaca) or built from the data-file
contract in COMMON terms (web: each document, then "\\n<|endoftext|>\\n", in order, until
SIZE bytes are written), never read back from the script's own output.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "get_data.sh")
EOT = "<|endoftext|>"


# -----------------------------------------------------------------------------
# the fixture server

class Server:
    """serves files from a dict {path: bytes}; 404 for the rest; honours Range (curl -C -);
    a path in `stall` sends half its body and then hangs until the test ends. A server that
    lies: a path in `no_ranges` answers a Range request with 200 and the whole body, one in
    `cut` sends half its body under the whole one's Content-Length and closes, one in `cut_unsized`
    half its body with no Content-Length at all; `types` gives a path a Content-Type"""

    def __init__(self):
        self.files, self.requests, self.stall = {}, [], set()
        self.no_ranges, self.cut, self.cut_unsized, self.types = set(), set(), set(), {}
        self.stalled = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.requests.append((self.path, self.headers.get("Range")))
                body = outer.files.get(self.path)
                if body is None:
                    self.send_error(404, "Not Found")
                    return
                start, status = 0, 200
                rng = self.headers.get("Range")
                if self.path in outer.cut_unsized:
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(body[:len(body) // 2])
                    return                                   # HTTP/1.0: the body ends when the connection does
                if rng and rng.startswith("bytes=") and rng.endswith("-") and self.path not in outer.no_ranges:
                    start = int(rng[6:-1])
                    if start >= len(body):
                        self.send_error(416, "Range Not Satisfiable")
                        return
                    status = 206
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                if self.path in outer.types:
                    self.send_header("Content-Type", outer.types[self.path])
                self.end_headers()
                if self.path in outer.cut:
                    self.wfile.write(body[start:start + (len(body) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if self.path in outer.stall:
                    self.wfile.write(body[start:start + (len(body) - start) // 2])
                    self.wfile.flush()
                    outer.stalled.set()
                    outer.release.wait()                 # close() sets it: a fetcher left waiting waits for ever
                    return
                self.wfile.write(body[start:])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def closed_port_url():
    """a URL on 127.0.0.1 where nothing listens (bound, then closed)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def env_for(tmp_path, url, **extra):
    env = dict(os.environ)
    env.update(NANOEULER_DATA_DIR=str(tmp_path / "data"), NANOEULER_PAUSE="0",
               NANOEULER_GUTENBERG_URL=url + "/epub", NANOEULER_FINEWEB_URL=url + "/10BT",
               NANOEULER_ALPACA_URL=url + "/alpaca_data.json")
    env.update(extra)
    return env


def run(args, env, timeout=60):
    r = subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, timeout=timeout)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def default_signals():
    """a child starts with SIGINT and SIGTERM at their defaults, whatever the test runner ignores
    (a shell ignores SIGINT in what it starts in the background, and bash cannot trap a signal
    that was ignored when it started)"""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def start(args, env):
    """get_data.sh as a process to signal, in its own process group (as a terminal's job)"""
    return subprocess.Popen(["bash", SCRIPT, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=default_signals)


def start_stalled(server, url_path, args, env):
    """start(args, env) with the server holding url_path: returned once that download is in flight"""
    server.stall.add(url_path)
    p = start(args, env)
    assert server.stalled.wait(120), "the download never started"
    return p


def wait_for_bytes(path):
    """wait until the fetcher has written something to path (a condition; the cap only ends a broken test)"""
    deadline = time.monotonic() + 120
    while not (path.exists() and path.stat().st_size > 0):
        assert time.monotonic() < deadline, f"nothing was written to {path}"
        time.sleep(0.01)


def leftovers(data):
    """scratch files or folders a run must not leave behind"""
    return [p for p in os.listdir(data) if p.startswith(".get_data.") or p.endswith((".tmp", ".old"))]


# -----------------------------------------------------------------------------
# raw Gutenberg books, one per marker style, and what must be left of each

LICENCE_HEAD = ("The Project Gutenberg eBook of {t}\n\n"
                "This ebook is for the use of anyone anywhere in the United States and\n"
                "most other parts of the world at no cost.\n\nTitle: {t}\n\nLanguage: English\n\n")
LICENCE_TAIL = ("\n\nUpdated editions will replace the previous one--the old editions will\n"
                "be renamed.\n\n*** START: FULL LICENSE ***\n\nSection 1. General Terms of Use\n")

BOOKS = {
    # modern: THE, LF, marker on one line
    "1342": ("pride_and_prejudice",
             LICENCE_HEAD.format(t="Pride and Prejudice")
             + "*** START OF THE PROJECT GUTENBERG EBOOK PRIDE AND PREJUDICE ***\n\n\n\n"
             + "Chapter 1\n\nIt is a truth universally acknowledged.\n\n\n\n"
             + "*** END OF THE PROJECT GUTENBERG EBOOK PRIDE AND PREJUDICE ***" + LICENCE_TAIL,
             "Chapter 1\n\nIt is a truth universally acknowledged.\n"),
    # older: THIS, indented markers, CRLF, a BOM, a "Produced by" paragraph, an "End of" line
    "98": ("a_tale_of_two_cities",
           ("\ufeff" + LICENCE_HEAD.format(t="A Tale of Two Cities")
            + "    *** START OF THIS PROJECT GUTENBERG EBOOK A TALE OF TWO CITIES ***\n\n"
            + "Produced by Judith Boss\nand David Widger\n\n\n"
            + "A TALE OF TWO CITIES\n\nIt was the best of times,   \nit was the worst of times.\n\n"
            + "End of the Project Gutenberg EBook of A Tale of Two Cities, by Charles Dickens\n\n"
            + "   *** END OF THIS PROJECT GUTENBERG EBOOK A TALE OF TWO CITIES ***"
            + LICENCE_TAIL).replace("\n", "\r\n"),
           "A TALE OF TWO CITIES\n\nIt was the best of times,\nit was the worst of times.\n"),
    # the START marker wraps onto a second line (and the END one too), LF
    "2701": ("moby_dick",
             LICENCE_HEAD.format(t="Moby Dick; Or, The Whale")
             + "*** START OF THE PROJECT GUTENBERG EBOOK MOBY DICK; OR, THE\nWHALE ***\n\n"
             + "CHAPTER 1. Loomings.\n\nCall me Ishmael.\n"
             + "*** END OF THE PROJECT GUTENBERG EBOOK MOBY DICK; OR, THE\nWHALE ***" + LICENCE_TAIL,
             "CHAPTER 1. Loomings.\n\nCall me Ishmael.\n"),
    # THIS, E-BOOK, wrapped and indented, CRLF without BOM, "End of Project Gutenberg's" wrapped
    "11": ("alice_in_wonderland",
           (LICENCE_HEAD.format(t="Alice's Adventures in Wonderland")
            + "  *** START OF THIS PROJECT GUTENBERG E-BOOK ALICE'S ADVENTURES IN\n"
            + "  WONDERLAND ***\n\nCHAPTER I. Down the Rabbit-Hole\n\nAlice was beginning to get very tired.\n\n"
            + "End of Project Gutenberg's Alice's Adventures in Wonderland, by\nLewis Carroll\n\n"
            + "*** END OF THIS PROJECT GUTENBERG E-BOOK ALICE'S ADVENTURES IN WONDERLAND ***"
            + LICENCE_TAIL).replace("\n", "\r\n"),
           "CHAPTER I. Down the Rabbit-Hole\n\nAlice was beginning to get very tired.\n"),
}


def serve_books(server, ids):
    for i in ids:
        server.files[f"/epub/{i}/pg{i}.txt"] = BOOKS[i][1].encode("utf-8")
    return " ".join(f"{i}:{BOOKS[i][0]}" for i in ids)


# -----------------------------------------------------------------------------
# the script itself

def test_bash_syntax():
    r = subprocess.run(["bash", "-n", SCRIPT], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shellcheck():
    r = subprocess.run(["shellcheck", SCRIPT], capture_output=True)
    assert r.returncode == 0, r.stdout.decode()


def test_sizes_are_decimal_from_1_byte_to_100t():
    # parse_size alone, sourced from the script (its main runs only when the script is run)
    script = open(SCRIPT).read().split("\nTMP=")[0]
    sizes = ["0.5K", "1.5M", "2G", "3t", "100T", "1", "300MB", "0.4", "100.1T"]
    code = script + "\nfor s in " + " ".join(sizes) + "; do parse_size $s || echo refused; done\n"
    r = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["500", "1500000", "2000000000", "3000000000000", "100000000000000", "1",
                                "300000000", "refused", "refused"]


def test_no_argument_prints_usage_not_code(tmp_path):
    firsts = {"nonsense": "get_data.sh: unknown target 'nonsense'; the targets are books, web, alpaca, eval, all and strip",
              "web": "get_data.sh: web takes [SIZE], but was given 2 ('1G' 'extra')"}
    for args in ([], ["nonsense"], ["web", "1G", "extra"]):
        rc, out, err = run(args, env_for(tmp_path, "http://127.0.0.1:9"))
        assert rc == 2
        if args:                                               # what is wrong is named first
            first, err = err.split("\n", 1)
            assert first == firsts[args[0]]
        assert err.startswith("usage: bash get_data.sh TARGET")
        for target in ("books", "web [SIZE]", "alpaca", "all"):
            assert target in err
        assert "#!" not in err and "set -" not in err and "fi\n" not in err
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("args, first", [
    (["books", "extra"], "books takes no arguments, but was given 1 ('extra')"),
    (["alpaca", ""], "alpaca takes no arguments, but was given 1 ('')"),
    (["eval", "a", "b"], "eval takes no arguments, but was given 2 ('a' 'b')"),
    (["all", "1G"], "all takes no arguments, but was given 1 ('1G')"),
    (["strip", "raw.txt"], "strip takes IN OUT, but was given 1 ('raw.txt')"),
    (["strip", "a", "b", "c"], "strip takes IN OUT, but was given 3 ('a' 'b' 'c')"),
    (["web", ""], "web takes [SIZE], but was given an empty one"),
    (["strip", "raw.txt", ""], "strip takes IN OUT, but was given an empty one"),
])
def test_arguments_a_target_does_not_take_are_refused(tmp_path, args, first):
    rc, out, err = run(args, env_for(tmp_path, "http://127.0.0.1:9"))
    assert (rc, out, err.split("\n")[0]) == (2, "", "get_data.sh: " + first)
    assert not (tmp_path / "data").exists()


def test_default_book_list_has_95_distinct_books():
    r = subprocess.run(["bash", "-c", f'eval "$(sed -n \'/^BOOKS_DEFAULT=/,/^"$/p\' {SCRIPT})"; echo $BOOKS_DEFAULT'],
                       capture_output=True, text=True)
    entries = r.stdout.split()
    ids = [e.split(":")[0] for e in entries]
    names = [e.split(":")[1] for e in entries]
    assert len(entries) == 95 and len(set(ids)) == 95 and len(set(names)) == 95
    # the 40 of the first version of the script stay, and the embedded books keep their names
    for i in "1342 98 2701 11 1661 120 35 46 84 1080 174 345 768 1260 2542 4300 5200 6130 1952 16 \
              158 1400 219 2591 3207 36 43 514 730 1184 996 2600 1232 205 135 145 28054 244 55 1497".split():
        assert i in ids
    for f in os.listdir(os.path.join(HERE, "data", "gutenberg")):
        assert f[:-4] in names


def test_strip_command(tmp_path):
    src, dst = tmp_path / "raw.txt", tmp_path / "clean.txt"
    for name, raw, want in BOOKS.values():
        src.write_bytes(raw.encode("utf-8"))
        r = subprocess.run(["bash", SCRIPT, "strip", str(src), str(dst)], capture_output=True)
        assert r.returncode == 0, r.stderr.decode()
        assert dst.read_bytes() == want.encode("utf-8"), name
    # the START marker's *** two lines down (the furthest looked at), a first paragraph that
    # begins "Produced" but is the book's, an "End of" line wrapped over three lines
    src.write_text("*** START OF THE PROJECT GUTENBERG EBOOK A VERY\nLONG\nTITLE ***\n\n"
                   "Produced in haste, the letter\nwas sent.\n\nThe end came.\n\n"
                   "End of the Project Gutenberg EBook of A Very\nLong\nTitle\n\n"
                   "*** END OF THE PROJECT GUTENBERG EBOOK A VERY LONG TITLE ***\n")
    r = subprocess.run(["bash", SCRIPT, "strip", str(src), str(dst)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    assert dst.read_text() == "Produced in haste, the letter\nwas sent.\n\nThe end came.\n"
    # an OUT that cannot be written: one sentence each, no traceback, no temp file left
    for out, says in ((tmp_path, f"{tmp_path} is a folder; give the path of the file to write"),
                      (tmp_path / "no" / "such" / "x.txt", "cannot write")):
        r = subprocess.run(["bash", SCRIPT, "strip", str(src), str(out)], capture_output=True)
        err = r.stderr.decode()
        assert r.returncode == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert says in err and str(out) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean.txt", "raw.txt"]
    src.write_text("no markers here\n")
    r = subprocess.run(["bash", SCRIPT, "strip", str(src), str(dst)], capture_output=True)
    assert r.returncode == 1 and "START OF THE PROJECT GUTENBERG EBOOK" in r.stderr.decode()
    assert len(r.stderr.decode().strip().splitlines()) == 1


# -----------------------------------------------------------------------------
# books

def test_books_every_marker_style_then_skips_what_is_there(tmp_path, server):
    listing = serve_books(server, ["1342", "98", "2701", "11"])
    env = env_for(tmp_path, server.url, NANOEULER_BOOKS=listing)
    rc, out, err = run(["books"], env)
    assert rc == 0, err
    books = tmp_path / "data" / "books"
    total = 0
    for name, _, want in BOOKS.values():
        assert (books / f"{name}.txt").read_bytes() == want.encode("utf-8"), name
        total += len(want.encode("utf-8"))
    assert sorted(os.listdir(books)) == sorted(f"{n}.txt" for n, _, _ in BOOKS.values())
    assert out.splitlines()[-1] == f"fetched 4 of 4 books (0 already there), {total / 1e6:.1f} MB in {books}"
    assert err == "" and leftovers(tmp_path / "data") == []

    server.requests.clear()
    rc, out, err = run(["books"], env)
    assert rc == 0 and server.requests == []
    assert out.splitlines() == [f"fetched 0 of 4 books (4 already there), {total / 1e6:.1f} MB in {books}"]


def test_books_pause_between_requests(tmp_path, server):
    # a fake sleep on PATH records the pauses, so the test does not wait or time anything
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "sleeps"
    (bindir / "sleep").write_text(f'#!/bin/sh\necho "$1" >> {log}\n')
    (bindir / "sleep").chmod(0o755)
    listing = serve_books(server, ["1342", "98", "2701"])
    env = env_for(tmp_path, server.url, NANOEULER_BOOKS=listing, NANOEULER_PAUSE="1.5",
                  PATH=f"{bindir}:{os.environ['PATH']}")
    rc, out, err = run(["books"], env)
    assert rc == 0, err
    assert log.read_text().split() == ["1.5", "1.5"]             # between requests, not before the first
    log.unlink()
    (tmp_path / "data" / "books" / "moby_dick.txt").unlink()
    rc, out, err = run(["books"], env)                           # two skipped, one fetched: no pause
    assert rc == 0 and not log.exists()
    assert out.splitlines()[-1].startswith("fetched 1 of 3 books (2 already there)")


def test_books_404_is_one_sentence_and_the_rest_is_fetched(tmp_path, server):
    listing = serve_books(server, ["1342"]) + " 999999:not_a_book"
    rc, out, err = run(["books"], env_for(tmp_path, server.url, NANOEULER_BOOKS=listing))
    assert rc == 1
    assert (tmp_path / "data" / "books" / "pride_and_prejudice.txt").exists()
    assert not (tmp_path / "data" / "books" / "not_a_book.txt").exists()
    assert out.splitlines()[-1].startswith("fetched 1 of 2 books (0 already there)")
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "#999999 not_a_book" in lines[0] and "HTTP 404" in lines[0] and "run again" in lines[0]
    assert leftovers(tmp_path / "data") == []


def test_books_not_a_gutenberg_text(tmp_path, server):
    server.files["/epub/5/pg5.txt"] = b"<html>a login page</html>\n"
    rc, out, err = run(["books"], env_for(tmp_path, server.url, NANOEULER_BOOKS="5:odd"))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "#5 odd" in err and "START" in err
    assert os.listdir(tmp_path / "data" / "books") == []


def test_books_host_not_there_stops_at_once(tmp_path):
    listing = " ".join(f"{i}:{BOOKS[i][0]}" for i in BOOKS)
    rc, out, err = run(["books"], env_for(tmp_path, closed_port_url(), NANOEULER_BOOKS=listing))
    assert rc == 1
    assert out.count("fetching") == 1                            # one try, not one per book
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "does not answer" in lines[0] and "4 books were not fetched" in lines[0]
    assert "curl:" not in err
    assert os.listdir(tmp_path / "data" / "books") == [] and leftovers(tmp_path / "data") == []
    # two of the four already there: the other two are what was not fetched
    for name in ("pride_and_prejudice", "a_tale_of_two_cities"):
        (tmp_path / "data" / "books" / f"{name}.txt").write_text("a book\n")
    rc, out, err = run(["books"], env_for(tmp_path, closed_port_url(), NANOEULER_BOOKS=listing))
    assert rc == 1 and "2 books were not fetched" in err


@pytest.mark.skipif(shutil.which("wget") is None, reason="wget is not installed")
def test_books_through_wget(tmp_path, server):
    listing = serve_books(server, ["2701"]) + " 999999:not_a_book"
    rc, out, err = run(["books"], env_for(tmp_path, server.url, NANOEULER_BOOKS=listing, NANOEULER_FETCHER="wget"))
    assert rc == 1 and "HTTP 404" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "data" / "books" / "moby_dick.txt").read_text() == BOOKS["2701"][2]
    rc, out, err = run(["books"], env_for(tmp_path, closed_port_url(), NANOEULER_BOOKS="1:x", NANOEULER_FETCHER="wget"))
    assert rc == 1 and "does not answer" in err


def test_no_curl_nor_wget(tmp_path):
    rc, out, err = run(["books"], env_for(tmp_path, "http://127.0.0.1:9", NANOEULER_FETCHER="no-such-fetcher"))
    assert rc == 1 and err.strip() == ("get_data.sh: no-such-fetcher is not installed; "
                                       "install curl or wget (e.g. apt-get install curl)")


def test_books_ctrl_c_leaves_nothing_partial(tmp_path, server):
    listing = serve_books(server, ["1342", "98"])
    p = start_stalled(server, "/epub/98/pg98.txt", ["books"], env_for(tmp_path, server.url, NANOEULER_BOOKS=listing))
    os.killpg(p.pid, signal.SIGINT)                              # what Ctrl-C sends: the whole group
    out, err = p.communicate(timeout=120)                        # not the stalled download's for ever
    assert p.returncode == 130
    assert "interrupted" in err.decode()
    assert os.listdir(tmp_path / "data" / "books") == ["pride_and_prejudice.txt"]
    assert leftovers(tmp_path / "data") == []


# -----------------------------------------------------------------------------
# web

try:
    import duckdb
except ImportError:
    duckdb = None
needs_duckdb = pytest.mark.skipif(duckdb is None, reason="duckdb is not installed (pip install -r requirements-dev.txt)")

DOCS_0 = ["First document.\nWith two lines.", "Zweites Dokument: Größe, café, 日本語.",
          None, "", "a <|endoftext|> marker inside", "nested <|endo<|endoftext|>ftext|> marker"]
DOCS_1 = ["third file, " + "x" * 150, "tail " * 40, "never reached"]


def write_parquet(path, docs, other_column=True):
    con = duckdb.connect()
    con.execute("CREATE TABLE t (id INTEGER, text VARCHAR, score DOUBLE)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?)", [(i, d, 3.5) for i, d in enumerate(docs)])
    cols = "id, text, score" if other_column else "id"
    con.execute(f"COPY (SELECT {cols} FROM t ORDER BY id) TO '{path}' (FORMAT parquet)")
    con.close()
    return path.read_bytes()


def expected_web(docs, size):
    """the corpus the contract asks for: documents in order, marker removed, each followed by
    \\n<|endoftext|>\\n, empty ones left out, stopping after the document that reaches size"""
    out = b""
    for d in docs:
        if d is None:
            continue
        while EOT in d:
            d = d.replace(EOT, "")
        if not d:
            continue
        out += (d + "\n" + EOT + "\n").encode("utf-8")
        if len(out) >= size:
            break
    return out


@pytest.fixture
def fineweb(server, tmp_path):
    server.files["/10BT/000_00000.parquet"] = write_parquet(tmp_path / "a.parquet", DOCS_0)
    server.files["/10BT/001_00000.parquet"] = write_parquet(tmp_path / "b.parquet", DOCS_1)
    return server


def read_shards(web):
    names = sorted(n for n in os.listdir(web) if n.endswith(".txt"))
    return names, [(web / n).read_bytes() for n in names]


@needs_duckdb
def test_web_two_parquet_files_into_shards_then_skips(tmp_path, fineweb):
    want = expected_web(DOCS_0 + DOCS_1, 400)
    assert b"never reached" not in want and b"tail" in want        # SIZE ends inside the second file
    env = env_for(tmp_path, fineweb.url, NANOEULER_WEB_SHARD="100")
    rc, out, err = run(["web", "400"], env)
    assert rc == 0, err
    web = tmp_path / "data" / "web"
    names, shards = read_shards(web)
    assert b"".join(shards) == want
    # a new shard starts once the current one holds 100 bytes; no document straddles two
    docs = [d + b"\n" + EOT.encode() + b"\n" for d in want.split(b"\n" + EOT.encode() + b"\n")[:-1]]
    expect_shards, cur = [], b""
    for d in docs:
        if len(cur) >= 100:
            expect_shards.append(cur)
            cur = b""
        cur += d
    expect_shards.append(cur)
    assert shards == expect_shards and names == [f"web_{i:05d}.txt" for i in range(len(shards))]
    assert out.splitlines()[-1] == (f"wrote {len(want) / 1e6:.1f} MB of web text in {len(shards)} shards "
                                    f"in {web} from 2 parquet files")
    assert not (tmp_path / "data" / ".cache").exists() and leftovers(tmp_path / "data") == []
    assert [p for p, _ in fineweb.requests] == ["/10BT/000_00000.parquet", "/10BT/001_00000.parquet"]

    fineweb.requests.clear()
    rc, out, err = run(["web", "400"], env)
    assert rc == 0 and fineweb.requests == [] and "skipped" in out
    rc, out, err = run(["web", "300"], env)                          # less than what is there: skipped too
    assert rc == 0 and fineweb.requests == [] and "skipped" in out
    assert read_shards(web)[1] == shards


@needs_duckdb
def test_web_stops_at_the_document_that_reaches_size_and_a_full_shard_takes_no_more(tmp_path, fineweb):
    # SIZE exactly the first two documents, a shard exactly the first one: two documents in two shards
    first = ("First document.\nWith two lines.\n" + EOT + "\n").encode("utf-8")
    second = ("Zweites Dokument: Größe, café, 日本語.\n" + EOT + "\n").encode("utf-8")
    env = env_for(tmp_path, fineweb.url, NANOEULER_WEB_SHARD=str(len(first)))
    rc, out, err = run(["web", str(len(first) + len(second))], env)
    assert rc == 0, err
    assert read_shards(tmp_path / "data" / "web")[1] == [first, second]


@needs_duckdb
def test_web_default_shard_and_source_running_out(tmp_path, fineweb):
    rc, out, err = run(["web", "1M"], env_for(tmp_path, fineweb.url))
    assert rc == 0, err
    names, shards = read_shards(tmp_path / "data" / "web")
    assert names == ["web_00000.txt"] and shards[0] == expected_web(DOCS_0 + DOCS_1, 10**6)
    assert "(the source has no more files)" in out


@needs_duckdb
@pytest.mark.parametrize("fetcher", ["curl", "wget"])
def test_web_resumes_a_partial_parquet_download(tmp_path, fineweb, fetcher):
    if shutil.which(fetcher) is None:
        pytest.skip(f"{fetcher} is not installed")
    body = fineweb.files["/10BT/000_00000.parquet"]
    cache = tmp_path / "data" / ".cache" / "fineweb"
    cache.mkdir(parents=True)
    (cache / "000_00000.parquet.part").write_bytes(body[:300])
    rc, out, err = run(["web", "60"], env_for(tmp_path, fineweb.url, NANOEULER_FETCHER=fetcher))
    assert rc == 0, err
    assert fineweb.requests == [("/10BT/000_00000.parquet", "bytes=300-")]
    assert read_shards(tmp_path / "data" / "web")[1] == [expected_web(DOCS_0, 60)]


@needs_duckdb
def test_web_larger_size_replaces_the_corpus(tmp_path, fineweb):
    env = env_for(tmp_path, fineweb.url)
    assert run(["web", "60"], env)[0] == 0
    rc, out, err = run(["web", "0.3K"], env)
    assert rc == 0, err
    assert read_shards(tmp_path / "data" / "web")[1] == [expected_web(DOCS_0 + DOCS_1, 300)]


@needs_duckdb
def test_web_ctrl_c_keeps_only_the_resumable_download(tmp_path, server):
    body = bytes(range(256)) * 40
    server.files["/10BT/000_00000.parquet"] = body
    p = start_stalled(server, "/10BT/000_00000.parquet", ["web", "1K"], env_for(tmp_path, server.url))
    part_path = tmp_path / "data" / ".cache" / "fineweb" / "000_00000.parquet.part"
    wait_for_bytes(part_path)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)                        # not the stalled download's for ever
    assert p.returncode == 130 and "interrupted" in err.decode()
    data = tmp_path / "data"
    assert sorted(os.listdir(data)) == [".cache"] and not (data / "web").exists()
    part = part_path.read_bytes()
    assert 0 < len(part) < len(body) and body.startswith(part)   # what came, kept for curl -C -


def test_web_leaves_a_folder_it_did_not_write_alone(tmp_path, server):
    web = tmp_path / "data" / "web"
    web.mkdir(parents=True)
    (web / "mine.txt").write_text("my own corpus\n")
    rc, out, err = run(["web", "1K"], env_for(tmp_path, server.url))
    assert rc == 1 and "did not write" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(web) == ["mine.txt"] and server.requests == []


@needs_duckdb
def test_web_failures_are_one_sentence(tmp_path, server):
    data = tmp_path / "data"
    # the first file is missing: 404
    rc, out, err = run(["web", "1K"], env_for(tmp_path, server.url))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "HTTP 404" in err
    assert not (data / "web").exists() and leftovers(data) == []
    # no server
    rc, out, err = run(["web", "1K"], env_for(tmp_path, closed_port_url()))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "does not answer" in err
    # not parquet: nothing of it is kept (see test_web_never_keeps_what_is_not_parquet)
    server.files["/10BT/000_00000.parquet"] = b"<html>not parquet</html>"
    rc, out, err = run(["web", "1K"], env_for(tmp_path, server.url))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "is not a parquet file" in err
    assert not (data / "web").exists() and not (data / ".cache").exists() and leftovers(data) == []
    # parquet without a text column
    server.files["/10BT/000_00000.parquet"] = write_parquet(tmp_path / "c.parquet", ["x"], other_column=False)
    rc, out, err = run(["web", "1K"], env_for(tmp_path, server.url))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "text" in err
    # bad SIZE
    for size in ("lots", "9999999999G", "100.1T"):                    # past 100T bash's integers overflow
        rc, out, err = run(["web", size], env_for(tmp_path, server.url))
        assert rc == 2 and err.strip() == f"get_data.sh: web: SIZE '{size}' is not a size like 300M or 1G (at most 100T)"


def test_web_without_duckdb_says_how_to_install_it(tmp_path, server):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "duckdb.py").write_text("raise ImportError('no duckdb here')\n")
    server.files["/10BT/000_00000.parquet"] = b"PAR1"
    rc, out, err = run(["web", "1K"], env_for(tmp_path, server.url, PYTHONPATH=str(fake)))
    assert rc == 1
    assert err.strip().splitlines() == [
        "get_data.sh: web: DuckDB is missing for python3; install it with: pip install -r requirements-data.txt"]
    assert server.requests == []                                    # checked before downloading gigabytes


# -----------------------------------------------------------------------------
# alpaca

ALPACA = [{"instruction": "Give three tips for staying healthy.", "input": "",
           "output": "1. Eat well.\n2. Move.\n3. Sleep."},
          {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}]


def test_alpaca_fetched_once_with_its_licence(tmp_path, server):
    raw = json.dumps(ALPACA, indent=4).encode()
    server.files["/alpaca_data.json"] = raw
    env = env_for(tmp_path, server.url)
    rc, out, err = run(["alpaca"], env)
    assert rc == 0, err
    path = tmp_path / "data" / "alpaca_data.json"
    assert path.read_bytes() == raw
    assert out.splitlines()[-1].startswith(f"fetched 2 instructions, {len(raw) / 1e6:.1f} MB in {path}.")
    assert "CC BY-NC 4.0" in out and "never committed" in out
    server.requests.clear()
    rc, out, err = run(["alpaca"], env)
    assert rc == 0 and server.requests == [] and "skipped" in out and "CC BY-NC 4.0" in out
    with open(os.path.join(HERE, ".gitignore")) as f:
        assert "data/alpaca_data.json" in f.read().split()


def test_alpaca_failures(tmp_path, server):
    data = tmp_path / "data"
    rc, out, err = run(["alpaca"], env_for(tmp_path, server.url))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "HTTP 404" in err
    server.files["/alpaca_data.json"] = b"<html>rate limited</html>"
    rc, out, err = run(["alpaca"], env_for(tmp_path, server.url))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "not Alpaca JSON" in err
    assert not (data / "alpaca_data.json").exists() and leftovers(data) == []


def test_all_reports_each_failure_and_exits_nonzero(tmp_path):
    rc, out, err = run(["all"], env_for(tmp_path, closed_port_url(), NANOEULER_BOOKS="1342:pride_and_prejudice"))
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all("does not answer" in line for line in lines)
    assert [line.split(":")[1].strip() for line in lines] == ["books", "web", "alpaca"]


# -----------------------------------------------------------------------------
# servers that lie, full and read-only disks, signals, what a killed run left

sys.path.insert(0, HERE)


@pytest.mark.parametrize("body, kept", [
    (json.dumps(ALPACA).encode(), True),
    (b"\xef\xbb\xbf" + json.dumps(ALPACA).encode(), True),            # a byte-order mark, which sft reads
    (b'[{"instruction": "a", "response": "b"}]', True),                 # sft's own key for the output
    (b'[{"instruction": 1, "input": "", "output": "x"}]', False),       # values that are not text
    (b'[{"instruction": "a", "input": "", "output": ["x"]}]', False),
    (b'[{"instruction": "a", "input": null, "output": "x"}]', False),
    (b'[{"instruction": "a", "input": "", "output": NaN}]', False),     # literals JSON does not have
    (b'[{"instruction": "a", "input": "", "output": "x", "score": -Infinity}]', False),
    (b'[{"instruction": "a\\ud800", "input": "", "output": "x"}]', False),  # half a surrogate pair
    (b'[{"instruction": "a", "input": ""}]', False),
    (b'[]', False),
    (b'{"instruction": "a", "output": "b"}', False),
    (json.dumps(ALPACA).encode()[:-30], False),                           # cut off
])
def test_alpaca_keeps_only_what_sft_reads(tmp_path, server, body, kept):
    import nanoeuler
    server.files["/alpaca_data.json"] = body
    rc, out, err = run(["alpaca"], env_for(tmp_path, server.url))
    path = tmp_path / "data" / "alpaca_data.json"
    if kept:
        assert rc == 0 and err == "" and path.read_bytes() == body
        assert nanoeuler.load_instructions(str(path))                  # and sft reads what was kept
    else:
        assert rc == 1 and len(err.strip().splitlines()) == 1 and "is not Alpaca JSON" in err, err
        assert "Traceback" not in err and not path.exists() and leftovers(tmp_path / "data") == []
    assert os.listdir(tmp_path / "data") == (["alpaca_data.json"] if kept else [])


@needs_duckdb
def test_web_never_keeps_what_is_not_parquet(tmp_path, fineweb):
    good = fineweb.files["/10BT/000_00000.parquet"]
    env = env_for(tmp_path, fineweb.url)
    data, cache = tmp_path / "data", tmp_path / "data" / ".cache" / "fineweb"
    # a login page under 200, then the same file cut short with no Content-Length to tell
    for lie, says in ((b"<html>please log in</html>" * 20, "is not a parquet file (it starts with '<htm')"),
                      (good[:len(good) // 2], "is not a parquet file (it starts with 'PAR1' but is cut short)")):
        fineweb.files["/10BT/000_00000.parquet"] = lie
        rc, out, err = run(["web", "60"], env)
        assert rc == 1 and len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err
        assert "nothing of it was kept" in err and os.listdir(data) == []
    fineweb.cut_unsized.add("/10BT/000_00000.parquet")
    fineweb.files["/10BT/000_00000.parquet"] = good
    rc, out, err = run(["web", "60"], env)
    assert rc == 1 and "but is cut short" in err and os.listdir(data) == []
    # the next run against a good mirror gets the real file
    fineweb.cut_unsized.clear()
    rc, out, err = run(["web", "60"], env)
    assert rc == 0, err
    assert read_shards(data / "web")[1] == [expected_web(DOCS_0, 60)]
    # garbage that an older version kept under the final name is fetched again, not converted
    shutil.rmtree(data / "web")
    cache.mkdir(parents=True)
    (cache / "000_00000.parquet").write_bytes(b"<html>please log in</html>")
    fineweb.requests.clear()
    rc, out, err = run(["web", "60"], env)
    assert rc == 0, err
    assert f"the kept {cache / '000_00000.parquet'} is not a parquet file DuckDB reads; fetching it again" in out
    assert fineweb.requests == [("/10BT/000_00000.parquet", None)]
    assert read_shards(data / "web")[1] == [expected_web(DOCS_0, 60)]


@needs_duckdb
def test_web_a_text_column_that_is_not_text_is_one_sentence(tmp_path, server):
    con = duckdb.connect()
    con.execute(f"COPY (SELECT range AS text FROM range(5)) TO '{tmp_path / 'n.parquet'}' (FORMAT parquet)")
    server.files["/10BT/000_00000.parquet"] = (tmp_path / "n.parquet").read_bytes()
    rc, out, err = run(["web", "1K"], env_for(tmp_path, server.url))
    assert rc == 1 and "Traceback" not in err and err.strip().splitlines() == [
        f"get_data.sh: web: what 127.0.0.1:{server.url.rsplit(':', 1)[1]} sent for 000_00000.parquet has a "
        "text column of BIGINT, not of text; nothing of it was kept: run again later, or set "
        "NANOEULER_FINEWEB_URL to another mirror"]
    assert os.listdir(tmp_path / "data") == []


@needs_duckdb
def test_web_a_body_cut_short_of_its_length_resumes(tmp_path, fineweb):
    body = fineweb.files["/10BT/000_00000.parquet"]
    fineweb.cut.add("/10BT/000_00000.parquet")
    env = env_for(tmp_path, fineweb.url)
    rc, out, err = run(["web", "60"], env)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "broke off; run again to resume" in err
    part = tmp_path / "data" / ".cache" / "fineweb" / "000_00000.parquet.part"
    assert part.read_bytes() == body[:len(body) // 2]
    fineweb.cut.clear()
    fineweb.requests.clear()
    rc, out, err = run(["web", "60"], env)
    assert rc == 0, err
    assert fineweb.requests == [("/10BT/000_00000.parquet", f"bytes={len(body) // 2}-")]
    assert read_shards(tmp_path / "data" / "web")[1] == [expected_web(DOCS_0, 60)]


@needs_duckdb
@pytest.mark.parametrize("fetcher", ["curl", "wget"])
def test_web_a_server_that_ignores_byte_ranges_starts_over(tmp_path, fineweb, fetcher):
    if shutil.which(fetcher) is None:
        pytest.skip(f"{fetcher} is not installed")
    body = fineweb.files["/10BT/000_00000.parquet"]
    fineweb.no_ranges.add("/10BT/000_00000.parquet")
    cache = tmp_path / "data" / ".cache" / "fineweb"
    cache.mkdir(parents=True)
    (cache / "000_00000.parquet.part").write_bytes(body[:300])
    for _ in range(2):                          # not stuck: a second run would work too
        rc, out, err = run(["web", "60"], env_for(tmp_path, fineweb.url, NANOEULER_FETCHER=fetcher))
        assert rc == 0, err
        assert read_shards(tmp_path / "data" / "web")[1] == [expected_web(DOCS_0, 60)]
        shutil.rmtree(tmp_path / "data" / "web")
        cache.mkdir(parents=True)
        (cache / "000_00000.parquet.part").write_bytes(body[:300])
    if fetcher == "curl":
        assert "127.0.0.1:" in out and "ignores byte ranges, so 000_00000.parquet starts over from zero" in out
        assert fineweb.requests[:2] == [("/10BT/000_00000.parquet", "bytes=300-"), ("/10BT/000_00000.parquet", None)]


def can_mount_tmpfs(tmp_path):
    d = tmp_path / "probe"
    d.mkdir()
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', str(d)],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        d.rmdir()
    return r.returncode == 0


def run_on_tmpfs(tmp_path, options, args, env):
    """get_data.sh with its data folder on a tmpfs of its own (a user namespace: no root needed)"""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    r = subprocess.run(["unshare", "-rm", "bash", "-c", 'mount -t tmpfs -o "$0" tmpfs "$1" && exec bash "$2" "${@:3}"',
                        options, str(data), SCRIPT, *args], env=env, capture_output=True, timeout=120)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


@needs_duckdb
def test_web_a_full_disk_keeps_its_reason(tmp_path, server):
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare -rm)")
    # a few KB of parquet that turn into a megabyte of text: the download fits, the text does not
    server.files["/10BT/000_00000.parquet"] = write_parquet(tmp_path / "big.parquet", ["y" * 200_000] * 5)
    rc, out, err = run_on_tmpfs(tmp_path, "size=128k", ["web", "1M"], env_for(tmp_path, server.url))
    data = tmp_path / "data"
    assert rc == 1 and "Traceback" not in err and err.strip().splitlines() == [
        f"get_data.sh: web: cannot write the web text in {data} (No space left on device); "
        "free some space, or set NANOEULER_DATA_DIR to another folder"], err


def test_a_data_folder_that_cannot_be_written_is_one_sentence(tmp_path, server):
    (tmp_path / "afile").write_text("")
    env = env_for(tmp_path, server.url, NANOEULER_DATA_DIR=str(tmp_path / "afile" / "data"))
    rc, out, err = run(["alpaca"], env)
    assert rc == 1 and err.splitlines() == [
        f"get_data.sh: cannot create {tmp_path / 'afile' / 'data'} (Not a directory); "
        "set NANOEULER_DATA_DIR to a writable folder"]
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare -rm)")
    rc, out, err = run_on_tmpfs(tmp_path, "ro", ["alpaca"], env_for(tmp_path, server.url))
    assert rc == 1 and err.splitlines() == [
        f"get_data.sh: cannot write in {tmp_path / 'data'} (Read-only file system); "
        "set NANOEULER_DATA_DIR to a writable folder"]


@pytest.mark.parametrize("pause", ["abc", "-1", "1e3", "2s"])
def test_a_pause_that_is_not_a_number_is_refused(tmp_path, server, pause):
    listing = serve_books(server, ["1342", "98"])
    rc, out, err = run(["books"], env_for(tmp_path, server.url, NANOEULER_BOOKS=listing, NANOEULER_PAUSE=pause))
    assert rc == 2 and err.splitlines() == [
        f"get_data.sh: NANOEULER_PAUSE '{pause}' is not a number of seconds like 2 or 0.5"]
    assert server.requests == [] and not (tmp_path / "data").exists()


def processes_naming(text):
    """the processes whose command line holds text (Linux's /proc)"""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@needs_duckdb
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="looks for processes in /proc")
def test_sigterm_stops_a_download_at_once(tmp_path, server):
    # the server holds the download until the test ends; the script must not wait for it, nor leave curl behind
    body = bytes(range(256)) * 40
    server.files["/10BT/000_00000.parquet"] = body
    p = start_stalled(server, "/10BT/000_00000.parquet", ["web", "1K"], env_for(tmp_path, server.url))
    part_path = tmp_path / "data" / ".cache" / "fineweb" / "000_00000.parquet.part"
    wait_for_bytes(part_path)                                    # the server's flush is not yet curl's write
    p.send_signal(signal.SIGTERM)                                # to the script alone: kill PID, docker stop
    out, err = p.communicate(timeout=120)                        # not the stalled download's for ever
    assert p.returncode == 143 and "interrupted" in err.decode()
    assert processes_naming(str(tmp_path)) == []
    data = tmp_path / "data"
    assert sorted(os.listdir(data)) == [".cache"] and not (data / "web").exists()
    part = part_path.read_bytes()
    assert 0 < len(part) < len(body) and body.startswith(part)   # what came is kept for curl -C -


def test_sigterm_stops_the_pause_between_books_at_once(tmp_path, server):
    bindir, pidfile = tmp_path / "bin", tmp_path / "sleeping"
    bindir.mkdir()
    (bindir / "sleep").write_text(f'#!/bin/sh\necho $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}\n'
                                  f'exec {shutil.which("sleep")} "$@"\n')
    (bindir / "sleep").chmod(0o755)
    listing = serve_books(server, ["1342", "98"])
    p = start(["books"], env_for(tmp_path, server.url, NANOEULER_BOOKS=listing, NANOEULER_PAUSE="1000",
                                 PATH=f"{bindir}:{os.environ['PATH']}"))
    while not pidfile.exists() and p.poll() is None:
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)                        # not the 1000 s of the pause
    assert p.returncode == 143 and "interrupted" in err.decode()
    with pytest.raises(ProcessLookupError):                      # the pause itself ended too
        os.kill(int(pidfile.read_text()), 0)
    assert os.listdir(tmp_path / "data" / "books") == ["pride_and_prejudice.txt"]
    assert leftovers(tmp_path / "data") == []


def test_scratch_folders_of_killed_runs_are_removed(tmp_path, server):
    data = tmp_path / "data"
    data.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    hour_ago = time.time() - 3600
    folders = {"dead, quiet": f".get_data.{dead.pid}.a1B2c3", "dead, written to": f".get_data.{dead.pid}.d4E5f6",
               "alive": f".get_data.{os.getpid()}.g7H8i9", "no pid": ".get_data.AbCdEf"}
    for what, name in folders.items():
        (data / name).mkdir()
        (data / name / "pg1.raw").write_text("half a book")
        if what != "dead, written to":
            for p in (data / name / "pg1.raw", data / name):
                os.utime(p, (hour_ago, hour_ago))
    server.files["/alpaca_data.json"] = json.dumps(ALPACA).encode()
    rc, out, err = run(["alpaca"], env_for(tmp_path, server.url))
    assert rc == 0, err
    assert sorted(leftovers(data)) == sorted(n for w, n in folders.items() if w != "dead, quiet")


@pytest.mark.parametrize("fetcher", ["curl", "wget"])
def test_books_decode_as_the_mirror_or_the_book_declares(tmp_path, server, fetcher):
    if shutil.which(fetcher) is None:
        pytest.skip(f"{fetcher} is not installed")

    def book(head=""):
        return (LICENCE_HEAD.format(t="X") + head + "*** START OF THE PROJECT GUTENBERG EBOOK X ***\n\n"
                "A café in Zürich.\n\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\n")
    server.files["/epub/1/pg1.txt"] = book().encode("latin-1")
    server.types["/epub/1/pg1.txt"] = "text/plain; charset=ISO-8859-1"
    server.files["/epub/2/pg2.txt"] = book("Character set encoding: ISO-8859-1\n\n").encode("latin-1")
    server.files["/epub/3/pg3.txt"] = book().encode("latin-1")
    server.files["/epub/4/pg4.txt"] = book().encode("utf-8")
    server.types["/epub/4/pg4.txt"] = "text/plain; charset=ISO-8859-1"     # a lie: UTF-8 is what it is
    env = env_for(tmp_path, server.url, NANOEULER_BOOKS="1:one 2:two 3:three 4:four", NANOEULER_FETCHER=fetcher)
    rc, out, err = run(["books"], env)
    assert rc == 0, err
    books = tmp_path / "data" / "books"
    for name in ("one", "two", "four"):
        assert (books / f"{name}.txt").read_text(encoding="utf-8") == "A café in Zürich.\n", name
    assert (books / "three.txt").read_text(encoding="utf-8") == "A caf\ufffd in Z\ufffdrich.\n"
    assert ("note: #3 three is not UTF-8 and no charset is declared for it; 2 characters that could not "
            "be read became U+FFFD") in out.splitlines()


@needs_duckdb
def test_sigterm_stops_the_conversion_at_once(tmp_path, fineweb):
    # a Python that hangs in the conversion (its 5 arguments: -, parquet, stage, size, shard) and
    # says its pid: the stop must reach that process, not only the shell around it
    bindir, pidfile = tmp_path / "bin", tmp_path / "converting"
    bindir.mkdir()
    (bindir / "py").write_text(f'#!/bin/sh\nif [ $# -eq 5 ]; then echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; '
                               f'exec sleep 1000; fi\nexec {sys.executable} "$@"\n')
    (bindir / "py").chmod(0o755)
    p = start(["web", "1K"], env_for(tmp_path, fineweb.url, NANOEULER_PYTHON=str(bindir / "py")))
    while not pidfile.exists() and p.poll() is None:
        time.sleep(0.01)
    pid = int(pidfile.read_text())
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)                        # not the 1000 s of the conversion
    assert p.returncode == 143 and "interrupted" in err.decode()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    data = tmp_path / "data"
    assert sorted(os.listdir(data)) == [".cache"] and leftovers(data) == []
    kept = set(os.listdir(data / ".cache" / "fineweb")) - {".lock"}    # (flock's file, where flock is installed)
    assert kept == {"000_00000.parquet"}                                 # the download is kept for next time


@needs_duckdb
def test_web_files_that_hold_no_text_write_no_corpus(tmp_path, server):
    server.files["/10BT/000_00000.parquet"] = write_parquet(tmp_path / "e.parquet", [None, "", EOT])
    rc, out, err = run(["web", "1K"], env_for(tmp_path, server.url))
    assert rc == 1 and err.splitlines() == [
        f"get_data.sh: web: the 1 parquet file(s) of {server.url}/10BT hold no text (every text is empty or null); "
        "nothing was written"]
    assert not (tmp_path / "data" / "web").exists() and leftovers(tmp_path / "data") == []


@needs_duckdb
@pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) is not installed")
def test_a_second_web_run_waits_for_the_download_in_flight(tmp_path, server):
    # two curl -C - appending to one .part would mix two downloads into one file
    body = write_parquet(tmp_path / "a.parquet", DOCS_0)
    server.files["/10BT/000_00000.parquet"] = body
    env = env_for(tmp_path, server.url)
    first = start_stalled(server, "/10BT/000_00000.parquet", ["web", "60"], env)
    rc, out, err = run(["web", "60"], env)
    cache = tmp_path / "data" / ".cache" / "fineweb"
    assert rc == 1 and err.splitlines() == [
        f"get_data.sh: web: another get_data.sh, or a download it left running, is fetching into {cache}; "
        "wait for it to end"]
    assert len(server.requests) == 1
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == 143                                # not the stalled download's for ever
    server.stall.clear()
    rc, out, err = run(["web", "60"], env)                       # the lock went with the first run
    assert rc == 0, err
    assert read_shards(tmp_path / "data" / "web")[1] == [expected_web(DOCS_0, 60)]
