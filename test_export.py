"""
Tests for tools/export.py: the exported files checked by the programs that load them.

    python -m pytest -q test_export.py

In CI (light packages): Hugging Face tokenizers gives our ids, gguf's reader reads
every key and tensor back, and a Llama forward with llama.cpp's interleaved RoPE,
written here from the GGUF tensors, gives our logits. Where torch, transformers
and llama-cpp-python are installed, the slow tests at the end run the real models.
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import json
import os
import shutil
import subprocess
import sys

import gguf                  # requirements-dev.txt: what CI runs these tests with, so never skipped
import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings, strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "tools"), os.path.join(HERE, "dev")]
import export  # noqa: E402
import export_check  # noqa: E402  (dev/export_check.py: measures the real consumers; its chat_ids are chat's)

# text in many scripts and the awkward corners of UTF-8 and of the split pattern
ODD_TEXT = [
    "", " ", "a", "\n\n\n", "\t \t", "hello world", "don't  stop\tme", "I'LL SAY 'tis", "   leading and trailing   ",
    "naïve café", "Ünïcödé Straße", "Ελληνικά κείμενα", "Русский текст", "עברית ימין לשמאל", "العربية",
    "हिन्दी", "ภาษาไทย", "日本語のテキスト", "中文文本", "한국어", "emoji 🎉👍🏽 and flags 🇫🇷",
    "zwj 👩‍👩‍👧 family", "e\u0301 combining", "NUL\x00byte", "\x01\x02 control \x7f", "\x1c\x1d\x1e\x1f separators",
    "\u00a0nbsp\u2003em\u3000ideographic", "line\u2028sep\u2029para", "\r\n windows\r\n", "\x85next line",
    "snake_case_name __init__", "x²³ ½ Ⅻ ⅓ ①", "١٢٣ ४५६ digits", "mixed 123abc 45.6 -7", "$100,000.00!!",
    " " * 50 + "x", "a" * 129, "é" * 65 + "x", "日" * 43 + "本", "🎉" * 33, "\ufeffbom", "\U0010fffd private",
]

AWKWARD_RUNS = ["a" * 400, " " * 300 + "x", "é" * 200, "abc" * 100, "xyz" * 50]      # pieces over the 128-byte bound


@pytest.fixture(scope="module")
def tok():
    """trained on Shakespeare, the strings above and long runs, so that merges cross
    many kinds of byte and reach past the piece bound"""
    text = open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:60_000]
    return ne.Tokenizer.train(text + " ".join(ODD_TEXT + AWKWARD_RUNS) * 3, 600, progress=False)


def tiny_config(tok, C=32):
    return ne.Config(V=tok.vocab_size, C=C, Hq=4, Hkv=2, L=2, T=16, F=64, K=3)


def random_flat(cfg, seed=0):
    """weights large enough that logits are far apart; norms not 1, so each is seen"""
    rng = np.random.default_rng(seed)
    flat = rng.normal(0, 0.3, ne.num_params(cfg)).astype(np.float32)
    params = ne.carve(flat, cfg)
    for name, shape in ne.param_shapes(cfg):
        if len(shape) == 1:
            params[name][...] = rng.uniform(0.5, 1.5, shape)
    return flat


def run_export(*args):
    return subprocess.run([sys.executable, os.path.join(HERE, "tools", "export.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=HERE)


@pytest.fixture(scope="module")
def exported(tok, tmp_path_factory):
    """a model saved by nanoeuler, exported by the command line to both formats"""
    d = tmp_path_factory.mktemp("export")
    cfg = tiny_config(tok)
    flat = random_flat(cfg)
    model = str(d / "model.safetensors")
    ne.save_model(model, cfg, flat, tok)
    r = run_export("--model", model, "--hf", str(d / "hf"), "--gguf", str(d / "model.gguf"))
    assert r.returncode == 0, r.stderr
    assert "2 extra heads" in r.stdout and "left out" in r.stdout
    return {"dir": d, "model": model, "hf": str(d / "hf"), "gguf": str(d / "model.gguf"), "cfg": cfg, "flat": flat}


def hf_tokenizer(folder, specials_as_text=True):
    t = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    t.encode_special_tokens = specials_as_text          # ours never makes a special from text
    return t


# -----------------------------------------------------------------------------
# the tokenizer, in Hugging Face tokenizers

def corpus_samples():
    """about 100 KB from each kind of text in data/: a play, books, instructions"""
    data = os.path.join(HERE, "data")
    paths = [os.path.join(data, "tinyshakespeare.txt"), os.path.join(data, "instructions.jsonl")]
    paths += sorted(os.path.join(data, "gutenberg", f) for f in os.listdir(os.path.join(data, "gutenberg")))[:3]
    return [open(p, encoding="utf-8").read()[100_000:200_000] for p in paths]


def test_hf_tokenizer_gives_our_ids_on_the_embedded_corpus(exported, tok):
    t = hf_tokenizer(exported["hf"])
    for text in corpus_samples():
        assert t.encode(text).ids == tok.encode(text)
        assert t.decode(tok.encode(text)) == text


def test_hf_tokenizer_gives_our_ids_on_odd_and_multilingual_text(exported, tok):
    t = hf_tokenizer(exported["hf"])
    for text in ODD_TEXT + AWKWARD_RUNS + ["<|endoftext|> <|user|> are text here"]:
        assert t.encode(text).ids == tok.encode(text), repr(text)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cn")), max_size=300))
def test_hf_tokenizer_gives_our_ids_on_any_text(exported, tok, text):
    """any character Python's Unicode tables know (Cn: unassigned there; a newer table may
    call one a letter)"""
    assert hf_tokenizer(exported["hf"]).encode(text).ids == tok.encode(text)


def test_the_piece_bound_is_kept_and_matters(exported, tok):
    """our 128-byte cut is in the file; without it the long runs encode otherwise"""
    with open(os.path.join(exported["hf"], "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["pre_tokenizer"]["pretokenizers"].pop()            # the cut
    uncut = tokenizers.Tokenizer.from_str(json.dumps(spec))
    t = hf_tokenizer(exported["hf"])
    for text in AWKWARD_RUNS:
        assert t.encode(text).ids == tok.encode(text)
    assert any(uncut.encode(text).ids != tok.encode(text) for text in AWKWARD_RUNS)


def test_bpe_merges_in_our_order_even_when_a_whole_piece_is_a_token():
    """"abc" learned as ab+c after bc: ours encodes "abc" as a + bc, never as the token abc
    (a tokenizer that takes whole pieces found in the vocab would)"""
    a, b, c = b"abc"
    t = ne.Tokenizer([(b, c), (a, b), (261, c)])
    assert t.vocab[262] == b"abc" and t.encode("abc") == [a, 260]
    hf = tokenizers.Tokenizer.from_str(json.dumps(export.tokenizer_json(t)))
    assert hf.encode("abc abcd").ids == t.encode("abc abcd") == [a, 260, 32, a, 260, ord("d")]


def python_pieces(text):
    return ne.SPLIT_PATTERN.findall(text)


def test_split_pattern_matches_pythons_where_gpt2s_does_not():
    """every code point below U+3000 that Python knows, between letters, digits, spaces:
    the pattern spelled for Oniguruma gives Python's pieces; GPT-2's own pattern differs
    on numbers that are not digits (², ½, Ⅻ) and \\x1c-\\x1f"""
    import unicodedata
    ours = tokenizers.pre_tokenizers.Split(tokenizers.Regex(export.ONIG_PATTERN), "isolated")
    gpt2 = tokenizers.pre_tokenizers.Split(tokenizers.Regex(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""), "isolated")
    for text in ODD_TEXT + AWKWARD_RUNS + ["we're they've I'll she'd it's don't I'm 'RE 'Re ''s x'sy"]:
        assert [p for p, _ in ours.pre_tokenize_str(text)] == python_pieces(text), repr(text)
    differ = []
    for cp in range(0x3000):
        c = chr(cp)
        if unicodedata.category(c) in ("Cs", "Cn"):
            continue
        text = f"a{c}b 1{c}2 {c}{c} x {c} !{c}! \t{c}"
        assert [p for p, _ in ours.pre_tokenize_str(text)] == python_pieces(text), hex(cp)
        if [p for p, _ in gpt2.pre_tokenize_str(text)] != python_pieces(text):
            differ.append(c)
    assert {"²", "½", "Ⅻ", "\x1c"} <= set(differ)
    assert all(unicodedata.category(c) in ("No", "Nl") or c in "\x1c\x1d\x1e\x1f" for c in differ)


def test_two_ids_with_the_same_bytes_are_refused(tmp_path):
    """"abc" learned twice, as ab+c and a+bc: one sentence, nothing written"""
    a, b, c = b"abc"
    t = ne.Tokenizer([(a, b), (b, c), (260, c), (a, 261)])
    assert t.vocab[262] == t.vocab[263] == b"abc"
    cfg = ne.Config(V=t.vocab_size, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=1)
    model = str(tmp_path / "m.safetensors")
    ne.save_model(model, cfg, ne.init_params(cfg), t)
    r = run_export("--model", model, "--hf", str(tmp_path / "hf"), "--gguf", str(tmp_path / "m.gguf"))
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: {model}'s tokenizer has two tokens with the same bytes b'abc' "
                               "(ids 262 and 263)")
    assert r.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == ["m.safetensors"]


def render_chat(template, messages, add_generation_prompt):
    """as transformers renders a chat template (a sandbox, trim_blocks, lstrip_blocks)"""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4.\nAnything else?"},
        {"role": "user", "content": " Tell me about\tcafés "}]


def test_chat_template_renders_chats_ids(exported, tok):
    with open(os.path.join(exported["hf"], "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    t = hf_tokenizer(exported["hf"], specials_as_text=False)
    text = render_chat(config["chat_template"], CHAT, add_generation_prompt=True)
    assert t.encode(text).ids == export_check.chat_ids(tok, CHAT)
    text = render_chat(config["chat_template"], CHAT[:2], add_generation_prompt=False)
    assert t.encode(text).ids == export_check.chat_ids(tok, CHAT[:2])
    with pytest.raises(ValueError, match="roles user and assistant"):
        render_chat(config["chat_template"], [{"role": "system", "content": "be brief"}] + CHAT, True)


# -----------------------------------------------------------------------------
# the Hugging Face folder

def test_hf_config_writes_our_values_not_the_librarys_defaults(exported, tok):
    cfg = exported["cfg"]
    with open(os.path.join(exported["hf"], "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    assert (c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (cfg.V, 32, 64, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 8)
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 10000.0 and c["max_position_embeddings"] == 16
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (c["bos_token_id"], c["eos_token_id"]) == (256, 259) and not c["tie_word_embeddings"]
    with open(os.path.join(exported["hf"], "generation_config.json"), encoding="utf-8") as f:
        g = json.load(f)
    assert g["eos_token_id"][0] == tok.special("<|end|>") and sorted(g["eos_token_id"]) == [256, 257, 258, 259]
    with open(os.path.join(exported["hf"], "tokenizer_config.json"), encoding="utf-8") as f:
        tc = json.load(f)
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|endoftext|>", "<|end|>", False)
    assert tc["model_max_length"] == 16              # T: transformers cuts (truncation=True) and warns past it
    t = hf_tokenizer(exported["hf"], specials_as_text=False)
    assert [t.token_to_id(s) for s in ne.SPECIALS] == [256, 257, 258, 259]


def test_hf_weights_are_ours_split_not_permuted(exported):
    """q, k, v are wqkv's rows as they are (Hugging Face rotates halves, as we do); heads.0 is
    lm_head; the extra heads are not there"""
    from safetensors.numpy import load_file
    cfg, p = exported["cfg"], ne.carve(exported["flat"], exported["cfg"])
    w = load_file(os.path.join(exported["hf"], "model.safetensors"))
    assert len(w) == 2 + 9 * cfg.L + 1
    wqkv = p["layers.1.wqkv"]
    np.testing.assert_array_equal(w["model.layers.1.self_attn.q_proj.weight"], wqkv[:32])
    np.testing.assert_array_equal(w["model.layers.1.self_attn.k_proj.weight"], wqkv[32:48])
    np.testing.assert_array_equal(w["model.layers.1.self_attn.v_proj.weight"], wqkv[48:])
    np.testing.assert_array_equal(w["model.layers.1.mlp.gate_proj.weight"], p["layers.1.w_gate"])
    np.testing.assert_array_equal(w["model.layers.0.post_attention_layernorm.weight"], p["layers.0.mlp_norm"])
    np.testing.assert_array_equal(w["lm_head.weight"], p["heads.0"])
    np.testing.assert_array_equal(w["model.embed_tokens.weight"], p["tok_emb"])


# -----------------------------------------------------------------------------
# the GGUF file, read back by gguf's reader

def gguf_read(path):
    """-> fields {key: value}, tensors {name: float32 array (rows, cols)}, types {name: type}"""
    r = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items()}
    tensors = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
               .reshape(tuple(int(n) for n in reversed(t.shape))) for t in r.tensors}
    return fields, tensors, {t.name: t.tensor_type for t in r.tensors}


def test_gguf_reads_back_every_key_and_tensor(exported, tok):
    fields, tensors, types = gguf_read(exported["gguf"])
    cfg = exported["cfg"]
    want = {"general.architecture": "llama", "llama.vocab_size": cfg.V, "llama.context_length": 16,
            "llama.embedding_length": 32, "llama.block_count": 2, "llama.feed_forward_length": 64,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.attention.key_length": 8,
            "llama.attention.value_length": 8,                                # llama.cpp's n_embd_head_v: D = 32 / 4
            "llama.rope.dimension_count": 8, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-5), "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 256, "tokenizer.ggml.eos_token_id": 259,
            "tokenizer.ggml.eot_token_id": 259, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": export.CHAT_TEMPLATE, "general.file_type": 0}
    assert {k: fields[k] for k in want} == want
    strings = fields["tokenizer.ggml.tokens"]
    assert len(strings) == cfg.V and strings[256:260] == ne.SPECIALS
    byte_of = {c: b for b, c in export.BYTE_CHAR.items()}
    assert len(byte_of) == 256 and all(c.isprintable() and not c.isspace() for c in byte_of)
    assert all(bytes(byte_of[c] for c in s) == tok.vocab[i] for i, s in enumerate(strings) if not 256 <= i < 260)
    assert fields["tokenizer.ggml.token_type"][250:262] == [1] * 6 + [3] * 4 + [1] * 2
    a, b = tok.merges[5]
    assert fields["tokenizer.ggml.merges"][5] == f"{strings[a]} {strings[b]}"
    assert len(fields["tokenizer.ggml.merges"]) == len(tok.merges)
    want_tensors = dict(export.gguf_tensors(cfg, ne.carve(exported["flat"], cfg)))
    assert set(tensors) == set(want_tensors) and len(tensors) == 3 + 9 * cfg.L
    for name, t in want_tensors.items():
        np.testing.assert_array_equal(tensors[name], t)
        assert types[name] == gguf.GGMLQuantizationType.F32


def rope_interleaved(x, pos0=0):
    """x (T,H,D) -> x rotated as llama.cpp's llama architecture does: pairs (2i, 2i+1)"""
    T, H, D = x.shape
    freq = 10000.0 ** (-np.arange(0, D, 2) / D)                        # (D/2,)
    angle = (pos0 + np.arange(T))[:, None, None] * freq                # (T,1,D/2)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(angle) - b * np.sin(angle)
    out[..., 1::2] = b * np.cos(angle) + a * np.sin(angle)
    return out


