"""
Tests for nanoeuler.py (and, where a GPU or its packages exist, nanoeuler_cuda.py).

    python -m pytest -q test_nanoeuler.py

Tiny configs keep the whole suite to a few minutes on 2 cores.
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import functools
import hashlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from test_data import reference_encode    # minbpe's encode, written out once, in the data's tests
from test_reliability import default_signals   # SIGINT, SIGTERM, SIGHUP at their defaults in a child

HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# common test data

AWKWARD = ["", "a", " ", "\n\n\n", "hello world", "don't  stop\tme", "   leading and trailing   ",
           "naïve café", "日本語のテキスト", "emoji 🎉👍🏽 and flags 🇫🇷", "e\u0301 combining", "NUL\x00byte",
           "\x01\x02 control", "<|endoftext|> is just text here", "snake_case_name __init__", "x²³ ½",
           " " * 50 + "x", "mixed 123abc 45.6 -7"]
TINY = ne.Config(V=300, C=16, Hq=4, Hkv=2, L=2, T=12, F=48, K=3)


@pytest.fixture(scope="module")
def tok():
    """a tokenizer trained on varied text, so merges cross many kinds of byte"""
    text = open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:60_000]
    return ne.Tokenizer.train(text + " ".join(AWKWARD) * 3, 400, progress=False)


def small_corpus(tmp_path, n_chars=40_000):
    text = open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:n_chars]
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


def run_cli(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), *args], input=stdin,
                          capture_output=True, timeout=timeout, cwd=HERE)


def random_model(cfg, seed=0, std=0.3, dtype=np.float64):
    """weights large enough that logits are far apart: greedy choices are not near ties"""
    rng = np.random.default_rng(seed)
    flat = rng.normal(0, std, ne.num_params(cfg)).astype(dtype)
    params = ne.carve(flat, cfg)
    for name, shape in ne.param_shapes(cfg):
        if len(shape) == 1:
            params[name][...] = 1.0
    return flat, params


# -----------------------------------------------------------------------------
# tokenizer

def test_bpe_wikipedia_example():
    # aaabdaaabac: aa -> Z, then ab -> Y (ties go to the smaller pair), then ZY -> X: XdXac
    tok = ne.Tokenizer.train("aaabdaaabac", ne.FIRST_MERGE_ID + 3, progress=False)
    a, b, c, d = 97, 98, 99, 100
    Z, Y, X = ne.FIRST_MERGE_ID, ne.FIRST_MERGE_ID + 1, ne.FIRST_MERGE_ID + 2
    assert tok.merges == [(a, a), (a, b), (Z, Y)]
    assert tok.encode("aaabdaaabac") == [X, d, X, a, c]
    assert tok.decode([X]) == "aaab"


def test_bpe_counts_a_pair_once_for_every_occurrence_of_its_piece():
    # pieces "!!" once and "zz" four times (newlines are pieces of their own): the pair zz
    # occurs 4 times, !! once, so zz merges first, though it is the larger pair
    tok = ne.Tokenizer.train("!!\nzz\nzz\nzz\nzz", ne.FIRST_MERGE_ID + 1, progress=False)
    assert tok.merges == [(122, 122)]


def test_bpe_merges_a_pair_that_occurs_once():
    # "abc": ab (a tie with bc, the smaller pair), then the new pair (ab, c), seen once
    tok = ne.Tokenizer.train("abc", ne.FIRST_MERGE_ID + 2, progress=False)
    assert tok.merges == [(97, 98), (ne.FIRST_MERGE_ID, 99)]


@pytest.mark.parametrize("s", AWKWARD)
def test_round_trip_awkward(tok, s):
    assert tok.decode(tok.encode(s)) == s


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_round_trip_any_text(tok, s):
    assert tok.decode(tok.encode(s)) == s


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["\n", " ", "\t", "a", "é", "🎉", "\x00", "\u0301", "_", "'s", "9"]), max_size=300))
def test_round_trip_runs(tok, parts):
    s = "".join(parts)
    assert tok.decode(tok.encode(s)) == s


def test_special_tokens(tok):
    assert [tok.special(s) for s in ne.SPECIALS] == [256, 257, 258, 259]
    for s in ne.SPECIALS:
        ids = tok.encode(s)
        assert not any(256 <= i < ne.FIRST_MERGE_ID for i in ids)   # ordinary text never makes a special
        assert tok.decode(ids) == s
        assert tok.decode([tok.special(s)]) == s


def test_decode_invalid_utf8_never_raises(tok):
    assert tok.decode([0xFF, 0xFE, ord("a")]) == "\ufffd\ufffda"
    assert tok.decode(tok.encode("é")[:1]) in ("\ufffd", "é")


def test_cached_encoder_matches_reference(tok):
    rng = np.random.default_rng(0)
    words = ["the", " the", "and", " king", "'s", " thou", "!", "\n", "  ", "é", "🎉", "42", "lord", "ing"]
    for _ in range(5):
        text = "".join(rng.choice(words, size=400))
        tok.cache.clear()
        first = tok.encode(text)
        assert first == reference_encode(tok, text)
        assert tok.encode(text) == first                  # again, now from the cache
    shakespeare = open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[200_000:230_000]
    assert tok.encode(shakespeare) == reference_encode(tok, shakespeare)


def test_ids_in_the_surrogate_range_encode():
    # ids 0xD800-0xDFFF, which a vocabulary of up to 65,536 reaches (the uint16 token
    # cache), encode and decode like any other (an encoder that held ids as the
    # characters of a str would meet surrogates there)
    k = 0xD900 - ne.FIRST_MERGE_ID                                 # the merge whose id is 0xD900
    others = [(a, b) for a in range(1, 256) for b in range(1, 256) if (a, b) != (ord("a"), ord("b"))]
    tok = ne.Tokenizer(others[:k] + [(ord("a"), ord("b"))])
    assert tok.encode("ab\nab") == [0xD900, 10, 0xD900] and tok.decode([0xD900, 10, 0xD900]) == "ab\nab"


def test_tokenizer_json_round_trip(tok):
    tok2 = ne.read_tokenizer(tok.to_json())
    assert tok2.merges == tok.merges and tok2.vocab == tok.vocab


def test_tokenize_files_streams_every_file(tmp_path, tok):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file\n" * 500 + "no newline at the end", encoding="utf-8")
    b.write_text("second 🎉 file\n" * 300, encoding="utf-8")
    parts = []
    n = ne.tokenize_files([str(a), str(b)], tok, parts.append, progress=False)
    ids = np.concatenate(parts)
    assert ids.dtype == np.uint16 and n == len(ids)
    eot = tok.special("<|endoftext|>")
    assert tok.decode(ids.tolist()) == a.read_text() + "<|endoftext|>" + b.read_text() + "<|endoftext|>"
    assert list(ids).count(eot) == 2


# -----------------------------------------------------------------------------
# layers

def naive_attention(q, k, v):
    """one query head at a time, explicit loops over positions: the definition"""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    y = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            for i in range(T):
                s = np.array([q[b, i, h] @ k[b, j, h // G] / math.sqrt(D) for j in range(i + 1)])
                p = np.exp(s - s.max())
                p /= p.sum()
                y[b, i, h] = sum(p[j] * v[b, j, h // G] for j in range(i + 1))
    return y


def test_attention_matches_naive_loop():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 9, 6, 4)), rng.normal(size=(2, 9, 2, 4)), rng.normal(size=(2, 9, 2, 4))
    y, _ = ne.attention_forward(q, k, v)
    np.testing.assert_allclose(y, naive_attention(q, k, v), rtol=1e-12, atol=1e-12)


def test_gqa_with_all_heads_is_multi_head_attention():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(2, 7, 4, 8)), rng.normal(size=(2, 7, 4, 8)), rng.normal(size=(2, 7, 4, 8))
    y, _ = ne.attention_forward(q, k, v)
    # plain multi-head attention, head by head
    for h in range(4):
        s = q[:, :, h] @ k[:, :, h].transpose(0, 2, 1) / math.sqrt(8)
        s[:, np.triu(np.ones((7, 7), bool), 1)] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(y[:, :, h], p @ v[:, :, h], rtol=1e-12, atol=1e-12)
    # and GQA equals MHA on kv heads repeated by hand
    k2, v2 = k[:, :, :2], v[:, :, :2]
    y_gqa, _ = ne.attention_forward(q, k2, v2)
    y_rep, _ = ne.attention_forward(q, np.repeat(k2, 2, axis=2), np.repeat(v2, 2, axis=2))
    np.testing.assert_allclose(y_gqa, y_rep, rtol=1e-12, atol=1e-12)


def test_rope_offset_equals_slice_of_full_sequence():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 20, 3, 8))
    full, _ = ne.rope_forward(x)
    for p in (0, 1, 7, 13):
        part, _ = ne.rope_forward(x[:, p:p + 5], pos=p)
        np.testing.assert_allclose(part, full[:, p:p + 5], rtol=1e-12, atol=1e-12)
    # rotation keeps the norm of every pair
    np.testing.assert_allclose(np.linalg.norm(full, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)


def test_cross_entropy_ignores_minus_one():
    rng = np.random.default_rng(5)
    logits, targets = rng.normal(size=(6, 10)), np.array([1, -1, 3, -1, 9, 0])
    loss, cache = ne.cross_entropy_forward(logits, targets)
    kept = targets >= 0
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert loss == pytest.approx(-logp[kept, targets[kept]].mean(), rel=1e-12)
    dlogits = ne.cross_entropy_backward(1.0, cache)
    assert not dlogits[~kept].any()


def test_layers_work_in_float32_and_float64():
    for dtype in (np.float32, np.float64):
        x = np.ones((2, 3, 4), dtype)
        assert ne.rmsnorm_forward(x, np.ones(4, dtype))[0].dtype == dtype
        assert ne.rope_forward(x.reshape(2, 3, 1, 4))[0].dtype == dtype
        assert ne.swiglu_forward(x)[0].dtype == dtype


# -----------------------------------------------------------------------------
# model

def test_parameter_counts_of_presets():
    assert ne.num_params(ne.PRESETS["small"]) == 1_053_824
    assert ne.num_params(ne.PRESETS["big"]) == 116_417_280
    assert ne.init_params(ne.PRESETS["small"]).size == 1_053_824
    # num_params counts from the sizes what param_shapes lists, for other head and layer counts too
    for cfg in (*ne.PRESETS.values(), ne.Config(V=300, C=48, Hq=6, Hkv=3, L=3, T=16, F=72, K=2),
                ne.Config(V=261, C=8, Hq=1, Hkv=1, L=1, T=2, F=8, K=1)):
        assert ne.num_params(cfg) == sum(math.prod(shape) for _, shape in ne.param_shapes(cfg))


def test_init_follows_spec():
    cfg = ne.PRESETS["small"]
    params = ne.carve(ne.init_params(cfg), cfg)
    assert np.all(params["layers.0.attn_norm"] == 1) and np.all(params["final_norm"] == 1)
    assert params["tok_emb"].std() == pytest.approx(0.02, rel=0.02)
    assert params["layers.1.wo"].std() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert params["layers.1.w_down"].std() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    # the merged views alias the SPEC tensors
    assert np.shares_memory(params["heads"], params["heads.3"])
    assert np.array_equal(params["layers.2.w_gate_up"][cfg.F:], params["layers.2.w_up"])


def test_gradient_check_passes():
    lines = []
    assert ne.gradient_check(out=lines.append)
    assert lines[-1] == "overall okay: 1"
    assert sum(" OK" in ln for ln in lines) == 19 + 16       # every model tensor and every layer input


def test_check_command_exits_zero():
    r = run_cli("check")
    assert r.returncode == 0, r.stderr.decode()
    assert b"overall okay: 1" in r.stdout


@pytest.mark.parametrize("layer", ["rmsnorm_backward", "attention_backward", "swiglu_backward", "rope_backward",
                                   "linear_backward", "mtp_heads_backward"])
def test_check_fails_on_a_wrong_backward(layer):
    # patch one backward to be slightly wrong: the check must notice and exit non-zero
    code = f"""
