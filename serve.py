"""
Chat with a NanoEuler model in the browser, and through an OpenAI-shaped API, with
Python's standard library only. nanoeuler.py and nanoeuler_cuda.py run it:

    python nanoeuler.py serve --model out/sft/best.safetensors         # numpy, on the CPU
    python nanoeuler_cuda.py serve --model out/sft/best.safetensors    # on the GPU
    # then open http://127.0.0.1:8000/ (the page, serve.html) or point an OpenAI client
    # at http://127.0.0.1:8000/v1 (docs/serve.md)

    GET  /                       the page: a conversation, replies token by token
    GET  /v1/models              the one model
    POST /v1/chat/completions    messages, stream, temperature, top_p, top_k, max_tokens, seed:
                                 Server-Sent Events when streaming, one JSON object if not

The conversation is fed as `chat` feeds it (each user turn rendered by render_turn,
the history cut to what leaves room for the reply, each assistant turn its ids and
<|end|>), so a greedy reply (temperature 0) is exactly chat's reply.

One model and one KV cache: one reply is generated at a time, by the thread that
called serve (the one that holds the GPU's context); requests wait for it in a
bounded queue or get 503. The network side is for a user's own machine and its
browser, which web pages can reach too: a fixed number of threads serve the
connections (more wait in a bounded queue, the rest get 503); a request must
arrive whole within a deadline; bodies and conversations have limits; the Host
header must be localhost or an address (a page of another site that rebinds its
name to 127.0.0.1 is refused); POST bodies must be application/json (a form of
another site cannot send one) and no CORS header is ever sent.

What it does not do: several replies at once (batching), keep-alive connections
(one request per connection), TLS or passwords (bind to 127.0.0.1, the default,
or put it behind a proxy that has them), system messages, tools, n > 1, stop strings.
"""

import codecs
import collections
import contextlib
import io
import ipaddress
import json
import os
import queue
import re
import select
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, "serve.html")


# -----------------------------------------------------------------------------
# limits

class Limits:
    """what one request may ask and how long it may take; tests pass smaller ones"""
    body_bytes = 1 << 20            # a request's body
    head_bytes = 16 << 10           # its request line and headers
    messages = 256                  # messages in a conversation
    chars = 100_000                 # characters in all of them together
    max_tokens = 4096               # a reply's tokens (max_tokens)
    request_seconds = 10.0          # to send a whole request, head and body
    write_seconds = 60.0            # a client that reads none of the reply for this long is gone
    threads = 16                    # connections served at once
    connections = 64                # connections waiting for a thread; more get 503
    waiting = 4                     # requests waiting for the model while it generates; more get 503
    poll_seconds = 0.25             # how often a waiting request looks whether its client left

    def __init__(self, **changes):
        for name, value in changes.items():
            if not hasattr(Limits, name):
                raise TypeError(f"no limit {name}")
            setattr(self, name, value)


class Refused(Exception):
    """an HTTP error status and the sentence that says what to do"""

    def __init__(self, status, message):
        super().__init__(message)
        self.status, self.message = status, message


class ClientGone(Exception):
    """the client closed its connection (or stopped reading)"""


# -----------------------------------------------------------------------------
# the request: messages and settings, checked

def number(body, name, default, low, high, integer=False):
    """body[name] if it is a number (an integer when asked) from low to high, else 400"""
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise Refused(400, f"{name} must be {kind} from {low} to {high}, not {json.dumps(value)[:40]}")
    if not low <= value <= high:
        raise Refused(400, f"{name} must be {kind} from {low} to {high}, not {value}")
    return value


def clean_text(text):
    """lone surrogates (JSON's "\\ud800") become U+FFFD, as bytes that are not UTF-8 do in chat"""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def message_text(m, i):
    """a message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts"""
    content = m.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise Refused(400, f"messages[{i}].content must be a string (or a list of text parts)")
    return clean_text(content)


