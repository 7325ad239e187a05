"""
Bad input: crafted model files, bad instruction data, bad flags. Each must end
in one sentence that names the file or flag, a non-zero exit and no traceback;
and reading a file must never allocate more than the file and a sane config imply.

    python -m pytest -q test_inputs.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import dataclasses
import errno
import importlib
import json
import math
import io
import os
import re
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
# a model that needs no tokenizer training: 260 tokens = bytes and specials, no merges
CFG = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)


def run(script, *args, stdin=None):
    return subprocess.run([sys.executable, os.path.join(HERE, script), *args], input=stdin,
                          capture_output=True, timeout=120, cwd=HERE)


def assert_one_sentence(r, *names):
    """exit code 2 (a NanoEulerError or argparse), one line of error, naming what is wrong"""
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    for name in names:
        assert name in last, (name, last)
    return last


def model_parts(cfg=CFG, seed=0):
    """(tensors in SPEC order, metadata) of a valid model"""
    flat = ne.init_params(cfg, seed)
    params = ne.carve(flat, cfg)
    meta = {"format": "nanoeuler", "version": "1", "config": json.dumps(ne.asdict(cfg)),
            "tokenizer": ne.Tokenizer().to_json()}
    return [(name, params[name]) for name, _ in ne.param_shapes(cfg)], meta


@pytest.fixture
def model(tmp_path):
    path = str(tmp_path / "good.safetensors")
    ne.save_model(path, CFG, ne.init_params(CFG), ne.Tokenizer())
    return path


def write_raw(path, header, data=b""):
    """a safetensors file with exactly this header (any JSON value) and data"""
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + data)
    return str(path)


def refused(path, *words):
    """load_model refuses path with one sentence naming the file and containing words"""
    with pytest.raises(ne.NanoEulerError) as e:
        ne.load_model(path)
    msg = str(e.value)
    assert os.path.basename(path) in msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


# -----------------------------------------------------------------------------
# crafted model files: the config

@pytest.mark.parametrize("change, words", [
    ({"Hq": 0}, ["Hq = 0", "positive integer"]),
    ({"Hkv": 0}, ["Hkv = 0"]),
    ({"C": -8}, ["C = -8"]),
    ({"C": 8.0}, ["C = 8.0"]),
    ({"L": "1"}, ["L = '1'"]),
    ({"K": True}, ["K = True"]),
    ({"F": None}, ["F = None"]),
    ({"Hq": 4, "Hkv": 3}, ["multiple of its Hkv = 3"]),
    ({"C": 6, "Hq": 2}, ["even size"]),                      # D = 3
    ({"T": 10 ** 9}, ["T = 1,000,000,000", "8,192"]),
    ({"T": 1}, ["T = 1"]),
    ({"V": 70_000}, ["V = 70,000", "65,536"]),
    ({"mtp_weight": float("nan")}, ["mtp_weight"]),
    ({"mtp_weight": -1}, ["mtp_weight"]),
])
def test_crafted_config_is_refused_before_anything_is_allocated(tmp_path, change, words):
    tensors, meta = model_parts()
    meta["config"] = json.dumps({**ne.asdict(CFG), **change})
    path = str(tmp_path / "crafted.safetensors")
    ne.write_safetensors(path, tensors, meta)
    msg = refused(path, *words)
    assert "unusable" in msg


@settings(max_examples=40, deadline=None)
@given(Hkv=st.integers(1, 3), G=st.integers(1, 3), half=st.integers(1, 3), V=st.integers(1, 12),
       L=st.integers(1, 2), T=st.integers(2, 6), F=st.integers(1, 6), K=st.integers(1, 4))
def test_every_config_of_spec_shape_is_accepted_trains_and_generates(Hkv, G, half, V, L, T, F, K):
    # validate is not stricter than SPEC, nor looser than the code: what it lets through runs
    cfg = ne.check_config(ne.Config(V=V, C=Hkv * G * 2 * half, Hq=Hkv * G, Hkv=Hkv, L=L, T=T, F=F, K=K))
    flat = ne.init_params(cfg)
    idx, targets = ne.split_rows(np.random.default_rng(0).integers(0, cfg.V, (2, cfg.T + cfg.K)), cfg.T, cfg.K)
    loss, ce = ne.loss_and_grads(flat, cfg, idx, targets, [np.zeros_like(flat)])
    assert np.isfinite(loss)
    params = ne.carve(flat, cfg)
    for speculative in (False, True):
        out = list(ne.generate(params, cfg, [0] * (cfg.T + 1), 2 * cfg.T + 1, temperature=0, speculative=speculative))
        assert len(out) == 2 * cfg.T + 1


@pytest.mark.parametrize("config, words", [
    ("[1, 2, 3]", ["not a map"]),
    ("{not json", ["broken config"]),
    (json.dumps({k: v for k, v in ne.asdict(CFG).items() if k != "T"}),
     ["has a broken config in its metadata (it lacks 'T'); give a model file"]),
    ("[" * 100_000 + "]" * 100_000, ["broken config"]),       # deep nesting: RecursionError inside json
])
def test_config_that_is_not_a_config_map_is_refused(tmp_path, config, words):
    tensors, meta = model_parts()
    path = str(tmp_path / "crafted.safetensors")
    ne.write_safetensors(path, tensors, dict(meta, config=config))
    refused(path, *words)


def test_huge_layer_or_head_count_is_refused_without_listing_the_tensors(tmp_path):
    # L = 10^18 once made load_model build a list of 7 * 10^18 tensor shapes
    tensors, meta = model_parts()
    for change in ({"L": 10 ** 18}, {"K": 2 ** 62}, {"C": 262144, "Hq": 2}, {"F": 2 ** 40}):
        meta["config"] = json.dumps({**ne.asdict(CFG), **change})
        path = str(tmp_path / "layers.safetensors")
        ne.write_safetensors(path, tensors, meta)
        refused(path, "unusable", "parameters", "2,147,483,648")


def test_many_layers_within_the_bound_are_refused_without_listing_the_tensors(tmp_path, monkeypatch):
    # L = 10^7 narrow layers: 2.6e8 parameters pass validate, and 7e7 shapes would take gigabytes
    tensors, meta = model_parts()
    meta["config"] = json.dumps({**ne.asdict(CFG), "C": 2, "Hq": 1, "Hkv": 1, "F": 1, "K": 1, "L": 10 ** 7})
    path = str(tmp_path / "deep.safetensors")
    ne.write_safetensors(path, tensors, meta)
    shapes = ne.param_shapes

    def listed(cfg):
        assert cfg.L < 1000, "the shapes of 10^7 layers were listed"
        return shapes(cfg)
    monkeypatch.setattr(ne, "param_shapes", listed)
    refused(path, "do not match its config", f"{len(tensors)} tensors, SPEC expects {3 + 7 * 10 ** 7}")


@pytest.mark.parametrize("cfg", [CFG, ne.PRESETS["small"], ne.PRESETS["big"],
                                 ne.Config(V=300, C=24, Hq=6, Hkv=2, L=3, T=8, F=40, K=3)])
def test_the_parameter_bound_counts_every_tensor(cfg, monkeypatch):
    n = sum(math.prod(shape) for _, shape in ne.param_shapes(cfg))
    monkeypatch.setattr(ne, "MAX_PARAMS", n)
    ne.check_config(cfg)
    monkeypatch.setattr(ne, "MAX_PARAMS", n - 1)
    with pytest.raises(ne.NanoEulerError, match=f"{n:,} parameters"):
        ne.check_config(cfg)


def test_a_header_claiming_a_huge_width_is_refused_before_reading(tmp_path):
    # C = 262,144 once read 1.5 GB, then said "out of memory; lower --batch" naming no file
    cfg = {**ne.asdict(CFG), "C": 262144, "Hq": 2, "Hkv": 1, "T": 2, "F": 8, "K": 1, "L": 1}
    path = write_raw(tmp_path / "wide.safetensors", {"__metadata__": {
        "format": "nanoeuler", "version": "1", "config": json.dumps(cfg), "tokenizer": ne.Tokenizer().to_json()},
        "tok_emb": {"dtype": "F32", "shape": [260, 262144], "data_offsets": [0, 4 * 260 * 262144]}})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + 4 * 260 * 262144)          # sparse: no disk used
    assert_one_sentence(run("nanoeuler.py", "sample", "--model", path), "wide.safetensors", "parameters")


@pytest.mark.parametrize("meta", [{"format": "nanoeuler"}, {"format": "other", "version": "1"},
                                  {"format": "nanoeuler", "version": "1", "config": "{}"}])
def test_a_model_header_is_refused_before_its_data_is_read(tmp_path, meta):
    # a 256 MB tensor under a header that is no NanoEuler model: once read whole, then refused
    n = 1 << 26
    path = write_raw(tmp_path / "big.safetensors", {"__metadata__": meta,
                                                    "x": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + 4 * n)                       # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(ne.NanoEulerError, match="big.safetensors"):
            ne.load_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 24), peak                                      # not the 256 MB


def test_config_missing_from_metadata_is_refused(tmp_path):
    tensors, meta = model_parts()
    del meta["config"]
    path = str(tmp_path / "noconfig.safetensors")
    ne.write_safetensors(path, tensors, meta)
    refused(path, "has a broken config in its metadata (it lacks 'config'); give a model file")   # not "('config')"


def test_huge_context_is_refused_by_sample_and_sft_in_a_moment(tmp_path):
    # T = 10^9 once made sample allocate 238 GiB and sft 298 GiB
    tensors, meta = model_parts()
    meta["config"] = json.dumps({**ne.asdict(CFG), "T": 10 ** 9})
    path = str(tmp_path / "long.safetensors")
    ne.write_safetensors(path, tensors, meta)
    assert_one_sentence(run("nanoeuler.py", "sample", "--model", path, "--prompt", "hi"), "long.safetensors", "8,192")
    assert_one_sentence(run("nanoeuler.py", "sft", "--model", path, "--out", str(tmp_path / "o")),
                        "long.safetensors", "8,192")
    # the GPU program reads models through the same code, and before it starts the GPU
    assert_one_sentence(run("nanoeuler_cuda.py", "sample", "--model", path), "long.safetensors", "8,192")


def test_nan_weights_are_refused(tmp_path):
    tensors, meta = model_parts()
    tensors = [(n, t.copy()) for n, t in tensors]
    tensors[3][1][0, 0] = np.nan
    path = str(tmp_path / "nan.safetensors")
    ne.write_safetensors(path, tensors, meta)
    refused(path, "NaN", tensors[3][0])
    tensors[3][1][0, 0] = np.inf
    ne.write_safetensors(path, tensors, meta)
    refused(path, "infinite")


# -----------------------------------------------------------------------------
# crafted model files: the header

def header_of(cfg=CFG):
    """a valid header (as a dict) and the data bytes of a model"""
    tensors, meta = model_parts(cfg)
    header, offset, data = {"__metadata__": meta}, 0, []
    for name, t in tensors:
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
        data.append(t.astype("<f4").tobytes())
    return header, b"".join(data)


def test_a_raw_valid_file_loads(tmp_path):
    # the helper below writes files the loader accepts, so each refusal is about its one change
    header, data = header_of()
    cfg, flat, tok = ne.load_model(write_raw(tmp_path / "ok.safetensors", header, data))
    assert cfg == CFG and flat.tobytes() == ne.init_params(CFG, 0).tobytes()


def crafted(tmp_path, edit):
    header, data = header_of()
    data = edit(header, data) or data
    return write_raw(tmp_path / "crafted.safetensors", header, data)


def drop_offsets(h, d):
    del h["tok_emb"]["data_offsets"]


def overlap(h, d):
    # final_norm's bytes point into the previous tensor: the file holds less than the shapes
    a, b = h["final_norm"]["data_offsets"]
    h["final_norm"]["data_offsets"] = [a - 8, b - 8]


@pytest.mark.parametrize("edit, words", [
    (lambda h, d: h["tok_emb"].update(shape=[-260, -8]), ["shape [-260, -8]"]),
    (lambda h, d: h["tok_emb"].update(shape=[260.0, 8]), ["shape [260.0, 8]"]),
    (lambda h, d: h["tok_emb"].update(shape="260x8"), ["shape '260x8'"]),
    (drop_offsets, ["data_offsets None"]),
    (lambda h, d: h["tok_emb"].update(data_offsets=[8320, 0]), ["data_offsets"]),
    (lambda h, d: h["tok_emb"].update(data_offsets=[0, 8320, 5]), ["data_offsets"]),
    (lambda h, d: h["tok_emb"].update(dtype="F16"), ["float32", "'F16'"]),
    (lambda h, d: h.update(__metadata__=["format", "nanoeuler"]), ["__metadata__ is not a map"]),
    (lambda h, d: h.update(__metadata__="nanoeuler"), ["__metadata__ is not a map"]),
    (lambda h, d: h["__metadata__"].update(version=1), ["__metadata__ is not a map of strings"]),
    (lambda h, d: h.update(tok_emb=[0, 1]), ["'tok_emb' is not a map"]),
    (overlap, ["'final_norm'", "previous tensor"]),
    (lambda h, d: d + b"\0" * 12, ["12 bytes follow"]),
    (lambda h, d: h["tok_emb"].update(shape=[8, 260]), ["tok_emb has shape (8, 260), SPEC expects (260, 8)"]),
    (lambda h, d: h.update({"heads.9": h.pop("heads.1")}),
     ["holds tensors that do not match its config (it lacks 'heads.1'); give a model file"]),
])
def test_crafted_header_is_refused(tmp_path, edit, words):
    refused(crafted(tmp_path, edit), *words)


def test_a_truncated_file_is_refused_from_its_header_before_its_data_is_read(tmp_path):
    # the data's size is checked against the header's offsets first: a header that asks for more than the
    # file holds is refused without reading (a crafted one would otherwise ask for its bytes in memory)
    _, data = header_of()
    path = crafted(tmp_path, lambda h, d: d[:-100])
    with pytest.raises(ne.NanoEulerError) as e:
        ne.read_safetensors(path, header_only=True)
    assert str(e.value) == (f"{path} is not a safetensors file this program reads (it is truncated: {len(data):,} "
                            f"data bytes expected, {len(data) - 100:,} found); {ne.MODEL_HINT}")


@pytest.mark.parametrize("where, value", [("m", np.nan), ("v", np.inf), ("v", -1.0)])
def test_a_state_whose_moments_are_not_finite_or_negative_is_refused(tmp_path, where, value):
    # a NaN moment (or the square root of a negative v) would make NaN weights at the first step
    flat = ne.init_params(CFG, 0)
    moments = {"m": np.zeros_like(flat), "v": np.zeros_like(flat)}
    moments[where][3] = value
    state = {"step": 2, "rng": np.random.default_rng(0).bit_generator.state}
    ne.RunFolder(str(tmp_path), CFG, ne.Tokenizer()).write_pair(2, flat, moments["m"], moments["v"], state)
    with pytest.raises(ne.NanoEulerError) as e:
        ne.RunFolder(str(tmp_path)).read_pair(2)
    assert str(e.value) == (f"{tmp_path / 'state_000002.safetensors'} holds AdamW moments that are NaN, infinite "
                            "or negative; use an earlier checkpoint")


def test_header_that_is_not_a_map_is_refused(tmp_path):
    for value in ([1, 2], "text", 3, None):
        refused(write_raw(tmp_path / "h.safetensors", value, b""), "header")


def test_huge_header_length_is_refused(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes((2 ** 63).to_bytes(8, "little") + b"{}" + b" " * 6)
    refused(str(path), "header")


ADVICE = "give a model file that train or sft wrote"


@pytest.mark.parametrize("content, what", [
    (b"", "is not a safetensors file this program reads (its header cannot be read: its length says 0 bytes)"),
    (b"ROMEO: hello\n", "is not a safetensors file this program reads (its header cannot be read: its length says "
                        f"{int.from_bytes(b'ROMEO: h', 'little'):,} bytes)"),
    ("another program's, bf16", "is not a safetensors file this program reads (tensor 'w' is not float32 of shape "
                                "[2] ('BF16', 4 bytes))"),
    ("another program's, float32", "is not a NanoEuler version 1 model (format 'pt', version None)"),
    ("a shape of 5,000 digits", "is not a safetensors file this program reads (it holds a number of more than 4,300 "
                                "digits)"),
])
def test_a_file_that_is_not_a_model_says_what_to_give_instead(tmp_path, content, what):
    """an empty or text file, or another program's safetensors (Hugging Face's, export's own --hf): the
    sentence said what was wrong, and not what to do"""
    path = tmp_path / "m.safetensors"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif "digits" in content:                          # more than int() reads: Python's words name its setting
        head = b'{"w": {"shape": [' + b"9" * 5000 + b"]}}"
        path.write_bytes(len(head).to_bytes(8, "little") + head)
    else:                                              # one tensor w of 2 numbers, bf16 or float32, as torch writes
        dtype, size = ("BF16", 4) if "bf16" in content else ("F32", 8)
        write_raw(path, {"__metadata__": {"format": "pt"}, "w": {"dtype": dtype, "shape": [2],
                                                                  "data_offsets": [0, size]}}, b"\0" * size)
    last = assert_one_sentence(run("nanoeuler.py", "sample", "--model", str(path)), str(path))
    assert last.startswith(f"error: {path} {what}; {ADVICE}"), last


DAMAGED = "; give a model file that train or sft wrote (an earlier checkpoint, if this one is damaged)"


def damaged(config=None, tokenizer=None, drop=False, cfg=CFG):
    """model_parts of cfg, with this config or tokenizer text in the metadata, or its last tensor dropped"""
    tensors, meta = model_parts(cfg)
    meta.update({k: v for k, v in (("config", config), ("tokenizer", tokenizer)) if v is not None})
    return tensors[:-1] if drop else tensors, meta


@pytest.mark.parametrize("parts, what", [
    (damaged(config="{not json"), "has a broken config in its metadata (Expecting "),
    (damaged(config=json.dumps({**ne.asdict(CFG), "T": 1})), "is unusable: its context T = 1 is below 2"),
    (damaged(tokenizer="[]"), "has a broken tokenizer in its metadata (its special tokens"),
    (damaged(drop=True), "holds tensors that do not match its config (10 tensors, SPEC expects 11"),
    (damaged(cfg=dataclasses.replace(CFG, V=300)), "has a broken tokenizer in its metadata (it has 260 "
                                                   "tokens where the config says V = 300)"),    # ne.Tokenizer(): 260
])
def test_a_model_with_damaged_metadata_says_what_to_give_instead(tmp_path, parts, what):
    """a broken or unusable config, a broken tokenizer, tensors unlike the config, a tokenizer of another V:
    the sentence said what was wrong, and not what to do (as a file that is not a model did before 0156e52)"""
    path = str(tmp_path / "m.safetensors")
    ne.write_safetensors(path, *parts)
    last = assert_one_sentence(run("nanoeuler.py", "sample", "--model", path), path)
    assert what in last and last.endswith(DAMAGED) and last.count("; ") == 1, last


# -----------------------------------------------------------------------------
# crafted tokenizers

@pytest.mark.parametrize("merges, words", [
    ([[97, 98], [97, 262]], ["merge 1", "below 261"]),       # 262 is not made yet
    ([[97, 260]], ["merge 0", "below 260"]),                  # merge 0 would hold itself
    ([[97, 257]], ["merge 0"]),                               # a special token
    ([[-1, 97]], ["merge 0"]),
    ([[97, 98, 99]], ["merge 0"]),
    ([[97, 98.0]], ["merge 0"]),
    ([[97, True]], ["merge 0"]),
    ([[97, 98], [97, 98]], ["merge 1 repeats"]),
    ("ab", ["merges"]),
    (None, ["merges"]),
])
def test_crafted_merges_are_refused(tmp_path, merges, words):
    cfg = ne.Config(**{**ne.asdict(CFG), "V": 260 + (len(merges) if isinstance(merges, list) else 0)})
    tensors, meta = model_parts(cfg)
    tok = json.loads(meta["tokenizer"])
    tok["merges"] = merges
    path = str(tmp_path / "tok.safetensors")
    ne.write_safetensors(path, tensors, dict(meta, tokenizer=json.dumps(tok)))
    refused(path, "tokenizer", *words)


def test_merges_that_double_a_token_forever_are_refused_without_building_it():
    # merge i joins token 259+i with itself: token 260+i is 2^(i+1) bytes long, so 60
    # merges would ask for an exabyte; the check adds up lengths before building any
    merges = [[97, 97]] + [[260 + i, 260 + i] for i in range(59)]
    with pytest.raises(ValueError, match="MiB"):
        ne.read_tokenizer(json.dumps({"specials": {s: 256 + i for i, s in enumerate(ne.SPECIALS)},
                                      "merges": merges}))


@pytest.mark.parametrize("field, value", [("pattern", r"\S+|\s+"), ("pattern", None), ("type", "wordpiece")])
def test_a_tokenizer_of_another_pattern_or_type_is_refused(tmp_path, field, value):
    # it would load and encode text differently from the program that trained it
    tensors, meta = model_parts(CFG)
    tok = json.loads(meta["tokenizer"])
    assert tok["type"] == "byte-level-bpe" and tok["pattern"] == ne.SPLIT_PATTERN.pattern
    tok[field] = value
    path = str(tmp_path / "tok.safetensors")
    ne.write_safetensors(path, tensors, dict(meta, tokenizer=json.dumps(tok)))
    refused(path, "tokenizer", field if field == "type" else "pattern")


def test_tokenizer_json_that_is_not_a_map_is_refused():
    for text in ("[]", "3", '"x"'):
        with pytest.raises(ValueError):
            ne.read_tokenizer(text)


# -----------------------------------------------------------------------------
# arbitrary bytes and headers: a NanoEulerError, never another exception

def only_nanoeuler_errors(path, read=ne.load_model):
    try:
        read(path)
    except ne.NanoEulerError as e:
        assert "\n" not in str(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_random_bytes_give_one_clear_error(tmp_path, raw):
    path = tmp_path / "random.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ne.NanoEulerError):
        ne.read_safetensors(str(path))


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() |
                           st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=4),
                           max_leaves=12)
entry = st.fixed_dictionaries({}, optional={"dtype": st.sampled_from(["F32", "F16", "I64"]) | json_values,
                                            "shape": st.lists(st.integers(-3, 70), max_size=3) | json_values,
                                            "data_offsets": st.lists(st.integers(-8, 400), max_size=3) | json_values})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=6), entry | json_values, max_size=4) | json_values,
       data=st.binary(max_size=400))
def test_garbage_headers_give_one_clear_error(tmp_path, header, data):
    path = write_raw(tmp_path / "garbage.safetensors", header, data)
    only_nanoeuler_errors(path, ne.read_safetensors)
    only_nanoeuler_errors(path)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.fixed_dictionaries({k: st.integers(-2, 2 ** 40) | json_values for k in ne.SIZE_FIELDS},
                                    optional={"mtp_weight": json_values}))
def test_arbitrary_configs_give_one_clear_error(tmp_path, config):
    tensors, meta = model_parts()
    path = str(tmp_path / "config.safetensors")
    ne.write_safetensors(path, tensors, dict(meta, config=json.dumps(config)))
    only_nanoeuler_errors(path)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.integers(0, 10 ** 6), value=st.integers(0, 255))
def test_a_changed_byte_of_a_model_gives_one_clear_error_or_loads(model, where, value):
    raw = bytearray(open(model, "rb").read())
    raw[where % len(raw)] = value
    path = model + ".changed"
    with open(path, "wb") as f:
        f.write(raw)
    only_nanoeuler_errors(path)


SPECIALS = {s: 256 + i for i, s in enumerate(ne.SPECIALS)}


@settings(max_examples=200, deadline=None)
@given(merges=st.lists(st.lists(st.integers(-2, 300), min_size=1, max_size=3), max_size=40) | json_values)
def test_arbitrary_merges_give_a_valueerror_or_a_working_tokenizer(merges):
    try:
        tok = ne.read_tokenizer(json.dumps({"specials": SPECIALS, "merges": merges}))
    except ValueError as e:
        assert "\n" not in str(e)
        return
    text = "aa bb ab ba " * 3 + "é"
    assert tok.decode(tok.encode(text)) == text                # what it accepts, it can use


# -----------------------------------------------------------------------------
# sft and sample

@pytest.fixture
def sft_data(tmp_path):
    def write(records, name="data.jsonl"):
        path = tmp_path / name
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
        return str(path)
    return write


def sft_error(model, data, tmp_path, capsys):
    """run sft in this process; -> its one line of error"""
    with pytest.raises(SystemExit) as e:
        ne.main(["sft", "--model", model, "--data", data, "--out", str(tmp_path / "sft"), "--steps", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")
    return err[-1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.fixed_dictionaries({}, optional={"instruction": json_values, "input": json_values,
                                                             "response": json_values, "output": json_values})
                        | json_values, max_size=4), as_list=st.booleans())
def test_arbitrary_instruction_records_give_one_clear_error_or_text_pairs(tmp_path, records, as_list):
    path = tmp_path / ("data.json" if as_list else "data.jsonl")
    path.write_text(json.dumps(records) if as_list else "\n".join(json.dumps(r) for r in records))
    try:
        pairs = ne.load_instructions(str(path))
    except ne.NanoEulerError as e:
        assert "\n" not in str(e) and "data.json" in str(e)
        return
    assert pairs and all(isinstance(a, str) and isinstance(b, str) for a, b in pairs)
    ne.sft_rows(ne.Tokenizer(), pairs, CFG)                   # and they render


def test_sft_missing_data_file(model, tmp_path, capsys):
    msg = sft_error(model, str(tmp_path / "nope.jsonl"), tmp_path, capsys)
    assert "nope.jsonl does not exist" in msg


@pytest.mark.parametrize("record, words", [
    ({"instruction": "Add", "input": "", "response": 3}, ["response of example 2 is int"]),
    ({"instruction": ["Add"], "response": "3"}, ["instruction of example 2 is list"]),
    ({"instruction": "Add", "input": 7, "response": "3"}, ["input of example 2 is int"]),
    ([1, 2], ["example 2 is not an object"]),
    ({"instruction": "Add"}, ["example 2 has no response (or output)"]),
    ({"response": "3"}, ["example 2 has no instruction"]),
    ({"instruction": "\ud800 hi", "response": "x"}, ["instruction of example 2 holds '\\ud800'", "surrogate"]),
    ({"instruction": "hi", "response": "x\udfff"}, ["response of example 2 holds '\\udfff'", "surrogate"]),
])
def test_sft_example_that_is_not_text(model, tmp_path, capsys, sft_data, record, words):
    data = sft_data([{"instruction": "Hi", "response": "Hello"}, record])
    msg = sft_error(model, data, tmp_path, capsys)
    assert "data.jsonl" in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("text, words", [
    ('{\n  "data": [{"instruction": "Hi", "response": "Hello"}]\n}\n', ["is one JSON object, not a list"]),
    ('[{"instruction": "Hi", "output": "Hello", "n": ' + "9" * 5000 + "}]", ["a number of more than 4,300 digits"]),
])
def test_instruction_files_that_are_json_but_not_examples_are_named_so(tmp_path, text, words):
    path = tmp_path / "data.json"
    path.write_text(text)
    with pytest.raises(ne.NanoEulerError) as e:
        ne.load_instructions(str(path))
    assert "data.json is not instruction data" in str(e.value) and all(w in str(e.value) for w in words)
    assert "sys.set_int_max_str_digits" not in str(e.value)


@pytest.mark.parametrize("text", ["", "\n\n", "[]"])
def test_an_instruction_file_without_examples_says_what_to_give(tmp_path, text):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    with pytest.raises(ne.NanoEulerError) as e:
        ne.load_instructions(str(path))
    assert str(e.value) == (f"{path} holds no examples; give JSONL or a JSON list of objects with instruction, "
                            "input and response (or output)")


def test_a_training_state_given_as_a_model_names_the_model_file(tmp_path):
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)
    flat = ne.init_params(cfg)
    ne.RunFolder(str(tmp_path), cfg, ne.Tokenizer()).write_pair(3, flat, flat * 0, flat * 0, {"step": 3})
    with pytest.raises(ne.NanoEulerError) as e:
        ne.load_model(str(tmp_path / "state_000003.safetensors"))
    assert str(e.value).endswith("(format 'nanoeuler-state', version '1'); it is a training state: give the "
                                 "model_ file of its step")


def test_an_instruction_file_with_a_byte_order_mark_reads(tmp_path):
    for name, text in (("data.json", '[{"instruction": "Hi", "output": "Hello"}]'),
                       ("data.jsonl", '{"instruction": "Hi", "response": "Hello"}\n')):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert ne.load_instructions(str(tmp_path / name)) == [("Hi", "Hello")]


def test_sft_single_example(model, tmp_path, capsys, sft_data):
    msg = sft_error(model, sft_data([{"instruction": "Hi", "response": "Hello"}]), tmp_path, capsys)
    assert "data.jsonl: 1 of its 1 examples" in msg and "at least 2" in msg


def test_sft_every_prompt_longer_than_the_context(model, tmp_path, capsys, sft_data):
    long = "a long question " * 20                            # far beyond T = 8 tokens
    data = sft_data([{"instruction": long, "response": "yes"}] * 5)
    msg = sft_error(model, data, tmp_path, capsys)
    assert "0 of its 5 examples" in msg and "context of 8 tokens" in msg


@pytest.mark.parametrize("cut, reached, refused", [(100, 0, True), (198, 2, False), (299, 2, True), (0, 5, False)])
def test_sft_keeps_the_examples_whose_response_head_0_learns_from(tmp_path, monkeypatch, capsys, cut, reached,
                                                                  refused):
    # byte tokens: <|user|> + a prompt of P bytes + <|assistant|> puts the first response token
    # at position P + 2; head 0's targets are positions 1..T, so P = T - 2 is the longest prompt
    # whose example teaches head 0, and P = T - 1 teaches only the draft heads (positions 2..T+1)
    cfg = ne.Config(V=ne.Tokenizer().vocab_size, C=16, Hq=2, Hkv=1, L=1, T=24, F=48, K=2)
    model, data = str(tmp_path / "m.safetensors"), tmp_path / "d.jsonl"
    ne.save_model(model, cfg, ne.init_params(cfg), ne.Tokenizer())
    examples = [("q" * (cfg.T - 1), "cut") for _ in range(cut)] + [("r" * (cfg.T - 2), "kept") for _ in range(reached)]
    data.write_text("".join(json.dumps({"instruction": p, "response": r}) + "\n" for p, r in examples))
    seen = {}
    monkeypatch.setattr(ne, "train_loop", lambda *a, **k: seen.setdefault("run", a))
    args = ne.build_parser().parse_args(["sft", "--model", model, "--data", str(data), "--out", str(tmp_path / "o")])
    args.run = ne.RunFolder(args.out)                  # what run_command hands a command: its run's folder
    n = cut + reached
    if refused:
        with pytest.raises(ne.NanoEulerError) as e:
            ne.cmd_sft(args)
        assert str(e.value) == (f"{data}: {reached} of its {n} examples have a response token within the model's "
                                f"context of 24 tokens ({cut} cut off by their prompt); SFT needs at least 2 and 1% of "
                                "them (one is held out for validation); give shorter prompts, or a model with a longer "
                                "context")
        assert "run" not in seen
        return
    ne.cmd_sft(args)
    out = capsys.readouterr().out
    left = f" ({cut} left out: their prompt fills the context of 24 tokens)" if cut else ""
    assert re.search(rf"^examples +\| {reached} of {n} kept{re.escape(left)}$", out, re.M), out
    next_batch, val = seen["run"][4], seen["run"][5]
    for idx, targets in [next_batch(np.random.default_rng(0))] + val:
        assert ((targets[:, :, 0] >= 0).sum(1) > 0).all()          # every row gives head 0 a target


def test_sft_errors_from_the_command_line(model, tmp_path):
    r = run("nanoeuler.py", "sft", "--model", model, "--data", str(tmp_path / "none.jsonl"),
            "--out", str(tmp_path / "sft"))                   # not out/sft in the repository
    assert_one_sentence(r, "none.jsonl")


def test_sample_prompt_that_is_not_utf8(model):
    # bytes that are not UTF-8 reach Python as lone surrogates; they become U+FFFD, as in chat
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "sample", "--model", model,
                        "--prompt", b"caf\xe9 \xff ok", "--max-new-tokens", "3", "--temperature", "0"],
                       capture_output=True, timeout=120, cwd=HERE)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.startswith("caf\ufffd \ufffd ok".encode())


def test_argv_text():
    assert ne.argv_text("plain é") == "plain é"
    assert ne.argv_text(b"a\xffb".decode("utf-8", "surrogateescape")) == "a\ufffdb"
    assert ne.argv_text("x\ud800y") == "x?y"                 # a surrogate no byte made


# -----------------------------------------------------------------------------
# paths that are not files

@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.txt"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("command", ["sample", "chat", "sft", "bench"])
def test_a_model_that_is_a_folder_or_a_device_is_named_so(tmp_path, command):
    extra = ["--out", str(tmp_path / "sft")] if command == "sft" else []
    last = assert_one_sentence(run("nanoeuler.py", command, "--model", str(tmp_path), *extra), str(tmp_path))
    assert f"{tmp_path} is a folder, not a model file" in last
    last = assert_one_sentence(run("nanoeuler.py", command, "--model", os.devnull, *extra), os.devnull)
    assert f"{os.devnull} is not a model file (it is a device" in last


def test_a_corpus_that_is_a_pipe_or_a_device_is_named_so(tmp_path, fifo):
    for path in (fifo, os.devnull):
        last = assert_one_sentence(run("nanoeuler.py", "prepare", "--data", path, "--out", str(tmp_path / "run")), path)
        assert f"{path} is not a text file (it is a device, a pipe or a socket)" in last


def test_plot_of_a_pipe_a_device_or_a_folder_says_what_it_is(tmp_path, fifo):
    # it said "/dev/null is not there", which is false; a path with nothing there still is
    (tmp_path / "run" / "log.csv").mkdir(parents=True)
    for path, says in ((fifo, "is not a run's log.csv (it is a device, a pipe or a socket)"),
                       (os.devnull, "is not a run's log.csv (it is a device, a pipe or a socket)"),
                       (str(tmp_path / "run"), "is a folder, not a run's log.csv"),
                       (str(tmp_path / "none"), "is not there")):
        named = os.path.join(path, "log.csv") if path.endswith("run") else path
        last = assert_one_sentence(run("nanoeuler.py", "plot", path))
        assert last == f"error: {named} {says}; give a run folder (like out/small) or its log.csv", last


def test_sft_data_that_is_a_folder_is_named_so(model, tmp_path, capsys):
    msg = sft_error(model, str(tmp_path), tmp_path, capsys)
    assert f"{tmp_path} is a folder, not a file of instructions" in msg


def test_a_jsonl_line_that_is_not_json_is_named_by_its_number(tmp_path):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"instruction": "Hi", "response": "Hello"})
    cut = '{"instruction": "Hi", "response": '           # the value is missing after its last character
    path.write_text(f"\n{good}\n\n{good}\n{cut}\n{good}\n")
    with pytest.raises(ne.NanoEulerError) as e:
        ne.load_instructions(str(path))
    assert f"line 5 is not JSON: Expecting value (column {len(cut) + 1})" in str(e.value) and "\n" not in str(e.value)


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    # U+2028, U+2029, U+0085 and \x1c are text inside a JSON string (json.dumps with
    # ensure_ascii=False writes them as they are); str.splitlines would cut the record there
    path = tmp_path / "data.jsonl"
    odd = ["one\u2028two", "three\u2029four", "price\x85list", "a\x1cb"]
    path.write_text("".join(json.dumps({"instruction": f"Q{i}", "response": r}, ensure_ascii=False) + "\r\n"
                            for i, r in enumerate(odd)), encoding="utf-8")
    assert ne.load_instructions(str(path)) == [(f"Q{i}", r) for i, r in enumerate(odd)]


# -----------------------------------------------------------------------------
# what sample, chat and bench say

@pytest.mark.parametrize("command", ["sample", "chat"])
def test_more_drafts_than_the_model_has_heads_are_said(model, command):
    # CFG has K = 2: one draft head
    args = ["--model", model, "--max-new-tokens", "3", "--temperature", "0", "--speculative", "--drafts", "3"]
    r = run("nanoeuler.py", command, *args, *(["--prompt", "ab"] if command == "sample" else []), stdin=b"hi\n")
    assert r.returncode == 0, r.stderr.decode()
    note, report = r.stderr.decode().strip().split("\n")
    assert note == f"note: {model} has 1 draft head (K = 2), fewer than --drafts 3; drafting with 1"
    assert report.startswith("speculative: ") and "tokens a pass" in report
    r = run("nanoeuler.py", command, *args[:-1], "1", *(["--prompt", "ab"] if command == "sample" else []),
            stdin=b"hi\n")
    assert r.returncode == 0 and r.stderr.decode().startswith("speculative: "), r.stderr.decode()
    r = run("nanoeuler.py", command, *args[:-1], "0", *(["--prompt", "ab"] if command == "sample" else []),
            stdin=b"hi\n")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stderr.decode().strip() == "note: --speculative with --drafts 0 has nothing to draft with; decoding plainly"


def test_the_settings_table_says_when_minutes_sets_the_steps(tmp_path, capsys):
    data = tmp_path / "c.txt"
    data.write_text(open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:20_000])
    ne.main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--vocab-size", "270", "--batch", "2",
             "--minutes", "1.5", "--stop-after", "1"])
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("steps")]
    assert len(table) == 1 and table[0].split("|")[1].startswith(" as many as fit in 1.5 minutes (planned after 20 "
                                                                 "steps), warmup"), table
    args = ne.build_parser().parse_args(["train", "--minutes", "1.5"])
    ne.print_settings([], args, {"planned_steps": 345})
    assert capsys.readouterr().out.startswith("steps | 345 (planned for --minutes), warmup")
    ne.print_settings([], ne.build_parser().parse_args(["train", "--steps", "77"]), {})
    assert capsys.readouterr().out.startswith("steps | 77, warmup")
    ne.print_settings([], ne.build_parser().parse_args(["train", "--steps", "20"]), {})   # warmup 30: no cosine
    assert capsys.readouterr().out.startswith("steps | 20 (all in the warmup), warmup 30, lr peaks at 0.002, weight")
    ne.print_settings([], ne.build_parser().parse_args(["train", "--steps", "30"]), {})   # the last step's lr: the peak
    assert capsys.readouterr().out.startswith("steps | 30, warmup 30, lr 0.003 cosine to 0.0003, weight")


def test_bench_refuses_a_bad_model_before_timing_anything(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 100)
    r = run("nanoeuler.py", "bench", "--model", str(bad))
    assert_one_sentence(r, "bad.safetensors")
    assert r.stdout == b""                               # not a line of timings before the refusal


def test_bench_threads_beyond_the_rows_make_no_gradient_buffers(monkeypatch):
    # a gradient buffer a thread: --threads 100000000 grew memory by 220 MB a second
    made, real_zeros_like = [], np.zeros_like
    monkeypatch.setattr(ne.np, "zeros_like", lambda a, *k, **kw: made.append(a.size) or real_zeros_like(a, *k, **kw))
    monkeypatch.setattr(ne, "CORES", 64)
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)
    assert np.isfinite(ne.bench_train(cfg, 3, 10 ** 4, steps=1))
    assert made.count(ne.num_params(cfg)) == 2 + 1         # m, v and one buffer: 3 rows are one thread's (MIN_ROWS)


# -----------------------------------------------------------------------------
# flags

BAD_FLAGS = [
    ("train", "--batch", "0"), ("train", "--eval-every", "0"), ("train", "--save-every", "0"),
    ("train", "--steps", "0"), ("train", "--steps", "-5"), ("train", "--steps", "1.5"), ("train", "--lr", "-1"),
    ("train", "--lr", "nan"), ("train", "--lr", "inf"), ("train", "--minutes", "-1"), ("train", "--minutes", "nan"),
    ("train", "--minutes", "1e307"), ("train", "--minutes", "14400.5"), ("train", "--minutes", "inf"),
    ("train", "--warmup", "-1"), ("train", "--weight-decay", "-0.1"), ("train", "--clip", "0"),
    ("train", "--threads", "0"), ("train", "--seed", "-1"), ("train", "--stop-after", "0"),
    ("train", "--eval-batches", "0"), ("train", "--vocab-size", "100"), ("train", "--vocab-size", "70000"),
    ("sft", "--batch", "0"), ("sft", "--steps", "-5"), ("train", "--steps", "1000000001"),
    ("sft", "--steps", "10" + "0" * 30), ("chat", "--max-new-tokens", "1000000001"),
    ("sample", "--max-new-tokens", "-1"), ("sample", "--temperature", "-1"), ("sample", "--temperature", "nan"),
    ("sample", "--top-p", "2"), ("sample", "--top-p", "0"), ("sample", "--top-k", "-1"), ("sample", "--drafts", "-1"),
    ("sample", "--seed", "-3"), ("chat", "--temperature", "nan"), ("chat", "--max-new-tokens", "0"),
    ("bench", "--threads", "0"), ("check", "--seed", "x"),
    ("prepare", "--workers", "0"), ("prepare", "--workers", "-2"), ("prepare", "--workers", "2.5"),
    ("prepare", "--workers", str(4 * ne.available_cores() + 1)), ("prepare", "--workers", str(10 ** 9)),
]


def needs_model(command):
    return ["--model", "m.safetensors"] if command in ("sft", "sample", "chat") else []


@pytest.mark.parametrize("command, flag, value", BAD_FLAGS)
def test_bad_flag_is_refused_by_argparse(capsys, command, flag, value):
    with pytest.raises(SystemExit) as e:
        ne.build_parser().parse_args([command, *needs_model(command), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: {value!r} is not" in err, err


@pytest.mark.parametrize("command, flag, value", [
    ("train", "--batch", "0"), ("train", "--lr", "-1"), ("train", "--vocab-size", "5"), ("train", "--gpus", "-1"),
    ("bench", "--steps", "0"), ("bench", "--batch", "-2"), ("sample", "--top-p", "2"),
    ("sample", "--temperature", "nan"), ("sample", "--max-new-tokens", "-1"),
])
def test_bad_gpu_flag_is_refused_by_argparse(capsys, command, flag, value):
    import nanoeuler_cuda
    with pytest.raises(SystemExit) as e:
        nanoeuler_cuda.build_parser().parse_args([command, *(["--model", "m"] if command == "sample" else []),
                                                  flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: {value!r} is not" in capsys.readouterr().err


def test_good_flags_still_parse():
    a = ne.build_parser().parse_args(["train", "--steps", "1", "--clip", "-1", "--stop-after", "-1", "--warmup",
                                      "0", "--weight-decay", "0", "--vocab-size", "260"])
    assert (a.steps, a.minutes, a.clip, a.stop_after, a.warmup, a.vocab_size) == (1, 0, -1, -1, 0, 260)
    assert ne.build_parser().parse_args(["train", "--minutes", "0"]).minutes == 0
    a = ne.build_parser().parse_args(["sample", "--model", "m", "--temperature", "0", "--top-p", "1",
                                      "--top-k", "0", "--drafts", "0", "--seed", "0"])
    assert (a.temperature, a.top_p, a.top_k, a.drafts, a.seed) == (0, 1, 0, 0, 0)


def test_bad_flag_on_the_command_line_is_one_line():
    r = run("nanoeuler.py", "train", "--batch", "0")
    last = assert_one_sentence(r, "--batch", "'0'")
    assert "positive integer" in last


def test_help_shows_defaults():
    out = " ".join(run("nanoeuler.py", "train", "--help").stdout.decode().split())    # unwrapped
    for default in (ne.DEFAULT_STEPS, ne.DEFAULT_BATCH, ne.DEFAULT_LR, ne.DEFAULT_WARMUP):
        assert f"(default: {default})" in out
    assert "0 = off (default: 0)" in out                                        # a default of 0 is said
    out = " ".join(run("nanoeuler.py", "sample", "--help").stdout.decode().split())
    assert "greedy, deterministic (default: 0.8)" in out and "1 = off (default: 0.95)" in out
    assert "(default: None)" not in out and "(default: False)" not in out     # nothing to say: nothing said
    out = " ".join(run("nanoeuler_cuda.py", "train", "--help").stdout.decode().split())
    assert "optimizer state) (default: bf16)" in out and out.count("(default: ") >= 14
    assert "--threads" not in out                                               # the GPU has no thread pool
    out = " ".join(run("nanoeuler.py", "prepare", "--help").stdout.decode().split())
    assert "processes that encode (default: every core; one for a corpus under 4 MB)" in out
    assert "(default: None)" not in out and out.count("(default: ") == 4     # --data, --vocab-size, --out, --workers


@pytest.mark.parametrize("program, command", [("nanoeuler.py", "train"), ("nanoeuler.py", "sft"),
                                              ("nanoeuler_cuda.py", "train"), ("nanoeuler_cuda.py", "sft")])
def test_steps_and_minutes_together_are_refused(tmp_path, program, command):
    # --minutes sets the steps, so --steps beside it was either overridden by the plan (from
    # step 20) or stopped the run before any plan, its steps shown as "?" to the end. Both
    # are refused before anything runs (the missing corpus and model are never read), in
    # either order, the default's own value too; either alone still parses
    model = ["--model", str(tmp_path / "m.safetensors")] if command == "sft" else []
    base = [command, *model, "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "run")]
    default = 1000 if (program, command) == ("nanoeuler.py", "train") else 600
    for both in (["--steps", "5", "--minutes", "0.3"], ["--minutes", "2", "--steps", str(default)]):
        r = run(program, *base, *both)
        last = assert_one_sentence(r, "--steps", "--minutes", "not allowed with")
        assert "missing.txt" not in r.stderr.decode() and not (tmp_path / "run").exists(), last
    parser = importlib.import_module(program[:-3]).build_parser()
    assert vars(parser.parse_args([command, *model, "--minutes", "2"])).items() >= {"steps": default,
                                                                                      "minutes": 2}.items()
    assert vars(parser.parse_args([command, *model, "--steps", "7"])).items() >= {"steps": 7, "minutes": 0}.items()
    usage = " ".join(run(program, command, "--help").stdout.decode().split())
    assert "[--steps STEPS | --minutes MINUTES]" in usage and f"(default: {default})" in usage


@pytest.mark.parametrize("program, argv, want", [
    ("nanoeuler", ["train"], "out/small"), ("nanoeuler", ["train", "--model-size", "big"], "out/big"),
    ("nanoeuler", ["train", "--model-size", "big", "--out", "mine"], "mine"),
    ("nanoeuler", ["sft", "--model", "m"], "out/sft"),
    ("nanoeuler_cuda", ["train"], "out/big"), ("nanoeuler_cuda", ["train", "small"], "out/small")])
def test_a_run_goes_into_the_folder_of_its_model_size_unless_out_says(program, argv, want, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = __import__(program).build_parser().parse_args(argv)
    seen = []
    ne.run_command(lambda args: seen.append((args.out, os.path.isdir(args.out))), args)
    assert seen == [(os.path.join(*want.split("/")), True)]        # claimed while it runs


def test_workers_up_to_four_per_core_are_accepted():
    most = 4 * ne.available_cores()
    for n in (1, most):
        assert ne.build_parser().parse_args(["prepare", "--workers", str(n)]).workers == n


# -----------------------------------------------------------------------------
# data folders

def test_dangling_symlink_in_a_data_folder_is_skipped_with_a_warning(tmp_path, capsys):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    os.symlink(str(tmp_path / "gone.txt"), str(folder / "b.txt"))
    assert ne.corpus_files(str(folder)) == [str(folder / "a.txt")]
    err = capsys.readouterr().err
    assert "skipping" in err and "b.txt" in err
    (folder / "a.txt").unlink()
    with pytest.raises(ne.NanoEulerError, match="holds no .txt files"):
        ne.corpus_files(str(folder))


@pytest.mark.parametrize("size, V", [("small", 512), ("big", 4096)])
def test_train_builds_the_presets_vocabulary_unless_vocab_size_is_given(monkeypatch, size, V):
    """--model-size big is SPEC's big model (V = 4,096), not big with the small V"""
    seen = []
    monkeypatch.setattr(ne, "available_memory", lambda: None)    # big's step on any machine (check_config)
    monkeypatch.setattr(ne, "pretrain", lambda args, cfg, *a: seen.append(cfg.V))
    ne.cmd_train(ne.build_parser().parse_args(["train", "--model-size", size]))
    ne.cmd_train(ne.build_parser().parse_args(["train", "--model-size", size, "--vocab-size", "300"]))
    assert seen == [V, 300]


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 5e-324])
def test_a_tiny_temperature_picks_the_likeliest_token(temperature):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=300).astype(np.float32) * 10
        expected = int(np.argmax(logits))                     # the limit of softmax(z / t) as t -> 0
        assert ne.sample_token(logits, rng, temperature, top_k=40, top_p=0.95) == expected
        assert ne.sample_token(logits, rng, temperature) == expected