import sys, nanoeuler as ne
orig = ne.{layer}
def wrong(*a, **k):
    out = orig(*a, **k)
    if isinstance(out, tuple):
        return (out[0] * 1.001,) + out[1:]
    return out * 1.001
ne.{layer} = wrong
ne.main(["check"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=300)
    assert r.returncode == 1
    assert b"NOT OK" in r.stdout and b"overall okay: 0" in r.stdout


def test_micro_batches_add_up_to_the_batch():
    cfg = TINY
    flat, params = random_model(cfg, std=0.1)
    rng = np.random.default_rng(6)
    idx, targets = ne.split_rows(rng.integers(0, cfg.V, size=(5, cfg.T + cfg.K)), cfg.T, cfg.K)
    targets = targets.copy()
    targets[0, :4] = -1                                     # uneven masks across parts
    whole = [np.zeros_like(flat)]
    loss1, ce1 = ne.loss_and_grads(flat, cfg, idx, targets, whole)
    parts = [np.zeros_like(flat) for _ in range(3)]
    loss3, ce3 = ne.loss_and_grads(flat, cfg, idx, targets, parts)
    assert loss3 == pytest.approx(loss1, rel=1e-12)
    np.testing.assert_allclose(ce3, ce1, rtol=1e-12)
    np.testing.assert_allclose(parts[0], whole[0], rtol=1e-9, atol=1e-14)
    # 5 micro-batches on 2 buffers (threads): buffer 0 adds parts 0, 2, 4 and buffer 1 parts
    # 1, 3; the same sums, and the same bits on a pool as one after another
    runs = []
    with ThreadPoolExecutor(2) as threads:
        two = [np.zeros_like(flat) for _ in range(2)]
        for pool in (None, threads, threads):                      # the same buffers: each run starts from sums
            runs.append((ne.loss_and_grads(flat, cfg, idx, targets, two, pool, parts=5), two[0].copy()))
    (loss5, ce5), grads5 = runs[0]
    assert loss5 == pytest.approx(loss1, rel=1e-12)
    np.testing.assert_allclose(ce5, ce1, rtol=1e-12)
    np.testing.assert_allclose(grads5, whole[0], rtol=1e-9, atol=1e-14)
    for (loss, ce), grads in runs[1:]:
        assert loss == loss5 and np.array_equal(ce, ce5) and np.array_equal(grads, grads5)
    by_part = [np.zeros_like(flat) for _ in range(5)]                 # buffer i > 0 keeps part i's alone
    ne.loss_and_grads(flat, cfg, idx, targets, by_part)
    np.testing.assert_allclose(two[1], by_part[1] + by_part[3], rtol=1e-9, atol=1e-14)   # buffer 1: parts 1, 3
    # more buffers than rows: the buffers no part used hold whatever they held, and stay out of the sum
    spare = [np.full_like(flat, np.nan) for _ in range(8)]
    loss8, _ = ne.loss_and_grads(flat, cfg, idx, targets, spare)
    assert loss8 == pytest.approx(loss1, rel=1e-12)
    np.testing.assert_allclose(spare[0], whole[0], rtol=1e-9, atol=1e-14)


def test_decoding_forward_equals_the_training_forward():
    # model_forward with a KV cache, fed in three pieces (prefill, 1 token, 3
    # tokens), must give the logits of the whole sequence through the layers the
    # gradient check proves, here called one by one without a cache
    cfg = TINY
    _, params = random_model(cfg)
    ids = np.random.default_rng(3).integers(0, cfg.V, (1, 10))
    x = params["tok_emb"][ids]
    for l in range(cfg.L):
        x, _ = ne.block_forward(x, ne.layer_params(params, l), cfg)
    ref = ne.rmsnorm_forward(x, params["final_norm"])[0] @ params["heads.0"].T
    kv = ne.new_kv_cache(cfg, 1, np.float64)
    got = [ne.model_forward(params, cfg, ids[:, a:b], pos=a, kv=kv)[0] for a, b in ((0, 6), (6, 7), (7, 10))]
    np.testing.assert_allclose(np.concatenate(got, 1), ref, rtol=1e-12, atol=1e-12)


def naive_greedy(params, cfg, prompt, n):
    """re-runs the whole sequence for every new token: no cache"""
    ids = list(prompt)
    for _ in range(n):
        x = np.array([ids[-cfg.T:]])
        logits, _ = ne.model_forward(params, cfg, x)
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[len(prompt):]


def test_kv_cache_generation_equals_full_recompute():
    cfg = TINY
    _, params = random_model(cfg)
    prompt = [5, 17, 42, 3]
    cached = list(ne.generate(params, cfg, prompt, cfg.T - len(prompt) - 1, temperature=0))
    assert cached == naive_greedy(params, cfg, prompt, cfg.T - len(prompt) - 1)


def test_speculative_greedy_equals_plain_greedy():
    # A model whose next token depends mostly on the current one: blocks add
    # only a little noise, head 0 maps token t to f(t) for a permutation f, and
    # head k predicts f^(k+1)(t), so the guesses are usually right. Head 2 is
    # wrong for a third of the tokens, so the reject path runs too.
    cfg = ne.Config(V=24, C=32, Hq=4, Hkv=2, L=2, T=20, F=48, K=4)
    rng = np.random.default_rng(7)
    flat = rng.normal(0, 0.01, ne.num_params(cfg))
    params = ne.carve(flat, cfg)
    for name, shape in ne.param_shapes(cfg):
        if len(shape) == 1:
            params[name][...] = 1.0
    params["tok_emb"][...] = np.eye(cfg.V, cfg.C)
    f = rng.permutation(cfg.V)
    nxt = np.arange(cfg.V)
    for k in range(cfg.K):
        nxt = f[nxt]                                        # f^(k+1)
        params[f"heads.{k}"][...] = 0
        params[f"heads.{k}"][nxt, np.arange(cfg.V)] = 30.0
    params["heads.2"][:, : cfg.V // 3] = rng.normal(0, 30.0, (cfg.V, cfg.V // 3))
    for prompt in ([1], [3, 5, 7], [i % cfg.V for i in range(cfg.T + 5)]):
        plain = list(ne.generate(params, cfg, prompt, 60, temperature=0))
        for drafts in (None, 1, 2):
            stats = {}
            spec = list(ne.generate(params, cfg, prompt, 60, temperature=0, speculative=True, stats=stats,
                                    drafts=drafts))
            assert spec == plain                            # across two window slides, too
            assert 1.3 < stats["tokens"] / stats["steps"] <= 1 + (drafts or cfg.K - 1)
            assert stats["tokens"] == 60                    # the last pass, cut at 60, counts too


def test_generation_counts_every_pass_even_the_last():
    # plain decoding: one pass per token, counted by the time the token is yielded
    # (chat stops reading at <|end|>, before generate would go on)
    _, params = random_model(TINY)
    for n in (1, 5):
        stats = {}
        tokens = ne.generate(params, TINY, [5, 17], n, temperature=0, stats=stats)
        next(tokens)
        assert stats == {"steps": 1, "tokens": 1}
        list(tokens)
        assert stats == {"steps": n, "tokens": n}


def test_a_reply_cut_inside_a_character_ends_with_its_replacement():
    # the reply's last token is the first byte of a 3-byte character (0xE2), then <|end|>:
    # the decoder holds the byte back, and the end of the reply flushes it as U+FFFD
    tok = ne.Tokenizer()
    args = ne.build_parser().parse_args(["chat", "--model", "m"])
    out, reply = io.StringIO(), []
    ne.chat_reply(None, None, tok, [], args, out, reply, gen=lambda *a, **kw: iter([0xE2, tok.special("<|end|>")]))
    assert reply == [0xE2] and out.getvalue() == "\ufffd\n"


def test_bench_times_generation_down_to_one_new_token(capsys):
    # one new token comes from the prompt's pass alone: 1.00 tokens per pass
    cfg = ne.Config(V=260, C=16, Hq=2, Hkv=1, L=1, T=16, F=32, K=3)
    for n in (1, 9):
        ne.bench_generation(cfg, ne.init_params(cfg), ne.Tokenizer(), "tiny", n)
        lines = capsys.readouterr().out.splitlines()
        assert f"greedy, {n} new tokens" in lines[1] and len(lines) == 5      # plain, 2 drafts, 1 draft
        assert [ln.split()[0:2] for ln in lines[2:]] == [["plain", "KV"], ["speculative,", "2"], ["speculative,", "1"]]
        assert all("tokens per pass" in ln for ln in lines[3:])
        assert n > 1 or all("1.00 tokens per pass" in ln for ln in lines[3:])


def test_generation_slides_past_the_context():
    cfg = TINY
    _, params = random_model(cfg)
    out = list(ne.generate(params, cfg, list(range(30)), 3 * cfg.T, temperature=0.9, seed=1))
    assert len(out) == 3 * cfg.T and all(0 <= t < cfg.V for t in out)
    again = list(ne.generate(params, cfg, list(range(30)), 3 * cfg.T, temperature=0.9, seed=1))
    assert out == again                                     # a seed makes sampling repeatable


# -----------------------------------------------------------------------------
# checkpoints

@pytest.fixture
def saved_model(tmp_path, tok):
    cfg = ne.Config(V=tok.vocab_size, C=16, Hq=4, Hkv=2, L=2, T=12, F=48, K=3)
    flat = ne.init_params(cfg, seed=3)
    path = str(tmp_path / "model.safetensors")
    ne.save_model(path, cfg, flat, tok)
    return path, cfg, flat


def test_checkpoint_round_trip(saved_model, tok):
    path, cfg, flat = saved_model
    cfg2, flat2, tok2 = ne.load_model(path)
    assert cfg2 == cfg and tok2.merges == tok.merges
    assert flat2.tobytes() == flat.tobytes()
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert n % 8 == 0
    assert list(header)[1:] == [name for name, _ in ne.param_shapes(cfg)]
    assert header["__metadata__"]["format"] == "nanoeuler" and header["__metadata__"]["version"] == "1"


def test_safetensors_library_reads_our_files(saved_model):
    safetensors = pytest.importorskip("safetensors.numpy")
    path, cfg, flat = saved_model
    tensors = safetensors.load_file(path)
    params = ne.carve(flat, cfg)
    assert set(tensors) == {name for name, _ in ne.param_shapes(cfg)}
    for name, _ in ne.param_shapes(cfg):
        assert tensors[name].dtype == np.float32
        assert np.array_equal(tensors[name], params[name])
    # and we read a file the library wrote
    from safetensors import safe_open
    with safe_open(path, "np") as f:
        meta = f.metadata()
    out = path + ".lib.safetensors"
    safetensors.save_file({name: tensors[name] for name, _ in ne.param_shapes(cfg)}, out, metadata=meta)
    cfg2, flat2, _ = ne.load_model(out)
    assert flat2.tobytes() == flat.tobytes()


def test_bad_files_are_refused_with_one_sentence(saved_model, tmp_path):
    path, cfg, flat = saved_model
    raw = open(path, "rb").read()
    cases = {"missing.safetensors": None, "garbage.safetensors": b"this is not a model at all",
             "truncated.safetensors": raw[:len(raw) - 100], "empty.safetensors": b""}
    for name, data in cases.items():
        p = str(tmp_path / name)
        if data is not None:
            open(p, "wb").write(data)
        with pytest.raises(ne.NanoEulerError) as e:
            ne.load_model(p)
        assert name in str(e.value) and "\n" not in str(e.value)
    # tensors that do not match the config
    tensors, meta = ne.read_safetensors(path)
    meta = dict(meta, config=json.dumps(dict(json.loads(meta["config"]), C=32)))
    bad = str(tmp_path / "mismatch.safetensors")
    ne.write_safetensors(bad, list(tensors.items()), meta)
    with pytest.raises(ne.NanoEulerError, match="do not match its config"):
        ne.load_model(bad)
    # another format
    other = str(tmp_path / "other.safetensors")
    ne.write_safetensors(other, list(tensors.items()), dict(meta, format="gpt2"))
    with pytest.raises(ne.NanoEulerError, match="not a NanoEuler"):
        ne.load_model(other)


def test_cli_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 64)
    r = run_cli("sample", "--model", str(bad), "--prompt", "hi")
    assert r.returncode == 2
    err = r.stderr.decode().strip()
    assert err.count("\n") == 0 and "bad.safetensors" in err and "Traceback" not in err


def test_atomic_write_leaves_no_partial_file(tmp_path):
    path = str(tmp_path / "x.bin")
    ne.atomic_write(path, b"old")

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        ne.atomic_write(path, fail)
    assert open(path, "rb").read() == b"old"


# -----------------------------------------------------------------------------
# training

def train_args(out, data, *extra):
    return ["train", "--data", data, "--out", str(out), "--vocab-size", "300", "--batch", "4",
            "--eval-every", "4", "--eval-batches", "2", "--save-every", "4", "--warmup", "2", *extra]


def test_empty_and_non_utf8_corpus_are_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_cli(*train_args(tmp_path / "o", str(empty)))
    assert r.returncode == 2 and b"empty.txt" in r.stderr and b"Traceback" not in r.stderr
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café au lait\n".encode("latin-1") * 100)
    r = run_cli(*train_args(tmp_path / "o", str(latin)))
    assert r.returncode == 2 and b"latin1.txt is not UTF-8" in r.stderr
    r = run_cli(*train_args(tmp_path / "o", str(tmp_path / "nope.txt")))
    assert r.returncode == 2 and b"nope.txt does not exist" in r.stderr


def test_damaged_token_cache_is_rebuilt(tmp_path):
    data = small_corpus(tmp_path)
    tok, tokens = ne.prepare_data(data, 300, str(tmp_path / "run"), progress=False)
    path = next(p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tokens_"))
    path.write_bytes(b"\x00" * 64 + path.read_bytes()[64:])          # a broken header
    tok2, tokens2 = ne.prepare_data(data, 300, str(tmp_path / "run"), progress=False)
    assert np.array_equal(tokens, tokens2)


def test_training_lowers_the_loss(tmp_path, capsys):
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "run", data, "--steps", "24", "--lr", "3e-3"))
    rows = open(tmp_path / "run" / "log.csv").read().splitlines()
    losses = [float(r.split(",")[1]) for r in rows[1:]]
    assert len(losses) == 24
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.3
    assert os.path.exists(tmp_path / "run" / "best.safetensors")
    out = capsys.readouterr().out
    assert "step 24/24 | loss" in out and "tok/s" in out and "val  24/24" in out and "bpb" in out


