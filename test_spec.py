"""
The model pinned to docs/SPEC.md (the contract) and the optimizer to its
published definition. Every expected number is computed here, in float64, from
the formula (SPEC's, or the paper's), never by calling the function under test.
tools/mutate.py checks that one-line bugs in nanoeuler.py make these tests fail.

    python -m pytest -q test_spec.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import json
import math
import os

import numpy as np
import pytest

# a tiny config whose every size differs from the others, so a mixed-up axis shows;
# mtp_weight is not the default, so the loss has to read it
CFG = ne.Config(V=40, C=16, Hq=4, Hkv=2, L=2, T=9, F=24, K=3, mtp_weight=0.3)


# -----------------------------------------------------------------------------
# an independent float64 implementation of SPEC's forward pass

def spec_tensors(cfg, rng, std=0.3):
    """random weights by SPEC name and shape (the table in SPEC, typed in here), norm weights near 1"""
    D = cfg.C // cfg.Hq
    t = {"tok_emb": rng.normal(0, std, (cfg.V, cfg.C))}
    for l in range(cfg.L):
        t[f"layers.{l}.attn_norm"] = 1 + rng.normal(0, 0.1, cfg.C)
        t[f"layers.{l}.wqkv"] = rng.normal(0, std, (cfg.Hq * D + 2 * cfg.Hkv * D, cfg.C))
        t[f"layers.{l}.wo"] = rng.normal(0, std, (cfg.C, cfg.Hq * D))
        t[f"layers.{l}.mlp_norm"] = 1 + rng.normal(0, 0.1, cfg.C)
        t[f"layers.{l}.w_gate"] = rng.normal(0, std, (cfg.F, cfg.C))
        t[f"layers.{l}.w_up"] = rng.normal(0, std, (cfg.F, cfg.C))
        t[f"layers.{l}.w_down"] = rng.normal(0, std, (cfg.C, cfg.F))
    t["final_norm"] = 1 + rng.normal(0, 0.1, cfg.C)
    for k in range(cfg.K):
        t[f"heads.{k}"] = rng.normal(0, std, (cfg.V, cfg.C))
    return t


def as_params(t, cfg):
    """the tensors in one flat float64 buffer in SPEC order (dicts keep insertion order), carved"""
    flat = np.concatenate([a.reshape(-1) for a in t.values()])
    return flat, ne.carve(flat, cfg)


def ref_rmsnorm(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w


def ref_rope(x, positions):
    """x (n, H, D) at the given absolute positions; rotate-half, theta 10000, element by element"""
    n, H, D = x.shape
    out = np.empty_like(x)
    for t in range(n):
        for i in range(D // 2):
            angle = positions[t] * 10000.0 ** (-2 * i / D)
            a, b = x[t, :, i], x[t, :, D // 2 + i]
            out[t, :, i] = a * math.cos(angle) - b * math.sin(angle)
            out[t, :, D // 2 + i] = b * math.cos(angle) + a * math.sin(angle)
    return out


def ref_attention(q, k, v):
    """q (n,Hq,D), k v (n,Hkv,D); query head h reads kv head h // (Hq/Hkv); position t sees 0..t"""
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    y = np.zeros_like(q)
    for h in range(Hq):
        g = h // (Hq // Hkv)
        for t in range(n):
            s = np.array([q[t, h] @ k[j, g] / math.sqrt(D) for j in range(t + 1)])
            p = np.exp(s - s.max())
            p /= p.sum()
            y[t, h] = sum(p[j] * v[j, g] for j in range(t + 1))
    return y


def ref_logits(t, cfg, ids):
    """ids (n,) -> logits (K, n, V), straight from SPEC's pseudo-code"""
    D = cfg.C // cfg.Hq
    n = len(ids)
    x = t["tok_emb"][np.asarray(ids)]
    for l in range(cfg.L):
        p = lambda name: t[f"layers.{l}.{name}"]
        h = ref_rmsnorm(x, p("attn_norm"))
        qkv = h @ p("wqkv").T
        q = qkv[:, :cfg.Hq * D].reshape(n, cfg.Hq, D)
        k = qkv[:, cfg.Hq * D:(cfg.Hq + cfg.Hkv) * D].reshape(n, cfg.Hkv, D)
        v = qkv[:, (cfg.Hq + cfg.Hkv) * D:].reshape(n, cfg.Hkv, D)
        q, k = ref_rope(q, range(n)), ref_rope(k, range(n))
        x = x + ref_attention(q, k, v).reshape(n, cfg.Hq * D) @ p("wo").T
        m = ref_rmsnorm(x, p("mlp_norm"))
        gate = m @ p("w_gate").T
        x = x + (gate / (1 + np.exp(-gate)) * (m @ p("w_up").T)) @ p("w_down").T
    x = ref_rmsnorm(x, t["final_norm"])
    return np.stack([x @ t[f"heads.{k}"].T for k in range(cfg.K)])