def huge_logits_model(tmp_path):
    """a model file of finite weights whose logits overflow float32: 1e36 * 1e20 per logit"""
    tensors, meta = model_parts()
    tensors = [(n, t * np.float32(1e36) if n == "heads.0" else t * np.float32(1e20) if n == "final_norm" else t)
               for n, t in tensors]
    path = str(tmp_path / "huge.safetensors")
    ne.write_safetensors(path, tensors, meta)
    return path


@pytest.mark.parametrize("command, temperature", [("sample", "0"), ("sample", "0.8"), ("sample", "1e-320"),
                                                  ("chat", "0.8")])
def test_a_model_whose_logits_are_not_finite_is_named_so(tmp_path, command, temperature):
    path = huge_logits_model(tmp_path)
    r = run("nanoeuler.py", command, "--model", path, "--temperature", temperature, "--max-new-tokens", "3",
            *(["--prompt", "hi"] if command == "sample" else []), stdin=b"hello\n")
    assert_one_sentence(r, path, "not finite")
    assert b"Warning" not in r.stderr, r.stderr.decode()


def brute_force_plan(step, left, step_time, eval_every, eval_time, save_every, pause, write):
    """the last total whose steps, evaluations and checkpoints (at the multiples of their
    interval past step, and at the last step) take at most left seconds, walked one step
    at a time from 100 steps below left / 1.2 s. A checkpoint holds the loop for its pause;
    its write runs beside the next save_every steps and holds the loop for what it lasts
    longer than they do; the last checkpoint's whole write is waited for"""
    def cost(n):
        multiples = lambda every: len(range((step // every + 1) * every, n + 1, every)) + (n % every != 0)
        saves = multiples(save_every)
        return ((n - step) * step_time + multiples(eval_every) * eval_time + saves * pause +
                (saves - 1) * max(0.0, write - save_every * step_time) + write)
    n = int(left / 1.2) - 100
    assert cost(n) <= left
    while cost(n + 1) <= left:
        n += 1
    return n


def plan_steps(args, step, step_time, eval_time, pause, write, elapsed):
    """RunFolder.plan, `elapsed` s into the run, after an evaluation timed at `eval_time` s and a save
    that held the loop `pause` s and was written in `write` s"""
    run = ne.RunFolder("out", clock=lambda: elapsed)            # the program started at 0
    run.paused, run.took, run.eval_time, run.began = pause, write, eval_time, 0.0
    return run.plan(args, {}, step, step_time)


def test_minutes_plans_at_most_a_billion_steps(capsys):
    args = ne.build_parser().parse_args(["train", "--minutes", "14400", "--eval-every", "10"])
    assert args.minutes == 14400
    for step_time, eval_time, pause, write in ((0.0, 0.0, 0.0, 0.0), (1e-300, 0.0, 0.0, 0.0), (0.5, 5.0, 2.0, 18.0),
                                               (0.5, 5.0, 2.0, 130.0)):
        total = plan_steps(args, 20, step_time, eval_time, pause, write, 3.0)
        # 864,000 s less the 3 s spent; 0.5 s a step, an evaluation of 5 s every 10 and a
        # checkpoint every 200 that holds the loop 2 s: about 1.01 s a step, while its write
        # (18 s) runs beside the next 100 s of steps; one of 130 s holds the loop 30 s more
        assert total == (20 + 10 ** 9 if step_time < 0.5 else
                         brute_force_plan(20, 863_997, 0.5, 10, 5.0, 200, pause, write))


def test_text_the_output_encoding_lacks_is_said_with_question_marks(model):
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "sample", "--model", model, "--prompt",
                        "h\u00e9llo", "--max-new-tokens", "3", "--temperature", "0"], capture_output=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()
    assert r.stdout.startswith(b"h?llo")


@pytest.mark.parametrize("script, command, closes, name", [
    ("nanoeuler.py", "sample", ">&-", "stdout"), ("nanoeuler.py", "chat", ">&-", "stdout"),
    ("nanoeuler.py", "chat", "<&-", "stdin"), ("nanoeuler_cuda.py", "sample", ">&-", "stdout")])
def test_a_closed_stream_that_the_command_needs_is_one_sentence(model, script, command, closes, name):
    # sh closes the descriptor before Python starts, which then finds sys.stdout (or stdin) None; nanoeuler_cuda.py
    # refuses it as nanoeuler.py does (one policy, set when nanoeuler.py is imported), before it looks for a GPU
    r = subprocess.run(["sh", "-c", f'"$0" "$@" {closes}', sys.executable, os.path.join(HERE, script),
                        command, "--model", model, "--max-new-tokens", "3"], capture_output=True, timeout=120)
    assert_one_sentence(r, f"{command} needs its {name}, which is closed")


def test_a_closed_stderr_does_not_hide_the_exit_code(tmp_path):
    r = subprocess.run(["sh", "-c", '"$0" "$@" 2>&-', sys.executable, os.path.join(HERE, "nanoeuler.py"), "sample",
                        "--model", str(tmp_path / "missing.safetensors")], capture_output=True, timeout=120)
    assert r.returncode == 2 and r.stdout == b""


def test_gpus_without_a_driver_says_so_before_preparing_the_data(tmp_path, monkeypatch):
    import nanoeuler_cuda
    # count_gpus sets the module's driver (cu) to the real one: put back at the end, so that later
    # tests see the module as they would alone (an emulated object's __del__ frees with its own driver)
    monkeypatch.setattr(nanoeuler_cuda, "cu", nanoeuler_cuda.cu)
    try:
        nanoeuler_cuda.count_gpus()
        pytest.skip("this machine has a GPU")
    except ne.NanoEulerError:
        pass
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text to tokenize\n" * 100)
    r = run("nanoeuler_cuda.py", "train", "--gpus", "2", "--data", str(corpus), "--out", str(tmp_path / "run"))
    assert_one_sentence(r, "no NVIDIA")
    assert not (tmp_path / "cache").exists() and b"tokeniz" not in r.stderr


@pytest.mark.parametrize("gpus", [[], ["--gpus", "2"]])
def test_gpu_train_names_a_missing_corpus_before_it_asks_for_a_gpu(tmp_path, gpus):
    missing = tmp_path / "no_such_corpus"
    r = run("nanoeuler_cuda.py", "train", "small", "--data", str(missing), "--out", str(tmp_path / "run"), *gpus)
    assert_one_sentence(r, f"{missing} does not exist")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script, argv, flag", [
    ("nanoeuler.py", ["train", "--out", ""], "--out"), ("nanoeuler.py", ["prepare", "--out", ""], "--out"),
    ("nanoeuler.py", ["train", "--data", ""], "--data"), ("nanoeuler.py", ["sample", "--model", ""], "--model"),
    ("nanoeuler.py", ["sft", "--model", ""], "--model"), ("nanoeuler_cuda.py", ["sample", "--model", ""], "--model"),
    ("nanoeuler.py", ["sft", "--model", "m", "--data", ""], "--data"),
])
def test_an_empty_path_flag_is_named(tmp_path, script, argv, flag):
    r = subprocess.run([sys.executable, os.path.join(HERE, script), *argv], capture_output=True, timeout=120,
                       cwd=tmp_path)
    said = assert_one_sentence(r, f"{flag} is empty")
    assert said.startswith(f"error: {flag} is empty; give ")
    assert ("instructions" in said) == (argv[0] == "sft" and flag == "--data")
    assert os.listdir(tmp_path) == []                    # nothing written: not ../cache, not out/


