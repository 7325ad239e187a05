"""
Tests of nanoeuler_cuda.py's SFT, decoding and chat that run without a GPU:
generate's host loop (passes queued ahead, the window slide, fewer drafts near
the window's end, sampling) against nanoeuler.generate through a stand-in for
GPUDecoder that computes each pass with nanoeuler.model_forward and applies
the acceptance rule of argmax_accept_kernel; the NVRTC compile of the
decode kernels and the sizes their launches are given; the decode kernels
themselves run on the CPU by tools/emulate_cuda.py (a thread of a block = a
fiber), through GPUDecoder, against nanoeuler.model_forward; the sft and chat
command lines. `python nanoeuler_cuda.py check` tests the kernels on a GPU.
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import importlib.util
import io
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import nanoeuler_cuda as nc

HERE = os.path.dirname(os.path.abspath(__file__))


class HostArray:
    """what generate reads of a DeviceArray: view(offset, shape).download()"""

    def __init__(self, a):
        self.a = np.asarray(a)

    def view(self, offset, shape):
        return HostArray(self.a.reshape(-1)[offset:offset + math.prod(shape)].reshape(shape))

    def download(self):
        return self.a.copy()


class StandInDecoder:
    """GPUDecoder's contract, computed at once on the host: each pass is nanoeuler.model_forward
    over the fed ids at the device's pos, then the accept kernel's rule updates ids and pos.
    Passes are checked to stay inside the window and to be at most LOOKAHEAD unread."""

    def __init__(self, params, cfg):
        self.params, self.cfg = params, cfg
        self.kv = ne.new_kv_cache(cfg, 1, params["tok_emb"].dtype)
        self.ids, self.pos, self.passes, self.entries = [], 0, 0, {}
        self.unread, self.most_unread, self.log, self.heads = 0, 0, [], set()

    def run(self, feed, pos, n_heads):
        T = self.cfg.T
        assert 1 <= len(feed) and pos + len(feed) <= T, (pos, feed)
        logits, x = ne.model_forward(self.params, self.cfg, np.array([feed]), pos=pos, kv=self.kv)
        heads = self.params["heads"][:n_heads]                              # (n_heads, V, C)
        rows = np.concatenate([logits[0][:, None], np.einsum("kvc,rc->rkv", heads[1:], x[0])], 1)
        return rows                                                         # (R, n_heads, V)

    def finish(self, rows, feed, pos, n_heads):
        amax = rows.argmax(-1)                                              # (R, n_heads)
        j = 0
        while j < len(feed) - 1 and feed[1 + j] == amax[j, 0]:
            j += 1
        self.logits, self.amax = HostArray(rows.reshape(len(rows), -1)), HostArray(amax)
        self.entries[self.passes % nc.RING] = amax[:j + 1, 0].tolist()
        self.ids, self.pos = amax[j].tolist(), pos + j + 1
        self.passes += 1
        self.unread += 1
        self.most_unread = max(self.most_unread, self.unread)
        return (self.passes - 1) % nc.RING

    def prefill(self, tokens, n_heads):
        self.log.append(("prefill", len(tokens)))
        rows = self.run(list(tokens), 0, n_heads)[-1:]
        return self.finish(rows, [tokens[-1]], len(tokens) - 1, n_heads)

    def launch_step(self, R, n_heads):
        self.log.append(("step", R))
        self.heads.add(n_heads)
        assert R <= n_heads <= nc.DECODE_MAX_ROWS and R <= len(self.ids)   # the rows fed: the pass before made them
        feed = self.ids[:R]
        return self.finish(self.run(feed, self.pos, n_heads), feed, self.pos, n_heads)

    def wait(self, entry):
        self.unread -= 1
        return self.entries[entry]

    def set_feed(self, ids, pos):
        self.ids, self.pos = list(ids), pos

    def pass_cost(self, R):
        return 1.1                                                          # drafting pays at 1.1 tokens a pass


def margin_model(cfg, seed=7):
    """nanoeuler's speculative test model (see nanoeuler_cuda.margin_model), float64"""
    return ne.carve(nc.margin_model(cfg, np.random.default_rng(seed)).astype(np.float64), cfg)


CFG = ne.Config(V=24, C=32, Hq=4, Hkv=2, L=2, T=20, F=48, K=4)


@pytest.mark.parametrize("prompt", [[1], [3, 5, 7], [i % 24 for i in range(25)]])
def test_greedy_host_loop_equals_cpu_generate_across_slides(prompt):
    params = margin_model(CFG)
    want = list(ne.generate(params, CFG, prompt, 3 * CFG.T, temperature=0))
    for speculative, drafts in ((False, None), (True, None), (True, 1), (True, 2)):
        dec = StandInDecoder(params, CFG)
        stats = {}
        got = list(nc.generate(dec, CFG, prompt, 3 * CFG.T, temperature=0, speculative=speculative,
                               stats=stats, drafts=drafts))
        assert got == want, (speculative, drafts)
        assert stats["tokens"] == len(got)                         # a pass cut by max_new_tokens counts what it gave
        assert 1 < dec.most_unread <= nc.LOOKAHEAD                # it did read behind the passes
        assert sum(kind == "prefill" for kind, _ in dec.log) >= 3  # the prompt and two slides at least
        if speculative:
            assert stats["tokens"] / stats["steps"] > 1.3
            # near the end of the window a pass feeds fewer drafts, as nanoeuler.generate does
            assert any(kind == "step" and R < 1 + (drafts or CFG.K - 1) for kind, R in dec.log)


def policy_passes(policy, n, tokens):
    """(rows, heads) of n passes that DraftPolicy picks, each observed at once: tokens(i, rows)
    gives what pass i (from 1) emitted"""
    passes = []
    for i in range(1, n + 1):
        rows, heads = policy.next()
        policy.observe(rows, tokens(i, rows))
        passes.append((rows, heads))
    return passes


def runs(*parts):
    """[(count, pass), ...] written out"""
    return [p for count, p in parts for _ in range(count)]


def test_drafts_that_always_fail_stop_and_are_probed_less_and_less_often():
    # the first pass drafts, the second feeds its draft: 1 token at a cost of 1.2 -> stop;
    # after 16 plain passes a probe (a pass that drafts, 2 that feed drafts), the wait doubles
    got = policy_passes(nc.DraftPolicy(1, costs={1: 1.2}), 1200, lambda i, rows: 1)
    probe = [(1, (1, 2)), (2, (2, 2))]
    assert got[:121] == runs(*probe[:1], (1, (2, 2)), (16, (1, 1)), *probe, (32, (1, 1)), *probe, (64, (1, 1)),
                             probe[0])
    plain_runs = [len(r) for r in "".join("p" if p == (1, 1) else "d" for p in got).split("d") if r]
    assert plain_runs == [16, 32, 64, 128, 256, 256, 256, 169]         # the wait stops doubling at 256
    assert sum(p == (2, 2) for p in got) == 1 + 2 * 7                 # 15 of 1,200 passes fed a failing draft


def test_a_probe_whose_drafts_are_right_starts_drafting_again():
    # drafts fail up to pass 30, are right for passes 31-70, fail again from 71: the second
    # probe (passes 54-56) finds them right, judged alone (with the 3 failures before it, 7/5
    # tokens a pass would not beat 1.45); drafting stops after 5 failures (2 - 5/8 <= 1.45),
    # and the wait before the next probe is the first again
    got = policy_passes(nc.DraftPolicy(1, costs={1: 1.45}), 130, lambda i, rows: rows if 30 < i <= 70 else 1)
    assert got[18:21] == [(1, 2), (2, 2), (2, 2)] and got[21:53] == runs((32, (1, 1)))
    probe = [(1, (1, 2)), (2, (2, 2))]
    assert got[53:] == runs(probe[0], (21, (2, 2)), (16, (1, 1)), *probe, (32, (1, 1)), *probe, (1, (1, 1)))