def ref_ce(logits, targets):
    """mean over targets >= 0 of -log softmax(logits)[target]; logits (N,V), targets (N,)"""
    nll = [math.log(np.exp(z - z.max()).sum()) + z.max() - z[y] for z, y in zip(logits, targets) if y >= 0]
    return sum(nll) / len(nll)


@pytest.fixture(scope="module")
def model():
    t = spec_tensors(CFG, np.random.default_rng(0))
    flat, params = as_params(t, CFG)
    return t, flat, params


# -----------------------------------------------------------------------------
# the forward pass and the loss

def test_model_loss_is_spec_loss(model):
    t, flat, params = model
    rng = np.random.default_rng(1)
    B, T, K = 2, CFG.T, CFG.K
    rows = rng.integers(0, CFG.V, (B, T + K))
    idx = rows[:, :T]
    # SPEC: the target of head k is row[1+k : 1+k+T]; a few are ignored (-1)
    targets = np.stack([rows[:, 1 + k:1 + k + T] for k in range(K)], -1)
    targets[0, 3, 0] = targets[1, 0, 2] = targets[1, 5, 1] = targets[0, :4, 2] = -1
    loss, ce, _ = ne.model_forward(params, CFG, idx, targets)
    logits = np.concatenate([ref_logits(t, CFG, idx[b]) for b in range(B)], 1)      # (K, B*T, V)
    want = [ref_ce(logits[k], targets[:, :, k].reshape(-1)) for k in range(K)]
    np.testing.assert_allclose(ce, want, rtol=1e-10)
    assert loss == pytest.approx(want[0] + 0.3 * np.mean(want[1:]), rel=1e-10)


def test_split_rows_shifts_head_k_by_k():
    rows = np.arange(2 * 14).reshape(2, 14)                   # T = 10, K = 4
    idx, targets = ne.split_rows(rows, 10, 4)
    assert np.array_equal(idx, rows[:, :10])
    for b in range(2):
        for t in range(10):
            for k in range(4):
                assert targets[b, t, k] == rows[b, t + 1 + k]


def test_a_head_whose_targets_are_all_ignored_adds_nothing():
    rng = np.random.default_rng(2)
    cfg = ne.Config(V=7, C=4, Hq=2, Hkv=1, L=1, T=3, F=8, K=3, mtp_weight=0.5)
    x, heads = rng.normal(size=(6, 4)), rng.normal(size=(3, 7, 4))
    targets = rng.integers(0, 7, (6, 3))
    targets[:, 2] = -1
    targets[[0, 4], 1] = -1
    loss, ce, _ = ne.mtp_heads_forward(x, heads, targets, cfg)
    want0, want1 = ref_ce(x @ heads[0].T, targets[:, 0]), ref_ce(x @ heads[1].T, targets[:, 1])
    np.testing.assert_allclose(ce, [want0, want1, 0.0], rtol=1e-12)
    assert loss == pytest.approx(want0 + 0.5 * (want1 + 0.0) / 2, rel=1e-12)   # the mean is over K-1 heads


def test_decoding_forward_is_spec_forward(model):
    # the KV-cache path, fed in pieces: positions continue across calls
    t, flat, params = model
    ids = np.random.default_rng(3).integers(0, CFG.V, CFG.T)
    want = ref_logits(t, CFG, ids)
    kv = ne.new_kv_cache(CFG, 1, np.float64)
    for a, b in ((0, 4), (4, 5), (5, 9)):
        logits, x = ne.model_forward(params, CFG, ids[None, a:b], pos=a, kv=kv)
        np.testing.assert_allclose(logits[0], want[0, a:b], rtol=1e-10, atol=1e-12)
        for k in range(1, CFG.K):                             # the other heads follow from x
            np.testing.assert_allclose(x[0] @ t[f"heads.{k}"].T, want[k, a:b], rtol=1e-10, atol=1e-12)


def test_rmsnorm_eps():
    # inputs this small make eps most of the denominator, so a changed eps shows at once
    rng = np.random.default_rng(4)
    x, w = rng.normal(0, 3e-3, (3, 8)), rng.normal(size=8)
    out, _ = ne.rmsnorm_forward(x, w)
    for r in range(3):
        want = x[r] / math.sqrt(sum(v * v for v in x[r]) / 8 + 1e-5) * w
        np.testing.assert_allclose(out[r], want, rtol=1e-12)


def test_rope_theta_pairing_and_positions():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 6, 2, 8))
    for pos in (0, 3, 1000):                                  # large positions: theta must be exact
        out, _ = ne.rope_forward(x, pos)
        np.testing.assert_allclose(out[0], ref_rope(x[0], range(pos, pos + 6)), rtol=1e-9, atol=1e-12)
    # by hand, D = 4 at position 1: pairs (0, 2) and (1, 3), angles 1 and 1/100
    x = np.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    out, _ = ne.rope_forward(x, 1)
    c0, s0, c1, s1 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    want = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]
    np.testing.assert_allclose(out.reshape(-1), want, rtol=1e-12)