def fake_clock(monkeypatch, now, costs):
    """ne.now reads now[0], which each patched function moves by its cost: {module or class:
    {name: seconds}}. A checkpoint written in the background (not on the main thread)
    moves it not at all: it runs beside the steps"""
    def taking(seconds, work):
        def timed(*args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                now[0] += seconds
            return work(*args, **kwargs)
        return timed
    for owner, names in costs.items():
        for name, seconds in names.items():
            monkeypatch.setattr(owner, name, taking(seconds, getattr(owner, name)))
    monkeypatch.setattr(ne, "now", lambda: now[0])


def plan_costs():
    """the --minutes tests' clock costs: reading the corpus 1 s, a step 1/16 s, an evaluation 2 s,
    a checkpoint's copy 0.25 s and its write 0.5 s (fake_clock's form)"""
    return {ne: {"prepare_data": 1.0}, ne.RunFolder: {"write_pair": 0.5},
            ne.CPUEngine: {"step": 1 / 16, "evaluate": 2.0, "host_weights": 0.25}}


def test_minutes_plans_the_run_once_and_resume_keeps_the_plan(tmp_path, capsys, monkeypatch):
    # a fake clock that moves only when the program works (reading the corpus 1 s, a step
    # 1/16 s, an evaluation 2 s, a checkpoint's copy 0.25 s and its write 0.5 s), so the
    # plan does not depend on how fast this machine is today
    now = [0.0]
    fake_clock(monkeypatch, now, plan_costs())
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "run", data, "--minutes", "0.2", "--warmup", "25", "--stop-after", "30",
                       "--eval-every", "1000", "--save-every", "1000"))
    out = capsys.readouterr().out
    # by hand: the corpus, 20 steps, an evaluation and a checkpoint spent 1 + 20/16 + 2 + 0.75
    # of the 12 s; the last step's evaluation and checkpoint will take 2.75 more, leaving
    # 4.25 s for 68 steps of 1/16 s
    planned = 20 + 68
    assert (f"plan | {planned} steps in 0.2 minutes (62.5 ms a step, 2.0 s an evaluation every 1000, "
            "a checkpoint every 1000 holding training 0.25 s, written in 0.5 s)") in out
    assert planned > 30 and re.search(rf"step +21/{planned} \|", out)
    # before the plan the total is unknown: "?" and no time left, the plan's evaluation too
    assert re.search(r"^step 20/\? \|.* tok/s$", out, re.M) and "val  20/? |" in out and "/1000" not in out
    cfg, flat, tok, m, v, state = ne.RunFolder(str(tmp_path / "run")).read_pair(30)
    assert state["planned_steps"] == planned
    # resumed with other --minutes: the plan stands, and the run ends on it
    ne.main(train_args(tmp_path / "run", data, "--minutes", "5", "--resume", "--eval-every", "1000"))
    out = capsys.readouterr().out
    assert "plan |" not in out and f"step {planned}/{planned} |" in out
    assert ne.RunFolder(str(tmp_path / "run")).latest() == planned


