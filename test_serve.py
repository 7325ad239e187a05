"""
Tests of serve.py (`nanoeuler.py serve`, `nanoeuler_cuda.py serve`): the server runs in a
thread on port 0 and is asked over real sockets (http.client, and raw bytes for the
hostile cases). A greedy reply is chat's reply to the same conversation (chat's own
transcript, parsed); the stream's events, one reply at a time, a client that leaves,
text held back inside a UTF-8 character, the limits; hostile clients and pages (bad JSON,
lying lengths, slow clients, a hundred connections, other hosts, form posts), each ending
in its status with the server still answering; the OpenAI client example of docs/serve.md,
run with the real `openai` package. The page in headless Chromium: test_serve_browser.py.

    python -m pytest -q test_serve.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import contextlib
import http.client
import importlib
import io
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading

import pytest

import serve
from test_reliability import default_signals   # SIGINT, SIGTERM, SIGHUP at their defaults in a child

HERE = os.path.dirname(os.path.abspath(__file__))
WAIT = 60                                    # seconds before a test gives up on a condition


# -----------------------------------------------------------------------------
# a model, a server in a thread, and ways to ask it

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """a random model with a trained tokenizer (merges, so a reply's ids need not be what its
    text encodes to): its replies are noise, deterministic at temperature 0"""
    path = str(tmp_path_factory.mktemp("serve") / "m.safetensors")
    with open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        tok = ne.Tokenizer.train(f.read()[:60_000], 300, progress=False)
    cfg = ne.Config(V=300, C=32, Hq=2, Hkv=1, L=2, T=64, F=64, K=2)
    ne.save_model(path, cfg, ne.init_params(cfg, seed=1), tok)
    return path


@contextlib.contextmanager
def running(model_path, gen=None, params=None, **limits):
    """a ChatServer on 127.0.0.1, port 0, serving in a thread"""
    cfg, flat, tok = ne.load_model(model_path)
    srv = serve.ChatServer(ne, params or ne.carve(flat, cfg), cfg, tok, gen or ne.generate,
                           os.path.basename(model_path), port=0, limits=serve.Limits(**limits))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.close()
        thread.join(WAIT)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(model):
    with running(model) as srv:
        yield srv


def call(srv, method, path, body=None, headers=None):
    """-> status, response headers, the body (JSON decoded when it is JSON)"""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=WAIT)
    headers = dict(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
        headers.setdefault("Content-Type", "application/json")
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.getheader("Content-Type") == "application/json":
        data = json.loads(data)
    return r.status, r, data


def ask(srv, messages, **settings):
    """a reply without streaming -> its JSON"""
    status, _, data = call(srv, "POST", "/v1/chat/completions", {"messages": messages, **settings})
    assert status == 200, data
    return data


def events(srv, messages, **settings):
    """a streamed reply -> its events (decoded JSON, and the string "[DONE]"), read line by
    line: each `data: ...` line is followed by an empty one"""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=WAIT)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": messages, "stream": True, **settings}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream", r.read()
    out = []
    while line := r.readline():
        assert line.startswith(b"data: ") and line.endswith(b"\n"), line
        assert r.readline() == b"\n"
        data = line[6:-1].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return out


def deltas(evs):
    """the content pieces of a stream's events, and its finish reason"""
    assert evs[-1] == "[DONE]" and evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [e["choices"][0]["delta"]["content"] for e in evs[1:-2]]
    assert all(pieces) and evs[-2]["choices"][0]["delta"] == {}
    return pieces, evs[-2]["choices"][0]["finish_reason"]


def user(text):
    return {"role": "user", "content": text}


def chat_transcript(model_path, lines, max_new_tokens, monkeypatch, capsys, flags=("--temperature", "0")):
    """`chat --temperature 0` (or these flags) on these lines -> its replies, as its transcript shows them"""
    args = ne.build_parser().parse_args(["chat", "--model", model_path, "--max-new-tokens", str(max_new_tokens),
                                         *flags])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("".join(f"{q}\n" for q in lines).encode())))
    ne.cmd_chat(args)
    out = capsys.readouterr().out
    cut = r"(?:\(reply cut at --max-new-tokens \d+; give a larger one for longer replies\)\n)?"
    pattern = "chatting with [^\n]*\n" + "".join(f"you> {re.escape(q)}\nbot> (.*?)\n{cut}" for q in lines) + "bye\n"
    m = re.fullmatch(pattern, out, re.S)
    assert m, out
    return list(m.groups())