def test_causal_mask_no_position_sees_a_later_one():
    rng = np.random.default_rng(6)
    q, k, v = rng.normal(size=(1, 7, 4, 8)), rng.normal(size=(1, 7, 2, 8)), rng.normal(size=(1, 7, 2, 8))
    y, _ = ne.attention_forward(q, k, v)
    np.testing.assert_allclose(y[0], ref_attention(q[0], k[0], v[0]), rtol=1e-12, atol=1e-12)
    for j in range(7):                                        # change key/value j: only queries >= j move
        k2, v2 = k.copy(), v.copy()
        k2[0, j] += 1.0
        v2[0, j] += 1.0
        y2, _ = ne.attention_forward(q, k2, v2)
        assert np.array_equal(y2[0, :j], y[0, :j])
        assert not np.isclose(y2[0, j:], y[0, j:]).all(axis=(1, 2)).any()
    # queries after a cache: the 3 queries sit at positions 4, 5, 6 of 7 keys
    y3, _ = ne.attention_forward(q[:, 4:], k, v)
    np.testing.assert_allclose(y3, y[:, 4:], rtol=1e-12, atol=1e-12)


def test_gqa_query_head_h_reads_kv_head_h_over_group_size():
    # every value of kv head g is g + 1, so query head h's output is (its kv head) + 1
    rng = np.random.default_rng(7)
    Hq, Hkv = 6, 3
    q, k = rng.normal(size=(2, 5, Hq, 4)), rng.normal(size=(2, 5, Hkv, 4))
    v = np.broadcast_to(np.arange(1.0, Hkv + 1)[None, None, :, None], (2, 5, Hkv, 4)).copy()
    y, _ = ne.attention_forward(q, k, v)
    for h in range(Hq):
        np.testing.assert_allclose(y[:, :, h], h // (Hq // Hkv) + 1, rtol=1e-12)


def test_swiglu_is_silu_gate_times_up():
    g, u = np.array([-3.0, -0.5, 0.0, 2.0]), np.array([1.5, -2.0, 3.0, 0.25])
    out, _ = ne.swiglu_forward(np.concatenate([g, u]))
    want = [gi / (1 + math.exp(-gi)) * ui for gi, ui in zip(g, u)]
    np.testing.assert_allclose(out, want, rtol=1e-12)


def test_attention_scale_is_one_over_sqrt_d():
    # one query, two keys: the weights are softmax(q.k / sqrt(D)) exactly
    D = 16
    q = np.zeros((1, 2, 1, D))
    q[0, 1, 0, 0] = 2.0
    k = np.zeros((1, 2, 1, D))
    k[0, 1, 0, 0] = 1.5
    v = np.zeros((1, 2, 1, D))
    v[0, 0, 0, 0], v[0, 1, 0, 0] = 0.0, 1.0
    y, _ = ne.attention_forward(q, k, v)                      # query 1 sees keys 0 (score 0) and 1 (3/4)
    s = 2.0 * 1.5 / math.sqrt(D)
    assert y[0, 1, 0, 0] == pytest.approx(math.exp(s) / (1 + math.exp(s)), rel=1e-12)


# -----------------------------------------------------------------------------
# bits per byte

def test_token_bytes():
    tok = ne.Tokenizer([(104, 105), (260, 33)])               # "hi", then "hi!"
    n = tok.token_bytes()
    assert n[:256].tolist() == [1] * 256
    assert n[256:260].tolist() == [0, 0, 0, 0]               # specials are not text
    assert n[260:].tolist() == [2, 3]


def test_bits_per_byte():
    token_bytes = np.array([1, 2, 3, 0, 5])
    t1 = np.array([[[1, 0], [4, 0]], [[-1, 0], [2, 0]]])    # (B=2, T=2, K=2); head 1 does not count
    t2 = np.array([[[3, 0], [0, 0]]])
    ce = {id(t1): np.array([0.7, 9.0]), id(t2): np.array([1.3, 9.0])}
    loss, bpb = ne.evaluate(lambda idx, targets: ce[id(targets)], [(None, t1), (None, t2)], token_bytes)
    nats = 0.7 * 3 + 1.3 * 2                                  # CE_0 times the kept targets of each batch
    nbytes = (2 + 5 + 3) + (0 + 1)                            # the bytes of the kept targets
    assert loss == pytest.approx(nats / 5, rel=1e-12)
    assert bpb == pytest.approx(nats / math.log(2) / nbytes, rel=1e-12)


# -----------------------------------------------------------------------------
# the optimizer

def ref_adamw(p, grads, lr, mask, beta1, beta2, eps, wd):
    """Loshchilov & Hutter (2019), Algorithm 2 with the schedule multiplier folded into lr:
    bias-corrected moments, weight decay decoupled from the gradient"""
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
        p = p - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * mask * p)
    return p, m, v