def test_minutes_keeps_a_plan_made_at_the_sessions_last_step(tmp_path, capsys, monkeypatch):
    # the clock of the test above, and --stop-after 20: this session ends at the plan's step,
    # whose checkpoint is written (and timed) before the plan. The plan it printed is the
    # run's: --resume continues to it (as after --stop-after 30), makes no other, and a
    # resume once it is done says so, as for a --steps run that made all its steps
    now = [0.0]
    fake_clock(monkeypatch, now, plan_costs())
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "run", data, "--minutes", "0.2", "--warmup", "25", "--stop-after", "20",
                       "--eval-every", "1000", "--save-every", "1000"))
    out = capsys.readouterr().out
    assert "plan | 88 steps in 0.2 minutes" in out and "done: 20 steps" in out
    cfg, flat, tok, m, v, state = ne.RunFolder(str(tmp_path / "run")).read_pair(20)
    assert state["planned_steps"] == 88
    ne.main(train_args(tmp_path / "run", data, "--minutes", "5", "--resume", "--warmup", "25", "--eval-every", "1000"))
    out = capsys.readouterr().out
    assert "steps  | 88 (planned for --minutes), warmup 25" in out
    assert "plan |" not in out and "step 21/88 |" in out and "step 88/88 |" in out and "step 89" not in out
    ne.main(train_args(tmp_path / "run", data, "--minutes", "5", "--resume"))
    assert (f"the run in {tmp_path / 'run'} is already complete: step 88 of 88, last checkpoint "
            f"{tmp_path / 'run' / 'model_000088.safetensors'}; nothing to do") in capsys.readouterr().out
    ne.main(train_args(tmp_path / "run", data, "--steps", "200", "--resume"))   # a new --steps moves no plan
    assert "already complete: step 88 of 88" in capsys.readouterr().out


def test_minutes_says_when_its_plan_ends_in_the_warmup(tmp_path, capsys, monkeypatch):
    # the same clock plans 88 steps; with a warmup of 100 the whole run is warmup, as a
    # --steps 88 run would be: the plan says so, and no line promises a cosine it never makes
    now = [0.0]
    fake_clock(monkeypatch, now, plan_costs())
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "run", data, "--minutes", "0.2", "--warmup", "100", "--stop-after", "30",
                       "--eval-every", "1000", "--save-every", "1000"))
    out = capsys.readouterr().out
    # before the plan nobody knows: the cosine is conditional
    assert ("steps  | as many as fit in 0.2 minutes (planned after 20 steps), warmup 100, lr 0.003 cosine to "
            "0.0003 if the plan outlasts the warmup, weight decay") in out
    # by hand: the last step's lr is 3e-3 * 88 / 100
    assert "plan | 88 steps in 0.2 minutes" in out
    assert ("plan | note: all 88 steps are in the warmup (100 steps): the lr peaks at 0.00264, with no cosine; "
            "a --warmup under 88 gives it one") in out
    ne.main(train_args(tmp_path / "run", data, "--minutes", "0.2", "--resume", "--warmup", "100",
                       "--eval-every", "1000"))
    out = capsys.readouterr().out
    assert ("steps  | 88 (planned for --minutes, all in the warmup), warmup 100, lr peaks at 0.00264, weight "
            "decay") in out and "cosine" not in out
    assert re.search(r"^step 88/88 \| loss [0-9.]+ \| lr 2\.64e-03 \|", out, re.M)


def test_minutes_is_the_whole_run_within_five_percent(tmp_path, capsys, monkeypatch):
    # the same fake clock, and a run left to end by itself: from main's start to its
    # last line, the corpus, evaluations, checkpoints and the summary included. A write in
    # the background (step 40's) takes none of the loop's time: its copy does
    now = [0.0]
    fake_clock(monkeypatch, now, {ne: {"prepare_data": 3.0}, ne.RunFolder: {"write_pair": 1.5},
                                  ne.CPUEngine: {"step": 0.25, "evaluate": 4.0, "host_weights": 0.5}})
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "run", data, "--minutes", "0.5", "--warmup", "25", "--eval-every", "20",
                       "--save-every", "20"))
    # by hand: 3 + 20 * 0.25 + 4 + 0.5 + 1.5 = 14 s by the plan at step 20 (whose save is
    # written before going on); steps 21..42 then take 22 * 0.25 = 5.5 s, evaluations at 40
    # and 42 8 s, the copies of both checkpoints 1 s, and the last one's write 1.5 s
    assert now[0] == 30.0
    out = capsys.readouterr().out
    assert "plan | 42 steps in 0.5 minutes" in out
    assert re.search(r"saved  \S+model_000040.safetensors \(\+ state\) in [0-9.]+ s, training held 0.50 s", out)


def test_resume_is_bit_identical(tmp_path):
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "straight", data, "--steps", "10"))
    ne.main(train_args(tmp_path / "split", data, "--steps", "10", "--stop-after", "5"))
    assert ne.RunFolder(str(tmp_path / "split")).latest() == 5
    ne.main(train_args(tmp_path / "split", data, "--steps", "10", "--resume"))
    a = open(tmp_path / "straight" / "model_000010.safetensors", "rb").read()
    b = open(tmp_path / "split" / "model_000010.safetensors", "rb").read()
    assert a == b
    ta, ma = ne.read_safetensors(str(tmp_path / "straight" / "state_000010.safetensors"))
    tb, mb = ne.read_safetensors(str(tmp_path / "split" / "state_000010.safetensors"))
    assert ta["m"].tobytes() == tb["m"].tobytes() and ta["v"].tobytes() == tb["v"].tobytes()
    sa, sb = json.loads(ma["state"]), json.loads(mb["state"])
    assert sa["rng"] == sb["rng"] and sa["step"] == sb["step"] == 10


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    data = small_corpus(tmp_path)
    r = run_cli(*train_args(tmp_path / "run", data, "--steps", "40", "--lr", "1e4", "--clip", "-1",
                            "--warmup", "1", "--save-every", "1"))
    assert r.returncode == 2, r.stdout.decode()[-2000:]
    err = r.stderr.decode()
    assert "training stopped" in err and "Traceback" not in err
    last = ne.RunFolder(str(tmp_path / "run")).latest()
    assert last is not None
    cfg, flat, _ = ne.load_model(str(tmp_path / "run" / f"model_{last:06d}.safetensors"))
    assert np.isfinite(flat).all()


def test_ctrl_c_saves_a_checkpoint(tmp_path):
    data = small_corpus(tmp_path)
    cmd = [sys.executable, "-u", os.path.join(HERE, "nanoeuler.py"),
           *train_args(tmp_path / "run", data, "--steps", "100000", "--save-every", "100000")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE, preexec_fn=default_signals)
    for line in proc.stdout:
        if line.startswith(b"step") and b"/100000" in line and int(line.split()[1].split(b"/")[0]) >= 3:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()                # 128 + SIGINT: stopped, saved
    step = ne.RunFolder(str(tmp_path / "run")).latest()
    assert step is not None and step >= 3
    assert f"model_{step:06d}.safetensors".encode() in out


def test_prompt_longer_than_the_context_keeps_its_end(tmp_path):
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "run", data, "--steps", "2", "--save-every", "2"))
    model = str(tmp_path / "run" / "model_000002.safetensors")
    r = run_cli("sample", "--model", model, "--prompt", "to be or not to be " * 100, "--max-new-tokens", "5",
                "--speculative")
    assert r.returncode == 0, r.stderr.decode()
    assert b"longer than the context" in r.stderr and b"keeping its last" in r.stderr


def test_sample_command_is_greedy_and_deterministic(tmp_path):
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "run", data, "--steps", "4"))
    model = str(tmp_path / "run" / "model_000004.safetensors")
    a = run_cli("sample", "--model", model, "--prompt", "KING:", "--temperature", "0", "--max-new-tokens", "20")
    b = run_cli("sample", "--model", model, "--prompt", "KING:", "--temperature", "0", "--max-new-tokens", "20")
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.startswith(b"KING:")


# -----------------------------------------------------------------------------
# SFT and chat

def test_sft_masks_everything_but_the_response(tok):
    cfg = ne.Config(V=tok.vocab_size, C=16, Hq=4, Hkv=2, L=1, T=40, F=48, K=2)
    rows, mask = ne.sft_rows(tok, [("Say hi", "hi there")], cfg)
    idx, targets = ne.sft_targets(rows, mask, cfg.T, cfg.K)
    reply = tok.encode("hi there") + [tok.special("<|end|>")]
    kept = targets[0, :, 0][targets[0, :, 0] >= 0].tolist()
    assert kept == reply                                    # head 0 learns exactly the reply
    prompt_len = len(tok.encode("Say hi")) + 2
    assert (targets[0, :prompt_len - 1, 0] == -1).all()
    assert (targets[0, prompt_len - 1 + len(reply):, :] == -1).all()   # padding