@pytest.mark.parametrize("script", ["nanoeuler.py", "nanoeuler_cuda.py"])
def test_numpy_missing_is_one_sentence(tmp_path, script):
    (tmp_path / "numpy.py").write_text("raise ImportError(\"No module named 'numpy'\")\n")   # numpy, not there
    r = subprocess.run([sys.executable, os.path.join(HERE, script), "--help"], capture_output=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert assert_one_sentence(r) == "error: numpy is not installed; run pip install -r requirements.txt"


def test_a_full_or_read_only_disk_is_one_sentence_naming_the_file():
    for code, said in ((errno.ENOSPC, "the disk is full; free some space, or give another --out"),
                       (errno.EROFS, "the file system is read-only; give another --out"),
                       (errno.EFBIG, "the file is too large; check the file size limit (ulimit -f), or give "
                                     "another --out")):
        assert ne.os_error_sentence(OSError(code, os.strerror(code), "out/cache/t.npy")) == f"out/cache/t.npy: {said}"


@pytest.mark.parametrize("code, said", [
    (errno.ENOENT, "no such file or folder; check its path, or give another --out"),
    (errno.EPERM, "the operation is not permitted; check its permissions"),
    (errno.ENAMETOOLONG, "file name too long; check the path and the disk, or give another --out"),  # any errno
    (errno.EIO, "input/output error; check the path and the disk, or give another --out"),    # the table leaves out
])
def test_a_path_that_cannot_be_made_gets_advice_that_fits(code, said):
    """a missing folder on the path (ENOENT), a file another user owns in a sticky folder (EPERM), a name
    past the file system's bound (ENAMETOOLONG) were told to check the disk and ulimit -f"""
    assert ne.os_error_sentence(OSError(code, os.strerror(code), "out/x/t.npy")) == f"out/x/t.npy: {said}"
    without_out = ne.os_error_sentence(OSError(code, os.strerror(code), "r.json"), False)
    assert "--out" not in without_out and "ulimit" not in without_out


def test_the_cache_sits_beside_the_run_folder_and_prepare_makes_no_run_folder(tmp_path):
    for out, cache in (("out/small", "out/cache"), ("run", "cache"), ("/a/b/", "/a/cache")):   # prepare_data's
        assert os.path.normpath(os.path.join(out, ne.CACHE)) == cache
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be or not to be " * 200)
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "prepare", "--data", str(corpus),
                        "--vocab-size", "270", "--out", "runs/first"], capture_output=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "runs"] and os.listdir(tmp_path / "runs") == ["cache"]