def test_drafting_stops_when_the_last_8_drafting_passes_give_no_more_than_their_cost():
    # 10 passes of 2 tokens fill the window, then 1 token each: the mean over the last 8 is
    # 2 - k/8 after k of them, not above 1.5 at k = 4 -> passes 2..15 fed drafts, then plain
    got = policy_passes(nc.DraftPolicy(1, costs={1: 1.5}), 20, lambda i, rows: 2 if i <= 11 else 1)
    assert got == [(1, 2)] + runs((14, (2, 2)), (5, (1, 1)))
    # three drafts: rows 4 and heads 4 while 2.5 tokens a pass beat the cost of 2.4
    got = policy_passes(nc.DraftPolicy(3, costs={3: 2.4}), 10, lambda i, rows: 2.5 if i <= 5 else 1)
    assert got == [(1, 4)] + runs((5, (4, 4)), (4, (1, 1)))


COSTS = {1: 1.25, 2: 1.5, 3: 1.65}                        # drafts fed -> a pass's cost, about an H100's


def test_the_policy_feeds_the_number_of_drafts_that_gives_most_tokens_per_cost():
    # every draft right: 2, 3, 4 tokens a pass for 1.25, 1.5, 1.65: 3 drafts (4 / 1.65 = 2.42)
    assert policy_passes(nc.DraftPolicy(3, costs=COSTS), 20, lambda i, rows: rows) == [(1, 4)] + runs((19, (4, 4)))
    # drafts 1 and 2 right, 3 wrong: the pass fed 3 gave 3 tokens, so 1 / 2 / 3 drafts would have
    # given 2 / 3 / 3: per cost 1.6 / 2.0 / 1.82 -> 2 drafts (3 rows, 3 heads)
    got = policy_passes(nc.DraftPolicy(3, costs=COSTS), 40, lambda i, rows: min(rows, 3))
    assert got[:34] == [(1, 4), (4, 4), (3, 3)] + runs((31, (3, 3)))
    # draft 1 right, 2 wrong: 2 tokens whatever is fed -> 1 draft (2 / 1.25 = 1.6). Once the
    # passes fed 2 or more have left the policy's memory (32 passes), 2 drafts could give
    # 2 + 1 (every pass took its one draft) for 1.5 = 2.0: one pass drafts 2 and the next
    # feeds them, gives 2 tokens (2 / 1.5 = 1.33), and 1 draft comes back
    got = policy_passes(nc.DraftPolicy(3, costs=COSTS), 104, lambda i, rows: min(rows, 2))
    assert got == [(1, 4), (4, 4)] + runs(*[(32, (2, 2)), (1, (2, 3)), (1, (3, 3))] * 3)
    # draft 1 right up to pass 10, then no draft: 1 draft until the last 8 passes fed drafts give
    # no more than 1.25 tokens each (16 - k <= 10 after k failures: pass 16), then plain; the
    # probe after 16 plain passes drafts the most again (2 drafts cost 2.0 here: never tried)
    got = policy_passes(nc.DraftPolicy(3, costs={1: 1.25, 2: 2.0, 3: 2.5}), 36,
                        lambda i, rows: min(rows, 2) if i <= 10 else 1)
    assert got == [(1, 4), (4, 4)] + runs((14, (2, 2)), (16, (1, 1)), (1, (1, 4)), (2, (4, 4)), (1, (1, 1)))


def test_plain_decoding_is_one_row_and_one_head_always():
    assert policy_passes(nc.DraftPolicy(0), 50, lambda i, rows: 1) == runs((50, (1, 1)))


def test_drafts_that_never_match_cost_little_and_change_no_token():
    # head 1 guesses one token past head 0's map (its rows rolled by one): drafts always fail
    params = margin_model(CFG)
    params["heads"][1] = np.roll(params["heads"][1], 1, axis=0)
    want = list(ne.generate(params, CFG, [3], 4 * CFG.T, temperature=0))
    dec, stats = StandInDecoder(params, CFG), {}
    assert list(nc.generate(dec, CFG, [3], 4 * CFG.T, temperature=0, speculative=True, drafts=1, stats=stats)) == want
    # the passes queued before the first verdict came back (LOOKAHEAD), then two probes of 2
    # passes (after 16 and 32 plain passes) in the 80 passes
    assert stats["tokens"] == stats["steps"] == 80 and stats["drafted"] == nc.LOOKAHEAD + 2 * 2
    assert stats["fed"] == stats["drafted"]                        # one draft each (bench's "drafts fed a pass")


@pytest.mark.parametrize("K, speculative, drafts, heads", [
    (4, False, None, 1), (4, False, 2, 1),              # plain: one row and head 0 alone, whatever --drafts
    (4, True, None, 4), (4, True, 9, 4), (4, True, 2, 3), (4, True, 0, 1),
    (12, True, None, nc.DECODE_MAX_ROWS),               # 11 draft heads, but a pass holds at most DECODE_MAX_ROWS rows
])
def test_a_pass_computes_head_0_and_the_drafts_asked_for(K, speculative, drafts, heads):
    cfg = ne.Config(**{**ne.asdict(CFG), "K": K})
    dec, stats = StandInDecoder(margin_model(cfg), cfg), {}
    list(nc.generate(dec, cfg, [1, 2], 2 * cfg.T, temperature=0, speculative=speculative, drafts=drafts, stats=stats))
    assert max(dec.heads) == heads and (heads == 1 or min(dec.heads) > 1)    # the first pass drafts the most
    if heads == 1:
        assert all(R == 1 for kind, R in dec.log if kind == "step") and stats["tokens"] == stats["steps"]