def test_sft_cuts_a_long_record_before_encoding_it_and_keeps_its_first_ids(monkeypatch):
    # a tokenizer whose ids can each span a whole part of a piece (128 letters "a" or spaces),
    # so that n ids span as much text as they can
    merges = []
    for byte in (ord("a"), ord(" ")):
        prev = byte
        for _ in range(7):                                  # 2, 4, .. 128 of them
            merges.append((prev, prev))
            prev = ne.FIRST_MERGE_ID + len(merges) - 1
    tok = ne.Tokenizer(merges)
    assert tok.max_piece_bytes == 128 and tok.encode("a" * 300) == [prev - 7] * 2 + tok.encode("a" * 44)
    cfg = ne.Config(V=tok.vocab_size, C=16, Hq=4, Hkv=2, L=1, T=40, F=48, K=2)
    n = cfg.T + cfg.K
    pairs = []
    for s in range(0, 3 * 128, 5):                          # the pieces' ends at every offset of a part
        pairs += [("a" * s + " " * (n * 128 + 300) + "b", "c"), ("a" * (n * 128 + s) + " b", "c"),
                  ("a", " " * (n * 128 - s) + "a" * 500), ("a" * s + " " * (n * 128) + "ab", "c")]
    user, assistant, end = (tok.special(s) for s in ("<|user|>", "<|assistant|>", "<|end|>"))
    want = [([user] + tok.encode(p) + [assistant] + tok.encode(r) + [end])[:n] for p, r in pairs]   # in full
    longest = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: longest.append(len(text)) or encode(text))
    rows, mask = ne.sft_rows(tok, pairs, cfg)
    assert rows.tolist() == want
    assert max(longest) <= (n + 2) * 128 < n * 128 + 300   # cut: the encoder never saw a whole text


def test_instruction_formats(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"instruction": "Add", "input": "1 and 2", "response": "3"}\n'
                  '{"instruction": "Hi", "input": "", "response": "Hello"}\n')
    assert ne.load_instructions(str(jl)) == [("Add\n\n1 and 2", "3"), ("Hi", "Hello")]
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Hi", "input": "", "output": "Hello"}]))
    assert ne.load_instructions(str(alpaca)) == [("Hi", "Hello")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ne.NanoEulerError, match="bad.jsonl"):
        ne.load_instructions(str(bad))


def test_sft_validates_on_eval_batches_of_held_out_examples(tmp_path, monkeypatch, capsys):
    # 200 examples: the last 10 (a 20th) held out; --batch 3 --eval-batches 2 evaluates the first 6
    cfg = ne.Config(V=ne.Tokenizer().vocab_size, C=16, Hq=2, Hkv=1, L=1, T=32, F=48, K=2)
    model, data = str(tmp_path / "m.safetensors"), tmp_path / "d.jsonl"
    ne.save_model(model, cfg, ne.init_params(cfg), ne.Tokenizer())
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(200)))
    seen = {}
    monkeypatch.setattr(ne, "train_loop", lambda *a, **k: seen.setdefault("val", a[5]))
    for extra, rows in ((["--eval-batches", "2"], [3, 3]), ([], [3, 3, 3, 1])):
        seen.clear()
        args = ne.build_parser().parse_args(["sft", "--model", model, "--data", str(data), "--batch", "3",
                                             "--out", str(tmp_path / "o")] + extra)
        args.run = ne.RunFolder(args.out)                  # what run_command hands a command: its run's folder
        ne.cmd_sft(args)
        assert [len(idx) for idx, _ in seen["val"]] == rows
        first = ne.Tokenizer().encode("q190")                  # the held-out examples, in order
        assert seen["val"][0][0][0, 1:1 + len(first)].tolist() == first
    assert "190 train + 10 val examples (the first 6 evaluated)" in capsys.readouterr().out


def test_sft_then_chat_end_to_end(tmp_path):
    data = small_corpus(tmp_path)
    ne.main(train_args(tmp_path / "pre", data, "--steps", "4"))
    model = str(tmp_path / "pre" / "model_000004.safetensors")
    r = run_cli("sft", "--model", model, "--steps", "4", "--batch", "4", "--out", str(tmp_path / "sft"),
                "--eval-every", "4", "--eval-batches", "1", "--save-every", "4")
    assert r.returncode == 0, r.stderr.decode()
    assert b"loss on responses only" in r.stdout
    chat_model = str(tmp_path / "sft" / "model_000004.safetensors")
    stdin = b"hello there\n\n   \n/reset\n\xff\xfe not utf-8 \xc3\n" + b"x" * 2000 + b"\n/quit\nnever read\n"
    r = run_cli("chat", "--model", chat_model, "--max-new-tokens", "8", "--seed", "1", stdin=stdin)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert out.count("bot> ") == 3 and "(history cleared)" in out and out.rstrip().endswith("bye")
    r = run_cli("chat", "--model", chat_model, "--max-new-tokens", "4", stdin=b"hi\n")   # ends with Ctrl-D
    assert r.returncode == 0 and r.stdout.decode().rstrip().endswith("bye")


# -----------------------------------------------------------------------------
# get_data.sh

def test_get_data_strips_gutenberg_boilerplate(tmp_path):
    raw = ("\ufeffThe Project Gutenberg eBook of Test\r\nlicence text\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK\r\nTEST BOOK ***\r\n\r\n"
           "Produced by Someone\r\nand others\r\n\r\nChapter 1\r\nIt was a dark night.   \r\n\r\n"
           "End of the Project Gutenberg EBook of Test\r\n\r\n"
           "            *** END OF THIS PROJECT GUTENBERG EBOOK TEST BOOK ***\r\nmore licence\r\n")
    src, dst = tmp_path / "raw.txt", tmp_path / "clean.txt"
    src.write_bytes(raw.encode("utf-8"))
    r = subprocess.run(["bash", os.path.join(HERE, "get_data.sh"), "strip", str(src), str(dst)],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert dst.read_text(encoding="utf-8") == "Chapter 1\nIt was a dark night.\n"


# -----------------------------------------------------------------------------
# GPU

def have_module(name):
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def gpu_count():
    """how many GPUs the driver sees; 0 without cuda-python, a driver or a GPU"""
    if not have_module("cuda.bindings"):
        return 0
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        return driver.cuDeviceGetCount()[1] if int(err) == 0 else 0
    except Exception:
        return 0


def gpu_available():
    return gpu_count() > 0


needs_nvrtc = pytest.mark.skipif(not have_module("cuda.bindings"), reason="cuda-python is not installed "
                                 "(pip install -r requirements-dev.txt)")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="no NVIDIA GPU and driver on this machine")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["80", "89", "90"])
def test_nvrtc_compiles_every_kernel(arch, tmp_path):
    import nanoeuler_cuda as nc
    cubins = nc.compile_kernels(arch, str(tmp_path))
    assert set(cubins) == set(nc.MODULES)                      # kernels.cu twice: floatX float and bfloat16
    for name, cubin in cubins.items():
        assert cubin[:4] == b"\x7fELF", name                   # a CUBIN is an ELF file
    assert cubins["kernels.cu"] != cubins["kernels.cu bf16"]
    # flash_attn.cu's TMA forward and dk/dv pass: built for sm_90a on 9.0 (H100, H200), left out elsewhere
    assert (b"attention_forward_tma_kernel_64" in cubins["flash_attn.cu"]) == (arch == "90")
    assert (b"attention_backward_dkv_tma_kernel_64" in cubins["flash_attn.cu"]) == (arch == "90")
    for kernel in (b"rmsnorm_backward_kernel", b"residual_rmsnorm_forward_kernel", b"adamw_update_kernel"):
        assert kernel in cubins["kernels.cu"] and kernel in cubins["kernels.cu bf16"]
    again = nc.compile_kernels(arch, str(tmp_path))            # now from the disk cache
    assert again == cubins and len(os.listdir(tmp_path)) == 3
    # NVRTC writes into the buffers it is given: they must not be Python's shared b" "
    assert " ".encode()[0] == 32 and "a b".split() == ["a", "b"]