# -----------------------------------------------------------------------------
# replies: chat's, streamed, one at a time

def test_a_greedy_reply_is_chats_reply_to_the_same_conversation(model, server, monkeypatch, capsys):
    questions = ["Hello there", "And what of the king? Él está aquí", "Again"]
    want = chat_transcript(model, questions, 30, monkeypatch, capsys)
    assert len(set(want)) == 3 and all(want)                  # three replies, not one repeated
    messages, got = [], []
    for i, q in enumerate(questions):
        messages.append(user(q))
        if i % 2 == 0:                                        # streamed, then not, then streamed
            pieces, _ = deltas(events(server, messages, temperature=0, max_tokens=30))
            reply = "".join(pieces)
        else:
            reply = ask(server, messages, temperature=0, max_tokens=30)["choices"][0]["message"]["content"]
        got.append(reply)
        messages.append({"role": "assistant", "content": reply})
    assert got == want


def test_a_seeded_sampled_reply_is_chats_with_the_same_seed_and_settings(model, server, monkeypatch, capsys):
    # temperature, top_k, top_p and seed reach generate as chat's flags do (a swap would show)
    for t, k, p, seed in ((1.3, 0, 1.0, 5), (0.9, 12, 0.9, 11), (1.0, 50, 0.3, 2)):
        flags = ("--temperature", str(t), "--top-k", str(k), "--top-p", str(p), "--seed", str(seed))
        want = chat_transcript(model, ["Once upon a time"], 25, monkeypatch, capsys, flags)
        reply = ask(server, [user("Once upon a time")], temperature=t, top_k=k, top_p=p, seed=seed, max_tokens=25)
        assert reply["choices"][0]["message"]["content"] == want[0]
    greedy = chat_transcript(model, ["Once upon a time"], 25, monkeypatch, capsys)[0]
    assert want[0] != greedy


def test_a_conversation_is_fed_as_chat_feeds_it(model):
    # by hand: each user turn rendered and the history cut to T - 1 - min(max_tokens, T // 2)
    # tokens; an assistant turn is its ids (the ones the server generated, when it did) and <|end|>
    cfg, _, tok = ne.load_model(model)
    end = tok.special("<|end|>")
    turns = [("user", "first question"), ("assistant", "an answer"), ("user", "x" * 200)]
    room = cfg.T - 1 - min(10, cfg.T // 2)                                     # 53
    first = ne.render_turn(tok, "first question")[0]
    want = ((first + tok.encode("an answer") + [end]) + ne.render_turn(tok, "x" * 200)[0])[-room:]
    assert serve.prompt_ids(ne, tok, cfg, turns, 10, {}) == want
    assert len(want) == room
    ids = [ord(c) for c in "an answer"]                                        # the bytes, not the merges
    assert tok.encode("an answer") != ids
    assert serve.prompt_ids(ne, tok, cfg, turns[:2], 10, {"an answer": ids}) == first + ids + [end]


def test_a_stream_is_server_sent_events_that_add_up_to_the_reply(server):
    messages = [user("Tell me a story")]
    evs = events(server, messages, temperature=0, max_tokens=12, stream_options={"include_usage": True})
    assert evs[-1] == "[DONE]" and evs[-2]["choices"] == []
    usage = evs[-2]["usage"]
    pieces, finish = deltas(evs[:-2] + ["[DONE]"])
    whole = ask(server, messages, temperature=0, max_tokens=12)
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]
    assert finish == whole["choices"][0]["finish_reason"] == "length"
    assert usage == whole["usage"] and usage["completion_tokens"] == 12
    assert {e["id"] for e in evs[:-1]} == {evs[0]["id"]} and evs[0]["object"] == "chat.completion.chunk"
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"


def test_the_models_list_names_the_one_model(server):
    status, _, data = call(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in data["data"]] == ["m.safetensors"] and data["object"] == "list"