@pytest.mark.parametrize("script, argv", [("nanoeuler.py", ["train", "--steps", "1"]),
                                          ("nanoeuler.py", ["prepare"]), ("nanoeuler_cuda.py", ["train"])])
def test_a_deleted_working_folder_is_named(tmp_path, script, argv):
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.Popen([sys.executable, os.path.join(HERE, script), *argv], cwd=gone, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=lambda: os.rmdir(gone))    # gone before Python starts
    out, err = r.communicate(timeout=120)
    said = assert_one_sentence(subprocess.CompletedProcess(r.args, r.returncode, out, err),
                               "the current folder has been deleted")
    assert said.endswith("cd into one that exists and run again")


def test_check_needs_no_working_folder(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "check"], cwd=gone, capture_output=True,
                       preexec_fn=lambda: os.rmdir(gone), timeout=300)
    assert r.returncode == 0 and r.stdout.decode().endswith("overall okay: 1\n"), r.stderr.decode()


def test_a_working_folder_deleted_during_a_command_is_named_too(tmp_path, monkeypatch):
    # later than run_command's first look: os.getcwd() (os.path.abspath of a relative path) fails with ENOENT and
    # no file name wherever it runs; it said "no such file or folder; check its path, or give another --out"
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(FileNotFoundError) as e:
        os.path.abspath("model.safetensors")
    assert ne.os_error_sentence(e.value) == "the current folder has been deleted; cd into one that exists and run again"