@needs_nvrtc
def test_a_damaged_cached_cubin_is_compiled_again(tmp_path, monkeypatch, capsys):
    # the driver crashes the process on a damaged CUBIN: each cached file is the CUBIN and the
    # SHA-256 of it, and one cut short or with one byte changed is compiled again
    import nanoeuler_cuda as nc
    compiled = []

    def nvrtc_compile(file, source, arch, defines):
        compiled.append(file)
        return f"CUBIN of {file} {defines} for sm_{arch}".encode() * 10
    monkeypatch.setattr(nc, "nvrtc_compile", nvrtc_compile)
    cubins = nc.compile_kernels("90", str(tmp_path))
    files = sorted(tmp_path.iterdir())
    assert len(compiled) == len(files) == 3
    assert {f.read_bytes() for f in files} == {c + hashlib.sha256(c).digest() for c in cubins.values()}
    assert nc.compile_kernels("90", str(tmp_path)) == cubins and len(compiled) == 3     # from the cache
    files[0].write_bytes(files[0].read_bytes()[:100])
    data = bytearray(files[1].read_bytes())
    data[len(data) // 2] ^= 1
    files[1].write_bytes(bytes(data))
    capsys.readouterr()
    assert nc.compile_kernels("90", str(tmp_path)) == cubins and len(compiled) == 5
    assert {f.read_bytes() for f in files} == {c + hashlib.sha256(c).digest() for c in cubins.values()}
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and all(re.fullmatch(r".+ is damaged; compiling .+ again", ln) for ln in said)
    assert {ln.split(" is damaged")[0] for ln in said} == {str(files[0]), str(files[1])}


@needs_nvrtc
def test_nvrtc_error_names_file_and_line(tmp_path, monkeypatch):
    import nanoeuler_cuda as nc
    with pytest.raises(ne.NanoEulerError, match=r"broken\.cu\(3\): error"):
        nc.nvrtc_compile("broken.cu", "// a kernel\n\nextern \"C\" __global__ void k() { undefined_thing(); }\n",
                         "90")


def test_every_launched_kernel_exists_in_the_sources():
    import re
    src = "".join(open(os.path.join(HERE, f)).read() for f in ("kernels.cu", "flash_attn.cu"))
    defined = set(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([\w, ]+\) )?(\w+)\(', src))
    assert "##" not in src                                      # entry points written out, no names pasted
    import nanoeuler_cuda as nc
    # each of the three passes, in each of the three versions, at every head dim
    attention = {name.format(D=d) for names in nc.ATTENTION_KERNELS.values() for name in names for d in nc.HEAD_DIMS}
    assert len(attention) == 3 * 3 * 3 and nc.HEAD_DIMS == (16, 32, 64) and attention <= defined
    py = open(os.path.join(HERE, "nanoeuler_cuda.py")).read()
    launched = set(re.findall(r'(?:gpu\.launch|decode_launch)\("(\w+)"', py))     # the names written whole
    launched |= set(nc.DECODE_MATVEC_KERNELS.values())
    assert len(launched) > 15 and launched <= defined, launched - defined
    # and the numpy layer of each kernel family exists under the same name
    for family in ("embedding", "rmsnorm", "rope", "swiglu", "attention"):
        assert hasattr(ne, f"{family}_forward") and hasattr(ne, f"{family}_backward")
        assert any(n.startswith(f"{family}_forward_kernel") for n in defined)


def test_bf16_round_is_round_to_nearest_even():
    nc = pytest.importorskip("nanoeuler_cuda")
    one = 1.0
    halfway, above = one + 2.0 ** -8, one + 1.5 * 2.0 ** -8              # bf16 keeps 7 bits after the point
    got = nc.bf16_round(np.array([one, halfway, above, -above, 3 * 2.0 ** -8 + 1], np.float32))
    assert got.tolist() == [1.0, 1.0, 1 + 2.0 ** -7, -(1 + 2.0 ** -7), 1 + 2.0 ** -6]
    x = np.random.default_rng(0).normal(size=10000).astype(np.float32)
    r = nc.bf16_round(x)
    assert np.all(r.view(np.uint32) & 0xFFFF == 0) and np.max(np.abs(r / x - 1)) <= 2.0 ** -8
    assert np.array_equal(nc.from_bf16((r.view(np.uint32) >> 16).astype(np.uint16)), r)


def test_flops_per_token_of_big_model():
    nc = pytest.importorskip("nanoeuler_cuda")
    cfg = ne.PRESETS["big"]
    matmul_params = 116_417_280 - 4096 * 768 - 33 * 768
    assert nc.flops_per_token(cfg) == 6 * matmul_params + 6 * 16 * 12 * 64 * 512


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
@needs_nvrtc
def test_gpu_engine_without_a_gpu_says_so():
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler_cuda.py"), "check"], capture_output=True,
                       timeout=120)
    assert r.returncode == 2
    err = r.stderr.decode().strip()
    assert "nanoeuler.py runs the same model on the CPU" in err and "Traceback" not in err


@needs_gpu
def test_gpu_check_passes():
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler_cuda.py"), "check"], capture_output=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout.decode()[-3000:]
    assert b"overall okay: 1" in r.stdout


# -----------------------------------------------------------------------------
# several GPUs: what runs without them (row shards, gradient parts, the launcher)

def test_shard_rows_cover_the_batch_once():
    nc = pytest.importorskip("nanoeuler_cuda")
    for B in range(1, 20):
        for world in range(1, min(B, 8) + 1):
            shards = [nc.shard_rows(B, world, r) for r in range(world)]
            assert [i for s in shards for i in range(B)[s]] == list(range(B))
            assert max(s.stop - s.start for s in shards) - min(s.stop - s.start for s in shards) <= 1
    with pytest.raises(ne.NanoEulerError, match="raise --batch"):
        nc.shard_rows(3, 4, 0)


def test_row_shards_with_whole_batch_counts_sum_to_the_whole_gradient():
    # the principle of the data-parallel engine, checked in float64 on the CPU model:
    # each rank divides by the whole batch's target counts, so losses and gradients add up
    nc = pytest.importorskip("nanoeuler_cuda")
    cfg = ne.Config(V=64, C=32, Hq=2, Hkv=1, L=2, T=16, F=88, K=3)
    rng = np.random.default_rng(0)
    flat = ne.init_params(cfg).astype(np.float64)
    idx, targets = ne.split_rows(rng.integers(0, cfg.V, (5, cfg.T + cfg.K)), cfg.T, cfg.K)
    targets = targets.copy()
    targets[1, :7] = -1                                        # masked targets, as SFT has
    counts = (targets >= 0).sum(axis=(0, 1))
    loss, ce, cache = ne.model_forward(ne.carve(flat, cfg), cfg, idx, targets)
    whole = np.zeros_like(flat)
    ne.model_backward(ne.carve(whole, cfg), cache)
    for world in (2, 3):
        summed, ce_sum = np.zeros_like(flat), 0
        for r in range(world):
            rows = nc.shard_rows(len(idx), world, r)
            _, ce_r, cache = ne.model_forward(ne.carve(flat, cfg), cfg, idx[rows], targets[rows], counts)
            ne.model_backward(ne.carve(summed, cfg), cache)
            ce_sum = ce_sum + ce_r
        assert np.allclose(ce_sum, ce, rtol=1e-13, atol=0)
        assert np.allclose(summed, whole, rtol=1e-10, atol=1e-15)


def test_grad_buckets_cover_the_gradient_in_backward_order():
    nc = pytest.importorskip("nanoeuler_cuda")
    for cfg in (ne.PRESETS["small"], ne.PRESETS["big"]):
        buckets = nc.grad_buckets(cfg)
        spans = list(buckets.values())
        assert list(buckets) == ["heads", *reversed(range(cfg.L)), "tok_emb"]
        assert spans[0][1] == ne.num_params(cfg) and spans[-1][0] == 0
        assert all(a[0] == b[1] for a, b in zip(spans, spans[1:]))          # contiguous, no gaps
        offset = 0
        for name, shape in ne.param_shapes(cfg):                             # each tensor in its part
            part = name.split(".")[1] if name.startswith("layers.") else name
            lo, hi = buckets[int(part)] if part.isdigit() else buckets["tok_emb" if part == "tok_emb" else "heads"]
            assert lo <= offset and offset + math.prod(shape) <= hi, name
            offset += math.prod(shape)


RANK_SCRIPT = """
import os, sys, time
rank, world = int(os.environ["NANOEULER_RANK"]), int(os.environ["NANOEULER_WORLD"])
assert os.environ["NCCL_NVLS_ENABLE"] == "0" and len(os.environ["NANOEULER_NCCL_ID"]) == 256
open(os.path.join(sys.argv[1], f"rank{rank}"), "w").write(f"{rank} of {world}")
if sys.argv[2:] == ["wait"]:                  # rank 0 records the signal it is sent, as its stop would
    import signal
    def got(signum, frame):
        open(os.path.join(sys.argv[1], "signal"), "w").write(str(signum))
        sys.exit(128 + signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, got)
    open(os.path.join(sys.argv[1], f"ready{rank}"), "w").close()
    time.sleep(300)                           # until the signal: the cap only ends a broken test
    sys.exit(9)
fail = {int(r): int(code) for r, code in (a.split("=") for a in sys.argv[2:])}
if rank in fail:
    print(f"rank {rank} fails", file=sys.stderr)
    sys.exit(fail[rank])
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
time.sleep(0 if not fail else 60)             # as NCCL would wait for the rank that failed: for ever
open(os.path.join(sys.argv[1], f"woke{rank}"), "w").close()
"""


@pytest.fixture
def fake_ranks(tmp_path, monkeypatch):
    nc = pytest.importorskip("nanoeuler_cuda")
    monkeypatch.setattr(nc, "count_gpus", lambda: 3)
    monkeypatch.setattr(nc, "nccl_unique_id", lambda: "ab" * 128)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    return lambda *fail, world=3: nc.launch_ranks([str(tmp_path), *fail], world, program=str(script))


def test_launcher_starts_one_process_per_gpu(fake_ranks, tmp_path):
    assert fake_ranks() is None
    assert sorted(p.read_text() for p in tmp_path.glob("rank*") if p.suffix == "") == \
        ["0 of 3", "1 of 3", "2 of 3"]


def test_launcher_stops_every_rank_when_one_fails(fake_ranks, tmp_path):
    with pytest.raises(ne.NanoEulerError, match="GPU 2's process stopped with exit code 3"):
        fake_ranks("2=3")                                      # ranks 0 and 1 would wait for ever
    for r in (0, 1):                                           # stopped (not waited for) and gone
        assert not (tmp_path / f"woke{r}").exists()
        if (tmp_path / f"pid{r}").exists():                    # (a rank may be stopped before it wrote it)
            with pytest.raises(ProcessLookupError):
                os.kill(int((tmp_path / f"pid{r}").read_text()), 0)


def test_launcher_exits_with_rank_0s_code(fake_ranks):
    with pytest.raises(SystemExit) as e:
        fake_ranks("0=4")
    assert e.value.code == 4


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_launcher_passes_ctrl_c_sigterm_and_sighup_to_rank_0(fake_ranks, tmp_path, sig):
    # rank 0 saves and stops the others; the launcher must not die first (SIGHUP: the
    # terminal closed) and leave the ranks, in sessions of their own, running without it
    signum = getattr(signal, sig)

    def send():                                              # once the ranks run and the launcher listens
        while not done.is_set() and not (all((tmp_path / f"ready{r}").exists() for r in range(3)) and
                                         signal.getsignal(signum) is not not_passed_on):
            time.sleep(0.05)
        if not done.is_set():                                # (the ranks ended first: no signal, the test fails)
            os.kill(os.getpid(), signum)
    def not_passed_on(signum, frame):                        # rather than this test process dying of it
        raise AssertionError(f"{sig} reached the launcher's caller instead of rank 0")
    before = signal.signal(signum, not_passed_on)
    done = threading.Event()
    sender = threading.Thread(target=send)
    sender.start()
    try:
        with pytest.raises(SystemExit) as e:
            fake_ranks("wait")
    finally:
        done.set()
        sender.join()
        signal.signal(signum, before)
    assert (tmp_path / "signal").read_text() == str(signum) and e.value.code == 128 + signum


ORPHAN_RANK = """
import os, signal, sys, time
sys.path.insert(0, os.getcwd())
import nanoeuler_cuda as nc
rank, folder = int(os.environ["NANOEULER_RANK"]), sys.argv[1]
def saved(signum, frame):                     # rank 0's stop: it saves (until the test says go)
    with open(os.path.join(folder, "signal"), "a") as f:
        f.write(str(signum))                  # (a second SIGTERM would mean: quit at once, unsaved)
    deadline = time.time() + 300              # the test writes go: the cap only ends a broken test
    while not os.path.exists(os.path.join(folder, "go")) and time.time() < deadline:
        time.sleep(0.05)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, saved)
if rank == 0:
    nc.stop_when_orphaned()                   # as cmd_train does
open(os.path.join(folder, f"ready{rank}"), "w").write(str(os.getpid()))
deadline = time.time() + 300                  # the others stop when rank 0 does, as on its STOP
while time.time() < deadline and not os.path.exists(os.path.join(folder, "go")) and \
        (rank == 0 or not os.path.exists(os.path.join(folder, "signal"))):
    time.sleep(0.05)
"""

LAUNCHER = """
import sys, threading, time, nanoeuler as ne, nanoeuler_cuda as nc
folder, out, program = sys.argv[1:]
nc.count_gpus, nc.nccl_unique_id = lambda: 2, lambda: "ab" * 128
for _ in range(3):                            # NCCL's and CUDA's threads in a real launcher
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
with ne.RunFolder(out).claim(resume=False) as lock:
    nc.launch_ranks([folder], 2, program=program, lock=lock)
"""


def wait_for(path, seconds=120):
    """wait until path exists (the cap only ends a broken test) -> whether it does"""
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
    return path.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_launcher_leaves_rank_0_to_save_and_the_folder_locked_until_it_has(tmp_path, monkeypatch):
    pytest.importorskip("nanoeuler_cuda")
    monkeypatch.delenv("NANOEULER_RANK", raising=False)
    (tmp_path / "rank.py").write_text(ORPHAN_RANK)
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), str(out), str(tmp_path / "rank.py")],
                                cwd=HERE)
    try:
        assert wait_for(tmp_path / "ready0") and wait_for(tmp_path / "ready1")
        launcher.kill()                                      # kill -9: no handler, no finally
        launcher.wait()
        assert wait_for(tmp_path / "signal")                 # rank 0 was told, as by a Ctrl-C, once:
        time.sleep(1)                                        # (the absence of a second can only be waited for)
        assert (tmp_path / "signal").read_text() == str(int(signal.SIGTERM))
        rank0 = int((tmp_path / "ready0").read_text())
        with pytest.raises(ne.NanoEulerError, match=fr"is in use by another training run \(pid {rank0}\)"):
            with ne.RunFolder(str(out)).claim(resume=True):  # while rank 0 saves, the folder is still held, by it
                pass
    finally:
        (tmp_path / "go").write_text("")
    deadline = time.time() + 120
    while time.time() < deadline and os.path.exists(f"/proc/{rank0}") and \
            "Z" not in open(f"/proc/{rank0}/stat").read().split()[2]:
        time.sleep(0.05)
    assert (tmp_path / "signal").read_text() == str(int(signal.SIGTERM))   # once, up to rank 0's end
    with ne.RunFolder(str(out)).claim(resume=True):                  # rank 0 gone: a new run may take the folder
        pass