def test_adamw_is_the_published_algorithm():
    rng = np.random.default_rng(8)
    n = 64
    p0 = rng.normal(size=n)
    # gradients over many scales, some as small as eps, so eps, both bias corrections
    # and both betas all move the result
    grads = [rng.normal(size=n) * 10.0 ** rng.uniform(-9, 1, n) for _ in range(6)]
    mask = (np.arange(n) % 3 != 0).astype(float)               # a third of the entries are "norms"
    flat, m, v = p0.copy(), np.zeros(n), np.zeros(n)
    for step, g in enumerate(grads, start=1):
        ne.adamw_update(flat, g, m, v, step, 0.01, mask)      # the defaults: betas, eps, decay
    want_p, want_m, want_v = ref_adamw(p0, grads, 0.01, mask, 0.9, 0.95, 1e-8, 0.1)
    np.testing.assert_allclose(flat, want_p, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(m, want_m, rtol=1e-12)
    np.testing.assert_allclose(v, want_v, rtol=1e-12)
    # the first step of Adam moves every entry by about lr whatever its gradient's size
    flat, m, v = p0.copy(), np.zeros(n), np.zeros(n)
    ne.adamw_update(flat, grads[0], m, v, 1, 0.01, np.zeros(n))
    big = np.abs(grads[0]) > 1e-4
    np.testing.assert_allclose(np.abs(flat - p0)[big], 0.01, rtol=1e-3)


def test_adamw_weight_decay_alone_is_decoupled():
    # zero gradient: the moments stay zero and the decay shrinks by exactly lr * wd
    p = np.array([1.0, -2.0, 3.0])
    flat, m, v = p.copy(), np.zeros(3), np.zeros(3)
    ne.adamw_update(flat, np.zeros(3), m, v, 1, 0.5, np.array([1.0, 1.0, 0.0]), weight_decay=0.2)
    np.testing.assert_allclose(flat, [0.9, -1.8, 3.0], rtol=1e-12)


def test_parallel_adamw_equals_one_pass():
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(9)
    p, g = rng.normal(size=101), rng.normal(size=101)
    mask = (rng.random(101) < 0.5).astype(float)
    a = [p.copy(), np.zeros(101), np.zeros(101)]
    b = [p.copy(), np.zeros(101), np.zeros(101)]
    ne.adamw_update(a[0], g, a[1], a[2], 3, 0.1, mask)
    with ThreadPoolExecutor(3) as pool:
        ne.adamw_update_parallel(pool, 3, b[0], g, b[1], b[2], 3, 0.1, mask)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_training_steps_are_clip_then_adamw(model):
    # the CPU engine's step: gradient (proven by the gradient check), clipped to --clip,
    # then AdamW with --weight-decay on the matrices only. Two steps, because Adam's
    # first step does not depend on the gradient's scale: the second shows the clip.
    from types import SimpleNamespace
    t, flat0, _ = model
    rng = np.random.default_rng(10)
    batches = [ne.split_rows(rng.integers(0, CFG.V, (3, CFG.T + CFG.K)), CFG.T, CFG.K) for _ in range(2)]
    mask = np.concatenate([np.full(a.size, 0.0 if name.endswith("norm") else 1.0) for name, a in t.items()])
    p, grads, norms = flat0.copy(), [], []
    for step, (idx, targets) in enumerate(batches, start=1):
        g = np.zeros_like(p)
        ne.loss_and_grads(p.copy(), CFG, idx, targets, [g])
        norms.append(math.sqrt(sum(float(x) ** 2 for x in g)))
        grads.append(g * min(1.0, 0.5 / norms[-1]))
        p, _, _ = ref_adamw(flat0, grads, 0.02, mask, 0.9, 0.95, 1e-8, 0.3)
    assert min(norms) > 0.5 and abs(norms[0] - norms[1]) > 0.05     # both clipped, by different factors
    flat = flat0.copy()
    args = SimpleNamespace(clip=0.5, weight_decay=0.3, threads=1, batch=3)
    engine = ne.CPUEngine(CFG, flat, np.zeros_like(flat), np.zeros_like(flat), args)
    for step, (idx, targets) in enumerate(batches, start=1):
        loss, ce, norm = engine.step(idx, targets, 0.02, step)
        assert norm == pytest.approx(norms[step - 1], rel=1e-6)     # the norm before clipping
    engine.close()
    # the decay mask is float32 (training's dtype), so the decay factor is rounded to float32
    np.testing.assert_allclose(flat, p, rtol=0, atol=1e-7 * np.abs(flat0).max())


def test_weight_decay_on_matrices_only():
    mask = ne.decay_mask(CFG)
    t = spec_tensors(CFG, np.random.default_rng(0))
    at = 0
    for name, tensor in t.items():
        want = 0.0 if name.endswith("norm") else 1.0          # SPEC's norm weights are the only vectors
        assert (mask[at:at + tensor.size] == want).all(), name
        at += tensor.size
    assert at == mask.size


def test_lr_schedule_warmup_cosine_floor():
    lr, warmup, total = 0.003, 10, 110
    for step in range(warmup):                                # linear warmup, reaching lr at its last step
        assert ne.lr_schedule(step, total, lr, warmup) == pytest.approx(lr * (step + 1) / warmup, rel=1e-12)
    for step in (10, 35, 60, 85, 109, 110):                   # cosine from lr down to lr / 10
        progress = (step - warmup) / (total - warmup)
        want = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert ne.lr_schedule(step, total, lr, warmup) == pytest.approx(want, rel=1e-12)
    assert ne.lr_schedule(60, total, lr, warmup) == pytest.approx(lr * 0.55, rel=1e-12)   # halfway
    for step in (110, 111, 500):                              # the floor holds after the end
        assert ne.lr_schedule(step, total, lr, warmup) == pytest.approx(lr / 10, rel=1e-12)


def test_gradient_clipping():
    g = np.array([3.0, 4.0])                                  # norm 5
    assert ne.clip_grad_norm(g, 1.0) == pytest.approx(5.0, rel=1e-12)
    np.testing.assert_allclose(g, [0.6, 0.8], rtol=1e-12)
    g = np.array([3.0, 4.0])
    assert ne.clip_grad_norm(g, 5.5) == pytest.approx(5.0) and g.tolist() == [3.0, 4.0]   # under: untouched
    g = np.array([3.0, 4.0])
    ne.clip_grad_norm(g, 4.9)                                 # just over
    assert math.sqrt(g @ g) == pytest.approx(4.9, rel=1e-12)
    g = np.array([30.0, 40.0])
    ne.clip_grad_norm(g, -1)                                  # off
    assert g.tolist() == [30.0, 40.0]


def test_init_scales():
    cfg = ne.PRESETS["small"]                                 # L = 4: residual outputs get 0.02 / sqrt(8)
    t = ne.carve(ne.init_params(cfg, seed=11), cfg)
    kinds = {"0.02": [], "residual": [], "norm": []}
    for name, shape in ne.param_shapes(cfg):
        kind = "norm" if len(shape) == 1 else "residual" if name.endswith(("wo", "w_down")) else "0.02"
        kinds[kind].append(t[name].reshape(-1).astype(np.float64))
    for kind, want in (("0.02", 0.02), ("residual", 0.02 / math.sqrt(8))):
        x = np.concatenate(kinds[kind])
        # n >= 65,536 samples: the std is within 0.6% (over 2 sigma), the mean near 0
        assert x.std() == pytest.approx(want, rel=0.012), kind
        assert abs(x.mean()) < 4 * want / math.sqrt(x.size), kind
    assert all((x == 1).all() for x in kinds["norm"])
    # every head and the embedding are initialised (none tied or left zero)
    for name in ["tok_emb"] + [f"heads.{k}" for k in range(cfg.K)]:
        assert t[name].std() == pytest.approx(0.02, rel=0.03), name


# -----------------------------------------------------------------------------
# SFT

def test_sft_mask_trains_the_response_and_its_end_only():
    tok = ne.Tokenizer([(104, 105)])
    cfg = ne.Config(V=261, C=8, Hq=2, Hkv=1, L=1, T=16, F=16, K=3)
    user, assistant, end, eot = 257, 258, 259, 256
    prompt, reply = [ord(c) for c in "Say"], [260, ord("!")]  # "hi!" with the merge h+i
    rows, mask = ne.sft_rows(tok, [("Say", "hi!")], cfg)
    seq = [user] + prompt + [assistant] + reply + [end]
    assert rows[0].tolist() == seq + [eot] * (cfg.T + cfg.K - len(seq))
    idx, targets = ne.sft_targets(rows, mask, cfg.T, cfg.K)
    trained = set(range(len(seq) - len(reply) - 1, len(seq)))  # positions of the reply and <|end|>
    for t in range(cfg.T):
        for k in range(cfg.K):
            at = t + 1 + k                                    # head k's target of input position t
            assert targets[0, t, k] == (seq[at] if at in trained else -1), (t, k)
    assert end in targets[0, :, 0] and assistant not in targets[0, :, 0]


# -----------------------------------------------------------------------------
# sampling and generation

class Recorder:
    """stands in for the random generator: keeps the distribution sample_token draws from"""

    def choice(self, n, p):
        self.p = np.asarray(p)
        return int(np.argmax(p))


def softmax(z):
    e = np.exp(z - max(z))
    return e / e.sum()


def drawn(logits, **kw):
    r = Recorder()
    ne.sample_token(np.array(logits), r, **kw)
    return r.p


def test_top_k_keeps_exactly_the_k_likeliest():
    logits = [0.5, 3.0, -1.0, 2.0, 1.0]
    for k, kept in ((1, [1]), (2, [1, 3]), (3, [1, 3, 4]), (5, [0, 1, 2, 3, 4]), (0, [0, 1, 2, 3, 4])):
        want = np.zeros(5)
        want[kept] = softmax(np.array(logits)[kept])
        np.testing.assert_allclose(drawn(logits, temperature=1.0, top_k=k), want, rtol=1e-12, atol=1e-300)
    rng = np.random.default_rng(0)                            # and a real generator draws only those
    assert {ne.sample_token(np.array(logits), rng, 1.0, top_k=2) for _ in range(200)} == {1, 3}
    assert {ne.sample_token(np.array(logits), rng, 1.0, top_p=0.5) for _ in range(50)} == {1}


def test_temperature_divides_the_logits():
    logits = np.array([0.5, 3.0, -1.0])
    np.testing.assert_allclose(drawn(logits, temperature=0.5), softmax(logits / 0.5), rtol=1e-12)
    assert ne.sample_token(logits, None, temperature=0) == 1 # greedy needs no random numbers


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.1, 0.5, 0.05, 0.3, 0.05])             # by size: 1 (0.5), 3 (0.3), 0 (0.1), then a tie
    logits = np.log(probs)
    # (top_p, how many are kept, which must be): p never sits on a sum, so rounding cannot decide
    for top_p, n, kept in ((0.3, 1, [1]), (0.49, 1, [1]), (0.51, 2, [1, 3]), (0.79, 2, [1, 3]),
                           (0.81, 3, [1, 3, 0]), (0.89, 3, [1, 3, 0]), (0.91, 4, [1, 3, 0]), (1.0, 5, range(5))):
        p = drawn(logits, temperature=1.0, top_p=top_p)
        assert (p > 0).sum() == n and (p[list(kept)] > 0).all(), (top_p, p)
        np.testing.assert_allclose(p[p > 0], probs[p > 0] / probs[p > 0].sum(), rtol=1e-12)


