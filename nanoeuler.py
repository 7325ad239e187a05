"""
NanoEuler: a GPT-2-scale language model in numpy, with every backward pass
written by hand and proven by a float64 gradient check.

    python nanoeuler.py check     # every gradient against float64 central differences (big tensors sampled)
    python nanoeuler.py train     # train the small model on the embedded corpus (4-9 min on 2 cores)
    python nanoeuler.py sample --model out/small/best.safetensors --prompt "ROMEO:"

and sft (fine-tune on instructions, loss on the responses only), chat (talk to the fine-tuned model), serve (chat
in a browser), prepare (tokenize a corpus before train), bench (time steps, tokenizer, generation), plot (log.svg).

The model (docs/SPEC.md is the contract; checkpoints are safetensors):
- byte-level BPE (byte-pair encoding) tokenizer with GPT-2 style pre-tokenization and chat specials
- token embedding, no learned positions; RoPE (rotary position embedding, rotate-half form) on q and k
- pre-norm blocks: RMSNorm -> grouped-query causal attention (Hq query heads
  share Hkv key/value heads) -> RMSNorm -> SwiGLU MLP, both on a residual stream
- no biases anywhere; K untied output heads, head k predicts token t+1+k
  (multi-token prediction), loss = CE_0 + mtp_weight * mean(CE_1..CE_K-1), CE_k: head k's cross-entropy
- AdamW, warmup + cosine schedule, grad-norm clipping; generation with a KV cache through the training
  forward, and self-speculative decoding with the MTP heads as drafts

The file reads in that order: configuration, layers (each forward beside its backward), the model,
gradient check, optimizer and schedule, generation, tokenizer, data, the training loop, a training step on
every core, supervised fine-tuning, chat and sample, command line; then the benchmark and the run's log
(its printed lines, log.csv and the loss plot, log.svg) and serve's entry. Last comes the operations part:
what keeps a long run from losing work or failing without a word (checked inputs, checkpoint files written
atomically and resumed from, the run folder's lock, signals, memory, lost output streams); a first reading
may skip it. A name the story uses above its definition is defined a little below, after the story (bench, the
run's log, serve's entry) or in operations; `python tools/layout.py --verbose` lists each with its line.

What it deliberately leaves out: dropout, mixed precision (float32 throughout, float64 in the check), a
gradient-accumulation flag (micro-batches only spread one batch over threads), training on more than one
process or machine (tokenizing a corpus does use every core), batched generation (one sequence at a time), any
autograd or framework. The GPU twin of this file is nanoeuler_cuda.py; it imports the config, tokenizer, data,
checkpoint and training-loop code from here and checks its kernels against the layers here.
"""

import codecs
import contextlib
import functools
import hashlib
import heapq
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
# and what only the operations part uses: a first reading may skip these
import argparse                     # the flags' parser, which operations' ArgumentParser extends
import bisect
import errno
import fcntl                        # POSIX: the run folder's lock; signals need POSIX anyway
import io
import pickle
import select
import signal
import stat
import threading
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait

# one BLAS thread: training runs threads of its own ("a training step on every core"), and two layers
# of threads on two cores made every step twice as slow; BLAS reads this as numpy loads, so it comes first
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
try:
    import numpy as np  # noqa: E402
except ImportError:                     # the one dependency: say so rather than a traceback
    print("error: numpy is not installed; run pip install -r requirements.txt", file=sys.stderr)
    sys.exit(2)

HERE = os.path.dirname(os.path.abspath(__file__))


class NanoEulerError(Exception):
    """A problem the user can fix: raised anywhere, it ends the command in one sentence on
    stderr, exit code 2, no traceback (run_command, at the end of the file, says it)."""


# -----------------------------------------------------------------------------
# configuration

MAX_V = 65536           # token ids are cached as uint16


@dataclass
class Config:
    V: int = 512              # vocabulary size (small 512, big 4096)
    C: int = 128              # model width (small 128, big 768)
    Hq: int = 4               # query heads (small 4, big 12)
    Hkv: int = 2              # key/value heads, shared by Hq/Hkv query heads each (small 2, big 4)
    L: int = 4                # transformer blocks (small 4, big 16)
    T: int = 128              # context length (small 128, big 512)
    F: int = 344              # SwiGLU hidden width = 8C/3 rounded up to a multiple of 8 (small 344, big 2048)
    K: int = 4                # output heads; head k predicts token t+1+k (small 4, big 4)
    mtp_weight: float = 0.5   # weight of the extra heads' mean loss, CE_1..CE_K-1 (small and big 0.5, SPEC's)

    @property
    def D(self):
        """head dimension (small 32, big 64)"""
        return self.C // self.Hq


PRESETS = {
    "small": Config(V=512, C=128, Hq=4, Hkv=2, L=4, T=128, F=344, K=4),
    "big": Config(V=4096, C=768, Hq=12, Hkv=4, L=16, T=512, F=2048, K=4),
}


# -----------------------------------------------------------------------------
# layers: forward and backward, side by side
#
# Every function takes its dtype from its inputs, so training runs them in
# float32 and the gradient check runs the very same code in float64.
# x_forward(...) -> out, cache;  x_backward(dout, cache) -> gradients. A backward may
# reuse its cache's arrays for the gradients it returns (a cache is used once).

def embedding_forward(idx, tok_emb):
    """idx (B,T) ints, tok_emb (V,C) -> x (B,T,C)"""
    return tok_emb[idx], (idx, tok_emb.shape)


def embedding_backward(dx, cache):
    """dx (B,T,C) -> dtok_emb (V,C); rows of repeated tokens add up"""
    idx, shape = cache
    dtok_emb = np.zeros(shape, dtype=dx.dtype)
    np.add.at(dtok_emb, idx.reshape(-1), dx.reshape(-1, shape[1]))
    return dtok_emb


def linear_forward(x, w):
    """x (..., IN), w (OUT, IN) -> x @ w.T (..., OUT); no bias, as SPEC says"""
    # flatten to 2-D first: numpy loops over the leading axes of an N-D matmul,
    # while one (B*T, IN) @ (IN, OUT) is a single large BLAS call, twice as fast
    x2 = x.reshape(-1, x.shape[-1])
    out = x2 @ w.T                                                     # (N,IN) @ (IN,OUT), N = B*T rows
    return out.reshape(*x.shape[:-1], w.shape[0]), (x, w)


def linear_backward(dout, cache):
    """dout (..., OUT) -> dx (..., IN), dw (OUT, IN)"""
    x, w = cache
    dout2 = dout.reshape(-1, dout.shape[-1])                          # (N,OUT)
    dx = (dout2 @ w).reshape(x.shape)                                 # (N,OUT) @ (OUT,IN)
    dw = dout2.T @ x.reshape(-1, x.shape[-1])                         # (OUT,N) @ (N,IN)
    return dx, dw


def rmsnorm_forward(x, w, eps=1e-5):
    """x (..., C), w (C,) -> out (..., C) = x / sqrt(mean(x^2) + eps) * w"""
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)       # (...,1), 1 / a row's root mean square
    return x * rstd * w, (x, w, rstd)


def rmsnorm_backward(dout, cache):
    """dout (..., C) -> dx (..., C), dw (C,)"""
    x, w, rstd = cache
    xhat = x * rstd                       # recompute: cheaper than caching another (B,T,C)
    dw = (dout * xhat).reshape(-1, x.shape[-1]).sum(0)                 # (C,)
    g = dout * w                          # gradient with respect to xhat
    # rstd depends on every x of the row, hence the mean term
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, dw


@functools.lru_cache(maxsize=16)
def rope_table_upto(n, D, dtype):
    """cos, sin (n, 1, D/2) for positions 0..n-1, computed in float64 and kept"""
    freq = 10000.0 ** (-np.arange(0, D // 2, dtype=np.float64) * 2.0 / D)  # (D/2,)
    angle = np.arange(n, dtype=np.float64)[:, None] * freq                 # (n, D/2), in float64
    return np.cos(angle)[:, None, :].astype(dtype), np.sin(angle)[:, None, :].astype(dtype)


def rope_table(T, D, pos, dtype):
    """cos, sin (T, 1, D/2) for absolute positions pos..pos+T-1 (SPEC: theta 10000)"""
    # decoding asks for one more position each step: a table for the next power of
    # two serves them all from the cache, sliced
    n = 1 << (pos + T - 1).bit_length()
    cos, sin = rope_table_upto(n, D, dtype)
    return cos[pos:pos + T], sin[pos:pos + T]


def rope_forward(x, pos=0):
    """x (B,T,H,D) at absolute positions pos.. -> rotated x (B,T,H,D), rotate-half form"""
    cos, sin = rope_table(x.shape[1], x.shape[3], pos, x.dtype)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]                                      # (B,T,H,D/2) each
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1), (cos, sin)


def rope_backward(dout, cache):
    """dout (B,T,H,D) -> dx (B,T,H,D): a rotation, so the backward rotates back"""
    cos, sin = cache
    h = dout.shape[-1] // 2
    da, db = dout[..., :h], dout[..., h:]
    # forward was: out = (a cos - b sin, b cos + a sin)
    return np.concatenate([da * cos + db * sin, db * cos - da * sin], -1)


@functools.lru_cache(maxsize=2048)                      # decoding meets every (Tq, Tk) up to T
def causal_mask(Tq, Tk, G, dtype):
    """additive mask (G*Tq, Tk), G = Hq/Hkv copies: 0 where query i (at position Tk-Tq+i) may see key j, else -inf"""
    i = np.arange(Tq)[:, None] + (Tk - Tq)
    mask = np.where(np.arange(Tk)[None, :] <= i, 0.0, -np.inf).astype(dtype)
    return np.tile(mask, (G, 1))


def attention_forward(q, k, v):
    """q (B,Tq,Hq,D), k v (B,Tk,Hkv,D) -> y (B,Tq,Hq,D); causal, grouped-query.

    Query head h reads kv head h // G with G = Hq/Hkv. Instead of repeating k
    and v G times, the G query heads of one kv head are stacked along the time
    axis, so one batched matmul per kv head serves all of them. Queries are the
    last Tq positions of the Tk keys, which is what the KV cache needs."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, Tq, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tq, D)
    kt = k.transpose(0, 2, 3, 1)                                      # (B,Hkv,D,Tk): k.T by kv head
    vh = v.transpose(0, 2, 1, 3)                                      # (B,Hkv,Tk,D): v by kv head
    att = (qg * (1.0 / math.sqrt(D))) @ kt    # (B,Hkv,G*Tq,D) @ (B,Hkv,D,Tk) -> (B,Hkv,G*Tq,Tk)
    att += causal_mask(Tq, Tk, G, q.dtype)
    att -= att.max(-1, keepdims=True)         # softmax in place (the largest array), shifted: exp cannot overflow
    np.exp(att, out=att)
    att /= att.sum(-1, keepdims=True)
    y = att @ vh                              # (B,Hkv,G*Tq,Tk) @ (B,Hkv,Tk,D) -> (B,Hkv,G*Tq,D)
    y = y.reshape(B, Hkv, G, Tq, D).transpose(0, 3, 1, 2, 4).reshape(B, Tq, Hq, D)
    return y, (qg, kt, vh, att)


def attention_backward(dy, cache):
    """dy (B,Tq,Hq,D) -> dq (B,Tq,Hq,D), dk dv (B,Tk,Hkv,D)"""
    qg, kt, vh, att = cache
    B, Tq, Hq, D = dy.shape
    Hkv = kt.shape[1]
    G = Hq // Hkv
    dyg = dy.reshape(B, Tq, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tq, D)
    datt = dyg @ vh.transpose(0, 1, 3, 2)     # (B,Hkv,G*Tq,D) @ (B,Hkv,D,Tk) -> (B,Hkv,G*Tq,Tk)
    # the G query heads of a kv head sit in one matmul, so their dv and dk add up here
    dvh = att.transpose(0, 1, 3, 2) @ dyg     # (B,Hkv,Tk,G*Tq) @ (B,Hkv,G*Tq,D) -> (B,Hkv,Tk,D)
    # softmax backward: ds = att * (datt - sum(datt * att)); masked entries have att = 0
    ds = datt                                 # in place: datt is not needed after
    ds -= (datt * att).sum(-1, keepdims=True)
    ds *= att
    # forward was: att = softmax((q / sqrt(D)) @ k.T); the 1/sqrt(D) multiplies the
    # D-wide products below rather than the Tk-wide ds
    dqg = ds @ kt.transpose(0, 1, 3, 2)       # (B,Hkv,G*Tq,Tk) @ (B,Hkv,Tk,D) -> (B,Hkv,G*Tq,D)
    dqg *= 1.0 / math.sqrt(D)
    dkh = ds.transpose(0, 1, 3, 2) @ (qg * (1.0 / math.sqrt(D)))   # (B,Hkv,Tk,G*Tq) @ (B,Hkv,G*Tq,D)
    dq = dqg.reshape(B, Hkv, G, Tq, D).transpose(0, 3, 1, 2, 4).reshape(B, Tq, Hq, D)
    return dq, dkh.transpose(0, 2, 1, 3), dvh.transpose(0, 2, 1, 3)


def swiglu_forward(gu):
    """gu (..., 2F) = gate then up -> silu(gate) * up (..., F)"""
    F = gu.shape[-1] // 2
    gate, up = gu[..., :F], gu[..., F:]
    sig = np.multiply(gate, 0.5)
    np.tanh(sig, out=sig)                    # sigmoid(z) = (1 + tanh(z/2)) / 2: no overflow, SIMD
    sig += 1.0
    sig *= 0.5
    silu = gate * sig                        # kept: the backward needs it too
    return silu * up, (gu, sig, silu)


def swiglu_backward(dout, cache):
    """dout (..., F) -> dgu (..., 2F), gate gradients then up gradients"""
    gu, sig, silu = cache
    F = sig.shape[-1]
    up = gu[..., F:]
    dgu = np.empty_like(gu)                  # both halves are written into it: no concatenate
    np.multiply(dout, silu, out=dgu[..., F:])                         # forward was: out = silu * up
    # dgate = dout * up * (sig + silu * (1 - sig)), d silu / d gate being the bracket; in place:
    dgate = np.subtract(1.0, sig, out=dgu[..., :F])
    dgate *= silu
    dgate += sig
    dgate *= up
    dgate *= dout
    return dgu


def cross_entropy_forward(logits, targets, n=None):
    """logits (N,V), targets (N,) ints with -1 = ignore -> mean loss over kept targets.

    n is the number of kept targets to divide by: by default those here, but a
    micro-batch passes the count of its whole batch, so that micro-batch losses
    and gradients add up exactly to the batch's. A head whose targets are all
    ignored contributes 0 (there is nothing to predict)."""
    N = logits.shape[0]
    keep = targets >= 0
    n = max(int(keep.sum()) if n is None else int(n), 1)
    t = np.where(keep, targets, 0)
    z = logits - logits.max(-1, keepdims=True)                        # (N,V), shifted
    z_t = z[np.arange(N), t]                                          # (N,) the targets' logits
    expz = np.exp(z, out=z)                                           # z is not needed after this
    sumexp = expz.sum(-1)                                             # (N,)
    nll = np.log(sumexp) - z_t                                        # (N,)
    loss = (nll * keep).sum() / n
    # the softmax is expz / sumexp; the backward folds that division into its scaling
    return loss, (expz, sumexp, t, keep, n)


def cross_entropy_backward(dloss, cache):
    """dloss scalar -> dlogits (N,V) = (softmax - onehot) / n on kept rows, 0 on ignored rows"""
    expz, sumexp, t, keep, n = cache
    # NOTE: turns the cached exp(z) into dlogits in place (saves a copy of an
    # (N,V) array), so call it once per forward, as the model backward does
    scale = keep * (dloss / n)                                        # (N,)
    dlogits = expz
    dlogits *= (scale / sumexp)[:, None].astype(expz.dtype)           # softmax * scale
    dlogits[np.arange(len(t)), t] -= scale.astype(expz.dtype)         # minus onehot * scale
    return dlogits


def mtp_weights(cfg):
    """how much each head counts: CE_0 fully, the K-1 extra heads share mtp_weight (K = 1: none)"""
    return [1.0] + [cfg.mtp_weight / max(cfg.K - 1, 1)] * (cfg.K - 1)


def mtp_heads_forward(x, heads, targets, cfg, counts=None):
    """x (N,C), heads (K,V,C), targets (N,K) -> loss, ce (K,), cache; counts[k]: cross_entropy_forward's n, head k"""
    ce, caches = [], []
    for k in range(cfg.K):
        logits = x @ heads[k].T                                       # (N,C) @ (C,V) -> (N,V)
        ce_k, cache_k = cross_entropy_forward(logits, targets[:, k], None if counts is None else counts[k])
        ce.append(ce_k)
        caches.append(cache_k)
    loss = sum(w * c for w, c in zip(mtp_weights(cfg), ce))
    return loss, np.array(ce), (x, heads, caches, cfg)


def mtp_heads_backward(dloss, cache):
    """dloss scalar -> dx (N,C), dheads (K,V,C); every head adds into the dx they share"""
    x, heads, caches, cfg = cache
    dx = np.zeros_like(x)
    dheads = np.empty_like(heads)
    for k, w in enumerate(mtp_weights(cfg)):
        dlogits = cross_entropy_backward(dloss * w, caches[k])       # (N,V)
        dx += dlogits @ heads[k]                                      # (N,V) @ (V,C)
        dheads[k] = dlogits.T @ x                                     # (V,N) @ (N,C)
    return dx, dheads


# -----------------------------------------------------------------------------
# the model

def param_shapes(cfg):
    """(name, shape) of every tensor, in SPEC order: the checkpoint's layout too"""
    C, D, F, V = cfg.C, cfg.D, cfg.F, cfg.V
    shapes = [("tok_emb", (V, C))]
    for l in range(cfg.L):
        shapes += [(f"layers.{l}.attn_norm", (C,)),
                   (f"layers.{l}.wqkv", ((cfg.Hq + 2 * cfg.Hkv) * D, C)),
                   (f"layers.{l}.wo", (C, cfg.Hq * D)),
                   (f"layers.{l}.mlp_norm", (C,)),
                   (f"layers.{l}.w_gate", (F, C)),
                   (f"layers.{l}.w_up", (F, C)),
                   (f"layers.{l}.w_down", (C, F))]
    shapes.append(("final_norm", (C,)))
    shapes += [(f"heads.{k}", (V, C)) for k in range(cfg.K)]
    return shapes


def num_params(cfg):
    """how many numbers param_shapes lists, counted from the sizes alone (check_config asks it of every config)"""
    per_layer = 2 * cfg.C + (cfg.Hq + 2 * cfg.Hkv) * cfg.D * cfg.C + cfg.C * cfg.Hq * cfg.D + 3 * cfg.F * cfg.C
    return (1 + cfg.K) * cfg.V * cfg.C + cfg.C + cfg.L * per_layer


def carve(flat, cfg):
    """flat buffer -> dict of named views into it (no copies), in SPEC order. All parameters live
    in one float32 array, so AdamW, clipping, summing gradients and checkpoints each see one array.
    Two more views cover neighbours in the buffer: `layers.{l}.w_gate_up` (2F,C)
    is w_gate with w_up after it, so that one matmul does the work of two, and
    `heads` (K,V,C) is all K heads, one gradient for the loss to fill and one
    matrix for speculative decoding's guesses (generate). Gradients written through
    them land in the SPEC tensors, whose memory they share."""
    views, start, offset = {}, {}, 0
    for name, shape in param_shapes(cfg):
        n = math.prod(shape)
        views[name], start[name] = flat[offset:offset + n].reshape(shape), offset
        offset += n
    views["heads"] = flat[start["heads.0"]:offset].reshape(cfg.K, cfg.V, cfg.C)
    for l in range(cfg.L):
        gate = start[f"layers.{l}.w_gate"]
        views[f"layers.{l}.w_gate_up"] = flat[gate:gate + 2 * cfg.F * cfg.C].reshape(2 * cfg.F, cfg.C)
    return views


def init_params(cfg, seed=1337):
    """flat float32 buffer with SPEC initialisation: N(0, 0.02), residual outputs scaled down"""
    rng = np.random.default_rng(seed)
    flat = np.empty(num_params(cfg), dtype=np.float32)
    params = carve(flat, cfg)
    for name, shape in param_shapes(cfg):
        if len(shape) == 1:
            params[name][...] = 1.0                                   # norm weights
        else:
            # wo and w_down feed the residual stream: 2L of them add up (GPT-2 paper, sec. 2.3)
            std = 0.02 / math.sqrt(2 * cfg.L) if name.endswith(("wo", "w_down")) else 0.02
            params[name][...] = rng.normal(0.0, std, size=shape)
    return flat


def block_forward(x, p, cfg, pos=0, kv=None):
    """x (B,T,C) -> x (B,T,C), cache; p maps short names to this layer's tensors.

    With kv = (k_cache, v_cache) of shape (B,cfg.T,Hkv,D) (new_kv_cache), the new keys and values
    are written at pos.. and attention reads the whole prefix (generation)."""
    B, T, C = x.shape
    Hq, Hkv, D = cfg.Hq, cfg.Hkv, cfg.D
    h, c_attn_norm = rmsnorm_forward(x, p["attn_norm"])                # (B,T,C); c_*: caches for block_backward
    qkv, c_wqkv = linear_forward(h, p["wqkv"])                         # (B,T,(Hq+2Hkv)*D)
    # q and k heads rotate together: one rope call for both
    qk, c_rope = rope_forward(qkv[..., :(Hq + Hkv) * D].reshape(B, T, Hq + Hkv, D), pos)
    q, k = qk[:, :, :Hq], qk[:, :, Hq:]                                # (B,T,Hq,D), (B,T,Hkv,D)
    v = qkv[..., (Hq + Hkv) * D:].reshape(B, T, Hkv, D)
    if kv is not None:
        kv[0][:, pos:pos + T], kv[1][:, pos:pos + T] = k, v
        k, v = kv[0][:, :pos + T], kv[1][:, :pos + T]
    y, c_att = attention_forward(q, k, v)                              # (B,T,Hq,D)
    attn_out, c_wo = linear_forward(y.reshape(B, T, Hq * D), p["wo"])  # (B,T,C)
    x = x + attn_out                                                   # residual
    m, c_mlp_norm = rmsnorm_forward(x, p["mlp_norm"])                  # (B,T,C)
    gu, c_gate_up = linear_forward(m, p["w_gate_up"])                  # (B,T,2F)
    s, c_swiglu = swiglu_forward(gu)                                   # (B,T,F)
    mlp_out, c_down = linear_forward(s, p["w_down"])                   # (B,T,C)
    x = x + mlp_out                                                    # residual
    return x, (c_attn_norm, c_wqkv, c_rope, c_att, c_wo, c_mlp_norm, c_gate_up, c_swiglu, c_down)


def block_backward(dx, cache, g):
    """dx (B,T,C) -> dx (B,T,C); adds this layer's parameter gradients into g"""
    c_attn_norm, c_wqkv, c_rope, c_att, c_wo, c_mlp_norm, c_gate_up, c_swiglu, c_down = cache
    B, T, C = dx.shape
    ds, dw_down = linear_backward(dx, c_down)
    g["w_down"] += dw_down
    dm, dw_gate_up = linear_backward(swiglu_backward(ds, c_swiglu), c_gate_up)
    g["w_gate_up"] += dw_gate_up
    dxm, dmlp_norm = rmsnorm_backward(dm, c_mlp_norm)
    g["mlp_norm"] += dmlp_norm
    dx = dx + dxm                                     # residual: both paths
    dy, dwo = linear_backward(dx, c_wo)
    g["wo"] += dwo
    D = c_att[0].shape[-1]                            # head dim, from the cached q
    dq, dk, dv = attention_backward(dy.reshape(B, T, -1, D), c_att)
    dqk = rope_backward(np.concatenate([dq, dk], axis=2), c_rope)     # (B,T,Hq+Hkv,D): q and k rotated as one
    dqkv = np.concatenate([dqk.reshape(B, T, -1), dv.reshape(B, T, -1)], -1)   # q, k, v: wqkv's rows
    dh, dwqkv = linear_backward(dqkv, c_wqkv)
    g["wqkv"] += dwqkv
    dxa, dattn_norm = rmsnorm_backward(dh, c_attn_norm)
    g["attn_norm"] += dattn_norm
    return dx + dxa                                   # residual: both paths