def test_chat_with_a_context_of_two_keeps_the_last_token_of_the_question(tmp_path, monkeypatch, capsys):
    import io
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=2, F=16, K=2)
    path = str(tmp_path / "t2.safetensors")
    ne.save_model(path, cfg, ne.init_params(cfg), ne.Tokenizer())
    seen = []

    def gen(params, cfg, history, *args, **kw):
        seen.append(list(history))
        yield ne.Tokenizer().special("<|end|>")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n")))
    ne.cmd_chat(ne.build_parser().parse_args(["chat", "--model", path]), gen=gen)
    # T - 1 = 1 token for the prompt; the reply's room (T // 2 = 1) leaves none, so the last token is kept
    assert seen == [[ne.Tokenizer().special("<|assistant|>")]]
    assert "keeping its last 1 tokens" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_stdout_to_a_full_device_is_named_as_stdout(model):
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "sample", "--model", model,
                            "--max-new-tokens", "3"], stdout=full, stderr=subprocess.PIPE, timeout=120)
    assert_one_sentence(r, "writing to stdout failed (no space left on device)")
    assert "--out" not in r.stderr.decode()


def test_sft_on_a_model_whose_loss_is_nan_at_once_says_the_model_gives_it(tmp_path, capsys, sft_data):
    path = huge_logits_model(tmp_path)
    data = sft_data([{"instruction": f"say {i}", "response": f"{i} said"} for i in range(4)])
    err = sft_error(path, data, tmp_path, capsys)
    assert "became nan at step 1, from the weights the run started with" in err and "--model file" in err, err
    assert "--lr" not in err                                    # no update made it