def test_top_k_then_top_p():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    p = drawn(np.log(probs), temperature=1.0, top_k=3, top_p=0.75)   # within the top 3: 4/9, 3/9, 2/9
    np.testing.assert_allclose(p, [4 / 7, 3 / 7, 0, 0], rtol=1e-12)


def ref_greedy(t, cfg, prompt, n):
    """SPEC greedy decoding with generate's window rule, by full recompute: the context is the
    last T-1 prompt tokens; when a token would make it longer than T, the window restarts
    at the last T/2 tokens, at position 0"""
    tokens = list(prompt)[-(cfg.T - 1):]
    start, out = 0, []
    for _ in range(n):
        if len(tokens) - start > cfg.T:
            start = len(tokens) - cfg.T // 2
        tok = int(np.argmax(ref_logits(t, cfg, tokens[start:])[0, -1]))
        tokens.append(tok)
        out.append(tok)
    return out


def test_greedy_generation_and_the_window_slide(model):
    t, flat, params = model
    for prompt in ([3], [5, 1, 2, 8, 13, 21], list(range(12))):      # the last one is cut to T-1 = 8
        got = list(ne.generate(params, CFG, prompt, 2 * CFG.T + 3, temperature=0))
        assert got == ref_greedy(t, CFG, prompt, 2 * CFG.T + 3), prompt