def test_slide_keeps_the_last_half_window():
    params = margin_model(CFG)
    prompt = [2, 4, 6]
    dec = StandInDecoder(params, CFG)
    out = list(nc.generate(dec, CFG, prompt, CFG.T + 5, temperature=0))
    # the window is full after T - 3 new tokens: the next pass feeds the last T/2 tokens
    # again from position 0 (one prefill of T/2 rows)
    assert ("prefill", CFG.T // 2) in dec.log
    assert dec.log[0] == ("prefill", 3) and len(out) == CFG.T + 5


@pytest.mark.parametrize("speculative", [False, True])
def test_sampling_follows_the_cpu_with_the_same_seed(speculative):
    params = margin_model(CFG)
    for seed in (1, 2):
        want = list(ne.generate(params, CFG, [3, 5], 2 * CFG.T, temperature=1.5, top_k=8, seed=seed,
                                speculative=speculative, drafts=2))
        dec = StandInDecoder(params, CFG)
        got = list(nc.generate(dec, CFG, [3, 5], 2 * CFG.T, temperature=1.5, top_k=8, seed=seed,
                               speculative=speculative, drafts=2))
        assert got == want
        assert dec.most_unread == 1                               # sampling: one pass at a time


def test_stop_token_and_max_new_tokens():
    params = margin_model(CFG)
    want = list(ne.generate(params, CFG, [1], 30, temperature=0))
    stop = want[7]
    got = list(nc.generate(StandInDecoder(params, CFG), CFG, [1], 30, temperature=0, stop=stop))
    assert got == want[:want.index(stop) + 1]
    for stop_at, n in ((None, 5), (stop, 30)):                      # both cut a pass of several tokens short
        stats = {}
        got = list(nc.generate(StandInDecoder(params, CFG), CFG, [1], n, temperature=0, speculative=True, stop=stop_at,
                               stats=stats))
        assert got == want[:5] if stop_at is None else got == want[:want.index(stop) + 1]
        assert stats["tokens"] == len(got)


def test_empty_prompt_is_refused():
    with pytest.raises(ne.NanoEulerError, match="prompt is empty"):
        list(nc.generate(StandInDecoder(margin_model(CFG), CFG), CFG, [], 5, temperature=0))


def test_decoding_sizes():
    big = ne.PRESETS["big"]
    nc.decode_check_sizes(big)
    nc.decode_check_sizes(ne.PRESETS["small"])
    with pytest.raises(ne.NanoEulerError, match="C and F multiples of 8"):
        nc.decode_check_sizes(ne.Config(V=50, C=36, Hq=4, Hkv=2, L=1, T=8, F=96, K=2))


def test_bf16_matrices_rounds_only_what_the_decoder_reads_in_bf16():
    cfg = ne.Config(V=30, C=16, Hq=2, Hkv=1, L=1, T=8, F=48, K=2)
    flat = np.random.default_rng(0).normal(0, 1, ne.num_params(cfg)).astype(np.float32)
    got, src = ne.carve(nc.bf16_matrices(flat, cfg), cfg), ne.carve(flat, cfg)
    assert np.array_equal(got["tok_emb"], src["tok_emb"]) and np.array_equal(got["final_norm"], src["final_norm"])
    w = got["layers.0.wqkv"]
    assert not np.array_equal(w, src["layers.0.wqkv"])
    assert np.all(w.astype(np.float32).view(np.uint32) & 0xFFFF == 0)           # 8 mantissa bits left
    assert np.max(np.abs(w - src["layers.0.wqkv"]) / np.abs(src["layers.0.wqkv"])) <= 2.0 ** -8


def test_sft_and_chat_flags_match_the_cpu_commands():
    gpu_args = nc.build_parser().parse_args(["sft", "--model", "m.safetensors"])
    cpu_args = ne.build_parser().parse_args(["sft", "--model", "m.safetensors"])
    for name, value in vars(cpu_args).items():
        if name not in ("threads", "save_minutes"):      # the GPU saves by the clock (test_async_save.py)
            assert getattr(gpu_args, name) == value, name
    assert gpu_args.precision == "bf16" and gpu_args.save_minutes == 10 and cpu_args.save_minutes is None
    chat = nc.build_parser().parse_args(["chat", "--model", "m.safetensors", "--speculative"])
    cpu_chat = ne.build_parser().parse_args(["chat", "--model", "m.safetensors", "--speculative"])
    for name, value in vars(cpu_chat).items():
        if name != "drafts":
            assert getattr(chat, name) == value, name
    assert chat.drafts == nc.DEFAULT_DRAFTS and chat.precision == "bf16"


@pytest.mark.parametrize("argv, words", [
    (["bench", "huge"], "unknown model huge; choose one of small, big"),
    (["bench", "--decode-only", "--decode-precision", "fp8"], "--decode-precision fp8: give bf16, fp32"),
    (["bench", "--decode-precision", "bf16,"], "--decode-precision bf16,: give"),
    (["bench", "--decode-only", "--no-decode"], "--decode-only and --no-decode together"),
])
def test_bench_flags_are_refused_before_a_gpu_starts(argv, words, monkeypatch, capsys):
    monkeypatch.setattr(nc, "init_gpu", lambda *a, **k: pytest.fail("a GPU was asked for"))
    with pytest.raises(SystemExit) as e:
        nc.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err


def test_a_stray_rank_variable_is_named_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(nc, "init_gpu", lambda *a, **k: pytest.fail("a GPU was asked for"))
    for name in ("NANOEULER_RANK", "NANOEULER_WORLD"):
        for value in ("abc", "\u00b2"):                  # superscript two: a digit to isdigit, not to int
            monkeypatch.setenv(name, value)
            with pytest.raises(SystemExit) as e:
                nc.main(["bench"])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"{name}={value!r} in the environment is not a number" in err
        monkeypatch.setenv(name, "0")


def test_cmd_sft_hands_its_batches_to_the_given_engine(tmp_path, monkeypatch):
    cfg = ne.Config(V=ne.Tokenizer().vocab_size, C=16, Hq=2, Hkv=1, L=1, T=64, F=48, K=2)
    model = str(tmp_path / "m.safetensors")
    ne.save_model(model, cfg, ne.init_params(cfg), ne.Tokenizer())
    args = ne.build_parser().parse_args(["sft", "--model", model, "--out", str(tmp_path / "sft"), "--batch", "4"])
    args.run = ne.RunFolder(args.out)                  # what run_command hands a command: its run's folder
    seen = {}

    def loop(args, cfg, tok, engine, next_batch, val, run, state, prompt):
        seen["engine"], seen["batch"] = engine, next_batch(np.random.default_rng(0))

    monkeypatch.setattr(ne, "train_loop", loop)
    made = object()
    ne.cmd_sft(args, make_engine=lambda cfg_, flat, m, v: made, engine_line="a GPU")
    assert seen["engine"] is made
    idx, targets = seen["batch"]
    assert idx.shape == (4, cfg.T) and targets.shape == (4, cfg.T, cfg.K)
    # every row starts with <|user|>, a prompt: its first targets are ignored (-1)
    assert np.all(idx[:, 0] == ne.Tokenizer().special("<|user|>")) and np.all(targets[:, 0] == -1)
    assert np.all((targets >= 0).any(axis=(1, 2)))                       # and each has a response


def test_chat_runs_nanoeuler_repl_with_the_gpu_generate(tmp_path, monkeypatch, capsys):
    tok = ne.Tokenizer()
    cfg = ne.Config(V=tok.vocab_size, C=16, Hq=2, Hkv=1, L=1, T=64, F=48, K=3)
    model = str(tmp_path / "m.safetensors")
    flat = np.random.default_rng(3).normal(0, 0.3, ne.num_params(cfg)).astype(np.float32)
    ne.save_model(model, cfg, flat, tok)
    transcripts = []
    for speculative in (False, True):
        for gpu in (False, True):
            argv = ["chat", "--model", model, "--temperature", "0", "--max-new-tokens", "20"]
            args = (nc if gpu else ne).build_parser().parse_args(argv + ["--speculative"] * speculative)
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello there\n/reset\nhi\n/quit\n")))
            if gpu:                                        # the GPU's generate, on the stand-in decoder
                ne.cmd_chat(args, make_params=lambda cfg_, flat_: StandInDecoder(ne.carve(flat_, cfg_), cfg_),
                            gen=nc.generate)
            else:
                ne.cmd_chat(args)
            transcripts.append(capsys.readouterr().out)
    assert transcripts[0] == transcripts[1] == transcripts[2] == transcripts[3]
    assert "(history cleared)" in transcripts[0] and transcripts[0].count("bot> ") == 2


def test_gpu_sample_is_nanoeuler_sample_with_the_gpu_generate(tmp_path, monkeypatch, capsys):
    """the GPU's sample runs nanoeuler.py's (its notes on --drafts too), generating with the GPU's generate"""
    tok = ne.Tokenizer()
    cfg = ne.Config(V=tok.vocab_size, C=16, Hq=2, Hkv=1, L=1, T=64, F=48, K=3)
    model = str(tmp_path / "m.safetensors")
    ne.save_model(model, cfg, np.random.default_rng(4).normal(0, 0.3, ne.num_params(cfg)).astype(np.float32), tok)
    monkeypatch.setattr(nc, "GPUDecoder", lambda cfg_, flat_, precision: StandInDecoder(ne.carve(flat_, cfg_), cfg_))
    argv = ["sample", "--model", model, "--prompt", "ab", "--temperature", "0", "--max-new-tokens", "20",
            "--speculative", "--drafts", "5"]
    outputs = []
    for module in (ne, nc):
        module.cmd_sample(module.build_parser().parse_args(argv))
        outputs.append(capsys.readouterr())
    assert outputs[0].out == outputs[1].out and outputs[0].out.startswith("ab")
    assert "fewer than --drafts 5; drafting with 2" in outputs[1].err


needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cuda") is None,
                                 reason="cuda-python is not installed (pip install -r requirements-dev.txt)")


@needs_nvrtc
def test_nvrtc_compiles_the_decode_kernels(tmp_path):
    cubin = nc.compile_kernels("90", str(tmp_path))["kernels.cu"]
    names = ["attention_decode_kernel", "argmax_accept_kernel"]
    names += [f"attention_decode_split_kernel_{D}" for D in nc.SPLIT_HEAD_DIMS]
    names += list(nc.DECODE_MATVEC_KERNELS.values())
    assert len(set(names)) == 2 + len(nc.SPLIT_HEAD_DIMS) + 8
    for name in names:
        assert name.encode() in cubin, name                         # extern "C": the name is in the CUBIN