def test_the_page_is_one_file_that_needs_no_other_site(server):
    status, r, data = call(server, "GET", "/")
    with open(os.path.join(HERE, "serve.html"), "rb") as f:
        assert status == 200 and data == f.read()
    assert r.getheader("Content-Type") == "text/html; charset=utf-8"
    assert "connect-src 'self'" in r.getheader("Content-Security-Policy")
    assert not re.search(rb"""(src|href)=["']?(https?:)?//""", data)       # no CDN, no remote script or style
    assert b"/v1/chat/completions" in data and b"stream: true" in data


def fake(ids, log=None):
    """a generate that yields these ids (up to max_new_tokens), whatever the prompt"""
    def gen(params, cfg, prompt, max_new_tokens, *a, **kw):
        if log is not None:
            log.append(list(prompt))
        yield from ids[:max_new_tokens]
    return gen


def test_text_is_held_back_while_it_ends_inside_a_utf8_character(model):
    # h, then é in two ids (C3 A9), then !: three pieces, no U+FFFD; a reply that ends
    # inside a character ends with U+FFFD, as chat shows it
    with running(model, fake([0x68, 0xC3, 0xA9, 0x21])) as srv:
        assert deltas(events(srv, [user("hi")]))[0] == ["h", "é", "!"]
    with running(model, fake([0x68, 0xE2, 0x82])) as srv:
        assert deltas(events(srv, [user("hi")]))[0] == ["h", "\ufffd"]
        assert ask(srv, [user("hi")])["choices"][0]["message"]["content"] == "h\ufffd"


def test_a_reply_ends_at_end_or_another_special_token_as_chats_does(model):
    tok = ne.Tokenizer()
    for stop in ("<|end|>", "<|user|>", "<|endoftext|>"):
        with running(model, fake([0x6F, 0x6B, tok.special(stop), 0x78])) as srv:
            pieces, finish = deltas(events(srv, [user("hi")], max_tokens=10))
            assert pieces == ["o", "k"] and finish == "stop"
    with running(model, fake([0x6F, 0x6B])) as srv:                      # generate ended: stop, not length
        assert ask(srv, [user("hi")], max_tokens=10)["choices"][0]["finish_reason"] == "stop"
        assert ask(srv, [user("hi")], max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_a_generate_that_fails_is_a_500_with_a_sentence_and_the_server_goes_on(model):
    def broken(params, cfg, prompt, max_new_tokens, *a, **kw):
        yield 0x61
        raise ne.LogitsNotFinite("its logits are not finite")
    with running(model, broken) as srv:
        status, _, data = call(srv, "POST", "/v1/chat/completions", {"messages": [user("hi")]})
        assert status == 500 and data["error"]["message"] == "m.safetensors: its logits are not finite"
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=WAIT)
        conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [user("hi")], "stream": True}),
                     {"Content-Type": "application/json"})
        lines = conn.getresponse().read().decode().split("\n\n")        # the stream says so, and ends
        assert json.loads(lines[-2][6:]) == {"error": {"message": "m.safetensors: its logits are not finite",
                                                       "type": "server_error", "code": 500}}
        assert json.loads(lines[1][6:])["choices"][0]["delta"] == {"content": "a"} and lines[-1] == ""
        srv.model.gen = fake([0x61])
        still_answers(srv)
        assert ask(srv, [user("hi")])["choices"][0]["message"]["content"] == "a"
        srv.model.gen = lambda *a, **kw: iter([1 / 0])
        status, _, data = call(srv, "POST", "/v1/chat/completions", {"messages": [user("hi")]})
        assert status == 500 and data["error"]["message"] == "generating failed (ZeroDivisionError: division by zero)"


class Gate:
    """a generate that yields "a" and then waits for the test to open the gate before each next
    id; logs when each generation starts and ends"""

    def __init__(self, n=3):
        self.n, self.log, self.opened, self.closed = n, [], threading.Semaphore(0), 0

    def __call__(self, params, cfg, prompt, max_new_tokens, *a, **kw):
        self.log.append("start")
        try:
            for i in range(min(self.n, max_new_tokens)):
                if i:
                    assert self.opened.acquire(timeout=WAIT)
                yield 0x61
        finally:
            self.log.append("end")

    def open(self, n=1):
        for _ in range(n):
            self.opened.release()


def wait_for(srv, condition):
    with srv.model.changed:
        assert srv.model.changed.wait_for(condition, WAIT)