# a block's tensors (layer_params); w_gate_up is not in SPEC: w_gate and w_up as one (2F,C) view, one matmul (carve)
LAYER_TENSORS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate", "w_up", "w_down", "w_gate_up")


def layer_params(params, l):
    """layer l's tensors under their short names (and w_gate_up, see carve)"""
    return {name: params[f"layers.{l}.{name}"] for name in LAYER_TENSORS}


def model_forward(params, cfg, idx, targets=None, counts=None, pos=0, kv=None):
    """idx (B,T) -> two modes. Training, targets (B,T,K), -1 = ignore: loss, ce (K,), cache for the
    backward. Generation, no targets: head 0's logits (B,T,V) and the final hidden state
    xf (B,T,C), from which the other heads' logits follow.

    ce[0] is CE_0, what logs report; loss adds the extra heads (SPEC, Loss).
    counts (K,): kept targets per head in the whole batch, when this is a part of it.
    pos, kv: generation's KV cache (new_kv_cache): the tokens sit at positions pos..,
    and each block adds their keys and values to its cache and attends to the prefix."""
    B, T = idx.shape
    x, c_emb = embedding_forward(idx, params["tok_emb"])               # (B,T,C)
    c_blocks = []
    for l in range(cfg.L):
        x, c = block_forward(x, layer_params(params, l), cfg, pos, None if kv is None else kv[l])
        c_blocks.append(c)
    xf, c_final = rmsnorm_forward(x, params["final_norm"])             # (B,T,C)
    if targets is None:
        logits, _ = linear_forward(xf, params["heads.0"])              # (B,T,V)
        return logits, xf
    loss, ce, c_heads = mtp_heads_forward(xf.reshape(B * T, -1), params["heads"],
                                          targets.reshape(B * T, -1), cfg, counts)
    return loss, ce, (c_emb, c_blocks, c_final, c_heads, (B, T))


def model_backward(grads, cache):
    """adds d loss / d params into grads (a dict of views into one flat buffer)"""
    c_emb, c_blocks, c_final, c_heads, (B, T) = cache
    # go through the forward in reverse; the chain starts at d loss / d loss = 1,
    # split over the heads by mtp_weights inside mtp_heads_backward
    dxf, dheads = mtp_heads_backward(1.0, c_heads)
    grads["heads"] += dheads
    dx, dfinal_norm = rmsnorm_backward(dxf.reshape(B, T, -1), c_final)
    grads["final_norm"] += dfinal_norm
    for l in reversed(range(len(c_blocks))):
        dx = block_backward(dx, c_blocks[l], layer_params(grads, l))
    grads["tok_emb"] += embedding_backward(dx, c_emb)


def split_rows(rows, T, K):
    """rows (B, T+K) of tokens -> idx (B,T), targets (B,T,K): head k's target is row[1+k:1+k+T]"""
    idx = rows[:, :T]
    targets = np.stack([rows[:, 1 + k:1 + k + T] for k in range(K)], -1)
    return idx, targets


# -----------------------------------------------------------------------------
# gradient check
#
# float64 central differences (five-point stencil, below) against the hand-written
# backward. Error = |analytic - numeric| / max(1e-4, |analytic| + |numeric|);
# a tensor passes below 1e-6. Correct layers land between 1e-13 and 3e-7 (200 seeds);
# a wrong formula lands near 1 (numeric_grad says why h is CHECK_H and the floor 1e-4).
# Each layer is checked alone with the scalar sum(out * dout) for a random dout, then
# the whole model with its real loss.

CHECK_H = 3e-4
CHECK_TOL = 1e-6
CHECK_SAMPLES = 32


def numeric_grad(f, x, entries, h=CHECK_H):
    """central difference of the scalar f() with respect to x.flat[entries]; x is moved in place, then put back.

    Both its errors are absolute: rounding in f, about 1e-12 / h (the check's 1e-4 floor keeps it small
    beside a gradient near 0), and truncation, h^4 times f's fifth derivative (the whole model's norm
    weights make it large: at h = 1e-3 one --seed in 20 failed a correct layer). The five-point stencil's
    h^4, where plain (f(x+h)-f(x-h))/2h has h^2, lets h be large enough that rounding stays small (the
    plain one bottoms out near 1e-7 here, too close to the tolerance)."""
    grad = np.empty(len(entries))
    for j, i in enumerate(entries):
        old = x.flat[i]
        fs = []
        for step in (2 * h, h, -h, -2 * h):
            x.flat[i] = old + step
            fs.append(f())
        x.flat[i] = old
        grad[j] = (-fs[0] + 8 * fs[1] - 8 * fs[2] + fs[3]) / (12 * h)
    return grad


def rel_error(analytic, numeric):
    return float(np.max(np.abs(analytic - numeric) / np.maximum(1e-4, np.abs(analytic) + np.abs(numeric))))


def sample_entries(x, rng, n=CHECK_SAMPLES):
    """every entry of a small tensor, n random ones of a large tensor"""
    return np.arange(x.size) if x.size <= n else rng.choice(x.size, n, replace=False)


def layer_cases(rng):
    """(layer name, forward taking the inputs, backward, inputs by name) for each layer"""
    r = lambda *shape: rng.normal(size=shape)
    B, T, C, Hq, Hkv, D = 2, 5, 6, 4, 2, 4
    idx = rng.integers(0, 7, size=(B, T))
    cfg_heads = Config(V=7, C=C, Hq=2, Hkv=1, L=1, T=T, F=8, K=3)
    targets = rng.integers(0, 7, size=(B * T, 3))
    targets[[1, 4, 7], [0, 2, 1]] = -1
    return [
        ("embedding", lambda tok_emb: embedding_forward(idx, tok_emb),
         lambda d, c: (embedding_backward(d, c),), {"tok_emb": r(7, C)}),
        ("linear", linear_forward, linear_backward, {"x": r(B, T, C), "w": r(9, C)}),
        ("rmsnorm", rmsnorm_forward, rmsnorm_backward, {"x": r(B, T, C), "w": r(C)}),
        ("rope", lambda x: rope_forward(x, pos=5),             # the offset the KV cache uses
         lambda d, c: (rope_backward(d, c),), {"x": r(B, T, Hq, D)}),
        ("attention", attention_forward, attention_backward,
         {"q": r(B, T, Hq, D), "k": r(B, T, Hkv, D), "v": r(B, T, Hkv, D)}),
        ("attention/kv", attention_forward, attention_backward,   # 3 queries after 4 cached keys
         {"q": r(B, 3, Hq, D), "k": r(B, 7, Hkv, D), "v": r(B, 7, Hkv, D)}),
        ("swiglu", swiglu_forward, lambda d, c: (swiglu_backward(d, c),), {"gu": r(B, T, 2 * C) * 3}),  # sigmoid tails
        ("cross_entropy", lambda logits: cross_entropy_forward(logits, targets[:, 0]),
         lambda d, c: (cross_entropy_backward(d, c),), {"logits": r(B * T, 7)}),
        ("mtp_heads", lambda x, heads: mtp_heads_forward(x, heads, targets, cfg_heads)[::2],   # (loss, cache)
         mtp_heads_backward, {"x": r(B * T, C), "heads": r(3, 7, C)}),
    ]


def check_layer(name, forward, backward, inputs, rng, report):
    """compare every input's analytic gradient with central differences of sum(out * dout)"""
    names = list(inputs)
    out, cache = forward(*inputs.values())
    scalar = np.ndim(out) == 0                          # losses are checked as they are
    dout = 1.0 if scalar else rng.normal(size=np.shape(out))
    f = lambda: float(np.sum(forward(*inputs.values())[0] * dout))
    grads = backward(dout, cache)
    for arg, grad in zip(names, grads):
        entries = sample_entries(inputs[arg], rng)
        num = numeric_grad(f, inputs[arg], entries)
        report(name, "d" + arg, rel_error(grad.flat[entries], num), len(entries), inputs[arg].size)


def check_model(cfg, rng, report, B=2):
    """whole model, float64, real loss with MTP heads and ignored targets"""
    # weights larger than the init's 0.02, so that every gradient is far above
    # the ~1e-11 rounding noise of the differences; norm weights near 1
    flat = rng.normal(0, 0.3, num_params(cfg))
    params = carve(flat, cfg)
    for name, shape in param_shapes(cfg):
        if len(shape) == 1:
            params[name] += 1.0
    rows = rng.integers(0, cfg.V, size=(B, cfg.T + cfg.K))
    idx, targets = split_rows(rows, cfg.T, cfg.K)                  # targets: a new array (np.stack), ours to mark
    targets[0, 2, 0] = targets[1, 5, 1] = targets[1, 0, cfg.K - 1] = -1
    grad_flat = np.zeros_like(flat)
    _, _, cache = model_forward(params, cfg, idx, targets)
    model_backward(carve(grad_flat, cfg), cache)
    grads = carve(grad_flat, cfg)
    f = lambda: model_forward(params, cfg, idx, targets)[0]
    for name, _ in param_shapes(cfg):
        entries = sample_entries(params[name], rng)
        num = numeric_grad(f, params[name], entries)
        report("model", name, rel_error(grads[name].flat[entries], num), len(entries), params[name].size)


def gradient_check(seed=1337, out=print):
    """run every check, print one line per tensor; returns True when all pass"""
    rng = np.random.default_rng(seed)
    cfg = Config(V=67, C=16, Hq=4, Hkv=2, L=2, T=7, F=48, K=3)
    out(f"gradient check: float64, central differences h={CHECK_H:g}, seed {seed}, tolerance {CHECK_TOL:g}")
    out(f"config tiny: V={cfg.V} C={cfg.C} Hq={cfg.Hq} Hkv={cfg.Hkv} D={cfg.D} L={cfg.L} "
        f"F={cfg.F} K={cfg.K}, B=2 T={cfg.T} (3 targets = -1)")
    out(f"{'layer':<14} {'tensor':<22} {'max rel err':>11}")
    worst = 0.0

    def report(layer, tensor, err, n, size):
        nonlocal worst
        worst = max(worst, err)
        sampled = f"   ({n} of {size} sampled)" if n < size else ""
        out(f"{layer:<14} {tensor:<22} {err:>11.1e}   {'OK' if err < CHECK_TOL else 'NOT OK'}{sampled}")

    for name, forward, backward, inputs in layer_cases(rng):
        check_layer(name, forward, backward, inputs, rng, report)
    check_model(cfg, rng, report)
    ok = worst < CHECK_TOL
    out(f"worst relative error {worst:.1e}")
    out(f"overall okay: {int(ok)}")
    return ok


# -----------------------------------------------------------------------------
# optimizer and schedule

def decay_mask(cfg):
    """(P,) for the P = num_params(cfg) parameters: 1.0 in matrices, 0.0 in norm weights (decayed: matrices only)"""
    return np.concatenate([np.full(math.prod(s), float(len(s) == 2), dtype=np.float32)
                           for _, s in param_shapes(cfg)])


def adamw_update(flat, grad, m, v, step, lr, decay, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1):
    """one AdamW step (Loshchilov & Hutter 2019) on flat buffers, in place; step counts from 1.

    p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * decay * p), written
    with in-place operations: each line is one pass over the buffers. decay is
    decay_mask(cfg): 1 for the matrices, 0 for the norm weights."""
    m *= beta1
    m += (1 - beta1) * grad
    v *= beta2
    v += (1 - beta2) * grad * grad
    flat *= 1.0 - (lr * weight_decay) * decay                     # decoupled weight decay
    denom = np.sqrt(v)
    denom *= 1.0 / math.sqrt(1 - beta2 ** step)                    # bias corrections
    denom += eps
    np.divide(m, denom, out=denom)                                 # from here denom holds the step (no new buffer)
    denom *= lr / (1 - beta1 ** step)
    flat -= denom


def clip_grad_norm(grad, max_norm):
    """scale grad in place so its global norm is at most max_norm; returns the norm before"""
    norm = float(np.sqrt(np.dot(grad, grad)))
    if max_norm > 0 and norm > max_norm:
        grad *= max_norm / norm
    return norm


LR_FLOOR = 0.1              # the cosine ends at LR_FLOOR * the peak learning rate


def lr_schedule(step, total, lr, warmup, min_ratio=LR_FLOOR):
    """linear warmup over `warmup` steps, then cosine decay to min_ratio * lr; step counts from 0"""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# -----------------------------------------------------------------------------
# generation

def new_kv_cache(cfg, B, dtype=np.float32):
    """per layer (k, v), each (B, T, Hkv, D): the keys and values seen so far"""
    return [(np.zeros((B, cfg.T, cfg.Hkv, cfg.D), dtype), np.zeros((B, cfg.T, cfg.Hkv, cfg.D), dtype))
            for _ in range(cfg.L)]


class LogitsNotFinite(NanoEulerError):
    """sample_token met a NaN or infinite logit: the model is broken; run_command and serve put its file's name first"""


def sample_token(logits, rng, temperature=1.0, top_k=0, top_p=1.0):
    """logits (V,) -> token id: greedy at temperature 0, else sampled from the kept tokens"""
    if not np.isfinite(logits).all():                  # a broken model: no token is more likely than another
        raise LogitsNotFinite("its logits are not finite (NaN or infinite): its weights are broken or too "
                              "large; use another checkpoint")
    if temperature <= 0:
        return int(np.argmax(logits))
    # the max is subtracted before dividing: a tiny temperature (1e-320) then sends the
    # others to -inf (probability 0) and the max to 0, where dividing first overflowed to inf - inf
    with np.errstate(over="ignore"):                   # -inf is what we want there
        z = (logits.astype(np.float64) - logits.max()) / temperature
    if 0 < top_k < len(z):
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf             # keep the k largest (and any equal to the k-th)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:                                                    # nucleus: smallest set with mass >= top_p
        order = np.argsort(-p)
        cut = np.searchsorted(np.cumsum(p[order]), top_p) + 1
        keep = np.zeros_like(p)
        keep[order[:cut]] = p[order[:cut]]
        p = keep / keep.sum()
    return int(rng.choice(len(p), p=p))