def test_the_kernels_constants_match():
    with open(os.path.join(HERE, "kernels.cu")) as f:
        source = f.read()
    for name in ("DECODE_MAX_ROWS", "DECODE_OUTS", "DECODE_LOADS", "DECODE_CHUNK", "DECODE_HEADS"):
        assert f"#define {name} {getattr(nc, name)} " in source, name
    for D in nc.SPLIT_HEAD_DIMS:
        assert f"attention_decode_split<{D}>(" in source, D
    with open(os.path.join(HERE, "flash_attn.cu")) as f:
        attention = f.read()
    for D, mt in nc.FORWARD_MT.items():                     # the bf16 forward's rows a block follow its m-tiles
        assert re.search(rf"attention_forward_bf16<{D}, {mt}, \w+>\(", attention), D


def test_matvec_splits_of_the_big_model_on_an_h200():
    # 132 SMs, 4 outputs a warp: each lane at most 2 loads of 16 bytes a weight row (64 chunks
    # a warp), and more warps while there are fewer than 8 per SM (1056 warps, so while
    # Out x splits < 4224) and each lane keeps at least one chunk (64 chunks a part before the split)
    big, sms = ne.PRESETS["big"], 132
    C, F, V, QKV = big.C, big.F, big.V, (big.Hq + 2 * big.Hkv) * big.D
    bf16 = {(C, QKV): 2, (C, C): 2, (C, 2 * F): 2, (F, C): 8, (C, V): 2}     # wqkv, wo, gate/up, down, a head
    for (In, Out), splits in bf16.items():
        assert nc.matvec_splits(In, Out, 8, sms) == splits, (In, Out)
    assert nc.matvec_splits(C, QKV, 4, sms) == 4 and nc.matvec_splits(F, C, 4, sms) == 8    # fp32: 4 a load
    assert nc.matvec_splits(C, 2 * F, 4, sms) == 4                            # 192 chunks: 4 parts of 48
    assert nc.matvec_splits(8192, 4096, 8, sms) == 8                          # 1024 chunks: 8 parts of 128
    assert nc.matvec_splits(32768, 4096, 8, sms) == 8                         # at most 8; the kernel loops
    for In in (64, 768, 2048, 8192):
        for Out in (8, 768, 4096, 16384):
            s = nc.matvec_splits(In, Out, 8, sms)
            assert s in (1, 2, 4, 8)
            fits = lambda k: math.ceil(In / 8 / k) <= 64 and (Out * k >= 4 * 1056 or In / 8 < 64 * k)
            assert (fits(s) or s == 8) and (s == 1 or not fits(s // 2)), (In, Out, s)


def test_attention_kernel_and_its_scratch():
    assert nc.attention_kernel(64) == "split" and nc.attention_kernel(64, "single") == "single"
    assert nc.attention_kernel(24) == "single"                               # no split kernel for D = 24
    with pytest.raises(ne.NanoEulerError, match="'split' or 'single'"):
        nc.attention_kernel(64, "flash")
    # big: 4 kv heads of 3 query heads (one block each), 8 chunks of 64 keys, 512 rows at most,
    # a record of 4 heads x (64 + 2) floats per (row, block, chunk); a count per (row, block)
    assert nc.split_scratch(ne.PRESETS["big"]) == (512 * 4 * 8 * 4 * 66, 512 * 4)
    many = ne.Config(V=96, C=512, Hq=8, Hkv=1, L=1, T=160, F=176, K=2)     # G = 8: two blocks per kv head
    assert nc.split_scratch(many) == (160 * 2 * 3 * 4 * 66, 160 * 2)
    longest = ne.Config(V=96, C=512, Hq=8, Hkv=8, L=1, T=8192, F=176, K=2)   # a prefill launches 512 rows at most
    assert nc.split_scratch(longest) == (512 * 8 * 128 * 4 * 66, 512 * 8)


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")


def emulator_module():
    spec = importlib.util.spec_from_file_location("emulate_cuda", os.path.join(HERE, "tools", "emulate_cuda.py"))
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    return emulator


def check_parts_module():
    """dev/gpu/check_parts.py: check part by part, the device script's fallback"""
    spec = importlib.util.spec_from_file_location("gpu_check_parts", os.path.join(HERE, "dev", "gpu", "check_parts.py"))
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    return parts


def test_the_emulator_run_bare_runs_its_default_checks(monkeypatch, capsys):
    # docs/gpu.md and its docstring give `python tools/emulate_cuda.py` bare: kernels, training and decoding.
    # Python 3.11's argparse checked the list default against choices= as one value and exited 2 at once
    # ("invalid choice: ['kernels', 'training', 'decoding']"); now it gets past its flags to the emulator
    emulator = emulator_module()

    class Started(Exception):
        pass

    def install(nc, **schedule):
        raise Started
    monkeypatch.setattr(emulator, "install", install)
    monkeypatch.setattr(sys, "argv", ["emulate_cuda.py"])
    with pytest.raises(Started):
        emulator.main()
    assert emulator.parse_args([]).what == ["kernels", "training", "decoding"]
    assert emulator.parse_args(["fast", "kernels"]).what == ["fast", "kernels"]
    with pytest.raises(SystemExit) as stop:                 # a word it does not know is still refused
        emulator.parse_args(["fats"])
    assert stop.value.code == 2 and "'fats' is not a check this emulator runs" in capsys.readouterr().err


@needs_gxx
def test_the_emulators_fibers_run_where_g_plus_plus_fortifies_longjmp(tmp_path):
    # the fibers longjmp between stacks; glibc's fortified longjmp (Ubuntu's g++ fortifies by
    # default) aborts the whole process on that unless the emulator turns it off
    (tmp_path / "mirror.cu").write_text(
        'extern "C" __global__ void mirror_kernel(float* x) {\n'
        "    __shared__ float s[64];\n"
        "    s[threadIdx.x] = x[threadIdx.x];\n"
        "    __syncthreads();\n"
        "    x[threadIdx.x] = s[63 - threadIdx.x];\n"
        "}\n")
    code = f"""
import ctypes, sys, numpy as np
sys.path.insert(0, {os.path.join(HERE, "tools")!r})
import emulate_cuda
lib = emulate_cuda.load({str(tmp_path / "mirror.cu")!r}, cache_dir={str(tmp_path)!r},
                        flags=("-D_FORTIFY_SOURCE=2",))
x = np.arange(64, dtype=np.float32)
arg = ctypes.c_void_p(x.ctypes.data)
launch = lib.emu_launch(lib.emu_kernel(b"mirror_kernel"), 1, 1, 1, 64, (ctypes.c_void_p * 1)(ctypes.addressof(arg)))
assert not lib.emu_run(launch)
print(x[:3].tolist(), x[-1])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=HERE, timeout=300)   # an abort kills it
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.decode().split() == ["[63.0,", "62.0,", "61.0]", "0.0"]


@pytest.fixture
def emulated(monkeypatch):
    """nanoeuler_cuda on tools/emulate_cuda.py's CPU emulator of kernels.cu"""
    monkeypatch.setattr(nc, "cu", nc.cu)
    monkeypatch.setattr(nc, "gpu", nc.gpu)
    monkeypatch.setattr(nc, "ATTENTION_BACKWARD_TMA", True)      # the product's default, pinned here
    monkeypatch.setattr(nc, "PRODUCT_TMA", True)                 # the product's default, pinned here
    monkeypatch.setattr(nc, "PRODUCT_TMA_BACKWARD", True)        # off by default until timed; the checks run it
    return emulator_module().install(nc)


@needs_nvrtc
@needs_gxx
def test_decode_kernels_on_the_cpu_emulator(emulated, monkeypatch):
    # kernels.cu run on the CPU against nanoeuler.model_forward with a KV cache: rows that see
    # one to three chunks of keys (D = 64, 8 query heads per kv head), both attention kernels,
    # fp32 and bf16; a 3-row pass == one-row steps; PDL launches, and a prefill's attention
    # launched over slices of its rows, and the layers as one kernel (decode_layers, its blocks
    # at once), give the same bits as plain launches of all rows
    cfg = ne.Config(V=96, C=512, Hq=8, Hkv=1, L=1, T=160, F=176, K=2)
    rng = np.random.default_rng(0)
    flat = ne.init_params(cfg, seed=1) + rng.normal(0, 0.05, nc.num_params(cfg)).astype(np.float32)
    ids = rng.integers(0, cfg.V, 134).tolist()
    failed, seen = [], {}
    for precision, attention, extra, slice_rows in (("fp32", "split", {}, 512), ("fp32", "single", {}, 512),
                                                    ("fp32", "split", {"pdl": True}, 512),
                                                    ("fp32", "split", {}, 48), ("bf16", "split", {}, 512),
                                                    ("fp32", "split", {"persistent": True}, 512),
                                                    ("bf16", "split", {"persistent": True}, 512)):
        monkeypatch.setattr(nc, "DECODE_PREFILL_ROWS", slice_rows)            # 126 rows: 48 + 48 + 30
        params = nc.reference_params(flat, cfg, precision)
        report = lambda what, err: failed.extend([] if err < nc.DECODE_TOLERANCE[precision] else [(what, err)])
        what = f"{precision} {attention} {sorted(extra)} slices of {slice_rows}"
        seen[what] = nc.check_decode_logits(report, what, cfg, flat, params, precision, ids, 126,
                                            attention=attention, **extra)
    assert not failed, failed
    plain = seen["fp32 split [] slices of 512"]
    for what in ("fp32 split ['pdl'] slices of 512", "fp32 split [] slices of 48",
                 "fp32 split ['persistent'] slices of 512"):
        assert all(np.array_equal(a, b) for a, b in zip(seen[what], plain)), what
    bf16 = seen["bf16 split [] slices of 512"]
    assert all(np.array_equal(a, b) for a, b in zip(seen["bf16 split ['persistent'] slices of 512"], bf16))
    assert emulated.programmatic > 0


@needs_nvrtc
@needs_gxx
def test_the_layers_as_one_kernel_give_the_bits_of_their_kernels_on_the_cpu_emulator(emulated, monkeypatch):
    # decode_layers over two layers (the weights and caches of layer 1 a stride on from layer 0's), its 4 blocks
    # at once (the emulator's processes), every stage's blocks taken in turns: the logits of a prefill, one-row
    # steps and 3-row passes within the bar of float64's, and the bits of the layers' kernels launched one by one
    cfg = ne.Config(V=96, C=64, Hq=4, Hkv=2, L=2, T=40, F=176, K=4)
    rng = np.random.default_rng(5)
    flat = ne.init_params(cfg, seed=2) + rng.normal(0, 0.05, nc.num_params(cfg)).astype(np.float32)
    ids = rng.integers(0, cfg.V, 20).tolist()
    launched, launch = [], nc.decode_launch
    monkeypatch.setattr(nc, "decode_launch", lambda name, *a, **k: launched.append(name) or launch(name, *a, **k))
    for precision in ("fp32", "bf16"):
        params = nc.reference_params(flat, cfg, precision)
        errors = []
        report = lambda what, err: errors.append((what, err))
        one_by_one = nc.check_decode_logits(lambda *_: None, precision, cfg, flat, params, precision, ids, 12,
                                            persistent=False)
        persistent = nc.check_decode_logits(report, precision, cfg, flat, params, precision, ids, 12, persistent=True)
        assert [e for e in errors if not e[1] < nc.DECODE_TOLERANCE[precision]] == [], errors
        assert all(np.array_equal(a, b) for a, b in zip(persistent, one_by_one)), precision
        assert f"decode_layers_{'bf16' if precision == 'bf16' else 'f32'}_16" in launched


@needs_nvrtc
@needs_gxx
def test_decode_matvec_on_the_cpu_emulator_against_float64(emulated):
    # decode_matvec (nanoeuler_cuda's launcher, kernels.cu run on the CPU) against float64 numpy:
    # every mode, fp32 and bf16 weights, += into a wider output; 13 outputs (the 4 a warp takes
    # leave the last group partly empty) with rows of 64, 1024 and 2048 inputs (the launcher's
    # splits), and 45 outputs over two blocks, the most rows at 1 warp a group (all 256 threads in the
    # last phase) and 2 rows at 2; each row of a launch has the bits of that row launched alone
    nc.init_gpu("fp32")
    rng = np.random.default_rng(5)
    for R, Out, In, splits in ((3, 13, 64, None), (3, 13, 1024, None), (3, 13, 2048, None),
                               (nc.DECODE_MAX_ROWS, 45, 768, 1), (2, 45, 768, 2)):
        check_decode_matvec(rng, R, Out, In, splits)


def check_decode_matvec(rng, R, Out, In, splits):
    """decode_matvec with R rows, Out outputs, In inputs (splits: the launcher's, or these)
    in every mode and with fp32 and bf16 weights, against float64"""
    ld = Out + 3
    for kind in ("f32", "bf16"):
        w = rng.normal(0, 1, (Out, In)).astype(np.float32)
        w_ref = (nc.bf16_round(w) if kind == "bf16" else w).astype(np.float64)
        w_gpu = nc.activation(w, kind == "bf16")
        for mode in ("plain", "rmsnorm", "swiglu"):
            x = rng.normal(0, 1, (R, 2 * In if mode == "swiglu" else In)).astype(np.float32)
            norm_w = rng.normal(1, 0.2, In).astype(np.float32)
            before = rng.normal(0, 1, (R, ld)).astype(np.float32)
            xr = x.astype(np.float64)
            if mode == "rmsnorm":
                xr = xr / np.sqrt((xr ** 2).mean(1, keepdims=True) + 1e-5) * norm_w
            elif mode == "swiglu":
                g, u = xr[:, :In], xr[:, In:]
                xr = g / (1 + np.exp(-g)) * u
            ref = before.astype(np.float64)
            ref[:, :Out] += xr @ w_ref.T
            out, x_gpu, n_gpu = nc.to_gpu(before), nc.to_gpu(x), nc.to_gpu(norm_w)
            nc.decode_matvec(out, x_gpu, w_gpu, n_gpu, R, In, Out, mode, accumulate=True, ld_out=ld, splits=splits)
            got = out.download()
            assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max(), (R, Out, In, kind, mode)
            for r in range(R):                                      # the same bits row by row
                one = nc.to_gpu(before[r:r + 1])
                nc.decode_matvec(one, nc.to_gpu(x[r:r + 1]), w_gpu, n_gpu, 1, In, Out, mode, accumulate=True,
                                 ld_out=ld, splits=splits)
                assert np.array_equal(one.download()[0], got[r]), (R, Out, In, kind, mode, r)


def emulated_accept(logits, fed, R, n_heads, V):
    """argmax_accept_kernel over logits (R * n_heads, V) with ids = fed -> amax, emitted ids, new pos"""
    ids = nc.to_gpu(np.array(fed + [0] * (nc.DECODE_MAX_ROWS - len(fed)), np.int32), np.int32)
    pos, counter = nc.DeviceArray((1,), np.int32).zero(), nc.DeviceArray((1,), np.int32).zero()
    ring, amax = nc.HostRing(nc.RING * (1 + nc.DECODE_MAX_ROWS)), nc.DeviceArray((R, n_heads), np.int32)
    nc.argmax_accept(ids, pos, counter, ring.ptr, amax, nc.to_gpu(logits.astype(np.float32)), V, R, n_heads)
    nc.gpu.sync()
    entry = ring.array[:1 + nc.DECODE_MAX_ROWS]
    return amax.download(), entry[1:1 + entry[0]].tolist(), int(pos.download()[0])


@needs_nvrtc
@needs_gxx
def test_argmax_accept_on_the_cpu_emulator(emulated):
    # the argmax is np.argmax's (the first index on ties), over rows wider than a round of the
    # block's 256 threads x 16 loads, wherever the maximum lies
    nc.init_gpu("fp32")
    V = 600
    for top in ([44, 300], [3, 20], [200], [599], [0, 599], [256 * 2 + 7, 7]):   # one thread; one warp; ...
        row = np.zeros((1, V))
        row[0, top] = 5.0
        assert emulated_accept(row, [1], 1, 1, V)[0][0, 0] == min(top), top
    # the acceptance rule, 3 rows fed [a, b, c] with 3 heads: row 0's head 0 chose b (the draft
    # fed after it: kept), row 1's head 0 chose d, not c: so b and d are emitted, pos moves by 2,
    # and the next feed is row 1's choices
    a, b, c, d = 1, 2, 3, 4
    logits = np.zeros((3, 3, V))
    for r, choices in enumerate(([b, c, 9], [d, 7, 8], [5, 6, 10])):
        logits[r, range(3), choices] = 1.0
    amax, emitted, pos = emulated_accept(logits.reshape(3, -1), [a, b, c], 3, 3, V)
    assert amax.tolist() == [[b, c, 9], [d, 7, 8], [5, 6, 10]] and emitted == [b, d] and pos == 2


@needs_nvrtc
@needs_gxx
@pytest.mark.parametrize("kernel, T, p0, D", [("split", 80, 70, 64), ("single", 300, 290, 64), ("split", 600, 590, 64),
                                              ("split", 80, 70, 16), ("split", 80, 70, 128), ("single", 80, 70, 128),
                                              ("split", 80, 70, 8)])
def test_decode_attention_with_two_groups_of_heads_against_float64(emulated, kernel, T, p0, D):
    # G = 6 query heads a kv head: two blocks of DECODE_HEADS = 4 and 2 heads; 2 rows at *pos = p0
    # over the cache and their own keys, y exactly R rows (a block writing past its heads would
    # write past it), against softmax attention in float64 with rope by hand (SPEC); and the
    # rows' rotated keys and values in the cache. At 590 the split kernel combines 10 chunks (past
    # the 8 that combine_chunks loads at once); at 290 the single kernel's warps take 32 keys a
    # round 8 at a time: a warp's second round rescales what its first summed (a kernel that did
    # not would pass at 80). D = 8, 16 and 128: the builds of the split kernel that no other test runs
    # (at D = 8 a key has 2 lanes for 4 heads: its scores take the shuffle trees, not the reduce-scatter)
    nc.init_gpu("fp32")
    Hq, Hkv, R = 6, 1, 2
    rng = np.random.default_rng(0)
    H = Hq + 2 * Hkv
    qkv = rng.normal(0, 1, (R, H * D)).astype(np.float32)
    k_cache, v_cache = (rng.normal(0, 1, (T, Hkv, D)).astype(np.float32) for _ in range(2))
    cos, sin = ne.rope_table(T, D, 0, np.float32)
    cfg = ne.Config(V=96, C=Hq * D, Hq=Hq, Hkv=Hkv, L=1, T=T, F=176, K=2)
    partial, count = nc.split_scratch(cfg)
    y, k_gpu, v_gpu = nc.DeviceArray((R, Hq * D)), nc.to_gpu(k_cache), nc.to_gpu(v_cache)
    nc.attention_decode(y, k_gpu, v_gpu, nc.to_gpu(qkv), nc.to_gpu(cos), nc.to_gpu(sin),
                        nc.to_gpu(np.array([p0], np.int32), np.int32), R, Hq, Hkv, D, T, kernel,
                        (nc.DeviceArray((partial,)), nc.DeviceArray((count,), np.int32).zero()))
    nc.gpu.sync()

    def rope(x, p):
        angle = p * 10000.0 ** (-2 * np.arange(D // 2) / D)
        a, b = x[:D // 2], x[D // 2:]
        return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)])
    q64 = qkv.astype(np.float64).reshape(R, H, D)
    keys, values = k_cache[:, 0].astype(np.float64), v_cache[:, 0].astype(np.float64)
    for r in range(R):
        keys[p0 + r], values[p0 + r] = rope(q64[r, Hq], p0 + r), q64[r, Hq + 1]
    want = np.zeros((R, Hq, D))
    for r in range(R):
        n = p0 + r + 1
        for h in range(Hq):
            s = keys[:n] @ rope(q64[r, h], p0 + r) / np.sqrt(D)
            w = np.exp(s - s.max())
            want[r, h] = w @ values[:n] / w.sum()
    assert np.abs(y.download() - want.reshape(R, -1)).max() < 1e-5
    assert np.abs(k_gpu.download()[:, 0] - keys).max() < 1e-5 and np.array_equal(v_gpu.download()[:, 0], values)


@needs_nvrtc
@needs_gxx
def test_a_prefill_uses_its_own_decoders_precision_whatever_was_set_last(emulated):
    # an fp32 decoder made before a bf16 one (init_gpu leaves cuBLAS in bf16): its prefill's
    # logits are still fp32's, against float64
    cfg = ne.Config(V=24, C=64, Hq=4, Hkv=2, L=1, T=40, F=48, K=2)
    flat = ne.init_params(cfg, seed=1) + np.random.default_rng(0).normal(0, 0.05, nc.num_params(cfg)).astype(np.float32)
    fp32 = nc.GPUDecoder(cfg, flat, "fp32")
    nc.GPUDecoder(cfg, flat, "bf16")
    prompt = list(range(1, 20))
    fp32.wait(fp32.prefill(prompt, 1))
    want = ne.model_forward(ne.carve(flat.astype(np.float64), cfg), cfg, np.array([prompt]))[0][0, -1]
    got = fp32.logits.view(0, (cfg.V,)).download()
    assert np.abs(got - want).max() / np.abs(want).max() < nc.DECODE_TOLERANCE["fp32"]


@needs_nvrtc
@needs_gxx
def test_a_long_greedy_run_goes_round_the_ring_of_chosen_ids(emulated):
    # 100 tokens in one window (T = 160, no slide): more passes than the ring has entries
    nc.init_gpu("fp32")
    cfg = ne.Config(V=24, C=32, Hq=4, Hkv=2, L=1, T=160, F=48, K=3)
    flat = nc.margin_model(cfg, np.random.default_rng(7))
    want = list(ne.generate(ne.carve(flat.astype(np.float64), cfg), cfg, [3], 100, temperature=0))
    stats = {}
    assert list(nc.generate(nc.GPUDecoder(cfg, flat, "fp32"), cfg, [3], 100, temperature=0, stats=stats)) == want
    assert stats["steps"] > nc.RING


@needs_nvrtc
@needs_gxx
def test_a_ctrl_c_while_a_decoding_step_is_captured_leaves_the_decoder_usable(emulated, monkeypatch):
    # chat's Ctrl-C stops a reply wherever it lands: in the first step's graph capture, the
    # pass the captured tail counted must not stay counted (the ring of chosen ids would then
    # be read one entry off), and the next reply is what a fresh decoder gives
    cfg = ne.Config(V=96, C=64, Hq=2, Hkv=1, L=1, T=32, F=48, K=2)
    flat = ne.init_params(cfg, seed=2)
    nc.init_gpu("fp32")
    want = list(nc.generate(nc.GPUDecoder(cfg, flat, "fp32"), cfg, [1, 2, 3], 12, temperature=0))
    dec = nc.GPUDecoder(cfg, flat, "fp32")
    step = dec.step

    def interrupted(R, n_heads):
        step(R, n_heads)
        raise KeyboardInterrupt
    monkeypatch.setattr(dec, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(nc.generate(dec, cfg, [1, 2, 3], 12, temperature=0))
    assert dec.passes == 1 and not dec.graphs                    # the prefill's pass alone
    monkeypatch.setattr(dec, "step", step)
    assert list(nc.generate(dec, cfg, [1, 2, 3], 12, temperature=0)) == want
    # and right after a step's launch, before the host counted it: the next prefill puts the
    # counts in step again (else every later reply would read the ring one entry late)
    launch, hits = nc.cu.cuGraphLaunch, []

    def launched_then_interrupted(*a):
        result = launch(*a)
        if not hits:
            hits.append(1)
            raise KeyboardInterrupt
        return result
    monkeypatch.setattr(nc.cu, "cuGraphLaunch", launched_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(nc.generate(dec, cfg, [1, 2, 3], 12, temperature=0))
    assert list(nc.generate(dec, cfg, [1, 2, 3], 12, temperature=0)) == want


@needs_nvrtc
@needs_gxx
def test_no_garbage_collection_frees_gpu_memory_inside_a_graph_capture(emulated):
    # a DeviceArray in a reference cycle goes when the collector runs, which any allocation may
    # trigger; a cuMemFree inside a capture ends it with an error (an interrupted reply leaves
    # such cycles: frames, tracebacks). The collector is paused from before a capture begins
    # (training's and decoding's) to after it ends: with it set to run at every allocation,
    # none runs while the emulator captures
    import gc
    nc.init_gpu("fp32")
    cfg = ne.Config(V=96, C=64, Hq=2, Hkv=1, L=1, T=32, F=48, K=2)
    dec = nc.GPUDecoder(cfg, ne.init_params(cfg, seed=2), "fp32")
    dec.wait(dec.prefill([1, 2, 3], 1))
    x = nc.DeviceArray((4,)).zero()
    during = []

    def seen(phase, info):
        if phase == "start" and emulated.capture is not None:
            during.append(info["generation"])
    threshold = gc.get_threshold()
    gc.callbacks.append(seen)
    try:
        gc.set_threshold(1)
        nc.capture_graph(lambda: x.zero(), "a memset")
        dec.launch_step(1, 1)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(seen)
    assert during == []


@needs_nvrtc
@needs_gxx
def test_page_locked_memory_the_driver_refuses_is_named_as_the_hosts(emulated, monkeypatch):
    # cuMemHostAlloc's CUDA_ERROR_OUT_OF_MEMORY is about the machine's RAM (page-locked for the GPU's
    # copies: a checkpoint's weights and moments, a batch, the ring of chosen ids), not the GPU's; it
    # said "out of GPU memory in cuMemHostAlloc; lower --batch". cuMemAlloc's still says the GPU's
    oom = (emulated.real.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    monkeypatch.setattr(emulated, "cuMemHostAlloc", lambda n, flags: oom)
    for make, nbytes in ((lambda: nc.PinnedBuffer(3 << 20), "3,145,728"), (lambda: nc.HostRing(5), "20")):
        with pytest.raises(ne.NanoEulerError) as e:
            make()
        assert str(e.value) == (f"cuMemHostAlloc could not allocate {nbytes} bytes of page-locked host memory "
                                "(this machine's RAM, not the GPU's); free memory on this machine, or raise its "
                                "limit (a container's memory limit, ulimit -l)")
    monkeypatch.setattr(emulated, "cuMemAlloc", lambda n: oom)
    with pytest.raises(ne.NanoEulerError, match=r"^out of GPU memory in cuMemAlloc of 16 bytes; lower --batch$"):
        nc.DeviceArray((4,))


@needs_nvrtc
@needs_gxx
@pytest.mark.parametrize("argv, advice", [
    (["sample", "--prompt", "ab"], "free the GPU's memory (nvidia-smi lists what holds it), or decode a smaller model"),
    (["chat"], "free the GPU's memory (nvidia-smi lists what holds it), or decode a smaller model"),
    (["bench", "small", "--decode-only"], "free the GPU's memory (nvidia-smi lists what holds it), or decode a "
                                          "smaller model"),
    (["sft"], "lower --batch"),
])
def test_out_of_gpu_memory_advice_fits_the_command(emulated, monkeypatch, capsys, tmp_path, argv, advice):
    # cuMemAlloc's CUDA_ERROR_OUT_OF_MEMORY said "lower --batch" to sample, chat and serve, which have no
    # --batch; what they hold is the model (its weights, a bf16 copy, a KV cache of its T rows): --max-new-tokens
    # changes none of it
    tok = ne.Tokenizer()
    cfg = ne.Config(V=tok.vocab_size, C=32, Hq=2, Hkv=1, L=1, T=32, F=48, K=2)
    model = str(tmp_path / "m.safetensors")
    ne.save_model(model, cfg, ne.init_params(cfg, seed=1), tok)
    monkeypatch.setattr(emulated, "cuMemAlloc", lambda n: (emulated.real.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n")))
    with pytest.raises(SystemExit) as e:
        nc.main([*argv, "--model", model] + (["--out", str(tmp_path / "sft")] if argv[0] == "sft" else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and re.fullmatch(rf"error: out of GPU memory in cuMemAlloc of [\d,]+ bytes; "
                                              rf"{re.escape(advice)}", err[-1]), err


@needs_nvrtc
@needs_gxx
def test_the_decoding_profile_runs_on_the_cpu_emulator(emulated, capsys):
    # bench --profile's decoding part (graph replays, a pass by kernel, passes over 1..K rows
    # and heads) on a small model: every line it promises, and the decoder still decodes after
    cfg = ne.Config(V=96, C=64, Hq=2, Hkv=1, L=1, T=256, F=96, K=3)
    flat = ne.init_params(cfg, seed=3)
    nc.init_gpu("fp32")
    dec = nc.GPUDecoder(cfg, flat, "fp32")
    nc.profile_decoding(dec, list(range(10)), replays=5)
    out = capsys.readouterr().out
    passes = re.findall(r"a pass over (\d) rows? and (\d) heads?: ", out)
    assert passes == [("1", "1"), ("2", "1"), ("2", "2"), ("3", "1"), ("3", "3")], out
    assert "one step at position 11" in out and "a pass over 2 rows and 2 heads, launched one by one" in out
    assert "decode_matvec_rmsnorm_f32_kernel" in out and "argmax_accept_kernel" in out
    fresh = nc.GPUDecoder(cfg, flat, "fp32")
    assert list(nc.generate(dec, cfg, [1, 2, 3], 8, temperature=0)) == \
        list(nc.generate(fresh, cfg, [1, 2, 3], 8, temperature=0))
    # one head (no drafts) and a short context: no pass wider than the heads, none past T
    one = ne.Config(V=96, C=64, Hq=2, Hkv=1, L=1, T=24, F=96, K=1)
    nc.profile_decoding(nc.GPUDecoder(one, ne.init_params(one, seed=3), "fp32"), list(range(10)), replays=100)
    out = capsys.readouterr().out
    assert "one step at position 11" in out and "a pass over" not in out
    nc.profile_decoding(nc.GPUDecoder(one, ne.init_params(one, seed=3), "fp32"), list(range(23)))
    assert "no room in the context of 24" in capsys.readouterr().out


@needs_nvrtc
@needs_gxx
def test_training_checks_on_the_cpu_emulator(emulated, monkeypatch):
    # check's training half on kernels.cu compiled for the CPU in both builds (floatX float
    # and bfloat16) and flash_attn.cu (its tensor-core passes too), part by part as
    # dev/gpu/check_parts.py runs it on a GPU: every kernel against numpy, attention in fp32,
    # tf32 and bf16, the model's loss and gradients in each, SFT rows, and whole steps in fp32
    # and bf16: AdamW against numpy, the NaN stop, and 3 steps replayed from the captured graph
    # (per precision, and the NaN step) with the bits of kernel-by-kernel steps. Each line of
    # output is named to the part that printed it, as the device script's fallback reads it.
    # The emulator is compute capability 9.0: bf16 at D = 64 runs flash_attn.cu's TMA forward and
    # TMA dk/dv pass (their tensor maps through the stand-in driver), the mma.sync ones checked beside them, and
    # the bf16 forward's products flash_attn.cu's TMA product (w_gate_up's with SwiGLU in its epilogue), and the
    # backward's data gradients its NN product (w_down's with swiglu_backward in its epilogue).
    parts = check_parts_module()
    failed, misnamed, part, lines = [], [], None, []
    # check's TMA products at small shapes (the GPU's, the big model's, take minutes here): 2 SMs walking 6 tiles,
    # ragged M, N, F and K
    monkeypatch.setattr(nc, "PRODUCT_CHECKS", {"wqkv": (200, 528, 136), "wo": (72, 256, 64),
                                               "w_gate_up": (136, 528, 72), "w_down": (72, 264, 200)})

    def reporter(tol):
        def report(what, err):
            lines.append(what)
            failed.extend([] if err < tol else [(what, err)])
            misnamed.extend([] if parts.part_of(what) == part else [(part, what)])
        return report

    launched, launch = set(), emulated.cuLaunchKernel                # (part, kernel) of each launch
    monkeypatch.setattr(emulated, "cuLaunchKernel",
                        lambda f, *rest: (launched.add((part, f.name)), launch(f, *rest))[1])
    table = parts.parts(np.random.default_rng(0), reporter)
    for part in table:
        if not part.startswith("decoding"):                       # the tests above and below
            table[part]()
    assert not failed, failed
    assert not misnamed, misnamed
    assert emulated.replays == 2 * (3 + 1)
    assert "attention_forward_tma_kernel_64" in emulated.shared                 # it ran, its shared memory allowed
    assert "attention_backward_dkv_tma_kernel_64" in emulated.shared
    assert {"matmul_forward_tma_kernel", "matmul_swiglu_forward_tma_kernel"} <= set(emulated.shared)
    assert {f"product {what} (TMA)" for what in ("wqkv 200x528x136", "w_gate_up + swiglu: s")} <= set(lines)
    assert "product w_gate_up + swiglu: s == swiglu_forward's (bits)" in lines
    assert {"matmul_backward_tma_kernel", "matmul_swiglu_backward_tma_kernel"} <= set(emulated.shared)
    # the bf16 model's gradients and steps through the backward's TMA products, swiglu_backward in w_down's
    assert {(p, k) for p in ("model bf16", "step bf16", "sft bf16")
            for k in ("matmul_backward_tma_kernel", "matmul_swiglu_backward_tma_kernel")} <= launched
    assert ("step bf16", "swiglu_backward_kernel") not in launched
    assert {"product wqkv dx 200x136x528 (TMA)", "product w_down dx + swiglu_backward: dgu (TMA)",
            "product w_down dx + swiglu_backward: dgu == swiglu_backward's (bits)"} <= set(lines)
    assert {f"attention bf16 D=64 G=3 {what} ({kernel})" for what in ("forward", "dq", "dk", "dv")
            for kernel in ("TMA", "mma.sync")} <= set(lines)
    assert set(table) == {f"{what} {p}" for what in ("attention", "model") for p in ("fp32", "tf32", "bf16")} | \
        {f"{what} {p}" for what in ("step", "sft", "decoding", "kernels") for p in ("fp32", "bf16")} | \
        {"optimizer", "products"}


def test_the_device_fallback_reruns_the_failed_parts_of_check_or_all_after_a_crash(tmp_path):
    parts = check_parts_module()
    names = ["kernels fp32", "kernels bf16", "optimizer", "attention bf16", "step fp32", "decoding bf16"]
    log = tmp_path / "check.log"
    log.write_text("GPU check on an H200\n"
                   "rmsnorm_forward (bf16)                             1.2e-01  1e-03  NOT OK\n"
                   "rmsnorm_forward                                    1.0e-07  1e-05  OK\n"
                   "step fp32: graph == one by one, 4 steps (bits)     1.0e+00  1e-05  NOT OK\n"
                   "decode bf16 D=64 G=8 single 3-row pass at 130 logits  5.0e-01  2e-02  NOT OK\n"
                   "overall okay: 0\n")
    assert parts.failed_parts(str(log), names) == ["kernels bf16", "step fp32", "decoding bf16"]
    log.write_text("GPU check on an H200\nrmsnorm_forward                 1.0e-07  1e-05  OK\n"
                   "CUDA error CUDA_ERROR_ILLEGAL_ADDRESS in a copy from the GPU\n")       # raised: all again
    assert parts.failed_parts(str(log), names) == names


@needs_nvrtc
@needs_gxx
def test_speculative_equals_plain_greedy_on_the_cpu_emulator(emulated):
    params = margin_model(CFG)
    want = list(ne.generate(params, CFG, [3, 5, 7], 2 * CFG.T, temperature=0))
    dec = nc.GPUDecoder(CFG, nc.margin_model(CFG, np.random.default_rng(7)), "bf16")
    dec.costs[2], dec.costs[3] = 1.05, 1.1              # no timing in a test (pass_cost measures it on a GPU)
    assert list(nc.generate(dec, CFG, [3, 5, 7], 2 * CFG.T, temperature=0)) == want
    stats = {}
    assert list(nc.generate(dec, CFG, [3, 5, 7], 2 * CFG.T, temperature=0, speculative=True, drafts=2,
                            stats=stats)) == want
    assert stats["tokens"] / stats["steps"] > 1.3


@pytest.mark.parametrize("argv", [["sft", "--model", "{missing}"], ["bench", "--model", "{missing}"]])
def test_a_missing_model_is_named_before_the_gpu_starts(tmp_path, argv):
    # with or without a GPU, the first thing a user hears of is their own file
    import subprocess
    missing = str(tmp_path / "no_such_model.safetensors")
    argv = [a.format(missing=missing) for a in argv] + (["--out", str(tmp_path / "run")] if argv[0] == "sft" else [])
    r = subprocess.run([sys.executable, nc.__file__, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert missing in r.stderr and "driver" not in r.stderr


def test_target_counts_are_the_kept_targets_of_each_head():
    rng = np.random.default_rng(5)
    targets = rng.integers(0, 50, (3, 7, 4))
    targets[rng.random((3, 7, 4)) < 0.3] = -1
    targets[:, :, 2] = -1                                            # a head with none kept
    expected = [sum(targets[b, t, k] != -1 for b in range(3) for t in range(7)) for k in range(4)]
    assert list(nc.target_counts(targets)) == expected and expected[2] == 0
    assert list(nc.target_counts(np.zeros((2, 5, 3), np.int32))) == [10, 10, 10]


@needs_nvrtc
@needs_gxx
def test_check_runs_both_bf16_attention_forwards_and_both_dkv_passes(emulated, monkeypatch):
    # check_attention in bf16 on compute capability 9.0: its "(TMA)" lines from flash_attn.cu's TMA forward and TMA
    # dk/dv pass, its "(mma.sync)" lines from the mma.sync ones (each launched once, at D = 64), all within the bar
    launched, launch = [], emulated.cuLaunchKernel
    monkeypatch.setattr(emulated, "cuLaunchKernel", lambda f, *rest: (launched.append(f.name), launch(f, *rest))[1])
    nc.gpu.precision = "bf16"
    errors = []
    nc.check_attention(np.random.default_rng(5), lambda what, err: errors.append((what, err)))
    bad = [(what, err) for what, err in errors if not err < nc.TOLERANCE["bf16"]]
    assert errors and not bad, bad
    for kernel in ("attention_forward_tma_kernel_64", "attention_forward_bf16_kernel_64",
                   "attention_backward_dkv_tma_kernel_64", "attention_backward_dkv_bf16_kernel_64"):
        assert launched.count(kernel) == 1, (kernel, launched)


@needs_nvrtc
@needs_gxx
# the emulator's harsher schedules: each cp.async held until the wait that covers it (late copies); each warp of a block
# running as far as it can before the next (warps ahead), copies landing at issue; and that with the warps reversed
@pytest.mark.parametrize("late, ahead, reverse", [(1, 0, 0), (0, 1, 0), (0, 1, 1)],
                         ids=["late copies", "warps ahead", "warps ahead, reversed"])
def test_the_attention_passes_with_copies_landing_at_their_waits(emulated, late, ahead, reverse):
    # flash_attn.cu's passes (fp32 CUDA cores, tf32 and bf16 tensor cores) with each cp.async held until the
    # cp.async.wait_group that covers it, the latest the PTX ISA allows (the emulator's default lands it at issue,
    # the earliest): a tile read before its wait would read what the buffer held before; or with each warp running
    # as far as it can before the next, where they take turns a barrier at a time: a missing block barrier lets a
    # warp read a tile before the others copied or wrote their part of it, or overwrite one they have still to read
    # (with copies landing at issue: held to their waits, the overwrite would land too late to show), and reversed,
    # the last warps first (a value the first warps write and the last read)
    for lib in nc.gpu.modules.values():
        lib.emu_set_late_copies(late)
        lib.emu_set_warps_ahead(ahead)
        lib.emu_set_reverse(reverse)
    errors = []
    try:
        for precision in ("fp32", "tf32", "bf16"):
            nc.gpu.precision = precision
            nc.check_attention(np.random.default_rng(5), lambda what, err: errors.append((what, err, precision)))
    finally:
        for lib in nc.gpu.modules.values():
            lib.emu_set_late_copies(0)
            lib.emu_set_warps_ahead(0)
            lib.emu_set_reverse(0)
    bad = [(what, err) for what, err, precision in errors if not err < nc.TOLERANCE[precision]]
    assert errors and not bad, bad