def stream_reader(srv, messages, results, **settings):
    t = threading.Thread(target=lambda: results.append(deltas(events(srv, messages, **settings))[0]), daemon=True)
    t.start()
    return t


def test_one_reply_at_a_time_others_wait_and_the_rest_get_503(model):
    gate = Gate(n=3)
    with running(model, gate, waiting=1) as srv:
        results = []
        first = stream_reader(srv, [user("one")], results)
        wait_for(srv, lambda: srv.model.running is not None)
        second = stream_reader(srv, [user("two")], results)
        wait_for(srv, lambda: srv.model.jobs.qsize() == 1)
        status, _, data = call(srv, "POST", "/v1/chat/completions", {"messages": [user("three")]})
        message = data["error"]["message"]
        assert status == 503 and "the model is busy" in message and "one reply at a time" in message
        # the page and the models list still answer while the model works
        assert call(srv, "GET", "/")[0] == 200 and call(srv, "GET", "/v1/models")[0] == 200
        gate.open(4)
        first.join(WAIT), second.join(WAIT)
        assert results == [["a", "a", "a"], ["a", "a", "a"]]
        assert gate.log == ["start", "end", "start", "end"]          # never two at once


def test_a_client_that_leaves_stops_its_generation(model):
    gate = Gate(n=1000)
    with running(model, gate, poll_seconds=0.05) as srv:
        conn = socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT)
        body = json.dumps({"messages": [user("hi")], "stream": True, "max_tokens": 1000}).encode()
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (srv.port, len(body), body))
        seen = b""
        while b'"content": "a"' not in seen:                  # the first id's text arrived
            seen += conn.recv(4096)
        conn.close()
        wait_for(srv, lambda: srv.model.left == 1)            # the server saw it go, while generate waited
        gate.open()
        wait_for(srv, lambda: srv.model.finished == [("gone", 1)])
        assert gate.log == ["start", "end"]                     # generate was closed, not left running
        assert ask(srv, [user("next")], max_tokens=1)["choices"][0]["message"]["content"] == "a"


# -----------------------------------------------------------------------------
# limits and wrong requests: 400 and a sentence

LIMITS = dict(messages=4, chars=100, max_tokens=50)


@pytest.fixture(scope="module")
def small(model):
    with running(model, fake([0x61]), request_seconds=WAIT, **LIMITS) as srv:
        yield srv