def test_the_gpus_launcher_hands_its_ranks_the_lock_run_command_holds(tmp_path, monkeypatch):
    """nanoeuler_cuda.py train --gpus N: run_command claims --out (args.run), and the launcher passes that
    claim's open train.lock (args.run.held) to launch_ranks, whose rank 0 inherits it"""
    nc = pytest.importorskip("nanoeuler_cuda")
    monkeypatch.delenv("NANOEULER_RANK", raising=False)
    monkeypatch.setattr(nc, "count_gpus", lambda: 2)
    seen = []
    monkeypatch.setattr(nc, "launch_ranks", lambda argv, world, lock=None, **k: seen.append(
        (world, lock and lock.name, lock and open(lock.name).read())))
    (tmp_path / "c.txt").write_text("some text\n")
    out = tmp_path / "run"
    args = nc.build_parser().parse_args(["train", "small", "--gpus", "2", "--data", str(tmp_path / "c.txt"),
                                         "--out", str(out)])
    args.argv = []
    ne.run_command(nc.cmd_train, args)
    assert seen == [(2, str(out / ne.LOCK_NAME), f"{os.getpid()}\n")]


def test_a_rank_killed_by_a_signal_is_named_with_the_signal(fake_ranks, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nif os.environ['NANOEULER_RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\nimport time; time.sleep(60)\n")
    nc = pytest.importorskip("nanoeuler_cuda")
    with pytest.raises(ne.NanoEulerError, match=r"^GPU 1's process was killed by SIGKILL \(the out-of-memory "
                                                r"killer sends it\), so every rank stopped; resume with --resume$"):
        nc.launch_ranks([], 2, program=str(script))
    script.write_text("import os, signal\nif os.environ['NANOEULER_RANK'] == '0':\n"
                      "    os.kill(os.getpid(), signal.SIGSEGV)\nimport time; time.sleep(60)\n")
    with pytest.raises(ne.NanoEulerError, match=r"^GPU 0's process was killed by SIGSEGV, so every rank stopped"):
        nc.launch_ranks([], 2, program=str(script))


def test_launcher_refuses_more_gpus_than_there_are(fake_ranks):
    with pytest.raises(ne.NanoEulerError, match="--gpus 4, but this machine has 3"):
        fake_ranks(world=4)


def test_zero_without_gpus_is_refused():
    nc = pytest.importorskip("nanoeuler_cuda")
    with pytest.raises(ne.NanoEulerError, match="give --gpus N"):
        nc.cmd_train(nc.build_parser().parse_args(["train", "big", "--zero"]))


def test_nccl_unique_id_round_trips():
    nc = pytest.importorskip("nanoeuler_cuda")
    if not have_module("nvidia.nccl"):
        pytest.skip("NCCL is not installed (pip install nvidia-nccl-cu13; only --gpus needs it)")
    uid = nc.nccl_unique_id()
    assert len(uid) == 256 and uid != nc.nccl_unique_id()
    assert bytes(nc.NcclUniqueId.from_buffer_copy(bytes.fromhex(uid))).hex() == uid


def train_losses(tmp_path, name, *flags):
    out = tmp_path / name
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler_cuda.py"), "train", "big", "--steps", "20",
                        "--batch", "8", "--eval-batches", "1", "--warmup", "5", "--out", str(out), *flags],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, (r.stdout.decode()[-2000:], r.stderr.decode()[-2000:])
    rows = [line.split(",") for line in (out / "log.csv").read_text().splitlines()[1:]]
    return np.array([float(row[1]) for row in rows]), out


def rounded_model(nc, cfg, rnd, seed=0):
    """nanoeuler_cuda's rounding reference on a random batch with ignored targets -> loss, grads, flat, batch"""
    rng = np.random.default_rng(seed)
    flat = ne.init_params(cfg, seed=seed).astype(np.float64) + rng.normal(0, 0.05, ne.num_params(cfg))
    idx, targets = ne.split_rows(rng.integers(0, cfg.V, (3, cfg.T + cfg.K)), cfg.T, cfg.K)
    targets = targets.copy()
    targets[0, :4, 1] = targets[2, 3:9] = -1
    params, grads = ne.carve(flat, cfg), np.zeros_like(flat)
    loss, ce, cache = nc.rounded_forward(params, cfg, idx, targets, rnd)
    nc.rounded_backward(params, ne.carve(grads, cfg), cache, cfg)
    return loss, grads, flat, (idx, targets)


def test_rounding_reference_without_rounding_is_nanoeulers_model():
    # check's reference for bf16 activations is nanoeuler.py's model with roundings added:
    # with none it must be that model, loss and every gradient
    nc = pytest.importorskip("nanoeuler_cuda")
    cfg = ne.Config(V=40, C=32, Hq=4, Hkv=2, L=2, T=12, F=88, K=3)
    loss, grads, flat, (idx, targets) = rounded_model(nc, cfg, lambda a: a)
    want, _, cache = ne.model_forward(ne.carve(flat, cfg), cfg, idx, targets)
    want_grads = np.zeros_like(flat)
    ne.model_backward(ne.carve(want_grads, cfg), cache)
    assert abs(loss - want) < 1e-12 * want
    assert np.allclose(grads, want_grads, rtol=1e-9, atol=1e-14)


def test_rounding_reference_rounds_to_bf16():
    # with bf16 rounding the gradients move by bf16's noise (a fraction of 1e-2 here), no more
    nc = pytest.importorskip("nanoeuler_cuda")
    cfg = ne.Config(V=40, C=32, Hq=4, Hkv=2, L=2, T=12, F=88, K=3)
    loss, grads, _, _ = rounded_model(nc, cfg, nc.rnd_bf16)
    plain, want_grads, _, _ = rounded_model(nc, cfg, lambda a: a)
    r = nc.rnd_bf16(np.array([1 + 2.0 ** -9, 3.0 + 2.0 ** -7, 1e-3]))
    assert r.dtype == np.float64 and r.tolist() == [1.0, 3.0, float(nc.bf16_round(np.float32(1e-3)))]
    err = np.linalg.norm(grads - want_grads) / np.linalg.norm(want_grads)
    assert 1e-4 < err < 5e-2 and abs(loss - plain) < 1e-2 * plain


def test_gpu_training_sizes():
    nc = pytest.importorskip("nanoeuler_cuda")
    nc.check_sizes(ne.PRESETS["big"])
    nc.check_sizes(ne.PRESETS["small"])
    with pytest.raises(ne.NanoEulerError, match="C and F multiples of 8"):
        nc.check_sizes(ne.Config(V=50, C=64, Hq=2, Hkv=1, L=1, T=8, F=100, K=2))
    with pytest.raises(ne.NanoEulerError, match="no attention kernel"):
        nc.check_sizes(ne.Config(V=50, C=48, Hq=1, Hkv=1, L=1, T=8, F=128, K=2))


@needs_gpu
def test_gpu_training_resumes_bit_identically(tmp_path):
    # no atomics in the GPU's backward: a run is the same bits every time, so a resumed
    # run ends on exactly the weights of an uninterrupted one
    flags = ["--steps", "12", "--batch", "4", "--eval-batches", "1", "--warmup", "3"]
    run = lambda out, *more: subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler_cuda.py"), "train", "big",
                                             "--out", str(tmp_path / out), *flags, *more],
                                            capture_output=True, timeout=300)
    for r in (run("straight"), run("resumed", "--stop-after", "5"), run("resumed", "--resume")):
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    _, a, _ = ne.load_model(str(tmp_path / "straight" / "model_000012.safetensors"))
    _, b, _ = ne.load_model(str(tmp_path / "resumed" / "model_000012.safetensors"))
    assert np.array_equal(a, b)