def read_chat_request(body, limits, V):
    """the JSON body of POST /v1/chat/completions -> its settings, each checked, or Refused(400)"""
    if not isinstance(body, dict):
        raise Refused(400, 'the body must be a JSON object, such as {"messages": [{"role": "user", '
                           '"content": "Hello"}]}')
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused(400, 'messages must be a non-empty list, such as [{"role": "user", "content": "Hello"}]')
    if len(messages) > limits.messages:
        raise Refused(400, f"the conversation has {len(messages)} messages, more than the {limits.messages} this "
                           "server takes; start a new one or send its last messages")
    turns, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Refused(400, f"messages[{i}] must be an object with a role and a content")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise Refused(400, f"messages[{i}].role is {json.dumps(role)[:40]}; this model knows only user and "
                               "assistant turns (it was fine-tuned without system messages)")
        text = message_text(m, i)
        chars += len(text)
        if chars > limits.chars:
            raise Refused(400, f"the conversation is longer than the {limits.chars:,} characters this server takes; "
                               "start a new one or send its last messages")
        turns.append((role, text.strip() if role == "user" else text))  # chat strips the line it reads
    if turns[-1][0] != "user" or not turns[-1][1]:
        raise Refused(400, "the last message must be the user's, and not empty: it is what the model answers")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise Refused(400, "stream must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise Refused(400, 'stream_options must be an object, such as {"include_usage": true}')
    if body.get("n", 1) != 1:
        raise Refused(400, "n must be 1: this server generates one reply at a time")
    if body.get("stop") not in (None, "", []):
        raise Refused(400, "stop must be null or empty: this server ends a reply only at <|end|> or max_tokens "
                           "(it has no stop strings)")
    if body.get("tools") not in (None, []):
        raise Refused(400, "tools must be null or empty: this model was fine-tuned without tools, so it cannot "
                           "call them")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return dict(turns=turns, stream=stream, usage=options.get("include_usage") is True,
                temperature=number(body, "temperature", 0.8, 0, 2),
                top_p=number(body, "top_p", 0.95, 0, 1),
                top_k=number(body, "top_k", 40, 0, V, integer=True),
                seed=number(body, "seed", None, 0, 2 ** 63 - 1, integer=True),
                max_tokens=number({"max_tokens": max_tokens}, "max_tokens", 200, 1, limits.max_tokens, integer=True))


def prompt_ids(ne, tok, cfg, turns, max_tokens, replies):
    """the ids that chat feeds for this conversation, with --max-new-tokens max_tokens: each
    user turn is added and the history cut to its last `room` tokens; each assistant turn is
    its ids and <|end|>. replies: the ids of the replies this server gave, by their text
    (the model's ids need not be the ones that encoding its text gives)."""
    reply_room = min(max_tokens, cfg.T // 2)
    room = max(1, cfg.T - 1 - reply_room)
    history = []
    for role, text in turns:
        if role == "user":
            if text:                                        # chat skips an empty line
                history = (history + ne.render_turn(tok, text)[0])[-room:]
        else:
            history += replies.get(text) or tok.encode(text)
            history += [tok.special("<|end|>")]
    return history


# -----------------------------------------------------------------------------
# the model: one reply at a time

class Job:
    """one reply to generate: the model's thread puts its ids on `out`, then (why it ended, how many)"""

    def __init__(self, prompt, settings):
        self.prompt, self.settings = prompt, settings
        self.out = queue.Queue()
        self.gone = threading.Event()                      # its client left: stop generating
        self.error = None


class Model:
    """the one model, its tokenizer and generate (nanoeuler's, or nanoeuler_cuda's with its decoder)"""

    def __init__(self, ne, params, cfg, tok, gen, name, limits):
        self.ne, self.params, self.cfg, self.tok, self.gen, self.name = ne, params, cfg, tok, gen, name
        self.limits = limits
        self.jobs = queue.Queue(maxsize=limits.waiting)
        self.replies = collections.OrderedDict()            # reply text -> its ids, the last 256
        self.changed = threading.Condition()               # tests wait on it for what follows
        self.running, self.finished, self.left = None, [], 0

    def note(self, **changes):
        with self.changed:
            for name, value in changes.items():
                setattr(self, name, value)
            self.changed.notify_all()

    def count_left(self):
        with self.changed:
            self.left += 1
            self.changed.notify_all()

    def submit(self, job):
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise Refused(503, f"the model is busy: it generates one reply at a time and {self.limits.waiting} more "
                               "wait their turn; try again when one is done") from None
        self.note()

    def work(self, stop):
        """generate the jobs one by one until stop is set (this thread holds the GPU's context)"""
        while not stop.is_set():
            try:
                # a timeout: a Ctrl-C that the kernel hands to another thread is seen here within it
                job = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            if job is None:
                continue
            if job.gone.is_set():
                self.note(finished=self.finished + [("gone", 0)])
                continue
            self.note(running=job)
            reason, n = self.generate(job)
            self.note(running=None, finished=self.finished + [(reason, n)])

    def generate(self, job):
        """job's ids onto job.out, stopping at <|end|> (or another special token) as chat does;
        -> why it ended ("stop", "length", "gone" or "error") and how many ids were generated"""
        s, ne, tok = job.settings, self.ne, self.tok
        end, reason, n = tok.special("<|end|>"), "length", 0
        try:
            with contextlib.closing(
                    self.gen(self.params, self.cfg, job.prompt, s["max_tokens"], s["temperature"], s["top_k"],
                             s["top_p"], s["seed"], False, stop=end)) as ids:
                for t in ids:
                    if job.gone.is_set():
                        reason = "gone"
                        break
                    n += 1
                    if t == end or 256 <= t < ne.FIRST_MERGE_ID:
                        reason = "stop"
                        break
                    job.out.put(t)
                else:
                    reason = "length" if n >= s["max_tokens"] else "stop"
        except ne.NanoEulerError as e:                     # LogitsNotFinite: a broken model, named by its file
            job.error, reason = f"{self.name}: {e}" if isinstance(e, ne.LogitsNotFinite) else str(e), "error"
        except Exception as e:                             # a bug or a GPU's error: this reply fails, not the server
            job.error, reason = f"generating failed ({type(e).__name__}: {e})", "error"
        job.out.put((reason, n))
        return reason, n

    def remember(self, text, ids):
        """the ids of a reply this server gave, so that a conversation that quotes it feeds them"""
        self.replies[text] = list(ids)
        self.replies.move_to_end(text)
        while len(self.replies) > 256:
            self.replies.popitem(last=False)


# -----------------------------------------------------------------------------
# reading a request, within its deadline and limits

def recv_until(sock, deadline, buf, done, limit, what):
    """recv into buf until done(buf), refusing a request over `limit` bytes or past the deadline"""
    while not done(buf):
        if len(buf) > limit:
            raise Refused(431 if what == "head" else 413, f"the request's {what} is larger than {limit:,} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise Refused(408, "the request did not arrive whole within the deadline; send it at once")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            raise ClientGone()
        buf += chunk
    return buf


# the empty line after the headers; lines may end in LF alone (a request typed into nc, or written with
# printf "...\n"), which HTTP lets a server take (RFC 9112, 2.2): they waited out the deadline, a 408
END_OF_HEAD = re.compile(rb"\r?\n\r?\n")


def allowed_host(host, port):
    """whether a Host header names this server: localhost or an IP address, with its port. A web
    page of another site that makes its name point at 127.0.0.1 (DNS rebinding) sends that name."""
    name, sep, p = host.rpartition(":")
    if not sep or name.endswith(":") or "]" in p:          # no port, or a bare IPv6 address
        name, p = host, "80"
    if p != str(port):
        return False
    name = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    if name.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


# -----------------------------------------------------------------------------
# the page and the API

class Handler(BaseHTTPRequestHandler):
    """one request per connection: read it whole (deadline, limits), route it, answer, close"""
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.1"                 # a garbled request line is answered with a status line too

    def version_string(self):
        return "NanoEuler"

    def handle(self):
        self.close_connection = True
        app, limits = self.server.app, self.server.app.limits
        deadline = time.monotonic() + limits.request_seconds
        self.command, self.path, self.request_version, self.requestline = None, "", "HTTP/1.1", ""
        try:
            buf = recv_until(self.connection, deadline, b"", END_OF_HEAD.search, limits.head_bytes, "head")
            end = END_OF_HEAD.search(buf)
            head, rest = buf[:end.start()], buf[end.end():]
            if len(head) > limits.head_bytes:
                raise Refused(431, f"the request's head is larger than {limits.head_bytes:,} bytes")
            self.rfile = io.BytesIO(head + b"\r\n\r\n")
            self.raw_requestline = self.rfile.readline(65537)
            if not self.parse_request():                   # it answered (send_error)
                return
            host = self.headers.get("Host", "")
            if not allowed_host(host, app.port):
                raise Refused(403, f"the Host header {host[:60]!r} is not this server's: ask for "
                                   f"http://127.0.0.1:{app.port}/ (or localhost, or its IP address)")
            path = self.path.split("?", 1)[0]
            routes = {"/": ("GET", self.page), "/v1/models": ("GET", self.models),
                      "/v1/chat/completions": ("POST", self.completions)}
            if path not in routes:
                raise Refused(404, f"there is nothing at {path[:80]}; this server answers GET /, GET /v1/models "
                                   "and POST /v1/chat/completions")
            method, answer = routes[path]
            if self.command != method:
                raise Refused(405, f"{path} answers {method} only, not {self.command[:20]}")
            body = self.read_body(rest, deadline, limits) if method == "POST" else b""
            self.connection.settimeout(limits.write_seconds)
            answer(body)
        except Refused as e:
            with contextlib.suppress(OSError):
                self.connection.settimeout(limits.write_seconds)
                self.send_json(e.status, error_body(e.status, e.message))
        except (ClientGone, OSError):
            pass
        except Exception as e:                             # a bug: this request fails, with a sentence
            with contextlib.suppress(OSError):
                self.send_json(500, error_body(500, f"the server failed ({type(e).__name__}: {e}); please report it"))

    def read_body(self, rest, deadline, limits):
        if "Transfer-Encoding" in self.headers:
            raise Refused(411, "send the body with a Content-Length, not chunked")
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise Refused(415, f"the body must be sent as application/json, not {ctype[:40] or 'without a type'}")
        lengths = self.headers.get_all("Content-Length", [])
        if len(set(lengths)) > 1:            # RFC 9112 6.3: an error (a proxy taking the other reads another request)
            raise Refused(400, f"the request has Content-Length headers that differ ({' and '.join(lengths)[:60]}); "
                          "send one")
        length = self.headers.get("Content-Length")
        if length is None:
            raise Refused(411, "send the body with a Content-Length")
        if not length.isdecimal():           # not isdigit: '²' is a digit that int() refuses
            raise Refused(400, f"Content-Length {length[:20]!r} is not a number of bytes")
        # int() refuses a number of more than 4,300 digits (it was a 500); far fewer already say "too large"
        length = length.lstrip("0") or "0"
        if len(length) > len(str(limits.body_bytes)) or int(length) > limits.body_bytes:
            size = f"is {int(length):,} bytes" if len(length) <= 30 else f"has a length of {len(length):,} digits"
            raise Refused(413, f"the body {size}, more than the {limits.body_bytes:,} bytes this server takes")
        length = int(length)
        body = recv_until(self.connection, deadline, rest, lambda b: len(b) >= length, length, "body")
        return body[:length]

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a malformed request line or header) in our shape"""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.send_json(code, error_body(code, f"{message or 'bad request'}; send an HTTP/1.1 request"))

    def log_message(self, format, *args):
        pass                                               # the terminal stays for the server's own lines

    def send_json(self, status, obj):
        data = (json.dumps(obj) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def page(self, body):
        data = self.server.app.page
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; "
                         "style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def models(self, body):
        app = self.server.app
        self.send_json(200, {"object": "list", "data": [{"id": app.model.name, "object": "model",
                                                           "created": app.created, "owned_by": "nanoeuler"}]})

    def completions(self, body):
        app = self.server.app
        model, limits = app.model, app.limits
        try:
            request = json.loads(body, parse_constant=not_json)
        except (ValueError, RecursionError) as e:
            raise Refused(400, f"the body is not JSON ({str(e)[:80]}); send an object such as "
                               '{"messages": [{"role": "user", "content": "Hello"}]}') from None
        s = read_chat_request(request, limits, model.cfg.V)
        prompt = prompt_ids(model.ne, model.tok, model.cfg, s["turns"], s["max_tokens"], model.replies)
        job = Job(prompt, s)
        model.submit(job)
        reply = Reply(self, job, model, app)
        try:
            reply.run()
        finally:
            job.gone.set()                                 # whatever happened here, stop generating


def not_json(name):
    raise ValueError(f"{name} is not a JSON number")


def error_body(status, message):
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


class Reply:
    """the generated ids of a job, as text (held back while it ends inside a UTF-8 character),
    streamed as Server-Sent Events or sent as one object at the end"""

    def __init__(self, handler, job, model, app):
        self.h, self.job, self.model, self.app = handler, job, model, app
        self.id = f"chatcmpl-{app.next_id()}"
        self.stream = job.settings["stream"]

    def chunk(self, delta, finish=None, usage=None):
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()),
               "model": self.model.name, "choices": [] if usage else
               [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage:
            obj["usage"] = usage
        self.send_event(json.dumps(obj))

    def send_event(self, data):
        try:
            self.h.wfile.write(f"data: {data}\n\n".encode())
        except OSError:
            raise ClientGone() from None

    def next_id(self):
        """the next generated id, or (reason, n) at the end; ClientGone if the client left meanwhile"""
        while True:
            try:
                item = self.job.out.get(timeout=self.model.limits.poll_seconds)
            except queue.Empty:
                item = None
            if client_gone(self.h.connection) or self.app.stopping.is_set():
                self.job.gone.set()
                self.model.count_left()
                raise ClientGone()
            if item is not None:
                return item

    def run(self):
        job, tok = self.job, self.model.tok
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if self.stream:
            h = self.h
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-store")
            h.send_header("Connection", "close")
            h.end_headers()
            self.chunk({"role": "assistant", "content": ""})
        ids, text = [], []
        while not isinstance(item := self.next_id(), tuple):
            ids.append(item)
            piece = decoder.decode(tok.vocab[item])
            if piece:
                text.append(piece)
                if self.stream:
                    self.chunk({"content": piece})
        reason, n = item
        last = decoder.decode(b"", final=True)              # a reply that ends inside a character: U+FFFD
        if last:
            text.append(last)
            if self.stream:
                self.chunk({"content": last})
        text = "".join(text)
        if reason == "error":
            if self.stream:
                self.send_event(json.dumps(error_body(500, job.error)))
                return
            raise Refused(500, job.error)
        self.model.remember(text, ids)
        usage = {"prompt_tokens": min(len(job.prompt), self.model.cfg.T - 1), "completion_tokens": n,
                 "total_tokens": min(len(job.prompt), self.model.cfg.T - 1) + n}
        if self.stream:
            self.chunk({}, reason)
            if job.settings["usage"]:
                self.chunk(None, usage=usage)
            self.send_event("[DONE]")
        else:
            self.h.send_json(200, {"id": self.id, "object": "chat.completion", "created": int(time.time()),
                                   "model": self.model.name, "usage": usage,
                                   "choices": [{"index": 0, "finish_reason": reason,
                                                "message": {"role": "assistant", "content": text}}]})


def client_gone(sock):
    """whether the client closed its side (its request was read whole, so anything readable
    is the end of the stream or bytes it should not have sent)"""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# -----------------------------------------------------------------------------
# the server: a fixed number of threads for the connections, the model in the caller's

def linger(sock, seconds=1.0, most=1 << 20):
    """after the answer, read what the client still sends (for a moment, up to `most` bytes) before
    closing: a socket closed with bytes unread resets the connection, and the client may lose the
    answer (a 413 to a body it is still sending)"""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        deadline, got = time.monotonic() + seconds, 0
        while got < most and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += len(chunk)


class TCPServer(socketserver.TCPServer):
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, app):
        self.app = app
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)

    def process_request(self, request, client_address):
        """hand the connection to a thread; with every thread busy and the queue full, 503"""
        try:
            self.app.connections.put_nowait((request, client_address))
        except queue.Full:
            with contextlib.suppress(OSError):
                request.settimeout(1)
                data = json.dumps(error_body(503, "the server has too many connections open; try again in a "
                                                  "moment")).encode()
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            self.shutdown_request(request)


class ChatServer:
    """the page and the API over one model: ChatServer(...).run() serves until close()"""

    def __init__(self, ne, params, cfg, tok, gen, name, host="127.0.0.1", port=8000, limits=None):
        self.limits = limits or Limits()
        self.model = Model(ne, params, cfg, tok, gen, name, self.limits)
        with open(PAGE, "rb") as f:
            self.page = f.read()
        self.connections = queue.Queue(maxsize=self.limits.connections)
        self.stopping = threading.Event()
        self.created, self.ids, self.ids_lock = int(time.time()), 0, threading.Lock()
        self.tcp = TCPServer((host, port), self)             # binds: a taken port fails here
        self.host, self.port = host, self.tcp.server_address[1]

    @property
    def url(self):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '') else host}:{self.port}/"

    def next_id(self):
        with self.ids_lock:
            self.ids += 1
            return self.ids

    def serve_connections(self):
        while True:
            item = self.connections.get()
            if item is None:
                return
            request, address = item
            try:
                self.tcp.finish_request(request, address)
            except Exception:                              # a handler's bug must not take a thread down
                pass
            finally:
                linger(request)
                self.tcp.shutdown_request(request)

    def run(self):
        """serve: the connections on their threads, the model on this one, until close()"""
        threads = [threading.Thread(target=self.serve_connections, daemon=True, name=f"serve-{i}")
                   for i in range(self.limits.threads)]
        threads.append(threading.Thread(target=self.tcp.serve_forever, daemon=True, name="serve-accept"))
        for t in threads:
            t.start()
        try:
            self.model.work(self.stopping)
        finally:
            self.stopping.set()
            self.tcp.shutdown()
            self.tcp.server_close()
            for _ in range(self.limits.threads):
                self.connections.put(None)

    def close(self):
        """stop run() (from another thread)"""
        self.stopping.set()
        with contextlib.suppress(queue.Full):            # a full queue wakes the model's thread anyway
            self.model.jobs.put_nowait(None)


# -----------------------------------------------------------------------------
# the command

def cmd_serve(args, ne, make_params=None, gen=None):
    """serve --model: nanoeuler.py's (ne: the nanoeuler module), or nanoeuler_cuda.py's with
    make_params(cfg, flat) (its decoder) and gen (its generate)"""
    if not args.host.strip():                            # the socket takes "" as every network: refuse, do not guess
        raise ne.NanoEulerError("--host is empty (an unset variable?); give 127.0.0.1 (this machine only) or "
                                "0.0.0.0 (every network)")
    cfg, flat, tok = ne.load_model(args.model)
    try:
        server = ChatServer(ne, None, cfg, tok, gen or ne.generate, os.path.basename(args.model), args.host,
                            args.port)
    except socket.gaierror:
        raise ne.NanoEulerError(f"--host {args.host} is not an address this machine has; give 127.0.0.1 (this "
                                "machine only) or 0.0.0.0 (every network)") from None
    except OSError as e:
        if e.errno == 98:
            why = f"is taken on {args.host} (another server runs there); give another --port, or --port 0"
        elif e.errno == 13:
            why = "needs root (ports below 1024); give one from 1024 up, such as 8000"
        else:
            raise ne.NanoEulerError(f"--host {args.host} --port {args.port}: cannot listen there "
                                    f"({e.strerror}); give 127.0.0.1 or 0.0.0.0, and another port") from None
        raise ne.NanoEulerError(f"--port {args.port} {why}") from None
    server.model.params = ne.carve(flat, cfg) if make_params is None else make_params(cfg, flat)
    print(f"serving {args.model} ({ne.num_params(cfg):,} parameters, context {cfg.T} tokens) at {server.url}\n"
          f"  the page: {server.url}    the API: {server.url}v1/chat/completions (OpenAI's shape)", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: --host {args.host} lets every machine that reaches this one chat with the model, with no "
              "password; use 127.0.0.1 to keep it to this machine", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:                              # SIGTERM and SIGHUP (ne.Interrupted) pass on to run_command
        print("\nstopped")


if __name__ == "__main__":          # `python serve.py` did nothing and exited 0: this file is the programs' module
    print("error: serve.py is run by the programs: python nanoeuler.py serve --model FILE (on the CPU), or "
          "python nanoeuler_cuda.py serve --model FILE (on a GPU); see docs/serve.md", file=sys.stderr)
    sys.exit(2)