def test_every_command_in_the_readmes_code_blocks_parses():
    # a renamed flag or command must not leave README's flows, or docs/'s pages, behind ([--x] marks an
    # optional flag)
    import glob
    import shlex
    import nanoeuler_cuda as nc
    blocks = []
    for page in ["README.md"] + sorted(glob.glob(os.path.join(HERE, "docs", "*.md"))):
        with open(os.path.join(HERE, page), encoding="utf-8") as f:
            blocks += re.findall(r"```\n(.*?)```", f.read(), re.S)
    commands = [m.groups() for block in blocks for line in block.splitlines()
                if (m := re.match(r"python (nanoeuler(?:_cuda)?\.py) (.*)", line.split("  #")[0].strip()))]
    assert len(commands) >= 12
    for program, rest in commands:
        parser = (nc if program == "nanoeuler_cuda.py" else ne).build_parser()
        try:
            parser.parse_args(shlex.split(rest.replace("[", "").replace("]", "")))
        except SystemExit:
            pytest.fail(f"README's `python {program} {rest}` does not parse")


def test_a_model_file_that_shrinks_while_it_is_read_is_said_to_have_changed(tmp_path, monkeypatch):
    # fstat says the whole file, the data read back is cut short (another program truncating it meanwhile)
    path = tmp_path / "m.safetensors"
    ne.write_safetensors(str(path), [("a", np.arange(6, dtype=np.float32))], {})
    whole = path.read_bytes()
    short = tmp_path / "short.bin"
    short.write_bytes(whole[:-8])                       # the last two floats gone

    class Shrinking(io.BufferedReader):
        def fileno(self):                               # fstat sees the file at its full size
            return os.open(str(path), os.O_RDONLY)

    monkeypatch.setattr(ne, "open", lambda p, mode="r", **kw: Shrinking(io.FileIO(str(short), "rb")), raising=False)
    with pytest.raises(ne.NanoEulerError, match=r"changed while it was read \(16 of 24 data bytes\); try again"):
        ne.read_safetensors(str(path))


def test_sample_notes_a_prompt_from_T_tokens_on_and_keeps_one_of_T_minus_1_whole(tmp_path, capsys):
    """generate keeps a prompt's last T-1 tokens (the next token needs a place in the context): sample says so
    for a prompt of T tokens, and says nothing for one of T-1 (4 bytes = 4 tokens with no merges)"""
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=4, F=16, K=2)
    path = str(tmp_path / "t4.safetensors")
    ne.save_model(path, cfg, ne.init_params(cfg), ne.Tokenizer())
    for prompt, noted in (("aaa", False), ("aaaa", True)):
        ne.cmd_sample(ne.build_parser().parse_args(["sample", "--model", path, "--prompt", prompt,
                                                    "--max-new-tokens", "1"]))
        err = capsys.readouterr().err
        assert ("the prompt is 4 tokens, longer than the context of 4; keeping its last 3" in err) == noted, err