@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("bf16", 1e-3)])
def test_data_parallel_matches_one_gpu(tmp_path, precision, tol):
    one, _ = train_losses(tmp_path, "one", "--precision", precision)
    two, _ = train_losses(tmp_path, "two", "--precision", precision, "--gpus", "2")
    zero, out = train_losses(tmp_path, "zero", "--precision", precision, "--gpus", "2", "--zero")
    print(f"{precision}: worst relative loss difference over 20 steps, 2 GPUs "
          f"{np.max(np.abs(two / one - 1)):.1e}, with ZeRO-1 {np.max(np.abs(zero / one - 1)):.1e}")
    assert len(one) == 20 and one[-1] < one[0] - 1
    assert np.allclose(two, one, rtol=tol, atol=0)
    assert np.array_equal(zero, two)                           # the same sums, the same update: the same bits
    if precision == "fp32":                                    # one rank through NCCL, and a ZeRO resume
        rank1, _ = train_losses(tmp_path, "rank1", "--precision", precision, "--gpus", "1")
        assert np.array_equal(rank1, one)
        train_losses(tmp_path, "resumed", "--precision", precision, "--gpus", "2", "--zero", "--stop-after", "10")
        resumed, out2 = train_losses(tmp_path, "resumed", "--precision", precision, "--gpus", "2", "--zero",
                                     "--resume")
        assert np.array_equal(resumed, zero)
        _, _, _, m, v, _ = ne.RunFolder(str(out)).read_pair(20)     # ZeRO gathered the moments whole
        _, _, _, m2, v2, _ = ne.RunFolder(str(out2)).read_pair(20)
        for a, b in ((m, m2), (v, v2)):
            assert np.linalg.norm(a) > 0 and np.array_equal(a, b)


@pytest.mark.parametrize("ids, kept", [
    ([65, 66, 256, 67], [65, 66]),                    # <|endoftext|>, the first special, ends the reply
    ([65, 259, 67], [65]),                            # <|end|>, the last
    ([65, 257, 67], [65]),                            # <|user|>: the model begins the next turn
    ([65, ne.FIRST_MERGE_ID, 67], [65, ne.FIRST_MERGE_ID, 67]),    # the first merge is text
])
def test_a_chat_reply_ends_at_any_special_token(ids, kept):
    tok = ne.Tokenizer([(97, 97)])                    # FIRST_MERGE_ID is "aa"
    args = ne.build_parser().parse_args(["chat", "--model", "m"])
    out, reply = io.StringIO(), []
    ne.chat_reply(None, None, tok, [], args, out, reply, gen=lambda *a, **kw: iter(ids))
    assert reply == kept
    assert out.getvalue() == tok.decode(kept) + "\n"


def test_rel_error_is_the_worst_entrys():
    # one bad entry among many good ones must fail the check: |1 - 3| / (1 + 3) = 0.5
    analytic, numeric = np.ones(1000), np.ones(1000)
    numeric[7] = 3.0
    assert ne.rel_error(analytic, numeric) == 0.5
    assert ne.rel_error(np.array([0.0]), np.array([1e-9])) == 1e-9 / 1e-4     # tiny values: the 1e-4 floor
    assert ne.rel_error(np.array([1e-4]), np.array([3e-4])) == 0.5


@pytest.mark.parametrize("seed", [11, 2 ** 32])
def test_gradient_check_passes_where_the_stencil_errs_most(seed):
    # seed 11: an entry whose gradient is below 1e-5 beside the stencil's rounding error of
    # 6e-12 (over a 1e-6 floor: 1.1e-6); seed 2^32: an attn_norm entry of 2e-3 whose
    # truncation error at h = 1e-3 is 7.6e-9 (1.8e-6), at h = 3e-4 6e-11
    assert ne.gradient_check(seed, out=lambda line: None)


def test_the_parts_of_a_batch_with_ignored_targets_add_up_to_the_whole_batchs_loss():
    # SFT's -1 targets: each part divides by the whole batch's kept targets, so the parts'
    # losses and gradients add up to one forward over the whole batch
    cfg = ne.Config(V=260, C=16, Hq=2, Hkv=1, L=1, T=8, F=24, K=2)
    flat = ne.init_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    idx, targets = ne.split_rows(rng.integers(0, cfg.V, (4, cfg.T + cfg.K)), cfg.T, cfg.K)
    targets[0, :6] = -1                                          # row 0 keeps few targets, the others all
    targets[2, 3:] = -1
    whole, _, _ = ne.model_forward(ne.carve(flat, cfg), cfg, idx, targets)
    bufs = [np.zeros_like(flat), np.zeros_like(flat)]
    loss, _ = ne.loss_and_grads(flat, cfg, idx, targets, bufs, parts=4)
    assert loss == pytest.approx(float(whole), rel=1e-6)
    one = [np.zeros_like(flat)]
    ne.loss_and_grads(flat, cfg, idx, targets, one, parts=1)
    np.testing.assert_allclose(bufs[0], one[0], rtol=1e-4, atol=1e-7)


def test_pre_tokenization_gives_the_last_space_of_a_run_to_the_word_and_keeps_numbers_whole():
    # GPT-2's \s+(?!\S): a run of whitespace before a word leaves its last space to the word;
    # a newline is no space, so "\n\n" before a word becomes two pieces. \d+: a number is one piece
    assert ne.SPLIT_PATTERN.findall("a  b\n\nc in 2024, 7 ") == ["a", " ", " b", "\n", "\n", "c", " in", " 2024",
                                                                  ",", " 7", " "]


def test_read_tokenizer_takes_bounds_from_4_to_2_to_the_20_bytes():
    specials = {s: 256 + i for i, s in enumerate(ne.SPECIALS)}
    for bound in (4, 1 << 20):
        assert ne.read_tokenizer(json.dumps({"specials": specials, "merges": [],
                                             "max_piece_bytes": bound})).max_piece_bytes == bound
    for bound in (3, (1 << 20) + 1):
        with pytest.raises(ValueError, match="max_piece_bytes"):
            ne.read_tokenizer(json.dumps({"specials": specials, "merges": [], "max_piece_bytes": bound}))


def test_a_vocabulary_of_the_bytes_and_specials_alone_trains_no_merges():
    assert ne.Tokenizer.train("abcabc", ne.FIRST_MERGE_ID, progress=False).merges == []
    with pytest.raises(ne.NanoEulerError, match="vocab size 259 is below the 260"):
        ne.Tokenizer.train("abcabc", ne.FIRST_MERGE_ID - 1, progress=False)


def test_chat_reset_forgets_the_conversation(tmp_path, monkeypatch, capsys):
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=64, F=16, K=2)
    path = str(tmp_path / "m.safetensors")
    tok = ne.Tokenizer()
    ne.save_model(path, cfg, ne.init_params(cfg), tok)
    seen = []

    def gen(params, cfg, history, *args, **kw):
        seen.append(list(history))
        yield from tok.encode("ok") + [tok.special("<|end|>")]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\nyo\n/reset\nbye\n/quit\n")))
    ne.cmd_chat(ne.build_parser().parse_args(["chat", "--model", path]), gen=gen)
    U, A, E = (tok.special(s) for s in ("<|user|>", "<|assistant|>", "<|end|>"))
    turn = lambda text: [U, *text.encode(), A]
    assert seen == [turn("hi"), turn("hi") + [*b"ok", E] + turn("yo"), turn("bye")]
    assert "(history cleared)" in capsys.readouterr().out


def test_pre_tokenization_splits_gpt2s_contractions():
    # GPT-2's pattern: 's 't 're 've 'm 'll 'd are pieces of their own
    assert ne.SPLIT_PATTERN.findall("they're we've I'm it's don't you'll he'd") == [
        "they", "'re", " we", "'ve", " I", "'m", " it", "'s", " don", "'t", " you", "'ll", " he", "'d"]
