#!/bin/bash
# nanoeuler_cuda.py serve on a GPU (bash dev/gpu/serve_smoke.sh OUTDIR [MODEL]; OUTDIR: summary.log and
# the logs), about 20 s on an H200 with a MODEL (default: out/sft/best.safetensors when there), about
# 90 s without (train big 300 steps, sft 200 first): the
# server on a free port; GET /v1/models; three questions streamed at temperature 0, each reply equal
# to `nanoeuler_cuda.py chat --temperature 0`'s to the same questions; time to the first piece and
# tokens/s of a stream of up to 200 tokens; a client that leaves mid-reply and the next request answered; a
# malformed body refused (400); SIGTERM stops the server (exit 143). Standard library only, no network.
source "$(dirname "$0")/common.sh"
M=${1:-}
[ -z "$M" ] && [ -f out/sft/best.safetensors ] && M=out/sft/best.safetensors    # the README flow's, when it ran
P=${PROGRAM:-nanoeuler_cuda.py}      # PROGRAM=nanoeuler.py: the same on the CPU (given a MODEL)
if [ -z "$M" ]; then
  t train.log python nanoeuler_cuda.py train big --steps 300 --eval-every 300 --fresh --out out/serve_big
  grep -vE "^step |^sample" "$R/train.log" | tail -2 | tee -a "$S"
  t sft.log python nanoeuler_cuda.py sft --model out/serve_big/best.safetensors --steps 200 --eval-every 200 \
    --fresh --out out/serve_sft
  grep -vE "^step |^sample" "$R/sft.log" | tail -2 | tee -a "$S"
  M=out/serve_sft/best.safetensors
fi
Q=$R/questions.txt
printf 'What is the capital of France?\nGive me three tips for staying healthy.\nWhat is a good name for a cat?\n' > "$Q"
t chat.log timeout 100 sh -c "python $P chat --model $M --temperature 0 --max-new-tokens 80 < $Q"

python $P serve --model "$M" --port 0 > "$R/serve.log" 2>&1 &
server=$!
for i in $(seq 1200); do grep -q "^serving" "$R/serve.log" && break; kill -0 $server 2>/dev/null || break; sleep 0.1; done
head -2 "$R/serve.log" | tee -a "$S"
port=$(grep -oE "http://127\.0\.0\.1:[0-9]+/" "$R/serve.log" | head -1 | grep -oE "[0-9]+/$" | tr -d /)

python - "$port" "$Q" "$R/chat.log" <<'EOF' 2>&1 | tee -a "$S"
import http.client, json, re, socket, sys, time
port, questions, transcript = int(sys.argv[1]), open(sys.argv[2]).read().splitlines(), open(sys.argv[3]).read()

def request(method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method, path, json.dumps(body) if body is not None else None,
                 {"Content-Type": "application/json"} if body is not None else {})
    return conn.getresponse()

def stream(messages, max_tokens):
    """-> the reply's text, its pieces, seconds to the first piece, seconds in all, tokens"""
    start, first, pieces, tokens = time.perf_counter(), None, [], None
    r = request("POST", "/v1/chat/completions", {"messages": messages, "stream": True, "temperature": 0,
                "max_tokens": max_tokens, "stream_options": {"include_usage": True}})
    assert r.status == 200, r.read()
    while line := r.readline():
        if not line.startswith(b"data: ") or line == b"data: [DONE]\n":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        elif event["choices"][0]["delta"].get("content"):
            first = first or time.perf_counter() - start
            pieces.append(event["choices"][0]["delta"]["content"])
    return "".join(pieces), pieces, first, time.perf_counter() - start, tokens

r = request("GET", "/v1/models")
print("models:", r.status, [m["id"] for m in json.loads(r.read())["data"]])
cut = r"(?:\(reply cut at --max-new-tokens \d+; give a larger one for longer replies\)\n)?"
want = re.search("".join(f"you> {re.escape(q)}\nbot> (.*?)\n{cut}" for q in questions), transcript, re.S)
messages, got = [], []
for q in questions:
    messages.append({"role": "user", "content": q})
    text, pieces, first, total, tokens = stream(messages, 80)
    messages.append({"role": "assistant", "content": text})
    got.append(text)
    print(f"reply ({len(pieces)} pieces, {tokens} tokens, first after {first * 1000:.0f} ms): {text!r}")
print("greedy replies == chat's:", "yes" if want and list(want.groups()) == got else f"NO (chat: {want and want.groups()})")
text, pieces, first, total, tokens = stream([{"role": "user", "content": "Tell me a long story."}], 200)
print(f"stream of {tokens} tokens: first piece after {first * 1000:.0f} ms, {tokens / total:.0f} tokens/s in all")
conn = socket.create_connection(("127.0.0.1", port))
body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                   "max_tokens": 4000}).encode()
conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (port, len(body), body))
seen = b""
while seen.count(b"data: ") < 3:
    seen += conn.recv(4096)
conn.close()
start = time.perf_counter()
r = request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
print(f"after a client left mid-reply: the next request {r.status} in {time.perf_counter() - start:.2f} s")
r = request("POST", "/v1/chat/completions", {"messages": "Hi"})
print("a malformed body:", r.status, json.loads(r.read())["error"]["message"])
EOF
kill -TERM $server                   # (a background job of a script ignores SIGINT, so not Ctrl-C's)
wait $server
echo "serve after SIGTERM: exit $? (143 expected), last line: $(tail -1 "$R/serve.log")" | tee -a "$S"