def permutation_model(cfg, seed, noisy=True):
    """head k predicts f^(k+1)(t) for a permutation f, blocks add a little noise: drafts are
    mostly right; head 2 is scrambled for a third of the tokens, so some are rejected"""
    rng = np.random.default_rng(seed)
    t = spec_tensors(cfg, rng, std=0.01)
    for name in t:
        if name.endswith("norm"):
            t[name][...] = 1.0
    t["tok_emb"][...] = np.eye(cfg.V, cfg.C)
    f = rng.permutation(cfg.V)
    nxt = np.arange(cfg.V)
    for k in range(cfg.K):
        nxt = f[nxt]
        t[f"heads.{k}"][...] = 0
        t[f"heads.{k}"][nxt, np.arange(cfg.V)] = 30.0
    if not noisy:
        return t
    t["heads.2"][:, :cfg.V // 3] = rng.normal(0, 30.0, (cfg.V, cfg.V // 3))
    # head 0 too is wrong now and then, so the verdicts are not all f
    t["heads.0"][:, cfg.V // 2:cfg.V] += rng.normal(0, 20.0, (cfg.V, cfg.V - cfg.V // 2))
    return t


def test_speculative_emits_only_head_0_choices():
    cfg = ne.Config(V=24, C=32, Hq=4, Hkv=2, L=2, T=12, F=48, K=4)
    t = permutation_model(cfg, 7)
    flat, params = as_params(t, cfg)
    for prompt in ([1], [3, 5, 7]):
        want = ref_greedy(t, cfg, prompt, 30)                # past two window slides
        for drafts in (1, 2, 3):
            stats = {}
            got = list(ne.generate(params, cfg, prompt, 30, temperature=0, speculative=True, drafts=drafts,
                                   stats=stats))
            assert got == want, (prompt, drafts)
            assert stats["tokens"] > stats["steps"]           # some drafts were accepted
        # sampling: each emitted token is head 0's draw, so the random stream is used as without drafts
        plain = list(ne.generate(params, cfg, prompt, 30, temperature=1.5, seed=4))
        spec = list(ne.generate(params, cfg, prompt, 30, temperature=1.5, seed=4, speculative=True, drafts=3))
        assert spec == plain


# -----------------------------------------------------------------------------
# files and data

def test_safetensors_layout(tmp_path):
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=2, T=8, F=16, K=2)
    flat = np.random.default_rng(12).normal(size=ne.num_params(cfg)).astype(np.float32)
    path = str(tmp_path / "m.safetensors")
    ne.save_model(path, cfg, flat, ne.Tokenizer())
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")                     # SPEC: 8-byte little-endian length
    head = raw[8:8 + n]
    assert n % 8 == 0                                         # padded to a multiple of 8 ...
    text = head.decode()
    assert text.rstrip(" ").endswith("}") and len(text) - len(text.rstrip(" ")) < 8   # ... with spaces
    header = json.loads(text)
    meta = header.pop("__metadata__")
    assert meta["format"] == "nanoeuler" and meta["version"] == "1"
    assert json.loads(meta["config"]) == {"V": 260, "C": 8, "Hq": 2, "Hkv": 1, "L": 2, "T": 8, "F": 16, "K": 2,
                                          "mtp_weight": 0.5}
    names = ["tok_emb"] + [f"layers.{l}.{w}" for l in range(2) for w in
                           ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")] + \
            ["final_norm", "heads.0", "heads.1"]
    shapes = [[260, 8]] + [[8], [16, 8], [8, 8], [8], [16, 8], [16, 8], [8, 16]] * 2 + [[8], [260, 8], [260, 8]]
    assert list(header) == names
    offset = 0
    for name, shape in zip(names, shapes):                    # contiguous float32, in SPEC order
        size = 4 * math.prod(shape)
        assert header[name] == {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    assert raw[8 + n:] == flat.astype("<f4").tobytes()        # row-major little-endian, nothing else


def test_checkpoint_pairing(tmp_path):
    # a model file counts only with its state file beside it; the pair loads as saved
    cfg = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)
    tok, out = ne.Tokenizer(), str(tmp_path)
    saved = {}
    for step in (5, 10):
        flat, m, v = (np.full(ne.num_params(cfg), step + i, np.float32) for i in (0.25, 0.5, 0.75))
        rng = np.random.default_rng(step).bit_generator.state      # read_pair checks it is one
        ne.RunFolder(out, cfg, tok).write_pair(step, flat, m, v, {"step": step, "rng": rng})
        saved[step] = (flat, m, v)
    assert ne.RunFolder(out).latest() == 10
    os.remove(os.path.join(out, "state_000010.safetensors"))  # as if stopped between the two writes
    assert ne.RunFolder(out).latest() == 5
    cfg2, flat, tok2, m, v, state = ne.RunFolder(out).read_pair(5)
    assert cfg2 == cfg and state == {"step": 5, "rng": np.random.default_rng(5).bit_generator.state}
    for got, want in zip((flat, m, v), saved[5]):
        assert got.tobytes() == want.tobytes()


def test_decode_replacement_character():
    tok = ne.Tokenizer()
    assert tok.decode([0xC3]) == "\ufffd"                     # a cut 2-byte sequence
    assert tok.decode([0x61, 0xE2, 0x82, 0x62]) == "a\ufffdb" # a cut 3-byte sequence: one U+FFFD
    assert tok.decode([0xFF, 0x61]) == "\ufffda"              # a byte never valid in UTF-8
    assert tok.decode([0xC3, 0xA9, 0x80]) == "\u00e9\ufffd"    # a stray continuation byte
    assert tok.decode([256, 0x68]) == "<|endoftext|>h"


def test_train_and_validation_are_disjoint():
    tokens = np.arange(10_000)
    train, val = ne.split_train_val(tokens, 13)
    assert len(train) + len(val) == len(tokens) and train[-1] + 1 == val[0]   # a cut, nothing shared
    assert len(val) == 1000                                    # the last 10%
    rng = np.random.default_rng(0)
    rows = ne.get_batch(train, 512, 13, rng)
    assert rows.max() < val[0] and rows.min() >= 0
    assert (np.diff(rows, axis=1) == 1).all()                  # rows are consecutive tokens
    rows = np.concatenate(ne.fixed_rows(val, 4, 13, 50))
    assert rows.min() >= val[0] and rows.max() <= val[-1]
    # every window of the training part can be drawn, the last one too, and none past it
    firsts = set(ne.get_batch(np.arange(15), 400, 13, rng)[:, 0].tolist())
    assert firsts == {0, 1, 2}
    # validation: min(B * max_batches, (n - 1) // rows_len) rows, evenly spaced from 0 to n - rows_len
    batches = ne.fixed_rows(np.arange(1000), 4, 13, 3)
    assert [len(b) for b in batches] == [4, 4, 4]
    np.testing.assert_array_equal(np.concatenate(batches)[:, 0], 
                                  [0, 89, 179, 269, 358, 448, 538, 628, 717, 807, 897, 987])   # 987/11 apart
    batches = ne.fixed_rows(np.arange(100), 4, 13, 50)            # (100 - 1) // 13 = 7 rows
    assert [len(b) for b in batches] == [4, 3]
    np.testing.assert_array_equal(np.concatenate(batches)[:, 0], [0, 14, 29, 43, 58, 72, 87])
    # a corpus barely big enough still keeps a whole row plus its target apart
    train, val = ne.split_train_val(np.arange(40), 13)
    assert len(val) >= 14 and len(train) >= 14


def test_drafts_come_from_heads_1_to_n_at_the_last_accepted_token():
    # head k is exactly f^(k+1): every draft is right, so each pass after the prompt's
    # emits drafts + 1 tokens, except where the window slide cuts the drafts short
    cfg = ne.Config(V=24, C=32, Hq=4, Hkv=2, L=2, T=40, F=48, K=4)
    t = permutation_model(cfg, 8, noisy=False)
    flat, params = as_params(t, cfg)
    for drafts in (0, 1, 2, 3):                                        # 0: speculative without drafts
        stats = {}
        got = list(ne.generate(params, cfg, [5], 1 + 8 * (drafts + 1), temperature=0, speculative=True,
                               drafts=drafts, stats=stats))
        assert got == ref_greedy(t, cfg, [5], len(got))
        assert stats == {"steps": 9, "tokens": 1 + 8 * (drafts + 1)}, drafts       # the prompt's pass, then 8


def test_every_mutant_of_tools_mutate_still_applies():
    """tools/mutate.py finds each mutation by its exact text; code that moved would leave a
    mutant that no longer applies (reported only when someone runs it), so check here"""
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("mutate", os.path.join(here, "tools", "mutate.py"))
    mutate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutate)
    source = open(os.path.join(here, "nanoeuler.py")).read()
    mutations = mutate.SPEC_MUTATIONS + mutate.INPUT_MUTATIONS
    assert len(mutate.SPEC_MUTATIONS) == 60 and len(mutate.INPUT_MUTATIONS) == 22   # as README says
    assert {name: source.count(old) for name, old, _ in mutations if source.count(old) != 1} == {}
    assert all(old != new for _, old, new in mutations)
    # the kernels' (--set kernels): each text once in its .cu file, each -k naming a test that exists
    kernels = mutate.KERNEL_MUTATIONS
    cu = {f: open(os.path.join(here, f)).read() for f in ("kernels.cu", "flash_attn.cu")}
    assert len(kernels) == 46                                     # as README says
    assert {name: cu[f].count(old) for name, f, old, _, _ in kernels if cu[f].count(old) != 1} == {}
    assert all(old != new for _, _, old, new, _ in kernels)
    tests = open(os.path.join(here, "test_cuda_pipeline.py")).read()
    assert all(f"def {k}" in tests or f"def test_{k}" in tests for k in {k for *_, k in kernels})
    # the files a model leaves home through (--set tools): each text once in its file, each -k
    # naming test files of the set
    tools, test_files = mutate.TOOL_MUTATIONS, mutate.SETS["tools"][1]
    src = {f: open(os.path.join(here, f)).read() for f in {f for _, f, *_ in tools}}
    assert len(tools) == 36                                       # as README says
    assert {name: src[f].count(old) for name, f, old, _, _ in tools if src[f].count(old) != 1} == {}
    assert all(old != new for _, _, old, new, _ in tools)
    assert all(any(t in k for t in test_files) for *_, k in tools)
    # the emulator's warpgroup MMA, mbarriers and TMA (--set wgmma, against test_wgmma.py): each text once in
    # tools/emulate_cuda.py
    wgmma = mutate.WGMMA_MUTATIONS
    emulator = open(os.path.join(here, "tools", "emulate_cuda.py")).read()
    assert len(wgmma) == 20
    assert {name: emulator.count(old) for name, f, old, _, _ in wgmma if f != mutate.EMULATOR or
            emulator.count(old) != 1} == {}
    assert all(old != new for _, _, old, new, _ in wgmma)