@pytest.mark.parametrize("body, words", [
    ({"messages": [user("a")] * 5}, "5 messages, more than the 4"),
    ({"messages": [user("a" * 60), {"role": "assistant", "content": "b" * 41}, user("c")]}, "100 characters"),
    ({"messages": [user("a")], "max_tokens": 51}, "max_tokens must be an integer from 1 to 50, not 51"),
    ({"messages": [user("a")], "max_completion_tokens": 0}, "max_tokens must be an integer from 1 to 50"),
    ({"messages": [user("a")], "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"messages": [user("a")], "temperature": "hot"}, 'temperature must be a number from 0 to 2, not "hot"'),
    ({"messages": [user("a")], "temperature": True}, "temperature must be a number"),
    ({"messages": [user("a")], "temperature": 2.5}, "temperature must be a number from 0 to 2, not 2.5"),
    ({"messages": [user("a")], "top_p": 1.5}, "top_p must be a number from 0 to 1"),
    ({"messages": [user("a")], "top_k": -1}, "top_k must be an integer"),
    ({"messages": [user("a")], "seed": -1}, "seed must be an integer"),
    ({"messages": [user("a")], "stream": "yes"}, "stream must be true or false"),
    ({"messages": [user("a")], "n": 2}, "n must be 1"),
    ({"messages": [user("a")], "stop": ["\n"]}, "stop must be null or empty"),
    ({"messages": [user("a")], "stop": "x"}, "stop must be null or empty"),
    ({"messages": [user("a")], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools must be null or empty"),
    ({"messages": "hello"}, "messages must be a non-empty list"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({}, "messages must be a non-empty list"),
    ([user("a")], "the body must be a JSON object"),
    ({"messages": ["hello"]}, "messages[0] must be an object"),
    ({"messages": [{"role": "system", "content": "be nice"}, user("a")]}, "messages[0].role is \"system\""),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "user"}]}, "messages[0].content must be a string"),
    ({"messages": [user("a"), {"role": "assistant", "content": "b"}]}, "the last message must be the user's"),
    ({"messages": [user("   ")]}, "the last message must be the user's, and not empty"),
])
def test_what_is_out_of_limits_or_of_the_wrong_type_is_refused_with_400_and_a_sentence(small, body, words):
    status, _, data = call(small, "POST", "/v1/chat/completions", body)
    assert status == 400 and words in data["error"]["message"], data
    assert data["error"]["type"] == "invalid_request_error"


def test_within_the_limits_is_answered(small):
    body = {"messages": [user("a" * 60), {"role": "assistant", "content": "b" * 30}, user("c" * 10)],
            "max_tokens": 50, "temperature": 1, "top_p": 0.5, "top_k": 3, "seed": 7}
    assert call(small, "POST", "/v1/chat/completions", body)[0] == 200
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hel"},
                                                       {"type": "text", "text": "lo"}]}]}
    assert call(small, "POST", "/v1/chat/completions", parts)[0] == 200         # content as OpenAI's parts
    # the parts are one text, put together with nothing added (docs/serve.md): "hello", not "hel lo"
    assert serve.read_chat_request(parts, serve.Limits(), 300)["turns"] == [("user", "hello")]
    # both lengths: max_completion_tokens, the one OpenAI's API reference says replaced the
    # deprecated max_tokens, is the reply's (as vLLM's server reads them too)
    both = {"messages": [user("a")], "max_completion_tokens": 7, "max_tokens": 50}
    assert serve.read_chat_request(both, serve.Limits(), 300)["max_tokens"] == 7
    for empty in ({"stop": None, "tools": None}, {"stop": [], "tools": []}, {"stop": ""}):   # null or empty: accepted
        assert call(small, "POST", "/v1/chat/completions", {"messages": [user("a")], **empty})[0] == 200, empty


def still_answers(srv):
    status, _, data = call(srv, "GET", "/v1/models")
    assert status == 200 and data["data"][0]["id"] == "m.safetensors"


# -----------------------------------------------------------------------------
# hostile clients

def raw(srv, data, close_after_send=False):
    """send these bytes on a new connection -> the status and the JSON error message of the answer"""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT) as conn:
        conn.sendall(data)
        if close_after_send:
            conn.shutdown(socket.SHUT_WR)
        return read_answer(conn)


def read_answer(conn):
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head else None
    return status, (json.loads(body).get("error", {}).get("message") if body.startswith(b"{") else body), head


def post(srv, body, length=None, ctype=b"application/json", extra=b""):
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: %s\r\n%sContent-Length: %d"
            b"\r\n\r\n%s" % (srv.port, ctype, extra, len(body) if length is None else length, body))