def generate(params, cfg, prompt, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=None,
             speculative=False, stop=None, stats=None, drafts=None):
    """yields the ids that follow prompt (ids), one by one (for streaming). stats: a
    dict counting passes ("steps") and tokens, for --speculative's report.

    The context holds T tokens. A longer prompt keeps its last T-1 tokens. When
    the cache is full, the window slides: the last T/2 tokens are fed again from
    position 0 (rope positions are relative to the window), then decoding goes on.

    speculative: heads 1..K-1 guess the next K-1 tokens; one forward pass over
    [last token, guesses] gives head 0's verdict at every position, and guesses
    are accepted while head 0's own choice (sampled the same way as without
    speculation) agrees. Every emitted token is head 0's choice given the tokens
    before it, so greedy output is the same as plain greedy decoding. drafts
    limits the guesses to heads 1..drafts: the later heads guess worse, and on
    these CPUs a pass over 2 tokens costs less than one over 4."""
    rng = np.random.default_rng(seed)
    tokens = list(prompt)[-(cfg.T - 1):] if prompt else []    # T - 1: room for the first new token
    if not tokens:
        raise NanoEulerError("the prompt is empty; give at least one token")
    kv = new_kv_cache(cfg, 1, params["tok_emb"].dtype)
    fast = decode_params(params)                       # the same weights, laid out for speed (after generate)
    n_drafts = cfg.K - 1 if drafts is None else max(0, min(drafts, cfg.K - 1))
    drafters = params["heads"][1:1 + n_drafts].reshape(-1, cfg.C)     # (drafts*V, C)
    pending, guesses, pos, emitted = list(tokens), [], 0, 0   # pending: tokens not yet in the cache
    while emitted < max_new_tokens:
        if pos + len(pending) > cfg.T:                     # slide the window
            pending, guesses, pos = tokens[-(cfg.T // 2):], [], 0
        # drop guesses that would not fit the window: it slides where plain decoding's does, greedy output unchanged
        guesses = guesses[:cfg.T - pos - len(pending)]
        feed = pending + guesses
        logits, x = model_forward(fast, cfg, np.array([feed]), pos=pos, kv=kv)    # (1,Tn,V), (1,Tn,C)
        first = len(pending) - 1                           # logits at feed[first] predict the next token
        for j in range(len(guesses) + 1):
            t = sample_token(logits[0, first + j], rng, temperature, top_k, top_p)
            tokens.append(t)
            emitted += 1
            if stats is not None:                          # counted before the yield: the caller may stop here
                stats["steps"] = stats.get("steps", 0) + (j == 0)   # a pass: its first token
                stats["tokens"] = stats.get("tokens", 0) + 1
            yield t
            if t == stop or emitted >= max_new_tokens:
                return
            if j == len(guesses) or guesses[j] != t:
                break
        # j: guesses accepted (the loop broke at the first wrong one); the cache keeps feed[:first + j + 1]
        pos += first + j + 1
        pending = [tokens[-1]]
        if speculative and n_drafts:                       # heads 1..drafts at the last accepted position
            guesses = (drafters @ x[0, first + j]).reshape(n_drafts, cfg.V).argmax(-1).tolist()


def decode_params(params):
    """speed only, a first reading may skip it: params as generate reads them, the matrices that block_forward
    and head 0 multiply stored column-major (same values, so the same logits). x @ w.T is then a product with a
    row-major (IN, OUT) matrix, which OpenBLAS does 5-9x faster for the 2 to 8 rows of a speculative pass (its
    small-matrix path): speculative decoding runs 1.5x faster for it (dev/LOG.md, 2026-12-01)."""
    multiplied = ("wqkv", "wo", "w_gate_up", "w_down", "heads.0")
    return {name: np.asfortranarray(t) if name.endswith(multiplied) else t for name, t in params.items()}


# -----------------------------------------------------------------------------
# tokenizer: byte-level BPE

# GPT-2 style pre-tokenization, written for Python's re (which has no \p{L}):
#   '(?:[sdmt]|ll|ve|re)   English contractions split off their word: "don't" -> "don", "'t"
#    ?[^\W\d_]+            a run of letters, with at most one space before it
#    ?\d+                  a run of digits, with at most one space before it
#    ?(?:[^\s\w]|_)+       a run of other symbols (punctuation, emoji, marks), same
#   \s+(?!\S)              whitespace, but not its last space when a word follows
#   \s+                    whatever whitespace is left (at the end of the text)
# So a space attaches to the word after it (" the" is one piece, not two), and
# only runs of whitespace make whitespace pieces. Every character falls in one
# of these classes, so the pieces always add up to the text: encoding is
# lossless. BPE merges never cross a piece boundary.
SPLIT_PATTERN = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")

# A piece longer than this many bytes (300,000 letters without a space, a long
# run of spaces) is cut into parts of at most this many bytes, never inside a
# character, and each part is merged on its own. BPE over a piece of n bytes
# takes up to n rounds of n steps; with the bound, encoding is linear in the
# text. Ordinary text has no longer piece (the embedded books' longest is a
# 70-byte run of spaces). The bound is saved with the tokenizer; a tokenizer
# saved without one gets this value.
MAX_PIECE_BYTES = 128

# Special tokens sit right after the 256 bytes at fixed ids, whatever the vocab
# size; learned merges take the ids from 260 up. Ordinary text never encodes to
# them: they come only from Tokenizer.special(name).
SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_IDS = {s: 256 + i for i, s in enumerate(SPECIALS)}
FIRST_MERGE_ID = 256 + len(SPECIALS)

# The encoder caches the ids of each distinct piece and clears the cache when
# it holds this many (about 35 MB), so a worker's memory stays bounded.
CACHE_PIECES = 100_000


def merge(ids, pair, new_id):
    """replace every non-overlapping occurrence of pair in ids, left to right, by new_id"""
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def cut_piece(piece, max_bytes):
    """a piece's UTF-8 bytes in parts of at most max_bytes (>= 4: a character's most), each part whole characters"""
    data = piece.encode("utf-8")
    parts, start = [], 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:      # 0b10xxxxxx continues a character
            end -= 1
        parts.append(data[start:end])
        start = end
    return parts


def count_pieces(text, max_bytes):
    """{piece as bytes: how often it occurs} over the text's pre-tokenized pieces,
    those longer than max_bytes cut as encoding cuts them"""
    words = defaultdict(int)
    for m in SPLIT_PATTERN.finditer(text):               # finditer: no list of every piece in memory
        words[m.group()] += 1
    pieces = defaultdict(int)
    for word, n in words.items():
        for part in cut_piece(word, max_bytes):
            pieces[part] += n
    return pieces


class Tokenizer:
    """byte-level BPE: ids 0..255 are bytes, 256..259 SPECIALS, then one id per merge"""

    def __init__(self, merges=(), max_piece_bytes=MAX_PIECE_BYTES):
        # a tokenizer file's value: read_tokenizer (operations) turns this ValueError into a sentence naming the file
        if not (isinstance(max_piece_bytes, int) and 4 <= max_piece_bytes <= 1 << 20):
            raise ValueError(f"its max_piece_bytes is {max_piece_bytes!r}, not a whole number from 4 to 1,048,576")
        self.merges = [tuple(p) for p in merges]                     # in the order learned
        self.ranks = {p: FIRST_MERGE_ID + i for i, p in enumerate(self.merges)}   # pair -> its new id
        self.max_piece_bytes = max_piece_bytes
        self.vocab = [bytes([i]) for i in range(256)] + [s.encode() for s in SPECIALS]
        for a, b in self.merges:
            self.vocab.append(self.vocab[a] + self.vocab[b])
        self.vocab_size = len(self.vocab)
        self.cache = {}                                              # piece -> its ids

    def special(self, name):
        """the id of a special token, e.g. special('<|endoftext|>') == 256"""
        return SPECIAL_IDS[name]

    @classmethod
    def train(cls, text, vocab_size, progress=True, max_piece_bytes=MAX_PIECE_BYTES):
        """learn vocab_size - 260 merges from text.

        Pairs are counted over the distinct pieces, each weighted by how often
        it occurs, and after each merge only the pieces that held the merged
        pair are recounted. A heap finds the most frequent pair; its stale
        entries (counts that have since changed) are skipped when popped.
        Ties go to the smallest pair of ids, so training is deterministic."""
        n_merges = vocab_size - FIRST_MERGE_ID
        if n_merges < 0:
            raise NanoEulerError(f"vocab size {vocab_size} is below the {FIRST_MERGE_ID} bytes and special tokens")
        pieces = count_pieces(text, max_piece_bytes)
        seqs = [list(p) for p in pieces]
        freqs = list(pieces.values())
        counts = defaultdict(int)                                    # pair -> weighted count
        where = defaultdict(set)                                     # pair -> pieces holding it (or that once did)
        for i, seq in enumerate(seqs):
            for pair in zip(seq, seq[1:]):
                counts[pair] += freqs[i]
                where[pair].add(i)
        heap = [(-c, pair) for pair, c in counts.items()]            # negated: heapq pops the smallest first
        heapq.heapify(heap)
        merges, t0 = [], time.time()
        while len(merges) < n_merges and heap:
            neg, pair = heapq.heappop(heap)
            if counts.get(pair, 0) != -neg:
                continue                                             # stale entry
            new_id = FIRST_MERGE_ID + len(merges)
            merges.append(pair)
            touched = set()                                          # pairs whose count changed: pushed again
            for i in where.pop(pair):
                seq, f = seqs[i], freqs[i]
                new = merge(seq, pair, new_id)
                if len(new) == len(seq):
                    continue                                         # no longer holds it: an earlier merge took it
                for p in zip(seq, seq[1:]):
                    counts[p] -= f
                    touched.add(p)
                for p in zip(new, new[1:]):
                    counts[p] += f
                    where[p].add(i)
                    touched.add(p)
                seqs[i] = new
            del counts[pair]
            touched.discard(pair)
            for p in touched:
                if counts[p] > 0:
                    heapq.heappush(heap, (-counts[p], p))
            if progress:
                progress_line(f"tokenizer: {len(merges)}/{n_merges} merges, {time.time() - t0:.1f} s",
                              done=len(merges) == n_merges)         # (operations: one line, redrawn)
        return cls(merges, max_piece_bytes)

    def encode_piece(self, piece):
        """one pre-tokenized piece -> its ids, as minbpe does it: among the pairs of
        neighbours, merge the one learned first (everywhere it occurs), and repeat
        until no pair is one that was learned. Each part of a long piece on its own."""
        ids = []
        for part in cut_piece(piece, self.max_piece_bytes):
            seq = list(part)
            while len(seq) >= 2:
                # the pair learned first is the one with the lowest new id; unlearned pairs rank inf
                new_id = min(self.ranks.get(pair, math.inf) for pair in zip(seq, seq[1:]))
                if new_id == math.inf:
                    break
                seq = merge(seq, self.merges[new_id - FIRST_MERGE_ID], new_id)
            ids += seq
        return ids

    def encode(self, text):
        """str -> list of ids; ordinary text only (see special for the others).

        Text repeats its pieces endlessly ("the", " and"), so each distinct piece
        is merged once and its ids cached (long pieces are not kept)."""
        if len(self.cache) > CACHE_PIECES:
            self.cache.clear()
        ids, cache = [], self.cache
        for piece in SPLIT_PATTERN.findall(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self.encode_piece(piece)
                if len(piece) <= self.max_piece_bytes:             # in characters: no encoding to count bytes
                    cache[piece] = piece_ids
            ids += piece_ids
        return ids

    def decode(self, ids):
        """ids -> str; byte sequences that are not valid UTF-8 become U+FFFD, never an error"""
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self):
        """(V,) number of UTF-8 bytes of each token, for bits per byte; specials count 0"""
        n = np.array([len(b) for b in self.vocab], dtype=np.int64)
        n[256:FIRST_MERGE_ID] = 0
        return n

    def to_json(self):
        """the tokenizer as SPEC's JSON; read_tokenizer (operations: input checks) reads it back, checked"""
        return json.dumps({"type": "byte-level-bpe", "pattern": SPLIT_PATTERN.pattern,
                           "max_piece_bytes": self.max_piece_bytes, "specials": SPECIAL_IDS,
                           "merges": [list(p) for p in self.merges]})


# -----------------------------------------------------------------------------
# data
#
# A batch is B rows of T+K consecutive tokens at random places in a file of uint16 token ids, read memory-mapped so
# that a corpus larger than memory trains (get_batch; split_rows makes a row the inputs and the K heads' targets);
# validation reads fixed, evenly spaced rows of the file's last tenth (fixed_rows). How a corpus (a text file, or a
# folder of .txt files: corpus_files) becomes that file: a tokenizer trained on a sample of at most 16 MB
# (tokenizer_sample) encodes it, an <|endoftext|> token after each document (get_data.sh's web shards end each with an
# <|endoftext|> line; a book is one document), in small memory on every core (write_tokens, operations: tokenizing a
# corpus at scale). prepare_data caches both files (cached, in operations: a file there is read if it is whole and
# its ids are below max_v; else make(path) writes it, or returns the bytes that cached writes).

DATA_DIR = os.path.join(HERE, "data")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "tinyshakespeare.txt")
DEFAULT_SFT = os.path.join(DATA_DIR, "instructions.jsonl")
TOKEN_DTYPE = np.dtype("<u2")  # the token cache's: every id below MAX_V fits (check_config refuses a larger V)
CACHE = os.path.join("..", "cache")   # the tokenizer and tokens beside a run's --out (out/small: out/cache)


def split_train_val(tokens, rows_len, val_fraction=0.1):
    """the last val_fraction of the tokens is held out for validation"""
    n_val = max(int(len(tokens) * val_fraction), rows_len + 1)        # one validation row at least
    if len(tokens) - n_val < rows_len + 1:
        raise NanoEulerError(f"the corpus has only {len(tokens):,} tokens, too few for training rows of "
                             f"{rows_len} tokens plus a validation part; give it more text")
    return tokens[:-n_val], tokens[-n_val:]


def get_batch(tokens, B, rows_len, rng):
    """B rows of rows_len = T+K consecutive tokens at random offsets -> (B, T+K) int64"""
    offsets = rng.integers(0, len(tokens) - rows_len + 1, size=B)     # rows may overlap: each is a fresh draw
    return np.stack([tokens[o:o + rows_len] for o in offsets]).astype(np.int64)


def fixed_rows(tokens, B, rows_len, max_batches):
    """evenly spaced validation rows, the same at every evaluation -> list of (B, rows_len)"""
    n_rows = max(1, min((len(tokens) - 1) // rows_len, B * max_batches))
    starts = np.linspace(0, len(tokens) - rows_len, n_rows).astype(np.int64)
    return [np.stack([tokens[o:o + rows_len] for o in starts[i:i + B]]).astype(np.int64)
            for i in range(0, n_rows, B)]


def data_cache(out_dir):
    """CACHE beside a run's out_dir, shared by the runs there (normalized: making it does not make out_dir)"""
    cache_dir = os.path.normpath(os.path.join(out_dir, CACHE))
    if cache_dir == os.path.normpath(out_dir):
        raise NanoEulerError(f"--out {out_dir} is where runs beside it cache their tokens; give the run a folder "
                             "of another name")
    return cache_dir


def prepare_data(path, vocab_size, out_dir, progress=True, workers=None):
    """corpus -> (tokenizer, tokens memory-mapped): the tokenizer is trained once
    and the tokens written once, both cached by the corpus's hash (the tokens also
    by the tokenizer's) in data_cache(out_dir); a damaged cache file is made again"""
    cache_dir = data_cache(out_dir)
    files = corpus_files(path)
    h = hashlib.sha256()                               # the cache key: the corpus files' names and contents
    for name in files:
        h.update(os.fsencode(os.path.basename(name)))  # a name that is not UTF-8 hashes as its own bytes
        with open(name, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    corpus = h.hexdigest()[:16]                        # in the cache files' names

    def train_tokenizer(tok_path):                     # -> its JSON's bytes, which cached writes
        tok = Tokenizer.train(tokenizer_sample(files, path), vocab_size, progress)   # (a sample of no text: refused)
        os.makedirs(cache_dir, exist_ok=True)          # made only now: a refused run leaves no empty cache
        return tok.to_json().encode()
    tok = cached(os.path.join(cache_dir, f"tokenizer_{vocab_size}_{corpus}.json"), train_tokenizer, max_v=vocab_size)
    tok_digest = hashlib.sha256(tok.to_json().encode()).hexdigest()[:8]   # another tokenizer: other tokens
    tokens = cached(os.path.join(cache_dir, f"tokens_{corpus}_{tok_digest}.npy"),
                    lambda npy_path: write_tokens(npy_path, files, tok, workers, progress), max_v=tok.vocab_size)
    return tok, tokens


# -----------------------------------------------------------------------------
# the training loop

# Defaults of `train`, chosen by measurement on these 2-core machines (BENCHMARKS.md, dev/LOG.md): 32 rows of 128
# tokens keep both cores busy; lr 3e-3 beat 6e-3 after the first minute; a short warmup (30 steps) gets going sooner.
# 1000 steps (4-5 minutes on idle cores) reach 2.133 bits per byte; past that the small model overfits tinyshakespeare
# (its 520k training tokens are seen 8 times by step 1000). 4000 steps of 8 rows at lr 2e-3 ended no better (2.146,
# the defaults then 2.142) in more time; but when time is short, more and smaller steps win: in 2 minutes (--minutes 2)
# 8 rows at lr 2e-3 reach 2.25, 32 rows at 3e-3 only 2.31.
DEFAULT_BATCH = 32
DEFAULT_LR = 3e-3
DEFAULT_STEPS = 1000
DEFAULT_WARMUP = 30
SAVE_EVERY = 200        # steps between checkpoints on the CPU (the GPU saves every 10 minutes)
PLAN_AFTER = 20         # --minutes: steps timed before the run's length is set
EVAL_ROWS = 32          # rows per validation batch whatever --batch is, so runs with other batches see the same rows


def pretrain(args, cfg, make_engine, describe=None, loop=None):
    """tokenizer and tokens (cached), validation rows, then the loop; both engines train
    through here. make_engine(cfg, flat, m, v) -> engine; describe(engine) -> the
    engine's lines of the settings table (default: its line); loop: train_loop
    (nanoeuler_cuda.py's ranks 1..N-1 on several GPUs pass their own, which follows rank 0's)"""
    run = args.run                                     # the run's folder: run_command made it and holds its lock
    run.cfg = cfg                                      # the model its checkpoints describe
    if args.resume:                                    # refused before the corpus is tokenized (minutes)
        run.refuse_other_run(args)
    tok, tokens = prepare_data(args.data, cfg.V, args.out)
    cfg.V = tok.vocab_size                             # a tiny corpus can run out of pairs to merge
    train_tokens, val_tokens = split_train_val(tokens, cfg.T + cfg.K)
    # a new run: init_params(--seed), AdamW's m = v = 0, step 0, data order seeded by --seed; --resume: a checkpoint's
    flat, m, v, state = run.resume_or_init(args, tok, functools.partial(init_params, cfg, args.seed))
    engine = make_engine(cfg, flat, m, v)
    print_settings((describe(engine) if describe else [("engine", engine.line)]) +   # the run's log (after bench)
                   [("model", f"{args.model_size}: {num_params(cfg):,} parameters, " +
                     " ".join(f"{name}={value}" for name, value in asdict(cfg).items())),
                    ("data", f"{args.data}: {len(train_tokens):,} train + {len(val_tokens):,} val tokens, "
                             f"vocab {tok.vocab_size}"),
                    ("batch", f"{args.batch} rows x {cfg.T} tokens = {args.batch * cfg.T:,} tokens per step")],
                   args, state)

    def next_batch(rng):
        return split_rows(get_batch(train_tokens, args.batch, cfg.T + cfg.K, rng), cfg.T, cfg.K)

    val = [split_rows(rows, cfg.T, cfg.K) for rows in fixed_rows(val_tokens, EVAL_ROWS, cfg.T + cfg.K,
                                                                  args.eval_batches)]
    (loop or train_loop)(args, cfg, tok, engine, next_batch, val, run, state)


# The loop in one glance, each step: lr = lr_schedule(step - 1, total, ..); engine.step(*next_batch(rng), lr, step)
# (forward, backward, clip, AdamW); log_step and a row of log.csv; every --eval-every steps run_validation; then
# run.after_step saves a checkpoint every --save-every steps (written while the next steps run). Around it, `run` (a
# RunFolder, in operations) stops the loop on a signal or lost output, saved; a non-finite loss stops the run at its
# last good checkpoint. --minutes: after_step sets total from step PLAN_AFTER's timed evaluation and save.
# A first reading follows only those five calls: lr_schedule, engine.step, log_step, run_validation, run.after_step.
def train_loop(args, cfg, tok, engine, next_batch, val_batches, run, state, sample_prompt=None):
    """the loop that pretraining and SFT, on the CPU and on the GPU, share (above, in one glance). next_batch(rng)
    -> idx (B,T), targets (B,T,K); val_batches: a fixed list of those. run: args.run, resumed (its checkpoints and
    when to stop); state: step, rng state, the best validation. The log's samples continue sample_prompt (ids;
    default: a document's start: sample_text_for_log). run.clock(): monotonic seconds (a test passes a fake)."""
    clock, out_dir = run.clock, run.out
    start = step = state["step"]
    total = state.get("planned_steps", args.steps)       # --minutes plans it once, early on (run.plan_at)
    if start >= total:                                   # --resume of a run that has made all its steps
        return run.complete(start, total, engine)
    rng, tokens_per_step, csv_path = saved_rng(state), args.batch * cfg.T, os.path.join(out_dir, "log.csv")
    stop = start + args.stop_after if args.stop_after > 0 else math.inf   # --stop-after ends this session sooner
    times = []
    with signals_handled(run):  # (operations) Ctrl-C, SIGTERM, SIGHUP set run.stop: the loop ends after this step
        # log.csv open, the clocks started (--save-minutes's too); lost output (a closed pipe) stops the loop too
        with run.begin(args, state, csv_path) as (csv, t_start):
            elapsed = lambda: fmt_time(clock() - t_start)   # fmt_time, log_step, log_csv, plot_log: the run's log
            while step < min(total, stop) and not run.stop:
                step += 1
                t0 = clock()                              # the step's time: the batch's making included
                lr = lr_schedule(step - 1, total, args.lr, args.warmup)   # steps count from 1, the schedule from 0
                loss, ce, norm = engine.step(*next_batch(rng), lr, step)
                run.stop_if_not_finite({"loss": loss, "gradient norm": norm}, step, made_by=step - 1)
                dt = clock() - t0
                if step > start + 1:
                    times.append(dt)                      # the first step warms up: left out
                mfu = engine.mfu(dt)                      # model FLOPs utilization (None on the CPU)
                shown = total if run.plan_at is None else "?"   # --minutes: the log's total is "?" until run.plan
                log_step(step, shown, ce, lr, norm, dt, times, tokens_per_step, mfu)
                val = ()
                if run.evaluates(step, total, args):      # every --eval-every steps, the last, --minutes's plan's
                    val = run_validation(engine, val_batches, cfg, tok, run, state, step, shown, sample_prompt, elapsed)
                log_csv(csv, step, ce, lr, norm, dt, tokens_per_step, mfu, *val)
                total = run.after_step(step, total, args, engine, state, rng, times)   # checkpoints; --minutes's plan
        run.end(step, stop, engine, state, rng)   # the last step saved, the engine closed; a stop raised (run_command)
    print_summary(step - start, elapsed(), times, state, out_dir, run.last_path)   # the run's log, after bench
    plot_log(csv_path)
    return step


def saved_rng(state):
    """the data order's random generator, where the training state left it (a new run's: seeded from --seed)"""
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    return rng


def run_validation(engine, val_batches, cfg, tok, run, state, step, total, sample_prompt, elapsed):
    """validation loss, bits per byte (nats / ln 2 per byte of text: comparable across tokenizers), a sample,
    best.safetensors when the best yet (run.save_best); elapsed() -> the run's time so far, as text"""
    val_loss, val_bpb = engine.evaluate(val_batches, tok.token_bytes())
    run.stop_if_not_finite({"validation loss": val_loss}, step)
    print(f"val  {step:{len(str(total))}d}/{total} | loss {val_loss:.4f} | bpb {val_bpb:.3f} | "
          f"{len(val_batches)} batches | {elapsed()} elapsed")
    flat = engine.host_params()                    # one copy for save_best and the sample; no moments
    run.stop_if_not_finite({"weights": flat}, step)
    if val_loss < state.get("best_val", math.inf):
        state.update(best_val=val_loss, best_bpb=val_bpb, best_step=step)
        run.save_best(flat)
    print("sample:", repr(sample_text_for_log(flat, cfg, tok, sample_prompt, seed=step)))   # (the run's log)
    return val_loss, val_bpb


# -----------------------------------------------------------------------------
# a training step on every core
#
# The step train_loop asks of its engine is four calls on one thread (params = carve(flat), grads = carve(grad)):
#     loss, ce, cache = model_forward(params, cfg, idx, targets); model_backward(grads, cache)
#     norm = clip_grad_norm(grad, args.clip); adamw_update(flat, grad, m, v, step, lr, decay_mask(cfg))
# CPUEngine runs that on every core: numpy works on one core at a time, so the batch is cut into parts that workers run
# (threads or processes: workers_for, in operations, says which from the numbers below), each into a gradient buffer of
# its own, summed (add_into); AdamW runs on slices of the flat buffer at once; BLAS runs one thread (set at import).
MIN_ROWS, MAX_THREADS, PROCESSES_ABOVE = 2, 8, 4    # rows a worker at least; threads at most; more workers: processes


def grads_of_parts(flat, cfg, counts, parts, grad):
    """a worker's micro-batches [(idx, targets), ..] -> loss, ce (K,); their gradients summed in grad"""
    grad[...] = 0.0                                                # model_backward adds into it: zeroed first
    loss, ce = 0.0, 0.0
    for idx, targets in parts:
        part_loss, part_ce, cache = model_forward(carve(flat, cfg), cfg, idx, targets, counts)
        model_backward(carve(grad, cfg), cache)
        del cache                                                  # its activations freed before the next forward
        loss, ce = loss + part_loss, ce + part_ce
    return loss, ce


def add_into(total, *bufs):
    """total += each of bufs, in place (slices of grad_bufs[0] += grad_bufs[1] + ..); returns None: nothing sent back"""
    for buf in bufs:
        total += buf


def loss_and_grads(flat, cfg, idx, targets, grad_bufs, pool=None, parts=None):
    """one batch's loss, ce (K,) and gradients, the gradients landing in grad_bufs[0].

    The batch is cut into `parts` micro-batches (default: one per buffer) that run on the pool's workers: buffer t
    of n adds up parts t, t + n, .. in that order, so memory grows with the workers, not the batch. Each part
    divides by the whole batch's target counts: the parts add up exactly, in an order fixed by parts and n alone."""
    counts, n = (targets >= 0).sum(axis=(0, 1)), len(grad_bufs)       # (K,), the workers
    split = [slice(p[0], p[-1] + 1) for p in np.array_split(np.arange(len(idx)), parts or n) if len(p)]
    jobs = [[(idx[rows], targets[rows]) for rows in split[t::n]] for t in range(min(n, len(split)))]
    spread = pool.map if pool and len(jobs) > 1 else map
    results = list(spread(functools.partial(grads_of_parts, flat, cfg, counts), jobs, grad_bufs))
    list(spread(add_into, *[np.array_split(buf, n) for buf in grad_bufs[:len(jobs)]]))   # on n slices at once
    return sum(r[0] for r in results), sum(r[1] for r in results)


def adamw_update_parallel(pool, n, flat, grad, m, v, step, lr, decay, **kw):
    """adamw_update on n slices of the buffers at once: elementwise, so the result is the same"""
    list(pool.map(lambda f, g, m_, v_, d: adamw_update(f, g, m_, v_, step, lr, d, **kw),
                  *(np.array_split(a, n) for a in (flat, grad, m, v, decay))))


def evaluate(ce_of, batches, token_bytes, pool=None):
    """batches of (idx, targets) -> validation CE_0 (nats per kept token) and bits per byte;
    ce_of(idx, targets) -> ce (K,) is the engine's forward pass"""

    def sums(batch):                                   # one batch's nats, bytes and tokens
        idx, targets = batch
        ce = ce_of(idx, targets)
        t0 = targets[..., 0]
        kept = t0 >= 0
        return ce[0] * kept.sum(), token_bytes[t0[kept]].sum(), kept.sum()   # a mean over kept, times their count

    results = list(pool.map(sums, batches)) if pool else [sums(b) for b in batches]
    nats, nbytes, ntok = (sum(r[i] for r in results) for i in range(3))
    return nats / max(ntok, 1), nats / math.log(2) / max(nbytes, 1)


class CPUEngine:
    """what train_loop asks of an engine: one update, an evaluation, and the weights
    and moments on the host for checkpoints. nanoeuler_cuda.py has a GPU one."""

    def __init__(self, cfg, flat, m, v, args):
        self.cfg, self.m, self.v = cfg, m, v
        self.clip, self.weight_decay, self.batch = args.clip, args.weight_decay, args.batch
        self.decay = decay_mask(cfg)
        # pool (operations): .map may be processes (the step's parts); .threads is always threads (AdamW, evaluation)
        self.pool = Workers(flat, args.batch, args.threads)
        self.flat, self.grad_bufs = self.pool.flat, self.pool.grad_bufs    # processes: shared memory, flat a copy
        self.n_threads, self.parts = len(self.grad_bufs), self.pool.parts  # a gradient buffer a worker; micro-batches
        self.line = self.pool.line                         # the engine's line in the settings table

    def step(self, idx, targets, lr, step):
        """forward, backward, clip, AdamW (skipped if the loss is not finite) -> loss, ce (K,), norm"""
        loss, ce = loss_and_grads(self.flat, self.cfg, idx, targets, self.grad_bufs, self.pool, self.parts)
        norm = clip_grad_norm(self.grad_bufs[0], self.clip)
        if np.isfinite(loss) and np.isfinite(norm):
            adamw_update_parallel(self.pool.threads, self.n_threads, self.flat, self.grad_bufs[0], self.m, self.v,
                                  step, lr, self.decay, weight_decay=self.weight_decay)
        return loss, ce, norm

    def evaluate(self, batches, token_bytes):
        params = carve(self.flat, self.cfg)
        # in a step's micro-batches: a forward keeps its caches, and 32 rows at once would outgrow the step's memory
        n = -(-self.batch // self.parts)                    # rows a part: the ceiling of batch / parts
        parts = [(idx[i:i + n], targets[i:i + n]) for idx, targets in batches for i in range(0, len(idx), n)]
        return evaluate(lambda idx, targets: model_forward(params, self.cfg, idx, targets)[1],
                        parts, token_bytes, self.pool.threads)

    def host_params(self):
        """a copy of the flat params (float32): best.safetensors is written from it beside the steps"""
        return self.flat.copy()

    def host_weights(self):
        """copies of the flat params, m, v (float32), the same buffers each time: a checkpoint
        writes them while the next steps change the originals"""
        self.saved = getattr(self, "saved", None) or [np.empty_like(a) for a in (self.flat, self.m, self.v)]
        for copy, a in zip(self.saved, (self.flat, self.m, self.v)):
            np.copyto(copy, a)
        return self.saved

    def mfu(self, dt):
        return None                                       # only the GPU log shows MFU

    def close(self):
        self.pool.close()


# -----------------------------------------------------------------------------
# supervised fine-tuning, chat and sample

def render_turn(tok, instruction, response=None):
    """<|user|> instruction <|assistant|> [response <|end|>] -> ids, train_on (1 = a response token)"""
    ids = [tok.special("<|user|>")] + tok.encode(instruction) + [tok.special("<|assistant|>")]
    train_on = [0] * len(ids)
    if response is not None:
        reply = tok.encode(response) + [tok.special("<|end|>")]
        ids += reply
        train_on += [1] * len(reply)
    return ids, train_on


def sft_rows(tok, pairs, cfg):
    """each example -> a row of T+K tokens padded with <|endoftext|>, and its mask (True: a response token).

    Targets are -1 (ignored) on the prompt and the padding, so the loss is
    the response only; examples longer than a row are cut at T+K tokens."""
    n = cfg.T + cfg.K
    rows = np.full((len(pairs), n), tok.special("<|endoftext|>"), dtype=np.int64)
    mask = np.zeros((len(pairs), n), dtype=bool)
    # A text is cut before it is encoded (a record of a gigabyte would take minutes and gigabytes), to what n ids can
    # span plus two parts of pieces: encoding goes piece by piece, each in parts of at most max_piece_bytes from its
    # start, so a cut changes the ids of the last two pieces' last parts only, and the first n ids stay as they were.
    cut = (n + 2) * tok.max_piece_bytes
    for i, (prompt, response) in enumerate(pairs):
        ids, train_on = render_turn(tok, prompt[:cut], response[:cut])
        rows[i, :len(ids[:n])] = ids[:n]
        mask[i, :len(ids[:n])] = train_on[:n]
    return rows, mask


def sft_targets(rows, mask, T, K):
    """rows, mask (B,T+K) -> idx (B,T), targets (B,T,K) with -1 where the target is not a response token"""
    idx, targets = split_rows(rows, T, K)
    _, keep = split_rows(mask, T, K)
    return idx, np.where(keep, targets, -1)


def cmd_sft(args, make_engine=None, engine_line=None):
    """make_engine(cfg, flat, m, v), engine_line (its description): nanoeuler_cuda.py's GPU engine"""
    cfg, flat0, tok = load_model(args.model)                  # load_model, load_instructions: operations, checked
    if make_engine is None:                    # CPUEngine's memory (check_config: operations); a GPU engine: its own
        check_config(cfg, args.model, args.batch, args.threads)
    rows, mask = sft_rows(tok, load_instructions(args.data), cfg)
    # an example teaches only if a response token is one of head 0's targets, row[1:T+1]
    # (the loss the run reports and keeps the best model by); the rest are left out
    keep = mask[:, 1:cfg.T + 1].any(1)
    kept, n = int(keep.sum()), len(rows)
    if kept < 2 or kept < n / 100:
        fix = "add examples" if kept == n else "give shorter prompts, or a model with a longer context"
        raise NanoEulerError(f"{args.data}: {kept:,} of its {n:,} examples have a response token within the model's "
                             f"context of {cfg.T} tokens ({n - kept:,} cut off by their prompt); SFT needs at least 2 "
                             f"and 1% of them (one is held out for validation); {fix}")
    rows, mask = rows[keep], mask[keep]
    n_val = max(1, len(rows) // 20)                      # 5% held out for validation, one at least
    val_rows, val_mask = rows[-n_val:], mask[-n_val:]
    rows, mask = rows[:-n_val], mask[:-n_val]
    n_eval = min(n_val, args.eval_batches * args.batch)  # --eval-batches of --batch examples
    run = args.run                                       # the run's folder, as in pretrain
    run.cfg = cfg
    flat, m, v, state = run.resume_or_init(args, tok, lambda: flat0)
    engine = (make_engine or functools.partial(CPUEngine, args=args))(cfg, flat, m, v)
    left_out = f" ({n - kept:,} left out: their prompt fills the context of {cfg.T} tokens)" if kept < n else ""
    evaluated = f" (the first {n_eval} evaluated)" if n_eval < n_val else ""
    print_settings([("model", f"{args.model}: {num_params(cfg):,} parameters"),
                    ("examples", f"{kept:,} of {n:,} kept{left_out}"),
                    ("data", f"{args.data}: {len(rows):,} train + {n_val} val examples{evaluated}, "
                             "loss on responses only"),
                    ("batch", f"{args.batch} examples x {cfg.T} tokens, {engine_line or engine.line}")], args, state)

    def next_batch(rng):
        pick = rng.integers(0, len(rows), size=args.batch)
        return sft_targets(rows[pick], mask[pick], cfg.T, cfg.K)

    val = [sft_targets(val_rows[i:i + args.batch], val_mask[i:i + args.batch], cfg.T, cfg.K)
           for i in range(0, n_eval, args.batch)]
    prompt, _ = render_turn(tok, "What is the best way to learn a new language?")
    train_loop(args, cfg, tok, engine, next_batch, val, run, state, prompt)


def load_for_decoding(args, make_params=None):
    """sample's and chat's --model -> cfg, params, tok; params carved from the weights, or made by
    make_params(cfg, flat) (nanoeuler_cuda.py's decoder). A model has K-1 draft heads and a context of T: given
    args, load_model (operations) fits --speculative --drafts N and sample's --prompt to them, with a note"""
    cfg, flat, tok = load_model(args.model, args)
    return cfg, carve(flat, cfg) if make_params is None else make_params(cfg, flat), tok


def chat_reply(params, cfg, tok, history, args, out, reply, gen=None, stats=None, chat=True):
    """generate the assistant's turn after history, streaming its text to out and its ids
    into reply as they come (so a Ctrl-C keeps what was said). gen: generate's twin
    (nanoeuler_cuda.generate, with its decoder for params); stats: generate's pass counts.
    chat=False (sample): the text goes on past <|end|> and the other specials, as written."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    end = tok.special("<|end|>") if chat else None
    cut = False                                        # whether --max-new-tokens ended the reply
    try:
        for t in (gen or generate)(params, cfg, history, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                     args.seed, args.speculative, stop=end, drafts=args.drafts, stats=stats):
            if chat and (t == end or 256 <= t < FIRST_MERGE_ID):
                break
            reply.append(t)
            out.write(decoder.decode(tok.vocab[t]))
            out.flush()
        else:
            cut = chat and len(reply) >= args.max_new_tokens
    finally:
        out.write(decoder.decode(b"", final=True) + "\n")
        out.flush()
    if cut:
        print(f"(reply cut at --max-new-tokens {args.max_new_tokens}; give a larger one for longer replies)")


CHAT_HELP = """  /reset  forget the conversation and start over
  /quit   leave (so do Ctrl-D and Ctrl-C at the prompt)
  /help   this list
Anything else is sent to the model; Ctrl-C stops a reply."""


def read_turn(interactive, out):
    """the user's next line, stripped; None at the end of input. A terminal gets input()
    (readline's line editing); a pipe or file is read as bytes, its text echoed after
    "you> ", so that a transcript reads like the terminal would."""
    if interactive:
        try:
            return input("you> ").strip()
        except EOFError:
            out.write("\n")                                   # Ctrl-D: "bye" on a line of its own
            return None
    line = sys.stdin.buffer.readline(1 << 20)                # a turn a line, held to 1 MB (`chat < /dev/zero`)
    if not line:
        return None
    if len(line) == 1 << 20 and not line.endswith(b"\n"):
        raise NanoEulerError("a line of chat's input is over 1 MB; chat reads one turn a line")
    text = line.decode("utf-8", errors="replace").strip()
    if text:
        out.write(f"you> {text}\n")
    return text


def speculation_report(stats):
    """--speculative's one line on stderr at the end: tokens per pass, drafts accepted"""
    if stats and stats.get("steps"):
        print(f"speculative: {stats['tokens'] / stats['steps']:.2f} tokens a pass ({stats['steps']} passes, "
              f"{stats['tokens'] - stats['steps']} drafts accepted)", file=sys.stderr)


def cmd_chat(args, make_params=None, gen=None):
    """a REPL on stdin/stdout: /reset forgets the conversation, /quit (or Ctrl-D, or Ctrl-C
    at the prompt) leaves; Ctrl-C during a reply stops it, and what was said stays.
    make_params(cfg, flat) and gen: nanoeuler_cuda.py's decoder and generate"""
    cfg, params, tok = load_for_decoding(args, make_params)
    out = sys.stdout
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):         # arrow keys edit the line and recall earlier ones
            import readline  # noqa: F401
    print(f"chatting with {args.model} ({num_params(cfg):,} parameters, context {cfg.T} tokens); "
          "/help lists the commands, /quit or Ctrl-D leaves")
    history, stats = [], ({} if args.speculative else None)
    try:
        while True:
            text = read_turn(interactive, out)
            if text is None:
                break                                              # Ctrl-D / end of input
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            if text == "/reset":
                history = []
                print("(history cleared)")
                continue
            if re.fullmatch(r"/[A-Za-z]+", text):               # /help, or a command we do not know
                print(("" if text == "/help" else f"unknown command {text}; the commands are:\n") + CHAT_HELP)
                continue
            ids, _ = render_turn(tok, text)
            # naive: keeps the whole conversation and re-feeds it each turn; the
            # oldest tokens are dropped once it outgrows the context
            reply_room = min(args.max_new_tokens, cfg.T // 2)
            room = max(1, cfg.T - 1 - reply_room)          # what history + question may take (T = 2: the last token)
            if len(ids) > room:
                print(f"note: the question is {len(ids)} tokens, more than fit in the context of {cfg.T} with room "
                      f"for a reply of {reply_room}; keeping its last {room} tokens", file=sys.stderr)
            history = (history + ids)[-room:]
            out.write("bot> ")
            reply = []
            try:
                chat_reply(params, cfg, tok, history, args, out, reply, gen, stats)
            except KeyboardInterrupt:                      # Ctrl-C stops the reply, not the chat
                print("(reply stopped; Ctrl-C at the prompt, /quit or Ctrl-D leaves)")
            history += reply + [tok.special("<|end|>")]
    except KeyboardInterrupt:                          # (SIGTERM or SIGHUP: run_command says so, exits 143/129)
        out.write("\n")
    print("bye")
    speculation_report(stats)


def cmd_sample(args, make_params=None, gen=None):
    """continue --prompt, streaming; make_params(cfg, flat) and gen: nanoeuler_cuda.py's decoder
    and generate (the model file is read, and refused, before either)"""
    cfg, params, tok = load_for_decoding(args, make_params)
    prompt = tok.encode(args.prompt) if args.prompt else [tok.special("<|endoftext|>")]  # (too long: a note)
    sys.stdout.write(args.prompt)
    stats = {} if args.speculative else None
    chat_reply(params, cfg, tok, prompt, args, sys.stdout, [], gen, stats, chat=False)
    speculation_report(stats)


# -----------------------------------------------------------------------------
# command line: a flag's type is named by a string ("positive_int"), checked by the operations part's FLAG_TYPES

def cmd_check(args):
    if not gradient_check(args.seed):
        sys.exit(1)


def cmd_prepare(args):
    tok, tokens = prepare_data(args.data, args.vocab_size, args.out, workers=args.workers)
    print(f"{args.data}: {len(tokens):,} tokens, vocab {tok.vocab_size}, in {os.path.normpath(tokens.filename)}")


def preset_with(preset, args):
    """the preset's Config with train's --vocab-size and --mtp-weight (at most 1,000: its flag type) where given"""
    mtp_weight = preset.mtp_weight if args.mtp_weight is None else args.mtp_weight
    return Config(**{**asdict(preset), "V": args.vocab_size or preset.V, "mtp_weight": mtp_weight})


def cmd_train(args):
    cfg = check_config(preset_with(PRESETS[args.model_size], args), batch=args.batch, threads=args.threads)
    pretrain(args, cfg, functools.partial(CPUEngine, args=args))


def add_training_flags(sp, steps, batch, lr, warmup, out, mtp_weight=False, threads=True, save_minutes=None):
    """the flags train and sft share, and train's --mtp-weight (and nanoeuler_cuda.py's, without --threads,
    saving every 10 minutes)"""
    if mtp_weight:
        sp.add_argument("--mtp-weight", type="mtp_weight_type", default=None,
                        help="weight of the extra heads' mean loss, 0 to 1,000 (default: the preset's, SPEC's 0.5); "
                             "more makes them better drafters for --speculative, at some cost to head 0")
    g = sp.add_argument_group("run")
    length = g.add_mutually_exclusive_group()          # --minutes sets the steps: given both, argparse refuses
    length.add_argument("--steps", type="count_type", default=steps, help="optimizer steps in the whole run")
    length.add_argument("--minutes", type="minutes_type", default=0, help="instead of --steps: as many steps as "
                        f"fit in about M minutes, timed on the first {PLAN_AFTER}; 0 = off")
    g.add_argument("--out", default=out, help="folder for checkpoints and log.csv" +
                   (" (default: out/ and the model size: out/small, out/big)" if out is None else ""))
    again = g.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    again.add_argument("--fresh", action="store_true", help="start over in --out: a run there is renamed "
                       "--out.old (.old.1, ...), never deleted")
    g.add_argument("--stop-after", type="positive_int_or_off", default=-1,
                   help="stop (and save) after N steps of this run; -1 = off")
    g.add_argument("--seed", type="nonnegative_int", default=1337, help="seed of the data order (and of train's init)")
    if threads:
        g.add_argument("--threads", type="positive_int", default=CORES,    # CORES: usable cores (operations)
                       help=f"threads the batch is split over, at most (one a core, {MIN_ROWS} rows a thread at least)")
    g = sp.add_argument_group("optimization")
    g.add_argument("--batch", type="positive_int", default=batch, help="rows of T+K tokens per step")
    g.add_argument("--lr", type="positive_float", default=lr, help="peak learning rate")
    g.add_argument("--warmup", type="nonnegative_int", default=warmup, help="linear warmup steps")
    g.add_argument("--weight-decay", type="nonnegative_float", default=0.1, help="AdamW decay, matrices only")
    g.add_argument("--clip", type="positive_float_or_off", default=1.0, help="global grad-norm clip; -1 = off")
    g = sp.add_argument_group("evaluation")
    g.add_argument("--eval-every", type="positive_int", default=100, help="validate and sample every N steps")
    g.add_argument("--eval-batches", type="positive_int", default=20,
                   help=f"validation batches (pretraining: of {EVAL_ROWS} rows; sft: of --batch held-out examples)")
    saving = g.add_mutually_exclusive_group()
    saving.add_argument("--save-every", type="positive_int", default=None,
                        help=f"checkpoint every N steps (default: {'--save-minutes' if save_minutes else SAVE_EVERY})")
    saving.add_argument("--save-minutes", type="positive_float", default=save_minutes,
                        help=f"checkpoint every M minutes (default: {save_minutes or '--save-every'}); and at the end")


def add_generation_flags(sp, drafts=1):
    """sample's and chat's flags (both programs; nanoeuler_cuda.py's --drafts default is its own)"""
    sp.add_argument("--model", required=True, help=".safetensors model file")
    sp.add_argument("--max-new-tokens", type="count_type", default=200, help="tokens to generate")
    sp.add_argument("--temperature", type="nonnegative_float", default=0.8, help="0 = greedy, deterministic")
    sp.add_argument("--top-k", type="nonnegative_int", default=40, help="sample from the k likeliest; 0 = all")
    sp.add_argument("--top-p", type="probability", default=0.95, help="nucleus sampling mass; 1 = off")
    sp.add_argument("--seed", type="nonnegative_int", default=None,
                    help="seed of the sampler (default: a fresh one each run)")
    sp.add_argument("--speculative", action="store_true", help="draft with the MTP heads, verify with head 0")
    # head 1 alone was the fastest on each of the four trained small models measured (BENCHMARKS.md, dev/LOG.md):
    # heads 2 and 3 are seldom right, and their tokens make every verifying pass dearer
    sp.add_argument("--drafts", type="nonnegative_int", default=drafts, help="with --speculative: draft with heads "
                    "1..N (at most K-1)")


def build_parser(command=None):
    """every command's flags, as --help lists them. main passes the command that runs, so that only its shared
    group (add_training_flags and the like, after its own flags) is built; build_parser() builds all (the tests).
    ArgumentParser: argparse's, extended at the end of the file (flag types named by strings, .run)"""
    p = ArgumentParser(prog="nanoeuler.py", description="NanoEuler on the CPU, in numpy")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="float64 gradient check of every layer and parameter").add_argument(
        "--seed", type="nonnegative_int", default=1337, help="random seed of the check")

    # Defaults by measurement on 2 cores (BENCHMARKS.md): see the comment at DEFAULT_STEPS
    sp = sub.add_parser("train", help="pretrain a model (the small preset unless --model-size)")
    sp.add_argument("--data", default=DEFAULT_CORPUS, help="UTF-8 text file or folder of .txt files")
    sp.add_argument("--vocab-size", type="vocab_size", default=None,
                    help="BPE vocabulary (V) (default: the preset's, small 512, big 4096)")
    sp.add_argument("--model-size", default="small", choices=sorted(PRESETS), help="SPEC preset")

    sp = sub.add_parser("prepare", help="train the tokenizer and tokenize a corpus, as train's first step")
    sp.add_argument("--data", default=DEFAULT_CORPUS, help="UTF-8 text file or folder of .txt files")
    sp.add_argument("--vocab-size", type="vocab_size", default=512, help="BPE vocabulary (V)")
    sp.add_argument("--out", default=os.path.join("out", "small"), help="the run's folder; the cache is beside it")
    sp.add_argument("--workers", type="workers_count", default=None,
                    help="processes that encode (default: every core; one for a corpus under 4 MB)")

    sp = sub.add_parser("sft", help="fine-tune on instructions, loss on responses only")
    sp.add_argument("--model", required=True, help="pretrained .safetensors")
    sp.add_argument("--data", default=DEFAULT_SFT, help="JSONL (instruction/input/response) or Alpaca JSON")
    sub.add_parser("sample", help="continue a prompt").add_argument(
        "--prompt", type="argv_text", default="", help="text to continue (default: none, a new document)")
    sub.add_parser("chat", help="chat on stdin/stdout")
    sub.add_parser("serve", help="chat in the browser, and an OpenAI-shaped API (docs/serve.md)")
    sub.add_parser("plot", help="draw a run's loss curve again (log.svg, and log.png with matplotlib)").add_argument(
        "run", help="a run folder (out/small) or its log.csv")
    sp = sub.add_parser("bench", help="time training steps, the tokenizer and generation")
    sp.add_argument("--model", default=None, help="trained model for the generation timings")
    sp.add_argument("--threads", type="positive_int", default=CORES, help="threads for training steps")
    sp.add_argument("--max-new-tokens", type="count_type", default=400, help="tokens to generate")
    shared = {"train": functools.partial(add_training_flags, steps=DEFAULT_STEPS, batch=DEFAULT_BATCH, lr=DEFAULT_LR,
                                         warmup=DEFAULT_WARMUP, out=None, mtp_weight=True),  # out=None: out/<size>
              "sft": functools.partial(add_training_flags, steps=600, batch=16, lr=1e-3, warmup=30,
                                       out=os.path.join("out", "sft")),
              "sample": add_generation_flags, "chat": add_generation_flags, "serve": add_serve_flags}  # after bench
    for name, add in shared.items():
        if command in (None, name):
            add(sub.choices[name])
    return p


def main(argv=None):
    """the program, `python nanoeuler.py train ...`: ArgumentParser.run (end of file) parses the flags; run_command
    sets args.run (the --out folder, default out/<size>: a RunFolder, locked), calls the command's function in
    this table (cmd_train, above) and turns a NanoEulerError raised on the way into one sentence (exit 2)"""
    commands = {"check": cmd_check, "prepare": cmd_prepare, "train": cmd_train, "sft": cmd_sft, "sample": cmd_sample,
                "chat": cmd_chat, "serve": cmd_serve, "plot": cmd_plot, "bench": cmd_bench}  # serve, plot, bench: below
    argv = sys.argv[1:] if argv is None else argv
    build_parser(next((a for a in argv if not a.startswith("-")), None)).run(argv, commands)   # its command's flags


# -----------------------------------------------------------------------------
# benchmark

def bench_train(cfg, B, threads, steps=20):
    """median ms of forward + backward + AdamW for one batch of B rows (first 2 steps are warm-up)"""
    pool = Workers(init_params(cfg), B, threads)
    flat, bufs, n, parts = pool.flat, pool.grad_bufs, len(pool.grad_bufs), pool.parts
    m, v, decay = np.zeros_like(flat), np.zeros_like(flat), decay_mask(cfg)
    rng = np.random.default_rng(0)
    times = []
    for step in range(steps + 2):
        idx, targets = split_rows(rng.integers(0, cfg.V, size=(B, cfg.T + cfg.K)), cfg.T, cfg.K)
        t0 = time.perf_counter()
        loss_and_grads(flat, cfg, idx, targets, bufs, pool, parts)
        clip_grad_norm(bufs[0], 1.0)
        adamw_update_parallel(pool.threads, n, flat, bufs[0], m, v, step + 1, 1e-3, decay)
        times.append(time.perf_counter() - t0)
    pool.close()
    return float(np.median(times[2:]))


def cmd_bench(args):
    model = load_model(args.model) if args.model else None      # a bad file is refused before 30 s of timing
    print(f"numpy {np.__version__}, {CORES} cores, --threads {args.threads}\n")
    cfg = PRESETS["small"]
    check_config(cfg, batch=32, threads=args.threads)
    print(f"training step of the small model (forward + backward + AdamW, float32, T={cfg.T})")
    for B in (8, 32):
        dt, (n, processes, _) = bench_train(cfg, B, args.threads), workers_for(B, args.threads)
        print(f"  B={B:<3d} {dt * 1e3:8.1f} ms/step  {B * cfg.T / dt:9,.0f} tok/s, {n} "
              f"{'process' if processes else 'thread'}{'es' if processes and n > 1 else 's' * (n > 1)}")
    files = corpus_files(os.path.join(DATA_DIR, "gutenberg")) + [DEFAULT_CORPUS]
    text = "\n".join(read_text(f) for f in files)
    nbytes = len(text.encode())
    print(f"\ntokenizer on the embedded books and Shakespeare ({nbytes / 1e6:.1f} MB, one core)")
    t0 = time.time()
    tok = Tokenizer.train(text, 4096, progress=False)
    print(f"  {'train vocab 4096:':<22}{time.time() - t0:6.1f} s")
    tok.cache.clear()                                  # the first encode starts empty, the second finds it warm
    for cache in ("empty", "warm"):
        t0 = time.time()
        ids = tok.encode(text)
        dt = time.time() - t0
        print(f"  {f'encode, {cache} cache:':<22}{nbytes / 1e6 / dt:6.1f} MB/s ({len(ids):,} tokens, "
              f"{nbytes / len(ids):.2f} bytes per token)")
    if model:
        (cfg, flat, tok), what = model, args.model
    else:
        flat, tok, what = init_params(cfg), Tokenizer(), "random weights (pass --model for a trained one)"
    bench_generation(cfg, flat, tok, what, args.max_new_tokens)


def bench_generation(cfg, flat, tok, what, max_new_tokens):
    """greedy tokens/s from the bench prompt, plain and with each number of drafts"""
    params = carve(flat, cfg)
    prompt = tok.encode("ROMEO:\nWhat say you")
    n = min(max_new_tokens, 4 * cfg.T)
    print(f"\ngeneration, batch 1, greedy, {n} new tokens (median of 3 after a warm-up), {what}")
    for drafts in [0] + list(range(cfg.K - 1, 0, -1)):
        times = []
        for _ in range(4):                                 # a warm-up, then the median of 3
            stats = {}
            t0 = time.perf_counter()
            out = list(generate(params, cfg, prompt, n, temperature=0, speculative=drafts > 0, stats=stats,
                                drafts=drafts))
            times.append(time.perf_counter() - t0)
        dt = float(np.median(times[1:]))
        name = f"speculative, {drafts} draft{'s' if drafts > 1 else ''}" if drafts else "plain KV cache"
        extra = f"  {stats['tokens'] / stats['steps']:.2f} tokens per pass" if drafts and stats else ""
        print(f"  {name:<26} {len(out) / dt:8,.0f} tok/s{extra}")


# -----------------------------------------------------------------------------
# the run's log: its lines, log.csv and the loss plot
#
# What train_loop says: the settings table once (print_settings), a line and a log.csv row a step (log_step, log_csv),
# a sample at each validation (sample_text_for_log), the summary (print_summary); log.csv drawn as log.svg (log.png too
# with matplotlib), as `python nanoeuler.py plot RUN` draws it again. Reporting, not learning: a first reading skips it.

def print_settings(rows, args, state):
    """the resolved settings, once, as two aligned columns (llm.c does this): rows, then the
    run's steps and folder. With --minutes the steps are planned later (the loop prints its plan)."""
    planned, total = "planned_steps" in state, state.get("planned_steps", args.steps)
    steps, lr = f"{total}{' (planned for --minutes)' * planned}", f"lr {args.lr:g} cosine to {args.lr * LR_FLOOR:g}"
    if getattr(args, "minutes", 0) > 0 and not planned:    # the plan will say what its lr does
        steps = f"as many as fit in {args.minutes:g} minutes (planned after {PLAN_AFTER} steps)"
        lr += " if the plan outlasts the warmup"
    elif total < args.warmup:                          # a run shorter than its warmup: no cosine, the peak not reached
        steps = f"{total} ({'planned for --minutes, ' * planned}all in the warmup)"
        lr = f"lr peaks at {args.lr * total / args.warmup:.3g}"
    rows = rows + [("steps", f"{steps}, warmup {args.warmup}, {lr}, weight decay {args.weight_decay}, "
                             f"clip {args.clip}"), ("out", args.out)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}} | {v}")


def fmt_time(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def log_step(step, total, ce, lr, norm, dt, times, tokens, mfu):
    """the step's line: CE_0, learning rate, gradient norm, time, throughput and the time
    left, estimated from the last 50 steps (none while total is "?": --minutes before its plan)"""
    eta = "" if total == "?" else f" | eta {fmt_time((total - step) * (np.mean(times[-50:]) if times else dt))}"
    print(f"step {step:{len(str(total))}d}/{total} | loss {ce[0]:.4f} | lr {lr:.2e} | norm {norm:6.3f} | "
          f"{dt * 1e3:7.1f} ms | {tokens / dt:7,.0f} tok/s" +
          (f" | mfu {100 * mfu:4.1f}%" if mfu is not None else "") + eta, flush=True)


def log_csv(csv, step, ce, lr, norm, dt, tokens, mfu, val_loss="", val_bpb=""):
    """one row of log.csv (LOG_HEADER); validation fields empty between evaluations"""
    csv.write(f"{step},{ce[0]:.6f},{lr:.6e},{norm:.6f},{dt * 1e3:.2f},{tokens / dt:.1f},"
              f"{'' if mfu is None else f'{mfu:.4f}'},"
              f"{val_loss and f'{val_loss:.6f}'},{val_bpb and f'{val_bpb:.6f}'}\n")
    csv.flush()


def log_row(line):
    """a line of log.csv -> (step, loss, val_loss or None), or None for the header and for a line that is
    half-written or garbled (its step must be ASCII digits: "²".isdigit()); plot_log's, and RunFolder.begin's"""
    cells = line.rstrip("\n").split(",")
    if len(cells) != LOG_HEADER.count(",") + 1 or not re.fullmatch(r"[0-9]+", cells[0]):
        return None
    with contextlib.suppress(ValueError):
        return int(cells[0]), float(cells[1]), float(cells[7]) if cells[7] else None
    return None


def sample_text_for_log(flat, cfg, tok, prompt, seed, n=48):
    """a short sample, so the log shows what the model has learned so far; prompt: ids
    (default: a document's start)"""
    prompt = prompt or [tok.special("<|endoftext|>")]
    params = carve(flat, cfg)
    ids = list(generate(params, cfg, prompt, n, temperature=0.8, top_k=40, seed=seed, stop=tok.special("<|end|>")))
    return tok.decode(prompt[1:] + ids) if len(prompt) > 1 else tok.decode(ids)


def print_summary(steps, elapsed, times, state, out_dir, last_path):
    # the steps are a part of the run's time: validation, samples and checkpoints take the rest
    steps_ms = f": {sum(times):.1f} s of steps ({np.mean(times) * 1e3:.1f} ms/step), the rest validation, " \
        "samples and checkpoints" if times else ""
    best = (f"best val loss {state['best_val']:.4f} (bpb {state['best_bpb']:.3f}) at step {state['best_step']}, "
            f"kept as {os.path.join(out_dir, 'best.safetensors')}") if "best_val" in state else "no validation yet"
    print(f"done: {steps} steps in {elapsed}{steps_ms}; {best}; last checkpoint {last_path}")


def svg_plot(steps, loss, val, width=640, height=360):
    """train loss as a line by step, validation loss as dots, both axes labelled, as SVG text"""
    left, bottom, top, right = 60, 40, 10, 10                 # margins for the labels
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    ys = loss + [v for _, v in val]
    y0, y1 = min(ys), max(max(ys), min(ys) + 1e-6)

    def xy(s, y):                                          # data -> pixels (y grows downwards)
        return (left + (s - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (y - y0) / (y1 - y0) * (height - bottom - top))
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>']
    for i in range(5):                                     # five ticks on each axis, with grid lines
        (x, _), (_, y) = xy(x0 + (x1 - x0) * i / 4, y0), xy(x0, y0 + (y1 - y0) * i / 4)
        svg += [f'<text x="{x:.1f}" y="{height - bottom + 16}" text-anchor="middle">'
                f'{x0 + (x1 - x0) * i / 4:.0f}</text>',
                f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{y0 + (y1 - y0) * i / 4:.3f}</text>',
                f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>']
    line = " ".join("{:.1f},{:.1f}".format(*xy(s, y)) for s, y in zip(steps, loss))
    svg.append(f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1"/>')
    svg += ['<circle cx="{:.1f}" cy="{:.1f}" r="3" fill="#ff7f0e"/>'.format(*xy(s, v)) for s, v in val]
    svg += [f'<text x="{(left + width) / 2:.0f}" y="{height - 6}" text-anchor="middle">step</text>',
            f'<text transform="translate(14 {(height - bottom) / 2:.0f}) rotate(-90)" text-anchor="middle">'
            'loss (nats per token)</text>',
            f'<text x="{width - 16}" y="24" text-anchor="end" fill="#1f77b4">train CE_0</text>',
            f'<text x="{width - 16}" y="40" text-anchor="end" fill="#ff7f0e">val CE_0 (dots)</text>', '</svg>']
    return "\n".join(svg) + "\n"


def plot_log(csv_path, out=print):
    """the loss curve beside log.csv: log.svg always (SVG is text: no package needed),
    and log.png too when matplotlib is installed"""
    with open(csv_path, encoding="utf-8", errors="replace") as f:
        rows = [row for line in f if (row := log_row(line))]
    if not rows:
        return
    steps, loss = [r[0] for r in rows], [r[1] for r in rows]
    val = [(r[0], r[2]) for r in rows if r[2] is not None]
    svg = os.path.splitext(csv_path)[0] + ".svg"
    atomic_write(svg, svg_plot(steps, loss, val).encode())
    out(f"loss curve: {svg}")
    try:
        from matplotlib.figure import Figure       # not pyplot: no backend to choose, no global figure to close
    except ImportError:
        return
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    ax.plot(steps, loss, lw=0.8, label="train CE_0")
    if val:
        ax.plot(*zip(*val), "o-", label="val CE_0")
    ax.set(xlabel="step", ylabel="loss (nats per token)")
    ax.legend()
    ax.grid(alpha=0.3)
    png = os.path.splitext(csv_path)[0] + ".png"
    fig.savefig(png, dpi=120, bbox_inches="tight")
    out(f"loss curve: {png}")


def cmd_plot(args):
    """log.svg (and log.png) of a run folder or a log.csv, drawn again"""
    csv_path = os.path.join(args.run, "log.csv") if os.path.isdir(args.run) else args.run
    advice = "give a run folder (like out/small) or its log.csv"
    if not os.path.exists(need_file(csv_path, "a run's log.csv", advice, absent=True)):   # a pipe, a device: said
        raise NanoEulerError(f"{csv_path or repr('')} is not there; {advice}")
    with open(csv_path, encoding="utf-8", errors="replace") as f:
        if f.readline() != LOG_HEADER:                   # a run writes it first, atomically (RunFolder.begin)
            raise NanoEulerError(f"{csv_path} is not a run's log (its first line is not log.csv's header); {advice}")
        if not any(log_row(line) for line in f):
            raise NanoEulerError(f"{csv_path} holds no step yet; plot it once the run has logged one")
    plot_log(csv_path)


# -----------------------------------------------------------------------------
# the chat in a browser: serve's command and flags (serve.py has the rest); a first reading may skip it

def cmd_serve(args, make_params=None, gen=None):
    """the chat page and its OpenAI-shaped API: serve.py, beside this file (docs/serve.md)"""
    import serve
    serve.cmd_serve(args, sys.modules[__name__], make_params, gen)


def add_serve_flags(sp):
    """serve's flags (both programs)"""
    sp.add_argument("--model", required=True, help=".safetensors model file")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 lets in every machine that "
                    "reaches this one, with no password")
    sp.add_argument("--port", type="port_type", default=8000, help="TCP port; 0 = any free one")


# =============================================================================
# operations
#
# Everything above is the story (the model, its data, its training and its
# commands), the benchmark, the run's log and serve's entry. What follows keeps long runs
# and bad inputs safe; a first reading may skip it. The story calls these
# functions by name, and Python looks a name up when the call runs, so they
# may come after it.
# The guarantees it keeps, each by one mechanism:
# - input checks: a bad file or flag is one sentence naming it and what to do, exit code 2, never a traceback.
#   By a NanoEulerError raised anywhere, said by run_command, the one place a command ends; a damaged file's
#   content is MALFORMED, refused by refused_if_malformed, or in the data cache (cached) made again
# - the run folder and its lock: one run per folder (train.lock, taken over from a killed run), another run's
#   files refused without --resume. By a RunFolder: everything a run does to its folder
# - checkpoint files written atomically (a temp file renamed), the state before the model; pairs that do not
#   read set aside on --resume, old pairs pruned, and a run that diverges stops at its last good checkpoint
#   (a NaN anywhere in a run stops it in the RunFolder's stop_if_not_finite)
# - signals: Ctrl-C, SIGTERM and SIGHUP stop a run after its step, saved; a second one stops at once; the exit
#   code is 128 + the signal's number. By one policy, signals_handled: raised where the command stands, or in
#   the training loop a stop after the step, saved
# - memory: a --batch that would not fit (cgroup limits counted) is refused before anything is allocated
#   (check_config's estimate); freed memory is kept (the allocator setting, run once at import)
# - lost output streams: a closed pipe or a hung-up terminal ends the run quietly, saved (it stops the training
#   loop as a signal does); streams closed at start are /dev/null from the import of this file on
#   (CLOSED_AT_START)
# - tokenizing a corpus: in small memory whatever its size, on every core, the tokens of whole documents (chunk_end)
# - a training step's workers: they ignore signals, die with this process, and an error in one is raised here

# -----------------------------------------------------------------------------
# operations: input checks
#
# Every file that a user or a crash may have damaged (a model, a training state,
# a cached tokenizer or token file, instructions) is read one way: a path that is
# no regular file is said so (need_file); each check of what it holds is a
# require (a ValueError saying what is wrong); that, and what a parser raises on
# content it cannot read (MALFORMED), becomes one sentence naming the file and
# what to do (refused_if_malformed), or in the data cache a file made again (cached).

# json's errors and bytes that are not UTF-8 (ValueError), nesting past the parser's
# depth (RecursionError), a field that is missing or of the wrong type (KeyError,
# TypeError, AttributeError), a number too large for what it sizes (OverflowError)
MALFORMED = (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError)


def require(ok, problem):
    """the one check of what a file or a config holds: ValueError(problem) unless ok. The problem's
    words are made before the check, so they use only what the checks before it proved."""
    if not ok:
        raise ValueError(problem)


@contextlib.contextmanager
def refused_if_malformed(path, what, advice):
    """content inside that cannot be read (MALFORMED) is refused in one sentence,
    NanoEulerError("{path} {what} ({the problem}); {advice}"); a missing field is said as such, and a
    number too long for int() too (Python's own words name a setting this program never sets)"""
    try:
        yield
    except MALFORMED as e:
        problem = ("it holds a number of more than 4,300 digits" if "integer string conversion" in str(e) else
                   f"it lacks {e}" if isinstance(e, KeyError) else e)
        raise NanoEulerError(f"{path} {what} ({problem}); {advice}") from None


def need_file(path, noun, advice, absent=False, links=True):
    """-> path, if it is a regular file (absent: or nothing is there); else one sentence: what is there instead
    (noun: what it should be), then advice. The one check before a file is opened: a pipe would hang the read,
    a folder fail the write. links=False: a link is refused too (train.lock, which we truncate, never follows one)"""
    try:
        mode = (os.stat if links else os.lstat)(path).st_mode
    except (OSError, ValueError):                      # nothing there (a dangling link: nothing to read)
        mode = None
    if stat.S_ISREG(mode or 0) or (mode is None and absent):
        return path
    what = ("does not exist" if mode is None else f"is a folder, not {noun}" if stat.S_ISDIR(mode) else
            f"is a link, not {noun}" if stat.S_ISLNK(mode) else f"is not {noun} (it is a device, a pipe or a socket)")
    raise NanoEulerError(f"{path} {what}; {advice}")


def corpus_files(path):
    """a text file, or every .txt file under a folder, in sorted order"""
    advice = "pass a UTF-8 text file or a folder of .txt files"
    if not os.path.isdir(path):
        return [need_file(path, "a text file", advice)]
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".txt"))
    for f in [f for f in files if not os.path.isfile(f)]:
        # a dangling symlink (or one to a folder): nothing to read, and the rest still is
        print(f"warning: skipping {f}: it is not a file (a broken link?)", file=sys.stderr)
        files.remove(f)
    if not files:
        raise NanoEulerError(f"{path} holds no .txt files; {advice}")
    return files


def decode_text(data, path, offset):
    """bytes read from path at offset -> str, refusing what is not UTF-8 with one sentence"""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NanoEulerError(f"{path} is not UTF-8 text (bad byte at offset {offset + e.start:,}); "
                             "convert it, e.g. with iconv -t utf-8") from None


def read_text(path):
    """the whole file as str, refusing what is not UTF-8 text"""
    with open(path, "rb") as f:
        return decode_text(f.read(), path, 0)


def check_config(cfg, source="the config", batch=None, threads=None, advice="", available=None):
    """-> cfg, once it is a config that the code can run and that would not ask for absurd memory, with a batch
    (train, sft, bench) one whose step on `threads` fits: refused before anything is allocated. source names it;
    advice, if any, ends the refusal. A step holds the weights, m, v, the decay mask and a gradient buffer per
    thread (CPUEngine), the copies of the weights, m and v that a checkpoint is written from, and the weights'
    copy that a validation samples from and writes best.safetensors from; the batch's ids, and the activations
    of the micro-batches in flight, one per thread (an evaluation runs the same micro-batches). A thread's
    activations, estimated (at most 10% above tracemalloc's peak): the forward's caches per token (per layer the
    block's inputs, q k v, the roped q k, the attention matrix, SwiGLU's five F-wide arrays; the K heads'
    softmaxes), the backward's largest temporaries (one layer's attention gradient), and its gradient
    temporaries of the heads, the embedding and a layer's largest matrix. available: the bytes free (default:
    available_memory's; None: nothing to read it from, not Linux: no check)"""
    try:
        for name in SIZE_FIELDS:
            value = getattr(cfg, name)                  # bool is an int subclass: refused too
            require(type(value) is int and value >= 1, f"its {name} = {value!r} is not a positive integer")
        w = cfg.mtp_weight
        require(type(w) in (int, float) and 0 <= w < math.inf, f"its mtp_weight = {w!r} is not a finite number >= 0")
        require(cfg.C % cfg.Hq == 0 and cfg.D % 2 == 0,
                f"its width C = {cfg.C} does not split into Hq = {cfg.Hq} heads of even size")
        require(cfg.Hq % cfg.Hkv == 0,
                f"its Hq = {cfg.Hq} query heads are not a multiple of its Hkv = {cfg.Hkv} key/value heads")
        require(cfg.V <= MAX_V,
                f"its vocabulary V = {cfg.V:,} is above {MAX_V:,}, the most the uint16 token cache holds")
        require(cfg.T >= 2, f"its context T = {cfg.T} is below 2, the least that generation can slide a window over")
        require(cfg.T <= MAX_T, f"its context T = {cfg.T:,} is above {MAX_T:,}, the most this program allows "
                "(attention holds a T x T matrix per head)")
        n = num_params(cfg)                             # from the sizes: L = 10^18 builds no list
        require(n <= MAX_PARAMS, f"its sizes make {n:,} parameters, above {MAX_PARAMS:,}, the most this program allows")
    except ValueError as e:
        raise NanoEulerError(f"{source} is unusable: {e}" + (f"; {advice}" if advice else "")) from None
    if not batch:
        return cfg
    have = (available or available_memory)()
    threads, processes, parts = workers_for(batch, threads)
    rows = -(-batch // parts)                          # a micro-batch's rows, at most
    C, D, Hq, Hkv, T, F, V, K, L = cfg.C, cfg.D, cfg.Hq, cfg.Hkv, cfg.T, cfg.F, cfg.V, cfg.K, cfg.L
    per_token = L * (5 * C + (4 * Hq + 3 * Hkv) * D + Hq * T + 5 * F) + 2 * Hq * T + (K + 1) * V + 4 * F + 8 * C
    activations = 4 * (rows * T * per_token + (K + 1) * V * C + 2 * F * C)      # a thread's
    weights = 4 * (8 + processes + threads) * n        # (processes: the weights' shared copy)
    need = weights + threads * activations + batch * (T + K) * 8 * (K + 2)
    if have is not None and need > have:
        raise NanoEulerError(f"--batch {batch} needs about {need / 1e9:,.1f} GB of memory ({weights / 1e9:,.1f} GB "
                             f"of weights, moments, decay mask, their copies for saving and {threads} gradient "
                             f"buffers, {threads} x {rows:,} rows of activations), more than the {have / 1e9:,.1f} GB "
                             f"available; lower --batch{' or --threads' if threads > 1 else ''}")
    return cfg


SIZE_FIELDS = ("V", "C", "Hq", "Hkv", "L", "T", "F", "K")     # SPEC's size fields, all in every checkpoint
MAX_T = 8192            # a T x T float32 score matrix per head is 256 MB at 8192
MAX_PARAMS = 2 ** 31    # 8 GB of float32 weights, 32 GB with AdamW's moments and a gradient; big has 0.1 billion
MAX_VOCAB_BYTES = 64 << 20     # all tokens' bytes together; a real vocabulary holds a few MB at most
MAX_HEADER = 100_000_000       # a safetensors header's bytes: the safetensors library's own bound
MODEL_HINT = "give a model file that train or sft wrote (an earlier checkpoint, if this one is damaged)"


def read_tokenizer(text):
    """the Tokenizer of to_json's text, if this program can use it: its special tokens and split pattern are
    this program's, each merge a pair of ids made before it (bytes or earlier merges, never a special), none
    repeated, and the tokens' bytes bounded (merging a token with itself doubles its length: 40 crafted merges
    would ask for a terabyte). Else ValueError (or the parser's error: MALFORMED) saying what is wrong"""
    d = json.loads(text)
    require(isinstance(d, dict) and d.get("specials") == SPECIAL_IDS, "its special tokens differ from this program's")
    # SPEC: encoding splits with the stored pattern; this program knows GPT-2's only
    require(d.get("type", "byte-level-bpe") == "byte-level-bpe" and d.get("pattern", SPLIT_PATTERN.pattern) ==
            SPLIT_PATTERN.pattern, "its type or split pattern differs from this program's (byte-level-bpe, GPT-2's)")
    merges = d.get("merges")
    require(isinstance(merges, list) and len(merges) <= MAX_V - FIRST_MERGE_ID,
            f"its merges are not a list of at most {MAX_V - FIRST_MERGE_ID:,} pairs")
    lengths, seen, total = [1] * 256 + [0] * len(SPECIALS), set(), 0
    # per merge, ifs rather than require: its words would be made for every merge (65,536 took 3 times as long)
    for i, pair in enumerate(merges):
        if not (isinstance(pair, list) and len(pair) == 2 and
                all(type(t) is int and (0 <= t < 256 or FIRST_MERGE_ID <= t < FIRST_MERGE_ID + i) for t in pair)):
            raise ValueError(f"merge {i} is {pair!r}, not a pair of ids below {FIRST_MERGE_ID + i} "
                             "(bytes or earlier merges)")
        if tuple(pair) in seen:
            raise ValueError(f"merge {i} repeats the pair {pair}")
        seen.add(tuple(pair))
        lengths.append(lengths[pair[0]] + lengths[pair[1]])
        total += lengths[-1]
        if total > MAX_VOCAB_BYTES:
            raise ValueError(f"its tokens add up to more than {MAX_VOCAB_BYTES >> 20} MiB")
    return Tokenizer(merges, d.get("max_piece_bytes", MAX_PIECE_BYTES))


def cached(path, make, max_v, chunk=1 << 24):
    """the data cache's one reader: the file cached at path, if it holds what was written there. tokenizer_*.json:
    the tokenizer, which may hold fewer than max_v tokens (a small corpus runs out of pairs), never more.
    tokens_*.npy: the tokens, memory-mapped, if they are what write_tokens writes: a 1-D array of the tokenizer's
    dtype, exactly as long as its header says, every id below max_v (checked chunk by chunk: no copy in memory).
    Made where there is none or it does not read (what is wrong, a require's ValueError or what a parser raises:
    MALFORMED, said in one line) by make(path), which writes it or returns its bytes (atomic_write writes them),
    then read back: what does not read then is refused. The temp files that killed writers left in the folder
    are removed first."""
    remove_stale_tmp(os.path.dirname(path))
    what, making = (("the tokenizer", "training the tokenizer") if path.endswith(".json") else
                    ("the corpus's tokens", "tokenizing"))
    made = not os.path.exists(need_file(path, "a file", f"move it away ({what} is cached there)", absent=True))
    while True:
        if made and (data := make(path)) is not None:  # the tokenizer's JSON
            atomic_write(path, data)
        try:
            with (refused_if_malformed(path, "cannot be read back", "delete it and run again") if made else
                  contextlib.nullcontext()):
                if path.endswith(".json"):
                    with open(path) as f:
                        tok = read_tokenizer(f.read())
                    require(tok.vocab_size <= max_v, f"{tok.vocab_size} tokens, more than the {max_v} asked for")
                    return tok
                fmt = np.lib.format
                with open(path, "rb") as f:            # numpy says what is wrong with a header (MALFORMED)
                    require(fmt.read_magic(f) == (1, 0), "not a version 1.0 .npy file")
                    shape, _, dtype = fmt.read_array_header_1_0(f)
                    offset = f.tell()
                require(dtype == TOKEN_DTYPE and len(shape) == 1,
                        f"it holds {dtype} of shape {shape}, not {TOKEN_DTYPE} ids")
                size = os.path.getsize(path)
                require(size == offset + shape[0] * dtype.itemsize, f"its header says {shape[0]:,} ids "
                        f"({shape[0] * dtype.itemsize:,} bytes), its data is {size - offset:,} bytes")
                tokens = np.load(path, mmap_mode="r")
                for i in range(0, len(tokens), chunk):
                    require((top := int(tokens[i:i + chunk].max())) < max_v,
                            f"it holds the id {top}, beyond the tokenizer's {max_v} ids")
                return tokens
        except MALFORMED as e:                         # (made: refused_if_malformed said it, as NanoEulerError)
            print(f"{path} is damaged ({e}); {making} again", file=sys.stderr)
            made = True


def read_safetensors(path, check=None, header_only=False):
    """-> (dict name -> float32 array in file order, metadata); one clear error for a bad file.

    The header is read and every field of it checked before the data is read,
    and the tensors must tile the data exactly (no overlaps, no gaps, nothing
    after them, as the safetensors library demands), so nothing is allocated
    beyond the file itself, and that only once its header adds up.
    check(path, shapes {name: shape tuple}, metadata): the caller's own checks of
    the header (raising NanoEulerError), also before the data is read; what it
    returns is returned in the metadata's place (model_header: cfg, tokenizer).
    header_only: -> (shapes, metadata), the data left unread."""
    need_file(path, "a model file", "pass a .safetensors file, or train one with: python nanoeuler.py train")
    with open(path, "rb") as f, refused_if_malformed(path, "is not a safetensors file this program reads", MODEL_HINT):
        size, n = os.fstat(f.fileno()).st_size, int.from_bytes(f.read(8), "little")
        require(2 <= n <= min(size - 8, MAX_HEADER), f"its header cannot be read: its length says {n:,} bytes")
        header = json.loads(f.read(n))
        require(isinstance(header, dict), "its header is not a map")
        metadata = header.pop("__metadata__", {})
        require(isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values()),
                "its __metadata__ is not a map of strings")
        entries = []                                   # (begin, end, name, shape) of each tensor
        for name, h in header.items():
            require(isinstance(h, dict), f"the entry of tensor {name!r} is not a map")
            shape, offsets = h.get("shape"), h.get("data_offsets")
            require(isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape),
                    f"tensor {name!r} has the shape {shape!r}, not a list of sizes >= 0")
            require(isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1],
                    f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
            require(h.get("dtype") == "F32" and offsets[1] - offsets[0] == 4 * math.prod(shape),
                    f"tensor {name!r} is not float32 of shape {shape} ({h.get('dtype')!r}, "
                    f"{offsets[1] - offsets[0]:,} bytes)")
            entries.append((offsets[0], offsets[1], name, tuple(shape)))
        entries.sort()
        end = 0                                        # they tile the data: each starts where the last ended
        for begin, stop, name, _ in entries:
            require(begin == end, f"tensor {name!r} starts at byte {begin:,} of the data, where "
                    f"{'the previous tensor still runs' if begin < end else 'a gap is left'} (byte {end:,})")
            end = stop
        found = size - 8 - n
        require(found >= end, f"it is truncated: {end:,} data bytes expected, {found:,} found")
        require(found == end, f"{found - end:,} bytes follow its last tensor")
        shapes = {name: shape for _, _, name, shape in entries}
        checked = check(path, shapes, metadata) if check else metadata
        if header_only:
            return shapes, checked
        data = f.read(end)
        require(len(data) == end, f"it changed while it was read ({len(data):,} of {end:,} data bytes); try again")
        return {name: np.frombuffer(data, dtype="<f4", count=(stop - begin) // 4, offset=begin).reshape(shape)
                for begin, stop, name, shape in entries}, checked


def model_header(path, shapes, meta):
    """a model file's metadata and tensor shapes against SPEC -> cfg, tokenizer (read_safetensors's check);
    a part that does not read is said with what is wrong, then what to do"""
    if meta.get("format") != "nanoeuler" or meta.get("version") != "1":
        state = meta.get("format") == "nanoeuler-state"  # the state_<step> file beside a model_<step>
        raise NanoEulerError(f"{path} is not a NanoEuler version 1 model (format {meta.get('format')!r}, version "
                             f"{meta.get('version')!r}); " + ("it is a training state: give the model_ file of its "
                             "step" if state else "give a model file that train or sft wrote"))
    with refused_if_malformed(path, "has a broken config in its metadata", MODEL_HINT):
        given = json.loads(meta["config"])
        require(isinstance(given, dict), "the config is not a map")
        cfg = Config(**{k: given[k] for k in SIZE_FIELDS},       # one missing: a KeyError, "it lacks 'T'"
                     mtp_weight=given.get("mtp_weight", Config.mtp_weight))
    check_config(cfg, f"the config in {path}", advice=MODEL_HINT)     # before anything is made from its sizes
    with refused_if_malformed(path, "has a broken tokenizer in its metadata", MODEL_HINT):
        tok = read_tokenizer(meta["tokenizer"])
        require(tok.vocab_size == cfg.V, f"it has {tok.vocab_size} tokens where the config says V = {cfg.V}")
    with refused_if_malformed(path, "holds tensors that do not match its config", MODEL_HINT):
        n_want = 2 + 7 * cfg.L + cfg.K                 # counted first: a crafted L = 10^18 must not list its shapes
        require(len(shapes) == n_want, f"{len(shapes)} tensors, SPEC expects {n_want}")
        for name, shape in param_shapes(cfg):          # by name (other writers order them otherwise); none: KeyError
            require(shapes[name] == shape, f"{name} has shape {shapes[name]}, SPEC expects {shape}")
    return cfg, tok


def check_state(state, step):
    """-> state, once it is a training state --resume can continue from: else ValueError (or KeyError,
    TypeError, OverflowError) saying what is wrong, so that --resume sets it aside rather than fail later"""
    require(type(state["step"]) is int and state["step"] == step, f"it says step {state['step']!r}")
    saved_rng(state)                                   # numpy refuses what is not a PCG64 state
    best = [name for name in ("best_val", "best_bpb", "best_step") if name in state]
    # the best model's three numbers go together
    require(len(best) in (0, 3), f"it holds {' and '.join(best)} without the rest of best_val, best_bpb, best_step")
    for name in ("best_val", "best_bpb"):              # a NaN best would never be beaten
        value = state.get(name, 0)
        require(type(value) in (int, float) and math.isfinite(value), f"its {name} = {value!r} is not a finite number")
    for name in ("best_step", "planned_steps"):
        value = state.get(name, 1)
        require(type(value) is int and 1 <= value <= MAX_PLANNED_STEPS,
                f"its {name} = {value!r} is not a whole number from 1 to {MAX_PLANNED_STEPS:,}")
    require(isinstance(state.get("args", {}), dict), f"its args = {state.get('args')!r:.40} is not a map")
    return state


def load_instructions(path):
    """JSONL (instruction, input, response) or Alpaca's JSON list (instruction, input, output)
    -> list of (prompt, response)"""
    give = "give JSONL or a JSON list of objects with instruction, input and response (or output)"
    need_file(path, "a file of instructions", "pass --data a JSONL or Alpaca JSON file of instructions")
    text = read_text(path).removeprefix("\ufeff")             # a byte-order mark some editors write
    pairs, alpaca = [], text.lstrip().startswith("[")
    # JSON Lines end at \n only: str.splitlines also cuts at U+2028, U+0085 and others, which
    # JSON strings may hold as they are (json.dumps(..., ensure_ascii=False) writes them)
    lines = text.split("\n")
    with refused_if_malformed(path, "is not instruction data", give):
        try:
            records = json.loads(text) if alpaca else [json.loads(line) for line in lines if line.strip()]
        except json.JSONDecodeError as e:
            if alpaca:
                raise
            one_object = False                         # a JSON object written over many lines is said to be one
            with contextlib.suppress(ValueError, RecursionError):
                one_object = isinstance(json.loads(text), dict)
            require(not one_object, "it is one JSON object, not a list of examples nor one example a line")
            # e.doc: the line that failed, the first of its text
            raise ValueError(f"line {lines.index(e.doc) + 1} is not JSON: {e.msg} (column {e.colno})") from None
        for i, r in enumerate(records, 1):
            require(isinstance(r, dict), f"example {i} is not an object")
            require("instruction" in r, f"example {i} has no instruction")
            require("response" in r or "output" in r, f"example {i} has no response (or output)")
            response = r["response"] if "response" in r else r["output"]
            for key, value in (("instruction", r["instruction"]), ("input", r.get("input", "")),
                               ("response", response)):
                require(isinstance(value, str), f"the {key} of example {i} is {type(value).__name__}, not text")
                half = re.search("[\ud800-\udfff]", value)      # JSON's \ud800: half of a UTF-16 pair
                require(not half, f"the {key} of example {i} holds {half and half[0]!r}, half of a UTF-16 "
                        "surrogate pair, which is not text")
            pairs.append((r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else ""), response))
    if not pairs:
        raise NanoEulerError(f"{path} holds no examples; {give}")
    return pairs


# -----------------------------------------------------------------------------
# operations: checkpoint files, and atomic writes (atomic_write, which the cache and log.csv's header use too)
#
# Model files are safetensors (SPEC.md): 8 bytes of header length, a JSON
# header, then the float32 tensors in SPEC order. The training state (AdamW
# moments, step, random state) goes in a second safetensors file beside it
# (RunFolder.write_pair, read_pair). Both are written to a .tmp file and
# renamed (atomic_write), the state first and the model last, so a model file
# that exists always has its complete state beside it. Both are read by
# read_safetensors.

def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, float32 array), written in that order; metadata: str -> str"""
    header, offset = {"__metadata__": metadata}, 0
    for name, t in tensors:
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.size * 4]}
        offset += t.size * 4
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)                                   # SPEC: pad to 8 bytes

    def write(f):
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for _, t in tensors:
            f.write(np.ascontiguousarray(t, dtype="<f4").data)
    atomic_write(path, write)


def save_model(path, cfg, flat, tok):
    """weights only, SPEC order and names, config and tokenizer in the metadata"""
    params = carve(flat, cfg)
    meta = {"format": "nanoeuler", "version": "1", "config": json.dumps(asdict(cfg)), "tokenizer": tok.to_json()}
    write_safetensors(path, [(name, params[name]) for name, _ in param_shapes(cfg)], meta)


def load_model(path, args=None):
    """-> cfg, flat float32 params, tokenizer; refuses files that break SPEC with one sentence,
    all but non-finite weights before the weights are read. args: sample's and chat's flags, whose
    --speculative --drafts and --prompt are fitted to the model's heads and context (fit_flags)"""
    tensors, (cfg, tok) = read_safetensors(path, model_header)
    names = [name for name, _ in param_shapes(cfg)]
    bad = [name for name in names if not np.isfinite(tensors[name]).all()]
    with refused_if_malformed(path, "holds weights that are NaN or infinite", "use an earlier checkpoint"):
        require(not bad, f"in {bad and bad[0]}{f' and {len(bad) - 1} more tensors' if len(bad) > 1 else ''}")
    flat = np.concatenate([tensors[name].reshape(-1) for name in names]).astype(np.float32)
    if args is not None:
        fit_flags(args, cfg, tok)
    return cfg, flat, tok


def fit_flags(args, cfg, tok):
    """--speculative --drafts N on a model with K-1 draft heads: say so when N asks for more
    (drafting with K-1), or none (decoding plainly), and set args to what decoding will do.
    sample's --prompt longer than the context: say that generate keeps its last T-1 tokens"""
    if args.speculative and (args.drafts == 0 or cfg.K == 1):
        why = "with --drafts 0" if args.drafts == 0 else f"on a model with one head ({args.model})"
        print(f"note: --speculative {why} has nothing to draft with; decoding plainly", file=sys.stderr)
        args.speculative, args.drafts = False, 0
    elif args.speculative and args.drafts > cfg.K - 1:
        heads = f"{cfg.K - 1} draft head{'s' * (cfg.K != 2)}"
        print(f"note: {args.model} has {heads} (K = {cfg.K}), fewer than --drafts {args.drafts}; drafting with "
              f"{cfg.K - 1}", file=sys.stderr)
        args.drafts = cfg.K - 1
    if getattr(args, "prompt", None) and len(prompt := tok.encode(args.prompt)) > cfg.T - 1:   # (chat has none)
        print(f"note: the prompt is {len(prompt)} tokens, longer than the context of {cfg.T}; "
              f"keeping its last {cfg.T - 1}", file=sys.stderr)


def atomic_write(path, write):
    """write(f) (or the bytes `write`) into path.<pid>.tmp, flush to disk, then rename
    over path. The pid keeps two writers from sharing a temp file; a failed write removes
    its temp file (a full disk stays no fuller) and names path, not the temp file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            if callable(write):
                write(f)
            else:
                f.write(write)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno:
            raise OSError(e.errno, e.strerror, path) from None
        raise


TMP_FILE = re.compile(r".+\.(\d+)\.tmp")     # name.<pid>.tmp: atomic_write's temp files
STALE_TMP_SECONDS = 600     # a writer touches its temp file every chunk; 10 minutes of silence is no writer


def remove_stale_tmp(folder, idle=STALE_TMP_SECONDS):
    """delete the temp files (name.<pid>.tmp) that killed writers left in folder: those whose
    process is gone and that nobody wrote for `idle` seconds (in the shared cache, a writer in
    another container shares the folder but not our pids; a locked run folder needs no wait)"""
    now = time.time()
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m, path = TMP_FILE.fullmatch(name), os.path.join(folder, name)
        try:
            if m:
                os.kill(int(m.group(1)), 0)            # signal 0: nothing is sent, the pid is checked
        except (ProcessLookupError, OverflowError):    # no such process (or a pid too large): its writer is gone
            with contextlib.suppress(OSError):         # another run may remove it first
                if now - os.path.getmtime(path) >= idle:
                    os.remove(path)
        except PermissionError:                        # EPERM: another user's process, alive
            pass


def set_aside(path, suffix):
    """rename path to path + suffix, or + suffix.1, .2, ... where that is taken (nothing set
    aside before is overwritten) -> the new name"""
    new, n = path + suffix, 0
    while os.path.exists(new):
        n += 1
        new = f"{path}{suffix}.{n}"
    os.replace(path, new)
    return new


# -----------------------------------------------------------------------------
# operations: the run folder
#
# One object, RunFolder, is everything a run does to its folder (--out). run_command holds it for train
# and sft from start to end (claim): one run per folder (train.lock: a second trainer refuses at once), and
# a folder that holds another run's files is continued (--resume), set aside (--fresh) or refused: two runs'
# logs, best models and pruning never mix. --resume takes the newest pair that reads (damaged files set
# aside) and cuts log.csv back to it; the loop's pairs are written while training goes on, then pruned; the
# loop stops, saved, on a signal or lost output, and at the last good pair on a NaN (stop_if_not_finite).

LOCK_NAME = "train.lock"
RUN_FILE = re.compile(r"(model|state)_\d+\.safetensors|best\.safetensors|log\.csv")
LOG_HEADER = "step,loss,lr,norm,ms,tok_per_s,mfu,val_loss,val_bpb\n"     # log.csv's first line; log_csv writes the rows
now = time.perf_counter   # seconds, monotonic: run.clock, for the timings and --minutes (a test passes a fake one)


class RunFolder:
    """A run's folder (above). out: its path; cfg, tok: the model's (for the checkpoints it writes);
    clock: seconds (the loop's, for the save timings); stop: the loop is to stop (below)."""
    thread = None                                    # the write in flight, one per process

    def __init__(self, out, cfg=None, tok=None, clock=None):
        self.out, self.cfg, self.tok, self.clock = out, cfg, tok, clock or now
        self.said, self.pair, self.result, self.last, self.paused, self.took = False, False, None, self.clock(), 0., 0.
        self.stop, self.signum, self.lost, self.held = False, None, None, None   # held: claim's lock, while claimed
        self.plan_at, self.began, self.eval_time = None, None, None    # --minutes's plan; plan_at None: none to make

    def path(self, step, kind="model"):
        """out/model_000120.safetensors (kind "state": its training state)"""
        return os.path.join(self.out, f"{kind}_{step:06d}.safetensors")

    def write_pair(self, step, flat, m, v, state):
        """state_<step>.safetensors then model_<step>.safetensors"""
        meta = {"format": "nanoeuler-state", "version": "1", "state": json.dumps(state)}
        write_safetensors(self.path(step, "state"), [("m", m), ("v", v)], meta)
        save_model(self.path(step), self.cfg, flat, self.tok)

    def read_pair(self, step):
        """-> cfg, flat, tok, m, v, state dict"""
        cfg, flat, tok = load_model(self.path(step))
        path = self.path(step, "state")

        def check(path, shapes, meta):                 # the state file's header -> its state dict
            with refused_if_malformed(path, "is no training state --resume can continue", "use an earlier checkpoint"):
                require(meta.get("format") == "nanoeuler-state" and shapes == {"m": flat.shape, "v": flat.shape},
                        f"it is not the state of {self.path(step)}")
                return check_state(json.loads(meta["state"]), step)
        tensors, state = read_safetensors(path, check)
        m, v = tensors["m"], tensors["v"]
        # a NaN moment would make NaN weights at the first step, saved over a good best.safetensors
        if not (np.isfinite(m).all() and np.isfinite(v).all() and (v >= 0).all()):
            raise NanoEulerError(f"{path} holds AdamW moments that are NaN, infinite or negative; use an earlier "
                                 "checkpoint")
        return cfg, flat, tok, m.copy(), v.copy(), state

    def steps(self, complete=True):
        """the steps of the model_<step>.safetensors files that path names (not model_8), newest first;
        complete: only those whose state file exists too (the model is written last, so the pair is complete)"""
        names = os.listdir(self.out) if os.path.isdir(self.out) else []
        steps = sorted((int(m.group(1)) for f in names
                        if (m := re.fullmatch(r"model_([0-9]{6}|[1-9][0-9]{6,})\.safetensors", f))), reverse=True)
        return [s for s in steps if not complete or os.path.exists(self.path(s, "state"))]

    def latest(self):
        """the highest step with a complete pair of files, or None"""
        return next(iter(self.steps()), None)

    def remove(self, step):
        """the pair of step's files, model first: a state alone is no checkpoint"""
        for kind in ("model", "state"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path(step, kind))

    def prune(self, keep=2):
        """delete all but the newest `keep` complete checkpoint pairs (best.safetensors stays)"""
        for step in self.steps()[keep:]:
            self.remove(step)

    # -- the folder held by one run

    @contextlib.contextmanager
    def claim(self, resume, fresh=False):
        """hold the folder for one run: train.lock, then refuse another run's folder without --resume, or with
        --fresh set it aside whole (renamed while still locked, so no run can slip in; the locked file then moves
        back into the new folder) -> the open, locked train.lock, also self.held while inside (None in a rank of
        --gpus, whose launcher holds it; nanoeuler_cuda.py --gpus hands self.held to its ranks).
        flock: the kernel lets go of it when its process ends, however it ends, so a lock file left by a
        killed run (a dead pid) is simply taken over; the pid in the file is there to name the holder."""
        out = self.out                                 # (an --out that is a file: run_command refused it)
        created, d = [], os.path.abspath(out)          # the folders makedirs makes (out/ of out/small too)
        while not os.path.exists(d):
            created.append(d)
            d = os.path.dirname(d)
        os.makedirs(out, exist_ok=True)
        path = need_file(os.path.join(out, LOCK_NAME), "a file", "move it away (it is where a run keeps its "
                         "lock) and run again", absent=True, links=False)
        while True:
            lock = open(path, "a+")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "?"
                lock.close()
                if holder != str(os.getppid()) or "NANOEULER_RANK" not in os.environ:
                    raise NanoEulerError(f"{out} is in use by another training run (pid {holder}); wait for it "
                                         "to end, or train into another --out") from None
                lock = None                            # a rank of nanoeuler_cuda.py --gpus: its launcher's lock
                break
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(lock.fileno()), os.stat(path)):
                    break
            lock.close()                               # its holder removed it as we opened it: once more
        try:
            if lock:                                   # ours: the pid, then the temp files of killed writers
                lock.truncate(0)                       # (append mode: the write goes to the new end)
                lock.write(f"{os.getpid()}\n")
                lock.flush()
                remove_stale_tmp(out, idle=0)
            held = any(RUN_FILE.fullmatch(f) for f in os.listdir(out))
            if fresh and held and lock:
                old = set_aside(out, ".old")
                print(f"--fresh: the run that was in {out} is kept in {old}", file=sys.stderr)
                os.makedirs(out)
                moved = os.path.join(old, LOCK_NAME)
                try:
                    os.link(moved, path)
                    os.remove(moved)
                except FileExistsError:                # a run began in the new folder meanwhile, and holds it
                    raise NanoEulerError(f"{out} is in use by another training run; train into another --out") from None
                except OSError:                        # no hard links (vfat, some network file systems): renamed
                    os.rename(moved, path)             # (only a run slipping into the gap would go unseen)
            elif not resume and held:
                raise NanoEulerError(f"{out} holds another run; continue it with --resume, start over with --fresh "
                                     "(the old run is kept aside), or train into another --out")
            for f in ("log.csv", "best.safetensors"):
                need_file(os.path.join(out, f), "a file", f"move it away (the run writes its {f} there)", absent=True)
            self.held = lock
            yield lock
        finally:
            if lock:
                with contextlib.suppress(FileNotFoundError):   # the folder went under us (begin made it again):
                    if os.path.samestat(os.fstat(lock.fileno()), os.stat(lock.name)):   # a later run's stays
                        os.remove(lock.name)           # while still locked: see the samestat above
                lock.close()
            with contextlib.suppress(OSError):         # a run refused before it wrote anything leaves no folder
                for d in created:                      # deepest first; one that holds something stays
                    os.rmdir(d)

    # -- --resume, or a fresh start

    def refuse_other_run(self, args, step=None):
        """--resume: what this run cannot continue is refused: checkpoints of another command (a train run and
        an sft run in one folder would mix their logs, best models and steps), of another config or tokenizer.
        Read from the pair's headers. step: resume_or_init's, the pair it loaded; None: the newest pair, before the
        corpus is tokenized (minutes), when the tokenizer is not made yet: it and V (which it may lower) wait"""
        if (step := step or self.latest()) is None:
            return                                     # no checkpoint: nothing to continue
        try:
            _, meta = read_safetensors(self.path(step, "state"), header_only=True)
            state = check_state(json.loads(meta["state"]), step)
            _, (cfg, tok) = read_safetensors(self.path(step), model_header, header_only=True)
        except (NanoEulerError, *MALFORMED):
            return                                     # a broken pair: resume_or_init sets it aside
        if self.tok is None:                           # called before the tokenizer is made: it and V wait
            cfg.V, tok = self.cfg.V, None
        saved, command = state.get("args", {}), getattr(args, "command", None)
        made_by = saved.get("command")
        if made_by and command and made_by != command:
            raise NanoEulerError(f"{self.out} holds checkpoints of {made_by}, which {command} cannot continue; "
                                 f"give {command} its own --out")
        # a --steps run's cosine is bound to its total; --minutes plans in the warmup, before the total binds the lr
        if getattr(args, "minutes", 0) and not saved.get("minutes") and "planned_steps" not in state:
            raise NanoEulerError(f"{self.out} holds a run of --steps {saved.get('steps', '?')}, at step {step}, whose "
                                 "length --minutes cannot plan; resume with --steps, or give --minutes another --out")
        differs = "; ".join(f"{k} {v} there, {asdict(self.cfg)[k]} here" for k, v in asdict(cfg).items()
                            if v != asdict(self.cfg)[k])
        if differs or tok and tok.merges != self.tok.merges:
            give = "--model" if command == "sft" else "--data and settings"
            raise NanoEulerError(f"the checkpoint at step {step} in {self.out} was trained with another config "
                                 f"or tokenizer{f' ({differs})' if differs else ''}; pass the same {give}, or "
                                 "another --out")

    def resume_or_init(self, args, tok, init_flat):
        """--resume: the newest complete checkpoint that reads (another run's refused), else a fresh start
        -> flat, m, v, state; tok: the run's tokenizer (the checkpoints it writes hold it). What --resume finds
        that is no checkpoint is set aside, said in a line, so that no later --resume, save or pruning takes it
        for one: a model_<step> without its state (we write the state first and delete the model first: a copied
        model, a state deleted by hand) as *.lone; the pairs newer than the one resumed that do not read (a
        truncated file, a state that is not JSON) as *.broken."""
        self.tok = tok
        if args.resume:
            for step in [s for s in self.steps(complete=False) if not os.path.exists(self.path(s, "state"))]:
                kept = set_aside(self.path(step), ".lone")
                print(f"--resume: {self.path(step)} has no {os.path.basename(self.path(step, 'state'))} beside it, "
                      f"so it is no checkpoint; kept as {os.path.basename(kept)}", file=sys.stderr)
            skipped = []                               # (step, why) of the newer pairs that do not read
            for step in self.steps():
                try:
                    loaded = self.read_pair(step)
                except NanoEulerError as e:
                    # the refusal's advice (an earlier checkpoint) is what --resume does here: keep what is wrong
                    skipped.append((step, str(e).split("; ")[0]))
                    continue
                for bad, why in skipped:                  # named as kept: .broken.1 where a .broken was there
                    kept = [os.path.basename(set_aside(self.path(bad, kind), ".broken")) for kind in ("model", "state")]
                    print(f"--resume: skipped the checkpoint at step {bad} ({why}); its files are kept as "
                          f"{kept[0]} and {kept[1]}", file=sys.stderr)
                self.refuse_other_run(args, step)
                print(f"resuming from {self.path(step)} at step {step}")
                _, flat, _, m, v, state = loaded
                return flat, m, v, state
            if skipped:
                raise NanoEulerError(f"--resume: no checkpoint in {self.out} can be read (the newest: "
                                     f"{skipped[0][1]}); train afresh with another --out")
            print(f"--resume: no checkpoint under {self.out} yet, starting from scratch")
            best = os.path.join(self.out, "best.safetensors")
            if os.path.exists(best):                   # an earlier start's best: this start would overwrite it
                print(f"--resume: {best} is kept as {os.path.basename(set_aside(best, '.earlier'))}", file=sys.stderr)
        n = num_params(self.cfg)                       # a fresh start (the settings: not this folder's object
        settings = {k: v for k, v in vars(args).items() if k not in ("run", "started")}   # and the start time)
        state = {"step": 0, "rng": np.random.default_rng(args.seed).bit_generator.state, "args": settings}
        return init_flat(), np.zeros(n, np.float32), np.zeros(n, np.float32), state

    def complete(self, start, total, engine):
        """--resume of a run that has made all its steps: said, the engine closed -> start (train_loop's)"""
        engine.close()
        print(f"the run in {self.out} is already complete: step {start} of {total}, last checkpoint "
              f"{self.path(start)}; nothing to do (--fresh starts it over, the old run kept aside)")
        return start

    @contextlib.contextmanager
    def begin(self, args, state, csv_path):
        """the loop's steps, inside -> log.csv open to append, and the clock now. log.csv: the header and the
        rows up to the state's step: a resumed run drops the rows past its checkpoint (and any
        half-written or garbled line), a fresh run starts it anew, so the log always matches the run.
        Bytes that are not UTF-8 are read as U+FFFD: a damaged log never stops a resume. The folder is
        made again if it went. --save-minutes counts from now, --minutes from the program's start;
        without a plan in the state, --minutes plans PLAN_AFTER steps from here (plan_at, plan).
        When our output is gone inside (`train | head` has exited, the terminal closed), the steps end, not
        the run: the loop saves, then ends quietly (self.lost holds the error). An error of writing our
        output has no file name: atomic_write names its file in every error"""
        step = state["step"]
        os.makedirs(self.out, exist_ok=True)
        rows = []
        if step > 0 and os.path.exists(csv_path):
            with open(csv_path, encoding="utf-8", errors="replace") as f:
                rows = [ln for ln in f if ln.endswith("\n") and (row := log_row(ln)) and row[0] <= step]
        atomic_write(csv_path, (LOG_HEADER + "".join(rows)).encode())
        self.last = self.clock()
        self.began = getattr(args, "started", self.last)
        self.plan_at = step + PLAN_AFTER if getattr(args, "minutes", 0) > 0 and "planned_steps" not in state else None
        self.planning, self.saved, self.last_path = False, step, self.path(step) if step else None   # the last save's
        try:
            with open(csv_path, "a", encoding="utf-8") as csv:
                yield csv, self.last
        except OSError as e:
            if e.filename is not None or e.errno not in (errno.EPIPE, errno.EIO):
                raise
            self.stop, self.lost = True, e
            silence_lost_output()

    # -- the training loop's stop: on a signal (signals_handled(run) calls handle while the loop runs)
    # or when output is gone (a closed pipe, a hung-up terminal: begin's), the loop stops after
    # the step in flight, saves, then raises the stop for run_command (end)

    def handle(self, signum, frame):
        """the loop's first signal: stop after this step, saved; a second: raised at once"""
        if self.signum is not None:                    # a second signal (not a lost output's stop):
            raise Interrupted(signum)                  # run_command names the last complete checkpoint
        self.stop, self.signum = True, signum
        if signum == signal.SIGHUP:
            silence_lost_output()                      # the terminal is most likely gone
        with contextlib.suppress(OSError):             # a word we cannot say must not stop the save
            print(f"\n{SIGNALS[signum]}: finishing this step, then saving a checkpoint ({SIGNALS[signum]} again "
                  "to quit at once)", file=sys.stderr)

    # -- the loop's checkpoints, written while training goes on, and --minutes's plan of the run's length:
    # save takes the engine's copies of the weights and moments (host_weights: on the GPU into page-locked
    # memory, in well under a second) and of the state; a thread writes the pair (write_pair: state
    # first, model last, each through a temp name) and prunes the older ones, so a kill at any moment leaves
    # the pair before; best.safetensors goes the same way (save_best). One write at most is in flight: the
    # next waits for it (a pair says so once); finish waits and says a pair is saved, stop_if_not_finite
    # waits (wait) to name the newest pair.

    @staticmethod
    def save_interval(args):
        """(steps, minutes) between saves: --save-every, else --save-minutes (the GPU's), else SAVE_EVERY steps"""
        return (args.save_every or (0 if args.save_minutes else SAVE_EVERY)), args.save_minutes or 0

    def evaluates(self, step, total, args):
        """whether the loop evaluates after step: every --eval-every steps, the last, and --minutes's plan's
        step (timed, to after_step: plan counts one every --eval-every steps); after a signal the save comes
        first: no evaluation, sample or plan before it"""
        self.planning, self.eval_start = step == self.plan_at and not self.stop, self.clock()
        return self.planning or (not self.stop and (step % args.eval_every == 0 or step == total))

    def after_step(self, step, total, args, engine, state, rng, times):
        """the loop's checkpoint after step, when due (save_interval: --save-every's multiples, or --save-minutes
        since the last save): written while the next steps run, except the last one and --minutes's timed one;
        then, at --minutes's step, the plan -> total (planned, or as it was)"""
        self.eval_time = self.clock() - self.eval_start   # the step's evaluation, if it made one (evaluates)
        self.finish(poll=True)                         # say a background save that has finished
        every, minutes = self.save_interval(args)
        due = step % every == 0 if every else self.clock() - self.last >= minutes * 60
        if due or step == total or self.planning:
            background = not (self.planning or step == total)
            self.saved, self.last_path = step, self.save(step, engine, state, rng, background=background)
            if self.planning:
                return self.plan(args, state, step, np.mean(times))
        return total

    def end(self, step, stop, engine, state, rng):
        """after the loop: the last step saved if it stopped before its checkpoint (a signal, lost output), or planned
        after the save of the session's last step (--stop-after); the write in flight waited for, the engine closed;
        then a stop is raised for run_command: a signal again as Interrupted(signum, step, last_path), lost output as
        it came (run_command ends the command: 128 + N; quiet on a closed pipe, one line otherwise)"""
        if step > self.saved or (self.planning and step == stop):
            self.last_path = self.save(step, engine, state, rng, background=False)
        self.finish()
        engine.close()
        if self.signum:
            raise Interrupted(self.signum, step, self.last_path)
        if self.lost:
            raise self.lost

    def plan(self, args, state, step, step_time):
        """--minutes: the most steps that end the whole run on time: the minutes less those since the program began,
        then every step (step_time: the mean so far), evaluation (eval_time) and checkpoint to come, the last's too. A
        checkpoint holds the loop for its copy (paused) and is written (took) beside the next steps: it costs the pause
        and what the write outlasts them by, the last its write. Once, in the warmup (the learning rate not yet bound
        to the total), kept in the state for a resume; none after a stop (a signal, lost output): -> args.steps."""
        if self.stop:                                      # came while the evaluation or the save was timed:
            return args.steps                              # the loop, saved, ends as at any other step
        left, eval_time = args.minutes * 60 - (self.clock() - self.began), self.eval_time
        every, minutes = self.save_interval(args)

        def cost(total):                                   # seconds from now to the end of a run of `total` steps
            ends = lambda every: total // every - step // every + (total % every != 0)   # the last step's too
            run = (total - step) * step_time + ends(args.eval_every) * eval_time
            saves = ends(every) if every else int(min(run // (minutes * 60) + 1, total - step))   # one a step at most
            behind = max(0.0, self.took - (every * step_time if every else minutes * 60))
            return run + saves * self.paused + (saves - 1) * behind + self.took
        # cost grows with total: bisect for the last that fits (one at least; capped: a step of 0 s plans forever)
        total = step + max(1, bisect.bisect_right(range(step + 1, step + MAX_PLANNED_STEPS + 1), left, key=cost))
        print(f"plan | {total:,} steps in {args.minutes:g} minutes ({step_time * 1e3:.1f} ms a step, "
              f"{eval_time:.1f} s an evaluation every {args.eval_every}, a checkpoint every "
              f"{every or f'{minutes:g} minutes'} holding training {self.paused:.2f} s, written in {self.took:.1f} s)")
        if args.warmup < step:
            print(f"plan | note: the warmup ({args.warmup} steps) ended before the plan; the steps "
                  "so far followed --steps's schedule")
        elif total < args.warmup:                          # as a --steps run shorter than its warmup (print_settings)
            print(f"plan | note: all {total} steps are in the warmup ({args.warmup} steps): the lr peaks at "
                  f"{args.lr * total / args.warmup:.3g}, with no cosine; a --warmup under {total} gives it one")
        state["planned_steps"] = total
        self.plan_at = None                                # planned: the log shows the total from here
        return total

    def save(self, step, engine, state, rng, background=True):
        """the pair of `step`, with the data order's random state -> the model's path"""
        t0 = self.last = self.clock()
        if self.pair and RunFolder.thread and RunFolder.thread.is_alive() and not self.said:
            self.said = True
            print("note: a checkpoint is still being written when the next is due; training waits for it "
                  "(now and later); save less often, or to a faster disk", file=sys.stderr)
        self.finish()
        state.update(step=step, rng=rng.bit_generator.state)
        flat, m, v = engine.host_weights()
        self.stop_if_not_finite({"weights": flat}, step)
        state = json.loads(json.dumps(state))            # the loop goes on changing its own
        self.paused = self.clock() - t0                  # how long the save held training
        self.start(lambda: (self.write_pair(step, flat, m, v, state), self.prune()), step, background)
        return self.path(step)

    def save_best(self, flat):
        """best.safetensors of flat (a copy that the steps do not change), written beside them"""
        self.start(lambda: save_model(os.path.join(self.out, "best.safetensors"), self.cfg, flat, self.tok))

    def start(self, work, step=None, background=True):
        """work() on the writer's thread once the write before it is finished, or on this one and finished;
        step: the pair's (None: best)"""
        self.finish()
        def write():
            t0 = self.clock()
            try:
                work()
                if step:
                    self.took, self.result = self.clock() - t0, step
            except BaseException as e:               # for finish() to raise in the loop's thread
                self.result = e
        self.pair = step is not None
        if background:
            RunFolder.thread = threading.Thread(target=write, name="checkpoint writer")
            RunFolder.thread.start()
        else:
            write()
            self.finish()

    @classmethod
    def wait(cls):
        if cls.thread:
            cls.thread.join()
            cls.thread = None

    def finish(self, poll=False):
        """wait for the write in flight (poll: only if it has ended) and say a pair is saved, or
        raise what stopped it"""
        if poll and RunFolder.thread and RunFolder.thread.is_alive():
            return
        self.wait()
        result, self.result = self.result, None
        if isinstance(result, BaseException):
            raise result
        if result is not None:
            print(f"saved  {self.path(result)} (+ state) in {self.paused + self.took:.1f} s, "
                  f"training held {self.paused:.2f} s")

    def stop_if_not_finite(self, values, step, made_by=None):
        """values: {what: a number or an array}, in the order to name them; the first that is
        NaN or infinite anywhere stops the run, naming the newest checkpoint whose weights
        went on to a finite loss. The loop asks this of a step's loss and gradient norm
        (made_by: step - 1, whose weights gave them), of the validation loss, and of the
        weights before any model is written: an update can break them after a finite loss
        (a huge --weight-decay), and best.safetensors must stay good. made_by's checkpoint,
        if one was saved, is removed (resuming from it meets the same value at once), while
        every older checkpoint was followed by a finite step. The save in flight ends first."""
        what, value = next(((w, v) for w, v in values.items() if not np.isfinite(v).all()), (None, None))
        if what is None:
            return
        value = value if np.ndim(value) == 0 else "NaN or infinite"
        RunFolder.wait()
        removed = ""
        if made_by and os.path.exists(self.path(made_by)):
            self.remove(made_by)
            removed = f" (the one of step {made_by}, whose weights gave it, was removed)"
        good = self.latest()
        stopped = f"; the last good checkpoint is {self.path(good)}" if good else " before any good checkpoint"
        advice = f"lower --lr (or --weight-decay) and {'continue from it' if good else 'start again'} with --resume"
        if made_by == 0:                                  # no update yet: neither --lr nor --weight-decay did it
            step = "1, from the weights the run started with, before any update"
            advice = "with sft, the --model file gives it: use another model"
        raise NanoEulerError(f"the {what} became {value} at step {step}, so training stopped{stopped}{removed}; "
                             + advice)


# -----------------------------------------------------------------------------
# operations: every core: tokenizing a corpus at scale (the data section's calls), a training step's workers

DOC_MARKER = b"<|endoftext|>"
DOC_SEPARATOR = re.compile(r"\n?<\|endoftext\|>\n?")   # "\n<|endoftext|>\n"; a file may start or end with less
CHUNK_BYTES = 256 << 10       # what a worker encodes at a time
SAMPLE_BYTES = 16 << 20        # text the tokenizer is trained on, at most
POOL_MIN_BYTES = 4 << 20       # a smaller corpus is encoded in this process: starting workers costs more


def chunk_end(data):
    """where to end a chunk of a file's bytes: before the last space that follows
    a visible ASCII character and precedes an ASCII letter ("said| the"). No
    pre-tokenized piece and no <|endoftext|> line spans that place, so encoding
    chunk by chunk gives exactly the tokens of encoding each whole document.
    Text with no such place in its last 64 KB (Chinese, say) is cut at its last
    newline, or at a character, never inside an <|endoftext|> line: its pieces
    at the cut may come out differently, and decoding still gives back the text."""
    window = max(0, len(data) - (64 << 10))
    i = len(data)
    while (i := data.rfind(b" ", window, i)) > 0:
        if 0x21 <= data[i - 1] <= 0x7E and data[i + 1:i + 2].isalpha():
            return i
    i = data.rfind(b"\n", window)
    if i >= 0:                                         # before the newline; after it if it ends a marker line
        return i + 1 if data[:i].endswith(DOC_MARKER) else i
    for k in range(len(DOC_MARKER), 0, -1):            # before a marker the next block may complete
        if data.endswith(DOC_MARKER[:k]):
            return len(data) - k
    end = len(data) - 1                                # the block may end inside a character:
    while end > 0 and data[end] & 0xC0 == 0x80:        # leave its last one to the next chunk
        end -= 1
    return end


def text_chunks(files):
    """yield (path, offset, data, ends_document) for pieces of the files of about
    CHUNK_BYTES, cut by chunk_end. ends_document is set on a file's last chunk
    when the file does not end with the marker (a book): its end ends a document."""
    for path in files:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - (4 << 10)))
            book = not re.search(rb"<\|endoftext\|>\n*\Z", f.read())    # blank lines after the marker: no document
            f.seek(0)
            offset, data = 0, b""
            while block := f.read(CHUNK_BYTES):
                data += block
                if cut := chunk_end(data):
                    yield path, offset, data[:cut], False
                    offset, data = offset + cut, data[cut:]
        if size:
            yield path, offset, data, book


def encode_chunk(tok, path, offset, data, ends_document):
    """one chunk of a file -> its token ids (an array of the token file's dtype),
    with <|endoftext|> after each document that ends in it; tok None: a worker process's own"""
    tok = _worker_tokenizer if tok is None else tok
    docs = DOC_SEPARATOR.split(decode_text(data, path, offset)) + [""] * ends_document
    ids, eot = [], tok.special("<|endoftext|>")
    for doc in docs[:-1]:                              # each ends in the chunk; the last runs on into the next
        ids += tok.encode(doc) + [eot]
    return np.array(ids + tok.encode(docs[-1]), dtype=TOKEN_DTYPE)


def tokenizer_sample(files, corpus=None, max_bytes=SAMPLE_BYTES):
    """what the tokenizer is trained on: at most max_bytes, an equal share from the
    start of every file, cut as chunks are, its documents joined by newlines; a sample
    of nothing but whitespace is refused, naming corpus (the --data the files are)"""
    share, texts = max(max_bytes // len(files), 1), []
    for path in files:
        with open(path, "rb") as f:
            data = f.read(share + 1)
        if len(data) > share:
            data = data[:chunk_end(data[:share])]
        texts += DOC_SEPARATOR.split(decode_text(data, path, 0))
    if corpus is not None and not "".join(texts).strip():
        raise NanoEulerError(f"{corpus} holds no text; give it a UTF-8 text file with something in it")
    return "\n".join(texts)


_worker_tokenizer = None


def _start_worker(merges, max_piece_bytes):
    """in each tokenizing worker process: build the tokenizer once (encode_chunk's when given None), and leave
    Ctrl-C to the main process, which stops the workers (they start with it blocked); exit should the main
    process be killed outright (kill -9, out of memory) rather than wait for work forever"""
    import multiprocessing
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=lambda: (multiprocessing.parent_process().join(), os._exit(1)), daemon=True).start()
    _worker_tokenizer = Tokenizer(merges, max_piece_bytes)


def progress_text(done, total, seconds):
    """'tokenizing: 300/1,000 MB, 42.0 MB/s, 0m16s left'"""
    rate = done / max(seconds, 1e-9)
    left = fmt_time((total - done) / rate) if rate > 0 else "?"
    return f"tokenizing: {done / 1e6:,.0f}/{total / 1e6:,.0f} MB, {rate / 1e6:.1f} MB/s, {left} left"


def tokenize_files(files, tok, write, workers=None, progress=True):
    """encode the files and hand the ids to write(ids), chunk by chunk, in order; -> the number of tokens.
    `workers` processes encode them (every core unless the corpus is small), or one thread here when 1.
    The processes are spawned, fresh interpreters (a fork beside training's or CUDA's threads can deadlock
    the child). At most two chunks per worker are in flight: the reader never runs ahead of the encoders,
    and memory stays bounded. At the end, or on Ctrl-C, the pool stops (its running chunks finish: a second)."""
    from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
    total = sum(os.path.getsize(f) for f in files)
    workers = workers or (CORES if total >= POOL_MIN_BYTES else 1)
    if workers > 1:
        import multiprocessing
        # Ctrl-C and a hangup (SIGHUP) reach every process of the terminal: the processes started here (the
        # workers, multiprocessing's resource tracker) start with both blocked, so the tracker never sees SIGHUP
        # (it ignores only SIGINT and SIGTERM); the main process gets them at the unblock, and stops the workers
        with signals_blocked():
            pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), initializer=_start_worker,
                                       initargs=(tok.merges, tok.max_piece_bytes))
        tok = None                                     # each worker's own (_start_worker)
    else:
        pool = ThreadPoolExecutor(1)
    chunks, pending, done, n_tokens, t0 = text_chunks(files), deque(), 0, 0, time.time()
    try:
        with signals_handled():                        # the policy, also where run_command has not
            while (chunk := next(chunks, None)) or pending:     # after the last chunk (None): the rest in flight
                if chunk:
                    with signals_blocked():            # submit may start a worker
                        pending.append((pool.submit(encode_chunk, tok, *chunk), len(chunk[2])))
                # the oldest chunk's ids, written, counted, shown: once done, or too many in flight, or all read
                while pending and (not chunk or len(pending) > 2 * workers or pending[0][0].done()):
                    future, nbytes = pending.popleft()
                    ids = future.result()
                    write(ids)
                    n_tokens, done = n_tokens + len(ids), done + nbytes
                    if progress:
                        progress_line(progress_text(done, total, time.time() - t0))
    except BrokenExecutor:
        raise NanoEulerError("a tokenizing worker process died (out of memory?); free some memory, or "
                             "prepare the data with fewer: python nanoeuler.py prepare --workers N") from None
    finally:
        pool.shutdown(cancel_futures=True)
    if progress:
        progress_line(f"tokenizing: done, {total / 1e6:,.1f} MB in {time.time() - t0:.1f} s, "
                      f"{n_tokens:,} tokens", done=True)
    return n_tokens


def write_tokens(path, files, tok, workers=None, progress=True):
    """tokenize files into the .npy file path as the ids come. The header, which holds their count, is
    written again at the end over the first one (numpy leaves room in it to grow: 128 bytes for any count
    below 10^16). All goes to path.<pid>.tmp, renamed when complete: an interrupted run leaves no token
    file, and two runs that share the cache each write their own temp file."""
    def header(f, n):
        f.seek(0)
        np.lib.format.write_array_header_1_0(f, {"descr": TOKEN_DTYPE.str, "fortran_order": False, "shape": (n,)})

    def write(f):
        header(f, 0)
        header(f, tokenize_files(files, tok, f.write, workers, progress))
    atomic_write(path, write)


# The training step's workers (the story's "a training step on every core"): threads while a few do (numpy lets go of
# the GIL in its loops and BLAS calls), else processes forked once, if this process has no other thread (a fork beside
# one can deadlock the child): between numpy calls a thread needs the GIL; on 16 cores 8 threads took 2.4x the step of
# 8 processes, 4 threads of 2 rows beat 4 (docs/cpu_threads.md). Weights and gradient buffers live in memory shared
# with them, arrays in it travel as their place in it; a worker ignores the signals (this process stops it) and ends
# when its pipe does, also when this process is killed; an error in one is raised here. A pipe each, not a pool:
# concurrent.futures' go-between threads made the step of 16 processes on 16 cores 10% slower (64 against 58 ms, B=32).

def workers_for(B, threads):
    """-> (n, processes, parts): the workers a batch of B rows is split over, at most --threads and one a core;
    processes where more than PROCESSES_ABOVE and fork is safe, a row each; else threads, MIN_ROWS rows each.
    parts: how many micro-batches loss_and_grads cuts the batch into, a multiple of the workers, of about 8 rows
    each (32 rows as 4 parts of 8 ran 2-4% faster than 2 of 16 on 2 cores, smaller arrays staying in cache; 8 of 4
    slower)"""
    n = max(1, min(threads, CORES, B))
    processes = n > PROCESSES_ABOVE and sys.platform == "linux" and threading.active_count() == 1   # fork: no thread
    n = n if processes else max(1, min(n, B // MIN_ROWS, MAX_THREADS))
    return n, processes, n * max(1, B // (8 * n))


class Workers:
    """the workers of a batch of `batch` rows on --threads (how many, of which kind: workers_for): map(fn, *iterables)
    like the builtin's on them; flat: the weights where they read them (flat itself for threads); grad_bufs: a
    gradient buffer a worker; threads: as many threads here; parts: the batch's micro-batches; line: the run's header
    line: the workers, what held them below --threads (the cores, MIN_ROWS or MAX_THREADS; a row a process), rows a
    micro-batch, BLAS's threads (a user's OPENBLAS_NUM_THREADS)"""

    def __init__(self, flat, batch, threads):
        import mmap
        from multiprocessing import Pipe
        n, procs, self.parts = workers_for(batch, threads)
        self.threads, self.processes, self.conns, self.pids = ThreadPoolExecutor(n), procs, [], []
        kind, least = ("process", "a row") if procs else ("thread", f"{MIN_ROWS} rows")
        why = (f" ({CORES} cores here)" if n == CORES < threads else
               f" ({least} a {kind} at least{'' if procs else f', {MAX_THREADS} at most'})" * (n < threads))
        blas = os.environ.get("OPENBLAS_NUM_THREADS", "1")
        self.line = (f"numpy {np.__version__}, {n} {kind}{('es' if procs else 's') * (n > 1)}{why}, "
                     f"{-(-batch // self.parts)}-row micro-batches, {blas} BLAS thread{'s' * (blas != '1')} each")
        if not procs:
            self.flat, self.grad_bufs = flat, [np.zeros_like(flat) for _ in range(n)]
            return
        self.memory = mmap.mmap(-1, (n + 1) * flat.nbytes)
        self.flat, *self.grad_bufs = np.frombuffer(self.memory, flat.dtype).reshape(n + 1, flat.size)
        self.flat[...] = flat
        with signals_blocked(tuple(SIGNALS)):                 # a signal until the worker ignores it is ours
            for _ in range(n):
                ours, theirs = Pipe()
                pid = os.fork()
                if pid == 0:
                    self._serve(theirs, ours)                  # and exits
                theirs.close()
                self.conns.append(ours)
                self.pids.append(pid)

    def _serve(self, conn, ours):
        """in a worker process: run what map sends until the pipe closes"""
        try:
            for end in self.conns + [ours]:              # this process's ends would keep the pipes open
                end.close()
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            while True:
                unpickler = pickle.Unpickler(io.BytesIO(conn.recv_bytes()))
                unpickler.persistent_load = lambda key: np.ndarray(key[2], key[1], self.memory, key[0], key[3])
                fn, args = unpickler.load()
                try:
                    result = fn(*args)
                except Exception as e:                     # noqa: BLE001 (raised in the main process)
                    result = e
                conn.send(result)
        finally:                                           # EOFError, OSError: the main process closed the pipe,
            os._exit(0)                                    # or is gone

    def _dump(self, obj):
        """obj pickled, an array in the shared memory as its place there (offset, dtype, shape, strides)"""
        f, base = io.BytesIO(), self.flat.ctypes.data
        pickler = pickle.Pickler(f, pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = lambda a: ((a.ctypes.data - base, a.dtype.str, a.shape, a.strides) if isinstance(
            a, np.ndarray) and 0 <= a.ctypes.data - base < len(self.memory) else None)
        pickler.dump(obj)
        return f.getvalue()

    def map(self, fn, *iterables):
        """[fn(*args) for args in zip(*iterables)], in that order (item i on process i % n). Its waits are timed: in an
        untimed one CPython misses a signal that lands while a handler runs (it waits again without looking)"""
        calls = list(zip(*iterables))
        if not self.processes:
            futures = [self.threads.submit(fn, *args) for args in calls]
            while wait(futures, 0.5).not_done:
                pass
            return [f.result() for f in futures]
        try:
            for i, args in enumerate(calls):
                self.conns[i % len(self.conns)].send_bytes(self._dump((fn, args)))
            results = []
            for i in range(len(calls)):
                conn = self.conns[i % len(self.conns)]
                while not conn.poll(0.5):
                    pass
                results.append(conn.recv())
        except (EOFError, OSError):
            raise NanoEulerError("a training worker process died (out of memory?); free some memory, or "
                                 "lower --batch or --threads") from None
        for error in (r for r in results if isinstance(r, BaseException)):
            raise error
        return results

    def close(self):
        """stop the workers now (a step cut short by a signal is lost anyway)"""
        self.threads.shutdown()
        for conn, pid in zip(self.conns, self.pids):
            conn.close()
            os.kill(pid, signal.SIGKILL)                   # not reaped yet: the pid is still this worker's
            os.waitpid(pid, 0)
        self.conns, self.pids = [], []


# -----------------------------------------------------------------------------
# operations: memory (what check_config's estimate of a step is held against), and the cores

# Freed memory is kept: numpy makes a fresh array for every result. Above 128 KB glibc maps new pages from the
# OS for each one and unmaps them on free, and those page faults cost a quarter of a training step (measured, B=8:
# 76 -> 57 ms). So keep arrays up to 32 MB on the heap, and keep freed heap memory: with this and the step's
# workers, a step on 2 cores runs at PyTorch's eager CPU step's speed. Set once, when this file is imported.
with contextlib.suppress(OSError, AttributeError):    # not glibc: nothing to tune
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(-3, 32 << 20)     # M_MMAP_THRESHOLD (glibc caps it at 32 MB)
    ctypes.CDLL("libc.so.6").mallopt(-1, 1 << 30)      # M_TRIM_THRESHOLD


def system_file(*path):
    """the text of a file the system keeps (/proc, /sys/fs/cgroup), or "" where it cannot be read
    (not Linux, no such cgroup, not UTF-8): the readers below then find no number in it"""
    with contextlib.suppress(OSError, ValueError), open(os.path.join(*path)) as f:
        return f.read()
    return ""


# cgroup v2 and v1 (its memory controller): the limit, the usage, and memory.stat's line of
# the page cache the kernel would drop before it refused memory (counted as free, as docker does)
CGROUP_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def cgroups(root="/", controller="memory"):
    """(version, folder) of this process's memory (or other controller's) cgroup and of each
    one above it (a limit anywhere above applies too), from /proc/self/cgroup; inside a cgroup
    namespace its path reads "/" and the mount's root is the container's own cgroup"""
    found, lines = [], [ln.split(":", 2) for ln in system_file(root, "proc/self/cgroup").splitlines()]
    for number, controllers, path in (ln for ln in lines if len(ln) == 3):
        if number == "0" and controllers == "":
            version, mount = "v2", os.path.join(root, "sys/fs/cgroup")
        elif controller in controllers.split(","):
            version, mount = "v1", os.path.join(root, "sys/fs/cgroup", controller)
        else:
            continue
        parts = [p for p in path.split("/") if p]
        found += [(version, os.path.join(mount, *parts[:depth])) for depth in range(len(parts), -1, -1)]
    return found


def available_cores(root="/", affinity=getattr(os, "sched_getaffinity", None)):
    """the cores this process may run on: its affinity's (taskset, a job's cpuset), fewer where a
    cgroup's CPU quota gives it less time (docker --cpus 2.5 counts as 2), and at least one"""
    have = [len(affinity(0)) if affinity else os.cpu_count() or 1]
    for version, folder in cgroups(root, "cpu"):
        names = ["cpu.max"] if version == "v2" else ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
        with contextlib.suppress(ValueError, ZeroDivisionError):      # no quota: v2's "max", v1's -1
            quota, period = " ".join(system_file(folder, n) for n in names).split()[:2]
            have += [max(1, int(quota) // int(period))] if quota not in ("max", "-1") else []
    return min(have)


CORES = available_cores()                              # read once, for workers_for and --threads


def available_memory(meminfo="/proc/meminfo", folders=cgroups()):
    """bytes this process may still take: MemAvailable of meminfo, or less where a cgroup memory limit leaves less
    (a container's, a batch job's; inside a container MemAvailable is the whole machine's); None where none of them
    can be read (not Linux). folders: our memory cgroups, read once, at import (only their figures change)"""
    have = [int(kb) * 1024 for kb in re.findall(r"^MemAvailable:\s*(\d+)", system_file(meminfo), re.M)]
    # each cgroup's room below its limit, the droppable page cache counted as free; none where
    # it sets no limit (v2 says "max", v1 gives a huge number) or its files cannot be read
    for version, folder in folders:
        limit_file, usage_file, cache_line = CGROUP_FILES[version]
        cache = sum(int(n) for n in re.findall(rf"^{cache_line} (\d+)", system_file(folder, "memory.stat"), re.M))
        with contextlib.suppress(ValueError):
            have.append(max(0, int(system_file(folder, limit_file)) - int(system_file(folder, usage_file)) + cache))
    return min(have) if have else None


# -----------------------------------------------------------------------------
# operations: how a command ends: signals, lost output streams, every command's last words; the program's flags

# One policy, which every command runs under (run_command's `with signals_handled()`): Ctrl-C
# (SIGINT), SIGTERM (what a scheduler or `docker stop` sends) and SIGHUP (the terminal closed)
# stop the command where it stands, raised (KeyboardInterrupt, Interrupted) so that every
# cleanup on the way out runs; run_command then exits 128 + N. While a training loop runs
# (signals_handled(run)), the first of them stops the loop after the step in flight, saved
# (RunFolder.handle), and a second is raised at once. A signal that was ignored when we
# started (nohup, a background job) stays ignored.

SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}   # their names


@contextlib.contextmanager
def signals_blocked(signals=(signal.SIGINT, signal.SIGHUP)):
    """hold these signals back while inside; one that came meanwhile is delivered on leaving"""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class Interrupted(BaseException):
    """SIGTERM or SIGHUP (or a second signal while training saves), raised as Ctrl-C's KeyboardInterrupt
    is (the policy above; a BaseException: no `except Exception` stops it). Not a KeyboardInterrupt: what
    Ctrl-C alone ends (a chat reply, the chat) never takes it for one. Interrupted(signum).signum: its number;
    Interrupted(signum, step, last_path): the training loop stopped after step, saved as last_path (None: before the
    first step; RunFolder.end)."""
    signum = property(lambda self: self.args[0])


@contextlib.contextmanager
def signals_handled(run=None):
    """the policy above while inside, the previous handlers after; run: the training loop's
    folder, whose handle takes the signals while the loop runs"""
    def raise_it(signum, frame):
        raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)
    handler = run.handle if run else raise_it
    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_now_if_threads_work_on(code):
    """after a signal's exit (128 + N): Python joins the threads at exit, and a training step's
    threads would hold a second Ctrl-C's "at once" until the step ends (minutes for a large
    --batch); their work is lost anyway, so leave without them, output flushed"""
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def progress_line(text, done=False):
    """one progress line on stderr: redrawn in place on a terminal; in a log file,
    a new line at most every 2 seconds and at the end"""
    if sys.stderr.isatty():
        print("\r" + text, end="\n" if done else "", file=sys.stderr, flush=True)
    elif done or time.time() - _last_progress[0] >= 2.0:
        print(text, file=sys.stderr, flush=True)
        _last_progress[0] = time.time()


def silence_lost_output(fds=()):
    """point stdout and stderr, where nobody reads them any more (a closed pipe, a hung-up
    terminal: poll says POLLERR or POLLHUP), at /dev/null, so that the save and the last
    words cannot fail on them; a file or a live terminal keeps its output. fds: these
    descriptors, whatever poll says (a closed pipe's stdout; streams closed at start)"""
    poll = select.poll()
    for fd in (1, 2):
        poll.register(fd, select.POLLOUT)
    gone = select.POLLERR | select.POLLHUP | select.POLLNVAL
    for fd in fds or [fd for fd, events in poll.poll(0) if events & gone]:
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:                                 # (a closed descriptor's number is the one open gives)
            os.dup2(null, fd)
            os.close(null)


def os_error_sentence(e, out_flag=True):
    """an OSError (a full disk, a read-only file system, ...) as one sentence naming the file;
    out_flag: whether the command has an --out to suggest (sample and chat write to stdout only)"""
    advice = {errno.ENOSPC: "the disk is full; free some space, or give another --out",
              errno.EDQUOT: "the disk quota is used up; free some space, or give another --out",
              errno.EROFS: "the file system is read-only; give another --out",
              errno.EFBIG: "the file is too large; check the file size limit (ulimit -f), or give another --out",
              errno.EACCES: "permission denied; check its permissions",
              errno.EPERM: "the operation is not permitted; check its permissions",
              errno.ENOENT: "no such file or folder; check its path, or give another --out",
              errno.ENOTDIR: "a part of this path is a file, not a folder; give a path through folders",
              errno.EEXIST: "a file is there where a folder should be; move it away, or give another path",
              errno.EISDIR: "a folder is there where a file should be; move it away, or give another path"}
    reason = str(e.strerror or e).lower()
    if e.errno == errno.ENOENT and e.filename is None:     # os.getcwd()'s, at the start or later (os.path.abspath)
        return "the current folder has been deleted; cd into one that exists and run again"
    for fd, stream in ((1, "stdout"), (2, "stderr")) if e.filename is None else ():
        try:                                         # the stream that refuses even an empty write (stdout > /dev/full)
            os.write(fd, b"")
        except OSError:
            return f"writing to {stream} failed ({reason}); send it to another file or device"
    if not out_flag and e.filename is None:          # a write to stdout's file (sample > file on a full disk)
        room = "free some space, or " if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return f"the output could not be written ({reason}); {room}send it elsewhere"
    what = advice.get(e.errno, f"{reason}; check the path and the disk, or give another --out")
    if not out_flag:
        what = what.replace(", or give another --out", "").replace("give another --out", "give another path")
    return f"{e.filename}: {what}" if e.filename else what


# One policy for every program's streams (nanoeuler_cuda.py, tools/export.py and serve.py import this file first),
# set once, at import: stdin, stdout or stderr closed at start (`>&-`) become /dev/null, so that no write (argparse's
# too) fails on None and no file opened later takes their descriptor (run_command refuses a command that needs one);
# a text that the streams' encoding lacks (PYTHONIOENCODING=ascii) is said with ? for what it lacks
CLOSED_AT_START = []
for fd, name in enumerate(["stdin", "stdout", "stderr"]):
    # open for its direction: a launcher that ran with fd 1 or 2 closed (pyenv's shim
    # script) may have left a read-only file there (fcntl's OSError: fd is closed)
    with contextlib.suppress(OSError):
        if getattr(sys, name) is not None and (
                fd == 0 or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY):
            continue
    silence_lost_output([fd])
    setattr(sys, name, open(fd, "r" if fd == 0 else "w", encoding="utf-8", closefd=False))
    CLOSED_AT_START.append(name)
for stream in (sys.stdout, sys.stderr):
    if hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="replace")
del fd, name, stream

PATH_FLAGS = {"out": "a folder for the run", "data": "a text file or folder", "model": "a .safetensors file",
              "sft --data": "a JSONL or Alpaca JSON file of instructions"}     # what each names (sft's --data its own)
NEEDS_STREAMS = {"sample": ["stdout"], "chat": ["stdin", "stdout"]}
_last_progress = [0.0]          # when progress_line last wrote a line to a log file


def run_command(command, args):
    """run a subcommand, the one place where a command ends: a NanoEulerError raised anywhere, an OSError or a
    MemoryError is one sentence on stderr and exit code 2; a signal, exit code 128 + N; a closed output pipe, a
    quiet 1. train and sft get their --out folder as args.run, the run's one RunFolder, held while they run
    (claim; prepare only writes the cache beside it). Refused before the command starts: a stream it needs,
    closed at start (`>&-`: CLOSED_AT_START); a path flag given empty (--out "" would put
    prepare's cache in ../cache, --model "" reads as "does not exist"); an --out that is a file; a working
    folder deleted under us (all but check use paths)."""
    run, name = None, getattr(args, "command", None)
    if hasattr(args, "out") and hasattr(args, "resume"):
        if args.out is None:                           # train's folder is named after its model size
            args.out = os.path.join("out", args.model_size)
        run = args.run = RunFolder(args.out)           # the run's folder, one object from here to the end
    try:
        for stream in (n for n in NEEDS_STREAMS.get(name, []) if n in CLOSED_AT_START):
            raise NanoEulerError(f"{name} needs its {stream}, which is closed; run it without closing {stream} "
                                 f"({'<&-' if stream == 'stdin' else '>&-'})")
        for flag in (f for f in ("out", "data", "model") if getattr(args, f, None) == ""):
            raise NanoEulerError(f"--{flag} is empty; give {PATH_FLAGS.get(f'{name} --{flag}', PATH_FLAGS[flag])}")
        if os.path.exists(out := getattr(args, "out", None) or "") and not os.path.isdir(out):
            raise NanoEulerError(f"--out {out} is a file, not a folder; give {PATH_FLAGS['out']}")
        if name != "check":
            os.getcwd()                                # a deleted working folder: os_error_sentence names it
        holds = run and (not hasattr(command, "holds_out") or command.holds_out(args))   # nanoeuler_cuda.py: rank 0
        claim = run.claim(args.resume, args.fresh) if holds else contextlib.nullcontext()
        with signals_handled(), claim, warnings.catch_warnings():
            # numpy's overflow warnings (a model with huge weights, a run on its way to a NaN)
            # show source lines; what they lead to is said in one sentence (LogitsNotFinite, stop_if_not_finite)
            warnings.simplefilter("ignore", RuntimeWarning)
            command(args)
    except (KeyboardInterrupt, Interrupted) as e:      # say where, and exit as its killing would have: 128 + N
        signum, *saved = e.args if isinstance(e, Interrupted) else [signal.SIGINT]   # (130 Ctrl-C, 143 SIGTERM, ..)
        if saved:                                      # the training loop stopped, saved (Interrupted)
            lead, said = "", (f"stopped at step {saved[0]}, saved as {saved[1]}; continue with --resume" if saved[1]
                              else "stopped before the first step; nothing to save")
        else:                                          # where it stood: train and sft name their last checkpoint
            for sig in SIGNALS:                        # a further signal must not cut these last words
                signal.signal(sig, signal.SIG_IGN)     # (on a line of its own: a step's line may be unfinished)
            step = None
            with contextlib.suppress(OSError):
                step = run.latest() if run else None
            lead, said = "\n", "interrupted" + (f"; the last complete checkpoint is {run.path(step)}, "
                                                "continue with --resume" if step is not None else "")
        silence_lost_output()                          # SIGHUP's terminal is most likely gone, or a pipe closed
        with contextlib.suppress(OSError):
            print(f"{lead}{SIGNALS[signum]}: {said}", file=sys.stderr)
        sys.exit(128 + signum)
    except BrokenPipeError:
        # the reader of our output went away (sample | head): stop quietly; stdout now
        # goes nowhere, so Python's own flush at exit cannot fail again (Python's docs' recipe)
        silence_lost_output([sys.stdout.fileno()])
        sys.exit(1)
    except (NanoEulerError, MemoryError, OSError) as e:    # one sentence, exit code 2
        if isinstance(e, MemoryError):                     # numpy's says what it could not allocate
            lower = "lower --batch, or " if hasattr(args, "batch") else ""
            e = f"out of memory ({str(e) or 'an allocation failed'}); {lower}free some memory"
        elif isinstance(e, OSError):
            e = os_error_sentence(e, hasattr(args, "out"))
        elif isinstance(e, LogitsNotFinite):               # sample's, chat's (generate): the model is named
            e = f"{args.model}: {e}"
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# Flag types: argparse calls them on the flag's text and turns an ArgumentTypeError into "argument --batch: 0 is
# not ...", one line with the usage, exit code 2. The story names them (type="positive_int": FLAG_TYPES, registered).
TINY, HUGE = math.ulp(0.0), sys.float_info.max       # the least float above 0, the largest finite one
def number_type(convert, low, high, what, off=None, above=None):
    """a flag type: convert the text, keep a number from low to high (or the off value), else say it is not
    `what`; above: what to do instead, said of a finite number above high. For floats "above 0" is from TINY
    and "finite" up to HUGE; nan is in no range"""
    def parse(text):
        with contextlib.suppress(ValueError):           # (not a number at all)
            if low <= (value := convert(text)) <= high or value == off:
                return value
            if above and high < value < math.inf:
                raise argparse.ArgumentTypeError(f"{value:g} is more than {high:,}; {above}")
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return parse


def argv_text(text):
    """a flag type: a command-line string as valid text: bytes that were not UTF-8 (Python keeps them
    as lone surrogates) become U+FFFD, as chat does with its input"""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:                         # a surrogate that no byte made
        raw = text.encode("utf-8", "replace")
    return raw.decode("utf-8", "replace")


positive_int = number_type(int, 1, math.inf, "a positive integer")
nonnegative_int = number_type(int, 0, math.inf, "an integer >= 0")
positive_float = number_type(float, TINY, HUGE, "a positive number")
nonnegative_float = number_type(float, 0, HUGE, "a number >= 0")    # refuses nan and inf too
probability = number_type(float, TINY, 1, "a probability in (0, 1]")
positive_int_or_off = number_type(int, 1, math.inf, "a positive integer, or -1 for off", off=-1)
MAX_MINUTES = 14_400    # 10 days: a longer --minutes is a typo, and 1e307 minutes overflowed the plan
minutes_type = number_type(float, 0, MAX_MINUTES, f"a number of minutes from 0 to {MAX_MINUTES:,} (10 days)")
# --steps, --max-new-tokens: more than a billion is a typo, and 10^30 steps showed an eta of 10^25 hours
MAX_PLANNED_STEPS = 10 ** 9
count_type = number_type(int, 1, MAX_PLANNED_STEPS, f"a positive integer up to {MAX_PLANNED_STEPS:,}")
positive_float_or_off = number_type(float, TINY, HUGE, "a positive number, or -1 for off", off=-1)
vocab_size = number_type(int, FIRST_MERGE_ID, MAX_V,
                         f"a vocabulary size from {FIRST_MERGE_ID} (bytes and special tokens) to {MAX_V:,}")
port_type = number_type(int, 0, 65535, "a TCP port from 0 to 65535")
workers_count = number_type(int, 1, 4 * CORES, "a number of processes from 1 to 4 per core")   # more: shared cores
MAX_MTP_WEIGHT = 1000      # past it head 0 hardly counts, and near 1e308 the loss is inf at step 1
mtp_weight_type = number_type(float, 0, MAX_MTP_WEIGHT, "a number >= 0", above="give a smaller weight (SPEC's "
                              "default is 0.5)")     # train's --mtp-weight
FLAG_TYPES = ("positive_int positive_int_or_off nonnegative_int nonnegative_float positive_float positive_float_or_off "
              "probability minutes_type count_type vocab_size port_type workers_count argv_text "
              "mtp_weight_type").split()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """every flag's default in --help, unless its help already says it in words or
    there is none to say (an off switch, an optional value that is not given)"""

    def _get_help_string(self, action):
        # False by "is", not "in": 0 == False, and --minutes' 0 has something to say
        if "(default: " in (action.help or "") or action.default in (None, "") or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose --help shows every flag's default, its flags' types named; subcommands inherit it"""

    def __init__(self, *args, formatter_class=HelpFormatter, **kw):
        super().__init__(*args, formatter_class=formatter_class, **kw)
        for name in FLAG_TYPES:                        # type="positive_int" is positive_int
            self.register("type", name, globals()[name])

    def run(self, argv, commands):
        """the program: its flags parsed, then run_command(commands[the command])"""
        args = self.parse_args(argv, argparse.Namespace(started=now()))   # --minutes counts the whole run from here
        run_command(commands[args.command], args)

if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, int) and e.code > 128:
            exit_now_if_threads_work_on(e.code)
        raise