def llama_forward(w, fields, ids):
    """a Llama forward in float64 as llama.cpp runs a GGUF file, written from the file's
    own tensors and keys: ids (T,) -> logits (T,V)"""
    H, Hkv = fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]
    eps, T = fields["llama.attention.layer_norm_rms_epsilon"], len(ids)
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g
    x = w["token_embd.weight"][ids]                                    # (T,C)
    for l in range(fields["llama.block_count"]):
        p = {k[len(f"blk.{l}."):]: v for k, v in w.items() if k.startswith(f"blk.{l}.")}
        h = norm(x, p["attn_norm.weight"])
        q = rope_interleaved((h @ p["attn_q.weight"].T).reshape(T, H, -1))
        k = rope_interleaved((h @ p["attn_k.weight"].T).reshape(T, Hkv, -1))
        v = (h @ p["attn_v.weight"].T).reshape(T, Hkv, -1)
        D = q.shape[-1]
        k, v = np.repeat(k, H // Hkv, 1), np.repeat(v, H // Hkv, 1)   # (T,H,D)
        s = np.einsum("thd,uhd->htu", q, k) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        y = np.einsum("htu,uhd->thd", a / a.sum(-1, keepdims=True), v).reshape(T, -1)
        x = x + y @ p["attn_output.weight"].T
        m = norm(x, p["ffn_norm.weight"])
        g = m @ p["ffn_gate.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (m @ p["ffn_up.weight"].T)) @ p["ffn_down.weight"].T
    return norm(x, w["output_norm.weight"]) @ w["output.weight"].T


def our_logits(cfg, flat, ids):
    logits, _ = ne.model_forward(ne.carve(flat.astype(np.float64), cfg), cfg, np.array([ids]))
    return logits[0]


def rel_diff(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_gguf_permutation_against_an_interleaved_rope_forward(exported, tok, tmp_path):
    """q and k permuted (k with its Hkv heads): the interleaved forward gives our logits;
    written unpermuted, it does not (the negative control)"""
    cfg, flat = exported["cfg"], exported["flat"]
    ids = tok.encode("First Citizen:\nBefore we proceed any further, hear me speak.")[:cfg.T]
    assert len(ids) == cfg.T
    fields, tensors, _ = gguf_read(exported["gguf"])
    assert rel_diff(llama_forward(tensors, fields, ids), our_logits(cfg, flat, ids)) < 1e-5
    plain = str(tmp_path / "unpermuted.gguf")
    export.write_gguf(plain, cfg, ne.carve(flat, cfg), tok, "f32", "x", permute=lambda w, H: w)
    fields, tensors, _ = gguf_read(plain)
    assert rel_diff(llama_forward(tensors, fields, ids), our_logits(cfg, flat, ids)) > 0.05


@pytest.mark.parametrize("outtype,tol", [("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 8e-3)])
def test_gguf_number_formats(exported, tok, tmp_path, outtype, tol):
    """each matrix within its format's rounding of ours (relative to its largest entry); norms f32"""
    path = str(tmp_path / f"m_{outtype}.gguf")
    r = run_export("--model", exported["model"], "--gguf", path, "--outtype", outtype)
    assert r.returncode == 0, r.stderr
    fields, tensors, types = gguf_read(path)
    assert fields["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[outtype]
    want = dict(export.gguf_tensors(exported["cfg"], ne.carve(exported["flat"], exported["cfg"])))
    for name, t in want.items():
        if t.ndim == 1:
            assert types[name] == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(tensors[name], t)
        else:
            assert types[name].name == outtype.upper()
            assert 0 < rel_diff(tensors[name], t) < tol, name


def test_q8_0_keeps_rows_that_do_not_split_into_blocks_as_f16(tok, tmp_path):
    cfg = tiny_config(tok, C=16)                     # rows of 16: Q8_0 needs multiples of 32
    model = str(tmp_path / "m.safetensors")
    ne.save_model(model, cfg, random_flat(cfg), tok)
    r = run_export("--model", model, "--gguf", str(tmp_path / "m.gguf"), "--outtype", "q8_0")
    assert r.returncode == 0 and "stored as f16" in r.stdout
    _, _, types = gguf_read(str(tmp_path / "m.gguf"))
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0      # rows of F = 64


# -----------------------------------------------------------------------------
# bad input: one sentence, exit code 2, nothing half-written

def assert_refused(r, *words):
    """exit code 2 and one line of error (argparse's come after its usage lines)"""
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().split("\n")
    assert "Traceback" not in r.stderr and all(s.startswith(("usage:", " ")) for s in lines[:-1]), r.stderr
    line = lines[-1]
    assert "error: " in line
    for w in words:
        assert w in line, line


@pytest.mark.parametrize("outtype", ["q8_0", "f16", "bf16"])
def test_outtype_without_gguf_is_refused(exported, tmp_path, outtype):
    """--outtype is --gguf's format and --hf is always float32: --hf with --outtype q8_0 wrote float32 and
    said nothing of it"""
    out = tmp_path / "hf"
    r = run_export("--model", exported["model"], "--hf", str(out), "--outtype", outtype)
    assert_refused(r, f"--outtype {outtype} is the number format of --gguf's file, and no --gguf is given",
                   "add --gguf FILE, or drop --outtype")
    assert r.stdout == "" and not out.exists()
    r = run_export("--model", exported["model"], "--hf", str(out), "--outtype", "f32")    # what --hf writes anyway
    assert r.returncode == 0 and out.is_dir(), r.stderr


def test_bad_input_is_refused_in_one_sentence(exported, tmp_path):
    model = exported["model"]
    out = str(tmp_path / "new")
    assert_refused(run_export("--model", str(tmp_path / "nope.safetensors"), "--hf", out), "does not exist")
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(open(model, "rb").read()[:1000])
    assert_refused(run_export("--model", str(damaged), "--gguf", out), "damaged.safetensors")
    assert_refused(run_export("--model", model, "--hf", exported["hf"]), "already exists", "--hf")
    assert_refused(run_export("--model", model, "--gguf", exported["gguf"]), "already exists", "--gguf")
    assert_refused(run_export("--model", model, "--gguf", str(tmp_path / "no" / "m.gguf")), "not a folder")
    assert_refused(run_export("--model", model, "--gguf", out, "--outtype", "q4_k"), "invalid choice")
    assert_refused(run_export("--model", model), "--hf", "--gguf")
    assert_refused(run_export("--model", model, "--hf", ""), "--hf is empty")
    assert_refused(run_export("--model", "", "--hf", out), "--model is empty")
    assert_refused(run_export("--model", model, "--gguf", out + "/"), "--gguf", "ends in /", "file name")
    slash = run_export("--model", model, "--hf", str(tmp_path / "slash") + "/")     # the folder, not "could not be written"
    assert slash.returncode == 0 and os.path.isfile(tmp_path / "slash" / "config.json"), slash.stderr
    shutil.rmtree(tmp_path / "slash")
    same = str(tmp_path / "same")                      # refused before either is written, not after the folder
    assert_refused(run_export("--model", model, "--hf", same, "--gguf", same), "--hf and --gguf", "same")
    assert_refused(run_export("--model", model, "--hf", same, "--gguf", str(tmp_path / "." / "same")), "--gguf")
    assert sorted(os.listdir(tmp_path)) == ["damaged.safetensors"]


def test_a_failure_while_writing_leaves_nothing(exported, tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise OSError(28, "No space left on device")
    for flag, writer in (("--hf", "write_safetensors"), ("--gguf", "write_gguf")):
        target = ne if writer == "write_safetensors" else export
        with monkeypatch.context() as m:
            m.setattr(target, writer, broken)
            with pytest.raises(SystemExit) as e:
                export.main(["--model", exported["model"], flag, str(tmp_path / "out")])
        assert e.value.code == 2
        assert os.listdir(tmp_path) == []
        err = capsys.readouterr().err
        assert err == f"error: {tmp_path / 'out'} could not be written (no space left on device); give {flag} a " \
            "place with room that you may write to\n"


# -----------------------------------------------------------------------------
# slow: the real consumers, where they are installed (dev/export_check.py measures;
# its figures for trained models are in docs/export.md)

def have(*modules):
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.fixture(scope="module")
def consumers(tok, tmp_path_factory):
    """a model with weights far from ties, room for 100 greedy tokens, rows that split into
    Q8_0's blocks, measured by dev/export_check.py"""
    d = tmp_path_factory.mktemp("consumers")
    cfg = ne.Config(V=tok.vocab_size, C=64, Hq=4, Hkv=2, L=2, T=128, F=128, K=2)
    model = str(d / "model.safetensors")
    ne.save_model(model, cfg, random_flat(cfg, seed=5), tok)
    return export_check, export_check.measure(model, str(d / "files"), prompt="First Citizen:\n", log=lambda s: None,
                                              transformers=have("torch", "transformers"), llama_cpp=have("llama_cpp"))


@pytest.mark.skipif(not have("torch", "transformers"), reason="needs torch and transformers (not in requirements)")
def test_transformers_gives_our_logits_greedy_tokens_and_chat_ids(consumers):
    _, r = consumers
    assert r["n_new"] == 100
    t = r["transformers"]
    assert t["logits_rel"] < 1e-4 and t["greedy_agree"] == 100 and t["chat_template_ok"]
    assert t["bos_eos"] == (256, 259)
    # the fixture's tokenizer learned merges across "x²" and in ½ Ⅻ: still our ids
    assert t["tokenizer_differs"] == []


@pytest.mark.skipif(not have("llama_cpp"), reason="needs llama-cpp-python (not in requirements; it builds llama.cpp)")
def test_llama_cpp_gives_our_logits_and_greedy_tokens_and_fails_unpermuted(consumers):
    check, r = consumers
    c = r["llama_cpp"]
    assert c["f32"]["logits_rel"] < 1e-3 and c["f32"]["greedy_agree"] == 100
    # weights of std 0.3 magnify rounding: here bf16 and q8_0 differ by some percent (docs/export.md
    # has a trained model's figures); the order of the formats is what holds
    assert c["f16"]["logits_rel"] < 1e-2 and c["f16"]["greedy_agree"] >= 50
    assert c["f16"]["logits_rel"] < c["bf16"]["logits_rel"] < 0.1 and c["q8_0"]["logits_rel"] < 0.3
    assert c["unpermuted"]["logits_rel"] > 0.05 and c["unpermuted"]["greedy_agree"] < 100    # negative control
    assert c["f32"]["bos_eos_eot"] == (256, 259, 259) and not c["f32"]["add_bos"] and c["f32"]["chat_template_ok"]
    # the corpus gives our ids; GPT-2's pre-tokenizer splits ² ½ Ⅻ off letters, and without
    # the pre-tokenizer's name the corpus itself splits otherwise
    assert not any(k.startswith("data/") for k in c["f32"]["tokenizer_differs"])
    assert set(c["f32"]["tokenizer_differs"]) <= {repr("x²³ ½ Ⅻ"), repr("\x1c\x1d\x1e\x1f separators"),
                                                   repr(" " * 24), repr("abc" * 8)}
    assert any(k.startswith("data/") for k in c["no_pre"]["tokenizer_differs"])