@pytest.mark.parametrize("body, words", [
    (b'{"messages": [', "the body is not JSON"),
    (b"\xff\xfe\x00garbage", "the body is not JSON"),
    (b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', "NaN is not a JSON number"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "the body is not JSON", id="nested-100000-deep"),
])
def test_a_body_that_is_not_json_is_refused(small, body, words):
    status, message, _ = raw(small, post(small, body))
    assert status == 400 and words in message, message
    still_answers(small)


def test_a_lone_surrogate_in_json_is_a_replacement_character_not_a_crash(small):
    assert raw(small, post(small, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'))[0] == 200
    assert serve.clean_text("a\ud800b") == "a\ufffdb"


@pytest.mark.parametrize("request_bytes, status, words", [
    (b"GET /../serve.py HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 404, "there is nothing at /../serve.py"),
    (b"GET /serve.html HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 404, "there is nothing at"),
    (b"GET //etc/passwd HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 404, "there is nothing at"),
    (b"GET /%2e%2e/%2e%2e/etc/passwd HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 404, "there is nothing at"),
    (b"GET /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 405, "answers POST only"),
    (b"POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\n\r\n", 405, "answers GET only"),
    (b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: http://evil.example\r\n"
     b"Access-Control-Request-Method: POST\r\n\r\n", 405, "answers POST only"),
    (b"GET / HTTP/1.1\r\nHost: evil.example:{port}\r\n\r\n", 403, "the Host header 'evil.example:"),
    (b"GET / HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n", 403, "is not this server's"),
    (b"GET / HTTP/1.1\r\n\r\n", 403, "the Host header '' is not this server's"),
    (b"GARBAGE\r\n\r\n", 400, "send an HTTP/1.1 request"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431,
                 "head is larger", id="a-head-of-20-KB"),
])
def test_paths_methods_hosts_and_malformed_requests_get_their_status(small, request_bytes, status, words):
    got, message, head = raw(small, request_bytes.replace(b"{port}", str(small.port).encode()))
    assert got == status and words in message, (got, message)
    assert b"access-control" not in head.lower()                               # never a CORS header
    still_answers(small)


def test_a_page_of_another_site_cannot_post_a_form_or_rebind_a_name(small):
    for ctype in (b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x"):
        status, message, head = raw(small, post(small, b'{"messages": [{"role": "user", "content": "a"}]}',
                                                ctype=ctype))
        assert status == 415 and "must be sent as application/json" in message
        assert b"access-control" not in head.lower()
    rebound = post(small, b'{"messages": [{"role": "user", "content": "a"}]}').replace(
        b"Host: 127.0.0.1", b"Host: attacker.example")
    assert raw(small, rebound)[0] == 403
    # this machine's own names; a host name is case-insensitive (RFC 3986 3.2.2): curl sends it as typed
    for host in (b"localhost", b"LocalHost", b"[::1]", b"127.0.0.1"):
        ok = post(small, b'{"messages": [{"role": "user", "content": "a"}]}').replace(b"127.0.0.1", host, 1)
        status, _, head = raw(small, ok)
        assert status == 200 and b"access-control" not in head.lower()
    assert serve.allowed_host("192.168.1.7:8000", 8000) and not serve.allowed_host("192.168.1.7.nip.io:8000", 8000)


def test_lengths_that_lie_or_are_missing(model):
    with running(model, fake([0x61]), request_seconds=1, body_bytes=1000) as srv:
        status, message, _ = raw(srv, post(srv, b"", length=10_000_000))        # refused before reading it
        assert status == 413 and "10,000,000 bytes, more than the 1,000" in message
        status, message, _ = raw(srv, post(srv, b'{"messages"', length=100))    # claims more, then waits
        assert status == 408 and "did not arrive whole" in message
        assert raw(srv, post(srv, b'{"messages"', length=100), close_after_send=True)[0] is None   # left: no answer
        status, message, _ = raw(srv, post(srv, b"{}", extra=b"Transfer-Encoding: chunked\r\n"))
        assert status == 411 and "not chunked" in message
        status, message, _ = raw(srv, post(srv, b"{}").replace(b"Content-Length: 2\r\n", b""))
        assert status == 411 and "Content-Length" in message
        status, message, _ = raw(srv, post(srv, b"{}").replace(b"Content-Length: 2", b"Content-Length: -2"))
        assert status == 400 and "is not a number of bytes" in message
        status, message, _ = raw(srv, post(srv, b"{}").replace(b"Content-Length: 2", b"Content-Length: \xb2"))
        assert status == 400 and "is not a number of bytes" in message          # a digit to isdigit, not to int
        digits = b"9" * 5000                           # more than int() reads (4,300): it was a 500, "please report it"
        status, message, _ = raw(srv, post(srv, b"{}").replace(b"Content-Length: 2", b"Content-Length: " + digits))
        assert status == 413 and message == "the body has a length of 5,000 digits, more than the 1,000 bytes " \
                                            "this server takes", message
        status, _, _ = raw(srv, post(srv, b"{}").replace(b"Content-Length: 2", b"Content-Length: " + b"0" * 5000 + b"2"))
        assert status == 400                           # 2 bytes, written long: read, and {} has no messages
        still_answers(srv)


def test_two_content_lengths_that_differ_are_refused(small):
    """RFC 9112 6.3: differing Content-Length values are an error (a proxy that believes the other one reads
    another request where we read a body); the first was taken. Equal ones are one length"""
    good = b'{"messages": [{"role": "user", "content": "a"}]}'
    for extra in (b"Content-Length: 5\r\n", b"Content-Length: %d\r\n" % (len(good) + 7)):
        status, message, _ = raw(small, post(small, good, extra=extra))
        assert (status, message) == (400, f"the request has Content-Length headers that differ "
                                          f"({extra[16:-2].decode()} and {len(good)}); send one"), message
    status, _, _ = raw(small, post(small, good, extra=b"Content-Length: %d\r\n" % len(good)))
    assert status == 200
    still_answers(small)


def test_a_request_whose_lines_end_in_lf_alone_is_answered(model):
    """nc, or printf "...\\n", ends the lines in LF alone, which HTTP lets a server take (RFC 9112, 2.2):
    such a request waited out the deadline and got 408 'did not arrive whole', though it had"""
    with running(model, fake([0x61]), request_seconds=5) as srv:
        status, _, head = raw(srv, b"GET /v1/models HTTP/1.1\nHost: 127.0.0.1:%d\n\n" % srv.port)
        assert status == 200, head
        body = b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}'
        status, _, head = raw(srv, post(srv, body).replace(b"\r\n", b"\n"))
        assert status == 200, head
        # an empty line inside the body is the body's: the head ends at the first one
        status, message, _ = raw(srv, post(srv, b'{"messages":\n\n[]}'))
        assert status == 400 and "messages must be a non-empty list" in message, message


def test_a_client_that_sends_a_byte_at_a_time_is_cut_off_at_the_deadline(model):
    with running(model, fake([0x61]), request_seconds=0.5) as srv:
        request = post(srv, b"{}", extra=b"X-Pad: " + b"a" * 5000 + b"\r\n")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT) as conn:
            sent = 0
            while not select.select([conn], [], [], 0.05)[0]:     # a byte, then another while nothing came back
                conn.sendall(request[sent:sent + 1])
                sent += 1
                assert sent < len(request), "the whole request went through, one byte at a time"
            status, message, _ = read_answer(conn)
        assert status == 408 and "did not arrive whole" in message
        still_answers(srv)


def test_a_hundred_connections_at_once_get_bounded_threads_and_the_server_survives(model):
    before = threading.active_count()
    with running(model, fake([0x61]), request_seconds=1, threads=4, connections=8) as srv:
        conns = [socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT) for _ in range(100)]
        for c in conns[:50]:
            c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % srv.port)    # half a head, then nothing
        assert threading.active_count() <= before + 4 + 1 + 1       # its threads, the accept loop and run's
        statuses = []
        for c in conns:
            statuses.append(read_answer(c)[0])
            c.close()
        # at least the 8 that the queue holds are served (408 at the deadline), the rest get 503 at once
        assert set(statuses) == {408, 503} and statuses.count(408) >= 8, statuses
        assert threading.active_count() <= before + 4 + 1 + 1
        still_answers(srv)


# -----------------------------------------------------------------------------
# OpenAI's client, as docs/serve.md shows it

def on_ci():
    """CI=true, or .ci/run's NANOEULER_CI=1: what CI installs must be there"""
    return os.environ.get("CI") == "true" or os.environ.get("NANOEULER_CI") == "1"


def needs(module):
    """import module, or skip; on CI (.ci/run installs requirements-dev.txt) fail instead"""
    try:
        return importlib.import_module(module)
    except ImportError:
        if on_ci():
            pytest.fail(f"{module} is not installed; .ci/run installs requirements-dev.txt")
        pytest.skip(f"{module} is not installed (pip install -r requirements-dev.txt)")


def test_the_openai_client_example_of_the_docs_prints_the_greedy_reply(model, server, monkeypatch, capsys):
    needs("openai")
    with open(os.path.join(HERE, "docs", "serve.md"), encoding="utf-8") as f:
        (example,) = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    question = re.search(r'"content": "([^"]+)"', example)[1]
    max_tokens = int(re.search(r"max_tokens=(\d+)", example)[1])
    want = chat_transcript(model, [question], max_tokens, monkeypatch, capsys)[0]
    assert want and "http://127.0.0.1:8000/v1" in example
    exec(compile(example.replace(":8000/", f":{server.port}/"), "docs/serve.md", "exec"), {})
    assert capsys.readouterr().out == want + "\n"


def test_the_openai_client_gets_whole_replies_and_errors(server):
    openai = needs("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["m.safetensors"]
    messages = [user("Hello there")]
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == ask(server, messages, temperature=0, max_tokens=12)["choices"][0][
        "message"]["content"] and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer from 1 to 4096"):
        client.chat.completions.create(model="m", messages=messages, max_tokens=5000)


# -----------------------------------------------------------------------------
# the command: nanoeuler.py serve, nanoeuler_cuda.py serve

def run_cli(*args, program="nanoeuler.py"):
    return subprocess.run([sys.executable, os.path.join(HERE, program), "serve", *args], capture_output=True,
                          timeout=300, cwd=HERE)


def test_serve_prints_its_address_answers_and_stops_on_ctrl_c(model):
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "nanoeuler.py"), "serve", "--model", model, "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE, preexec_fn=default_signals)
    try:
        first = p.stdout.readline().decode()
        m = re.fullmatch(r"serving \S+ \(47,392 parameters, context 64 tokens\) at http://127\.0\.0\.1:(\d+)/\n", first)
        assert m, first + p.stderr.read().decode()
        conn = http.client.HTTPConnection("127.0.0.1", int(m[1]), timeout=WAIT)
        conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [user("hi")], "max_tokens": 3}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] <= 3
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=WAIT)
        assert p.returncode == 0 and out.decode().endswith("stopped\n") and err == b"", err
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("args, words", [
    (["--model", "nowhere.safetensors"], "nowhere.safetensors"),
    (["--model", "{model}", "--host", "no.such.host.invalid"], "--host no.such.host.invalid is not an address"),
    (["--model", "{model}", "--host", ""], "--host is empty"),          # "" would listen on every network
    (["--model", "{model}", "--port", "65536"], "argument --port: '65536' is not a TCP port from 0 to 65535"),
    (["--model", "{model}", "--port", "http"], "argument --port: 'http' is not a TCP port"),
    (["--model", "{model}", "--port", "{taken}"], "is taken on 127.0.0.1"),
])
def test_a_bad_model_host_or_port_is_one_sentence(model, args, words):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [a.format(model=model, taken=taken.getsockname()[1]) for a in args]
        r = run_cli(*args)
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err and "Traceback" not in err, err
    assert err.count("\n") == 1 or err.startswith("usage:"), err


def test_serve_py_run_by_itself_says_which_command_serves(model):
    """`python serve.py --model FILE` printed nothing and exited 0: it is the programs' module, not a program"""
    for args in ([], ["--model", model]):
        r = subprocess.run([sys.executable, os.path.join(HERE, "serve.py"), *args], capture_output=True, text=True,
                           timeout=WAIT)
        assert (r.returncode, r.stdout) == (2, "") and r.stderr == (
            "error: serve.py is run by the programs: python nanoeuler.py serve --model FILE (on the CPU), or python "
            "nanoeuler_cuda.py serve --model FILE (on a GPU); see docs/serve.md\n"), r.stderr


def test_the_gpu_program_serves_through_the_same_server_with_its_generate(model, monkeypatch, capsys):
    """nanoeuler_cuda.py serve: its decoder and generate (on test_cuda_pipeline's stand-in for the
    GPU's decoder) give chat's greedy reply too"""
    nc = pytest.importorskip("nanoeuler_cuda")
    from test_cuda_pipeline import StandInDecoder
    want = chat_transcript(model, ["Hello there"], 20, monkeypatch, capsys)
    monkeypatch.setattr(nc, "GPUDecoder", lambda cfg, flat, precision: StandInDecoder(ne.carve(flat, cfg), cfg))
    made, started, server_class = [], threading.Event(), serve.ChatServer

    def run(self):
        made.append(self)
        started.set()
        server_class.run(self)
    monkeypatch.setattr(serve, "ChatServer", type("Recorded", (server_class,), {"run": run}))
    args = nc.build_parser().parse_args(["serve", "--model", model, "--port", "0", "--precision", "fp32"])
    thread = threading.Thread(target=nc.cmd_serve, args=(args,), daemon=True)
    thread.start()
    try:
        assert started.wait(WAIT)
        srv = made[0]
        assert isinstance(srv.model.params, StandInDecoder) and srv.model.gen is nc.generate
        assert "".join(deltas(events(srv, [user("Hello there")], temperature=0, max_tokens=20))[0]) == want[0]
    finally:
        if made:
            made[0].close()
        thread.join(WAIT)
