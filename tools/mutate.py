"""
Does the test suite catch real bugs? Puts one plausible one-line bug at a time
into a copy of nanoeuler.py (or of kernels.cu, flash_attn.cu, or a file a
trained model leaves home through: tools/export.py, tools/eval.py, serve.py,
the GPU's decoding policy in nanoeuler_cuda.py) and runs the tests against it;
a mutant whose tests still pass "survived", and shows a hole in the tests.

    python tools/mutate.py                 # the model and optimizer bugs against test_spec.py
    python tools/mutate.py --set inputs    # the input checks taken out, against test_inputs.py
    python tools/mutate.py --set kernels   # bugs in kernels.cu and flash_attn.cu, on the CPU emulator
    python tools/mutate.py --set tools     # export.py, eval.py, serve.py and the GPU's decoding policy
    python tools/mutate.py --set wgmma     # the emulator's warpgroup MMA, mbarriers, TMA, against test_wgmma.py
    python tools/mutate.py -k adamw        # the mutants whose name contains "adamw"
    python tools/mutate.py --tests test_spec.py test_nanoeuler.py

Exit code 1 when a mutant survives (or a mutation no longer applies: the code
it changes moved, so the list below needs updating).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, the exact text in nanoeuler.py, what it becomes); each text must occur exactly once
SPEC_MUTATIONS = [
    ("adamw: no bias correction of m", "denom *= lr / (1 - beta1 ** step)", "denom *= lr"),
    ("adamw: no bias correction of v", "denom *= 1.0 / math.sqrt(1 - beta2 ** step)", "denom *= 1.0"),
    ("adamw: beta1 0.9 -> 0.95", "beta1=0.9, beta2=0.95", "beta1=0.95, beta2=0.95"),
    ("adamw: beta2 0.95 -> 0.999", "beta1=0.9, beta2=0.95", "beta1=0.9, beta2=0.999"),
    ("adamw: eps 1e-8 -> 1e-6", "eps=1e-8, weight_decay", "eps=1e-6, weight_decay"),
    ("adamw: decay ignores the decay mask", "flat *= 1.0 - (lr * weight_decay) * decay", "flat *= 1.0 - (lr * weight_decay)"),
    ("adamw: decay not scaled by lr", "flat *= 1.0 - (lr * weight_decay) * decay", "flat *= 1.0 - weight_decay * decay"),
    ("adamw: v from |g| not g^2", "v += (1 - beta2) * grad * grad", "v += (1 - beta2) * abs(grad)"),
    ("engine: --weight-decay ignored", "step, lr, self.decay, weight_decay=self.weight_decay)", "step, lr, self.decay)"),
    ("engine: --clip ignored", "norm = clip_grad_norm(self.grad_bufs[0], self.clip)",
     "norm = clip_grad_norm(self.grad_bufs[0], -1)"),
    ("decay mask: norm weights decayed too", "float(len(s) == 2)", "float(len(s) >= 1)"),
    ("rope: theta 10000 -> 1000", "freq = 10000.0 **", "freq = 1000.0 **"),
    ("rope: sign of the rotation", "[a * cos - b * sin, b * cos + a * sin], -1), (cos, sin)",
     "[a * cos + b * sin, b * cos - a * sin], -1), (cos, sin)"),
    ("rope: interleaved pairs, not halves", "a, b = x[..., :h], x[..., h:]", "a, b = x[..., 0::2], x[..., 1::2]"),
    ("rope: positions off by one", "return cos[pos:pos + T], sin[pos:pos + T]",
     "return cos[pos + 1:pos + T + 1], sin[pos + 1:pos + T + 1]"),
    ("rope: frequency exponent 2i/D -> i/D", "* 2.0 / D)  # (D/2,)", "* 1.0 / D)  # (D/2,)"),
    ("rmsnorm: eps 1e-5 -> 1e-6", "def rmsnorm_forward(x, w, eps=1e-5):", "def rmsnorm_forward(x, w, eps=1e-6):"),
    ("rmsnorm: sum instead of mean", "np.sqrt((x * x).mean(-1, keepdims=True) + eps)",
     "np.sqrt((x * x).sum(-1, keepdims=True) + eps)"),
    ("mask: a query sees the next key", "np.where(np.arange(Tk)[None, :] <= i, 0.0",
     "np.where(np.arange(Tk)[None, :] <= i + 1, 0.0"),
    ("mask: a query does not see itself", "np.where(np.arange(Tk)[None, :] <= i, 0.0",
     "np.where(np.arange(Tk)[None, :] < i, 0.0"),
    ("gqa: query head h reads kv head h % Hkv",
     "qg = q.reshape(B, Tq, Hkv, G, D).transpose(0, 2, 3, 1, 4)",
     "qg = q.reshape(B, Tq, G, Hkv, D).transpose(0, 3, 2, 1, 4)"),
    ("attention: scale 1/D, not 1/sqrt(D)", "att = (qg * (1.0 / math.sqrt(D))) @ kt", "att = (qg * (1.0 / D)) @ kt"),
    ("swiglu: gate and up swapped", "gate, up = gu[..., :F], gu[..., F:]", "up, gate = gu[..., :F], gu[..., F:]"),
    ("loss: head k's targets shifted by k-1", "targets = np.stack([rows[:, 1 + k:1 + k + T]",
     "targets = np.stack([rows[:, k:k + T]"),
    ("loss: extra heads summed, not averaged", "[cfg.mtp_weight / max(cfg.K - 1, 1)] * (cfg.K - 1)",
     "[cfg.mtp_weight] * (cfg.K - 1)"),
    ("loss: mtp_weight ignored", "[cfg.mtp_weight / max(cfg.K - 1, 1)]", "[0.5 / max(cfg.K - 1, 1)]"),
    ("loss: ignored targets counted in the mean", "n = max(int(keep.sum()) if n is None else int(n), 1)",
     "n = max(len(targets) if n is None else int(n), 1)"),
    ("bpb: nats, not bits", "return nats / max(ntok, 1), nats / math.log(2) / max(nbytes, 1)",
     "return nats / max(ntok, 1), nats / max(nbytes, 1)"),
    ("bpb: specials count as bytes", "n[256:FIRST_MERGE_ID] = 0", "pass"),
    ("schedule: no floor", "LR_FLOOR = 0.1 ", "LR_FLOOR = 0.0 "),
    ("schedule: warmup starts at 0", "return lr * (step + 1) / warmup", "return lr * step / warmup"),
    ("schedule: cosine goes on past the end", "math.cos(math.pi * min(progress, 1.0))", "math.cos(math.pi * progress)"),
    ("clip: half the threshold", "grad *= max_norm / norm", "grad *= 0.5 * max_norm / norm"),
    ("clip: clips below the threshold too", "if max_norm > 0 and norm > max_norm:", "if max_norm > 0:"),
    ("init: residual scale 1/sqrt(L)", "std = 0.02 / math.sqrt(2 * cfg.L)", "std = 0.02 / math.sqrt(cfg.L)"),
    ("init: std 0.02 -> 0.01", "if name.endswith((\"wo\", \"w_down\")) else 0.02",
     "if name.endswith((\"wo\", \"w_down\")) else 0.01"),
    ("sft: <|end|> not trained", "reply = tok.encode(response) + [tok.special(\"<|end|>\")]\n        ids += reply\n"
     "        train_on += [1] * len(reply)",
     "reply = tok.encode(response) + [tok.special(\"<|end|>\")]\n        ids += reply\n"
     "        train_on += [1] * (len(reply) - 1) + [0]"),
    ("sft: prompt trained too", "train_on = [0] * len(ids)", "train_on = [1] * len(ids)"),
    ("top-k: keeps one too few", "z[z < np.partition(z, -top_k)[-top_k]] = -np.inf",
     "z[z <= np.partition(z, -top_k)[-top_k]] = -np.inf"),
    ("top-p: keeps one token too many", "cut = np.searchsorted(np.cumsum(p[order]), top_p) + 1",
     "cut = np.searchsorted(np.cumsum(p[order]), top_p) + 2"),
    ("top-p: smallest set below p, not reaching it", "cut = np.searchsorted(np.cumsum(p[order]), top_p) + 1",
     "cut = max(1, np.searchsorted(np.cumsum(p[order]), top_p))"),
    ("temperature: multiplies", "z = (logits.astype(np.float64) - logits.max()) / temperature",
     "z = (logits.astype(np.float64) - logits.max()) * temperature"),
    ("decoding: positions restart at every call",
     "block_forward(x, layer_params(params, l), cfg, pos, None if kv is None else kv[l])",
     "block_forward(x, layer_params(params, l), cfg, 0, None if kv is None else kv[l])"),
    ("decoding: no mask when queries follow cached keys", "att += causal_mask(Tq, Tk, G, q.dtype)",
     "att += causal_mask(Tq, Tk, G, q.dtype) if Tq == Tk else 0.0"),
    ("decoding: the cache keeps keys before rope", "kv[0][:, pos:pos + T], kv[1][:, pos:pos + T] = k, v",
     "kv[0][:, pos:pos + T], kv[1][:, pos:pos + T] = qkv[..., Hq * D:(Hq + Hkv) * D].reshape(B, T, Hkv, D), v"),
    ("decoding: attends to this call's tokens only", "k, v = kv[0][:, :pos + T], kv[1][:, :pos + T]",
     "k, v = kv[0][:, pos:pos + T], kv[1][:, pos:pos + T]"),
    ("decoding: logits of head 1, not head 0", 'logits, _ = linear_forward(xf, params["heads.0"])',
     'logits, _ = linear_forward(xf, params["heads.1"])'),
    ("speculative: a draft is kept without head 0's verdict", "if j == len(guesses) or guesses[j] != t:",
     "if j == len(guesses):"),
    ("speculative: drafts read one position late", "guesses = (drafters @ x[0, first + j])",
     "guesses = (drafters @ x[0, max(0, first + j - 1)])"),
    ("window: slides to T/2 + 1 tokens", "pending, guesses, pos = tokens[-(cfg.T // 2):], [], 0",
     "pending, guesses, pos = tokens[-(cfg.T // 2 + 1):], [], 0"),
    ("window: a long prompt keeps T tokens", "tokens = list(prompt)[-(cfg.T - 1):] if prompt else []",
     "tokens = list(prompt)[-cfg.T:] if prompt else []"),
    ("decode: invalid bytes dropped, not replaced", 'decode("utf-8", errors="replace")\n\n    def token_bytes',
     'decode("utf-8", errors="ignore")\n\n    def token_bytes'),
    ("safetensors: header padded to 4 bytes", 'head += b" " * (-len(head) % 8)', 'head += b" " * (-len(head) % 4)'),
    ("safetensors: big-endian data", 'f.write(np.ascontiguousarray(t, dtype="<f4").data)',
     'f.write(np.ascontiguousarray(t, dtype=">f4").data)'),
    ("checkpoint: a model without its state counts", "return [s for s in steps if not complete or os.path.exists(",
     "return [s for s in steps if s or not complete or os.path.exists("),
    ("data: validation overlaps training by one token", "return tokens[:-n_val], tokens[-n_val:]",
     "return tokens[:-n_val + 1], tokens[-n_val:]"),
    ("data: validation is 5%", "def split_train_val(tokens, rows_len, val_fraction=0.1):",
     "def split_train_val(tokens, rows_len, val_fraction=0.05):"),
    ("data: the last training window is never drawn", "rng.integers(0, len(tokens) - rows_len + 1, size=B)",
     "rng.integers(0, len(tokens) - rows_len, size=B)"),
    ("data: one validation row short", "B * max_batches))", "B * max_batches - 1))"),
    ("speculative: --drafts 0 still drafts with head 1", "max(0, min(drafts, cfg.K - 1))",
     "max(1, min(drafts, cfg.K - 1))"),
]

# each input check taken out or loosened: test_inputs.py must notice
INPUT_MUTATIONS = [
    ("config: no limit on T", "require(cfg.T <= MAX_T,", "require(True,"),
    ("config: no limit on V", "require(cfg.V <= MAX_V,", "require(True,"),
    ("config: Hq need not be a multiple of Hkv", "require(cfg.Hq % cfg.Hkv == 0,", "require(True,"),
    ("config: odd head size allowed", "require(cfg.C % cfg.Hq == 0 and cfg.D % 2 == 0,",
     "require(cfg.C % cfg.Hq == 0,"),
    ("config: floats and bools pass as sizes", "require(type(value) is int and value >= 1,", "require(value >= 1,"),
    ("file: overlapping tensors allowed", "require(begin == end,", "require(begin <= end,"),
    ("file: trailing bytes allowed", "require(found == end,", "require(found >= end,"),
    ("file: metadata values need not be text", "and all(isinstance(v, str) for v in metadata.values()),",
     "and True,"),
    ("file: NaN weights load", "require(not bad, ", "require(True, "),
    ("file: tensor count not checked first", "require(len(shapes) == n_want,", "require(True,"),
    ("merges: an id not made yet is allowed", "FIRST_MERGE_ID <= t < FIRST_MERGE_ID + i)",
     "FIRST_MERGE_ID <= t < FIRST_MERGE_ID + i + 1)"),
    ("merges: specials allowed", "(0 <= t < 256 or FIRST_MERGE_ID", "(0 <= t < FIRST_MERGE_ID or FIRST_MERGE_ID"),
    ("merges: repeats allowed", "if tuple(pair) in seen:", "if False:"),
    ("merges: no bound on the bytes", "if total > MAX_VOCAB_BYTES:", "if False:"),
    ("sft: a single example passes", "if kept < 2 or kept < n / 100:", "if kept < 1 or kept < n / 100:"),
    ("sft: an example teaching only the draft heads is kept", "keep = mask[:, 1:cfg.T + 1].any(1)",
     "keep = mask[:, 1:].any(1)"),
    ("sft: a number passes as a response", "require(isinstance(value, str),", "require(True,"),
    ("sample: argv bytes passed on raw", '"--prompt", type="argv_text",', '"--prompt",'),
    ("data: dangling links kept", "for f in [f for f in files if not os.path.isfile(f)]:", "for f in []:"),
    ("flags: positive_int takes 0", "positive_int = number_type(int, 1,", "positive_int = number_type(int, 0,"),
    ("flags: nan passes as a number >= 0", "if low <= (value := convert(text)) <= high or value == off:",
     "if not (value := convert(text)) < low and not value > high or value == off:"),
    ("flags: top-p above 1", "probability = number_type(float, TINY, 1,", "probability = number_type(float, TINY, HUGE,"),
]

# bugs in the kernels, which test_cuda_pipeline.py runs on tools/emulate_cuda.py's CPU emulator:
# (name, file, its exact text, what it becomes, pytest -k: the tests that run that kernel)
TRAINING, DECODING, LAYERS = "training_checks", "test_decode_", "test_the_layers_as_one_kernel"
KERNEL_MUTATIONS = [
    ("attention fp32: a query does not see itself", "flash_attn.cu", "s[r] = k0 + r <= i ? dot : -INFINITY;",
     "s[r] = k0 + r < i ? dot : -INFINITY;", TRAINING),
    ("attention bf16: a query sees the next key", "flash_attn.cu",
     "> row + 8 * (i >> 1)) s[mt][nt][i] = -INFINITY;", "> row + 8 * (i >> 1) + 1) s[mt][nt][i] = -INFINITY;",
     TRAINING),
    ("attention fp32: no softmax scale", "flash_attn.cu",
     "q[d] = i < T ? base[(long)i * stride + h * D + d] * scale : 0.0f;\n        o[d] = 0.0f;",
     "q[d] = i < T ? base[(long)i * stride + h * D + d] : 0.0f;\n        o[d] = 0.0f;", TRAINING),
    ("attention fp32: online softmax, output not rescaled", "flash_attn.cu",
     "for (int d = 0; d < D; d++) o[d] *= correction;", ";", TRAINING),
    ("attention bf16: query head h reads kv head h % Hkv", "flash_attn.cu",
     "kvh = h / (Hq / Hkv), q0 = (gridDim.z - 1 - blockIdx.z) * rows;",
     "kvh = h % Hkv, q0 = (gridDim.z - 1 - blockIdx.z) * rows;", TRAINING),
    ("rmsnorm: eps 1e-5 -> 1e-6", "kernels.cu", "sqrtf(warp_sum(ss) / C + 1e-5f)", "sqrtf(warp_sum(ss) / C + 1e-6f)",
     TRAINING),
    ("rmsnorm: sum instead of mean", "kernels.cu", "sqrtf(warp_sum(ss) / C + 1e-5f)", "sqrtf(warp_sum(ss) + 1e-5f)",
     TRAINING),
    ("rope: sign of the rotation", "kernels.cu", "ra = a[j] * c[j] - b[j] * sign * s[j], rb = b[j] * c[j] + a[j]",
     "ra = a[j] * c[j] + b[j] * sign * s[j], rb = b[j] * c[j] - a[j]", TRAINING),
    ("swiglu: gate and up swapped", "kernels.cu", "o[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];",
     "o[j] = up[j] / (1.0f + expf(-up[j])) * gate[j];", TRAINING),
    ("cross entropy: the running sum not rescaled", "kernels.cu", "sum *= expf(m - m_new);", "sum *= 1.0f;",
     TRAINING),
    ("cross entropy: the running sum not rescaled, V not in packs", "kernels.cu",
     "sum = sum * expf(m - m_new) + expf(x - m_new);", "sum = sum + expf(x - m_new);", TRAINING),
    ("cross entropy: the max not added back", "kernels.cu",
     "float lse = row_max + logf(block_sum(sum * expf(m - row_max)));",
     "float lse = logf(block_sum(sum * expf(m - row_max)));", TRAINING),
    ("cross entropy: every head weighted as head 0", "kernels.cu", "float scale = t >= 0 ? dscale[k] : 0.0f;",
     "float scale = t >= 0 ? dscale[0] : 0.0f;", TRAINING),
    ("adamw: no bias correction of m", "kernels.cu", "p[j] = pj - lr / bias1 * mi[j]", "p[j] = pj - lr * mi[j]",
     TRAINING),
    ("attention tf32: a query does not see itself", "flash_attn.cu", "if (col > row || col >= T) s[nt][i] = -INFINITY;",
     "if (col >= row || col >= T) s[nt][i] = -INFINITY;", TRAINING),
    ("attention fp32: dq not scaled", "flash_attn.cu", "h * D + d] = dq[d] * scale;", "h * D + d] = dq[d];", TRAINING),
    ("rmsnorm backward: mean(g xhat) summed, not averaged", "kernels.cu", "dot = warp_sum(dot) / C;",
     "dot = warp_sum(dot);", TRAINING),
    ("rope: positions off by one", "kernels.cu", "*s = sin + (pos + n % T) * half + p;",
     "*s = sin + (pos + n % T + 1) * half + p;", TRAINING),
    ("swiglu backward: d silu / d gate taken as sig (1 - sig)", "kernels.cu", "(sig + silu * (1.0f - sig))",
     "(sig * (1.0f - sig))", TRAINING),
    ("embedding backward: = where the gradient adds up", "kernels.cu", "dtok_emb[(long)v * C + c] += sum[k];",
     "dtok_emb[(long)v * C + c] = sum[k];", TRAINING),
    ("embedding backward: a warp's rows counted from its own", "kernels.cu", "before += w < warp ? counts[w] : 0;",
     "before += w <= warp ? counts[w] : 0;", TRAINING),
    ("clip: clips below the threshold too", "kernels.cu", "clip[0] = max_norm > 0.0f && norm > max_norm ?",
     "clip[0] = max_norm > 0.0f ?", TRAINING),
    ("adamw: decay ignores the decay mask", "kernels.cu", "(1.0f - lr * weight_decay * d[j])",
     "(1.0f - lr * weight_decay)", TRAINING),
    ("grad norm: |g|, not g^2", "kernels.cu", "s += grads[i] * grads[i];", "s += fabsf(grads[i]);", TRAINING),
    ("decode layers: a block takes every other block of work of its stage", "kernels.cu",
     "for (int b = blockIdx.x; b < n; b += G) {", "for (int b = blockIdx.x; b < n; b += 2 * G) {", LAYERS),
    ("decode layers: every layer's attention reads and writes layer 0's cache", "kernels.cu",
     "c0 = k / 5 * s.cache_stride;", "c0 = 0;", LAYERS),
    ("decode layers: the pass's last stage leaves its counters for the next pass to find", "kernels.cu",
     "if (k < 5 * s.L - 1) stage_arrive(a.ready + k);", "if (true) stage_arrive(a.ready + k);", LAYERS),
    ("decode attention: a row sees the next key", "kernels.cu", "DECODE_CHUNK && first + jj + KEYS * i < n;",
     "DECODE_CHUNK && first + jj + KEYS * i <= n;", DECODING),
    ("decode attention: a row sees the next key (scores reduce-scattered)", "kernels.cu",
     "DECODE_CHUNK && first + jj + KEYS * i0 < n ? d[0]", "DECODE_CHUNK && first + jj + KEYS * i0 <= n ? d[0]",
     DECODING),
    ("decode attention: a key's p read from the next pair's owner", "kernels.cu",
     "__shfl_sync(0xffffffff, pown, lane - s + i * DECODE_HEADS + g);",
     "__shfl_sync(0xffffffff, pown, lane - s + (i * DECODE_HEADS + g + 1) % S);", DECODING),
    ("decode attention: chunks combined without their max", "kernels.cu",
     "float f = expf(m[i] - M);", "float f = 1.0f;", DECODING),
    ("decode attention: chunks past the eighth combined without their max", "kernels.cu",
     "float f = expf(mc - M);", "float f = 1.0f;", DECODING),
    ("decode attention: a step's rows combine the chunks of the pass's first row", "kernels.cu",
     "chunks = (p0 + r + DECODE_CHUNK) / DECODE_CHUNK;", "chunks = (p0 + DECODE_CHUNK) / DECODE_CHUNK;", DECODING),
    ("decode attention: the wo product reads the records of the next block of heads", "kernels.cu",
     "int block = h / G * groups + within / DECODE_HEADS,", "int block = h / G * groups + (within + 1) / DECODE_HEADS,",
     DECODING),
    ("decode attention: no softmax scale", "kernels.cu",
     "q[g] = make_float4(a.x * scale, a.y * scale, a.z * scale, a.w * scale);", "q[g] = a;", DECODING),
    ("decode attention: this pass's keys a row of Hq heads apart", "kernels.cu",
     "const float* kr = qkv + (long)(j - p0) * H * D", "const float* kr = qkv + (long)(j - p0) * Hq * D", DECODING),
    ("decode attention single: online softmax, output not rescaled", "kernels.cu",
     "for (int k = 0; k < 4; k++) acc[k] *= corr;", ";", DECODING),
    ("decode attention single: rope's sign", "kernels.cu", "float a2 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));",
     "float a2 = __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, s));", DECODING),
    ("decode attention single: q's rope pairs interleaved, not halves", "kernels.cu",
     "float a = row[h * D + i], b = row[h * D + half + i];",
     "float a = row[h * D + 2 * i], b = row[h * D + 2 * i + 1];", DECODING),
    ("decode matvec: += ignored", "kernels.cu", "float old = accumulate && writes ? out[(long)r * ld_out + o] : 0.0f;",
     "float old = 0.0f;", DECODING),
    ("decode matvec: rmsnorm eps 1e-5 -> 1e-6", "kernels.cu", "sqrtf(sq / In + 1e-5f)",
     "sqrtf(sq / In + 1e-6f)", DECODING),
    ("decode matvec: parts added in an order that depends on the row", "kernels.cu",
     "s += part_sum[g * splits + p][j][r];", "s += part_sum[g * splits + (p + r) % splits][j][r];", DECODING),
    ("decode matvec: a lane's reduce-scatter index counts the half it sent, not the one it kept", "kernels.cu",
     "index += upper ? n / 2 : 0;", "index += upper ? 0 : n / 2;", DECODING),
    ("decode matvec: output rows Out apart, not ld_out", "kernels.cu", "out[(long)r * ld_out + o] = old + s;",
     "out[(long)r * Out + o] = old + s;", DECODING),
    ("argmax: the last index on a tie within a warp", "kernels.cu",
     "if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;\n        }",
     "if (ov > bv || (ov == bv && oi > bi)) bv = ov, bi = oi;\n        }", "argmax_accept"),
    ("accept: a draft checked against its own row's guess, not head 0's", "kernels.cu",
     "fed[1 + j] == chosen[j * n_heads]) j++;", "fed[1 + j] == chosen[j]) j++;", "argmax_accept"),
]
# the files a trained model leaves home through (--set tools): the exporters, the standard evaluation, the
# chat server and the GPU's host-side decoding policy; (name, file, its exact text, what it becomes, pytest -k),
# the -k naming the test file by its module name so that each mutant runs its own file's tests
EXPORT, EVAL, SERVE = "test_export.py", "test_eval.py", "test_serve.py"
DECODE_HOST = ("test_gpu_host.py or (test_cuda_pipeline.py and not training_checks and not nvrtc and "
               "not decode_kernels and not profile)")
TOOL_MUTATIONS = [
    ("export_byte_table_takes_the_soft_hyphen", "tools/export.py", "list(range(0xAE, 0x100))",
     "list(range(0xAD, 0x100))", EXPORT),
    ("export_rms_eps_the_librarys_default", "tools/export.py", '"rms_norm_eps": 1e-5,', '"rms_norm_eps": 1e-6,',
     EXPORT),
    ("export_permute_rope_inverted", "tools/export.py", "w.reshape(H, 2, HD // H // 2, C).swapaxes(1, 2)",
     "w.reshape(H, HD // H // 2, 2, C).swapaxes(1, 2)", EXPORT),
    ("export_k_permuted_with_the_query_heads", "tools/export.py", '"k": permute(k, Hkv)', '"k": permute(k, Hq)',
     EXPORT),
    ("export_q8_0_blocks_of_16", "tools/export.py", "t.shape[1] % 32", "t.shape[1] % 16", EXPORT),
    ("export_last_special_not_control", "tools/export.py",
     "gguf.TokenType.CONTROL if i in range(256, ne.FIRST_MERGE_ID)",
     "gguf.TokenType.CONTROL if i in range(256, ne.FIRST_MERGE_ID - 1)", EXPORT),
    ("export_template_reply_without_end", "tools/export.py", "message['content'] + '<|end|>' }}",
     "message['content'] }}", EXPORT),
    ("export_gguf_value_length_C", "tools/export.py", "w.add_value_length(cfg.D)", "w.add_value_length(cfg.C)",
     EXPORT),
    ("export_hf_model_max_length_doubled", "tools/export.py", '"model_max_length": cfg.T,',
     '"model_max_length": 2 * cfg.T,', EXPORT),
    ("eval_row_cut_one_token_short", "tools/eval.py", "full = (list(ctx_ids) + list(cont_ids))[-(T + 1):]",
     "full = (list(ctx_ids) + list(cont_ids))[-T:]", EVAL),
    ("eval_acc_norm_by_the_sum", "tools/eval.py", "return -nll.sum(), -nll.mean()", "return -nll.sum(), -nll.sum()",
     EVAL),
    ("eval_logits_one_place_early", "tools/eval.py", "z = logits[i, len(inp) - n:len(inp)]",
     "z = logits[i, len(inp) - n - 1:len(inp) - 1]", EVAL),
    ("eval_lambada_any_token_greedy", "tools/eval.py", "bool((z.argmax(-1) == t).all())",
     "bool((z.argmax(-1) == t).any())", EVAL),
    ("eval_centered_not_scaled", "tools/eval.py", "return None if a is None else (a - c) / (1 - c)",
     "return None if a is None else a - c", EVAL),
    ("eval_bpb_over_characters", "tools/eval.py", 'n_bytes += len(it["pairs"][0][1].encode("utf-8"))',
     'n_bytes += len(it["pairs"][0][1])', EVAL),
    ("eval_keeps_the_first_unconditioned_row", "tools/eval.py", 'if r["doc_id"] >= UNCONDITIONED:',
     'if r["doc_id"] > UNCONDITIONED:', EVAL),
    ("eval_choices_in_file_order", "tools/eval.py", 'for _, c, x in sorted(item.pop("rows"))',
     'for _, c, x in item.pop("rows")', EVAL),
    ("eval_last_number_loses_its_sign", "tools/eval.py", r'r"-?\d[\d,]*(?:\.\d+)?"', r'r"\d[\d,]*(?:\.\d+)?"',
     EVAL),
    ("serve_room_takes_the_last_place", "serve.py", "room = max(1, cfg.T - 1 - reply_room)",
     "room = max(1, cfg.T - reply_room)", SERVE),
    ("serve_assistant_turn_without_end", "serve.py", '            history += [tok.special("<|end|>")]',
     "            pass", SERVE),
    ("serve_localhost_case_sensitive", "serve.py", 'if name.lower() == "localhost":', 'if name == "localhost":',
     SERVE),
    ("serve_head_must_end_in_crlf", "serve.py", r'END_OF_HEAD = re.compile(rb"\r?\n\r?\n")',
     r'END_OF_HEAD = re.compile(rb"\r\n\r\n")', SERVE),
    ("serve_event_without_its_blank_line", "serve.py", r'f"data: {data}\n\n"', r'f"data: {data}\n"', SERVE),
    ("serve_stops_at_end_only", "serve.py", "if t == end or 256 <= t < ne.FIRST_MERGE_ID:", "if t == end:", SERVE),
    ("serve_text_parts_joined_by_spaces", "serve.py", '"".join(p["text"] for p in content)',
     '" ".join(p["text"] for p in content)', SERVE),
    ("serve_max_tokens_before_max_completion_tokens", "serve.py",
     'body.get("max_completion_tokens", body.get("max_tokens"))',
     'body.get("max_tokens", body.get("max_completion_tokens"))', SERVE),
    ("serve_reply_ending_inside_a_character_dropped", "serve.py", 'last = decoder.decode(b"", final=True)',
     'last = decoder.decode(b"")', SERVE),
    ("splits_a_full_round_of_loads_splits", "nanoeuler_cuda.py", "ceil_div(chunks, splits) > 32 * DECODE_LOADS",
     "ceil_div(chunks, splits) >= 32 * DECODE_LOADS", DECODE_HOST),
    ("splits_count_warps_without_the_splits", "nanoeuler_cuda.py", "Out * splits < 8 * DECODE_OUTS * sms",
     "Out < 8 * DECODE_OUTS * sms", DECODE_HOST),
    ("policy_drafts_at_its_cost", "nanoeuler_cuda.py",
     "if tokens_d / self.costs[d] > value:", "if tokens_d / self.costs[d] >= value:", DECODE_HOST),
    ("policy_depth_from_the_tokens_fed", "nanoeuler_cuda.py", "sum(min(t, d + 1) for t in seen)",
     "sum(t for t in seen)", DECODE_HOST),
    ("policy_deeper_tried_without_its_bound", "nanoeuler_cuda.py",
     "bound = tokens_d + sum(t > d for t in seen) / len(seen)", "bound = tokens_d", DECODE_HOST),
    ("policy_wait_without_its_longest", "nanoeuler_cuda.py", "min(2 * self.wait, DRAFT_WAIT[1])", "2 * self.wait",
     DECODE_HOST),
    ("policy_wait_not_reset_when_drafting_pays", "nanoeuler_cuda.py",
     "self.depth, self.wait = best, DRAFT_WAIT[0]", "self.depth = best",
     DECODE_HOST),
    ("policy_feeds_rows_the_last_pass_did_not_make", "nanoeuler_cuda.py",
     "rows, self.heads = min(self.heads, heads), heads", "rows, self.heads = heads, heads", DECODE_HOST),
    ("queue_fills_one_past_the_window", "nanoeuler_cuda.py", "if reach + policy.heads <= T:",
     "if reach + policy.heads <= T + 1:", DECODE_HOST),
]
# bugs in the CPU emulator's warpgroup MMA, mbarriers, TMA and named barriers (tools/emulate_cuda.py), which
# test_wgmma.py runs dev/variants/wgmma_probe.cu on: (name, file, its exact text, what it becomes, pytest -k: "" for
# all)
EMULATOR = "tools/emulate_cuda.py"
WGMMA_MUTATIONS = [
    ("wgmma: accumulator rows g and g + 8 swapped", EMULATOR, "int row = 16 * w + g + 8 * (i / 2 % 2), col",
     "int row = 16 * w + g + 8 * (1 - i / 2 % 2), col", ""),
    ("wgmma: the two columns of a register pair swapped", EMULATOR, "col = 8 * (i / 4) + 2 * q + i % 2;",
     "col = 8 * (i / 4) + 2 * q + 1 - i % 2;", ""),
    ("wgmma: the warps' 16-row slabs in reverse", EMULATOR, "int w = t % 128 / 32, g = t % 32 / 4, q = t % 4;",
     "int w = 3 - t % 128 / 32, g = t % 32 / 4, q = t % 4;", ""),
    ("wgmma: interleave K-major, LBO and SBO swapped", EMULATOR,
     ": start + mn / 8 * sbo + k / 8 * lbo + mn % 8 * 16 + k % 8 * 2;",
     ": start + mn / 8 * lbo + k / 8 * sbo + mn % 8 * 16 + k % 8 * 2;", ""),
    ("wgmma: interleave MN-major, LBO and SBO swapped", EMULATOR,
     "a = mn_major ? start + mn / 8 * sbo + k / 8 * lbo + k % 8 * 16 + mn % 8 * 2",
     "a = mn_major ? start + mn / 8 * lbo + k / 8 * sbo + k % 8 * 16 + mn % 8 * 2", ""),
    ("wgmma: swizzled MN-major, LBO and SBO swapped", EMULATOR,
     "start + mn / (8 * chunks) * lbo + k / 8 * sbo", "start + mn / (8 * chunks) * sbo + k / 8 * lbo", ""),
    ("wgmma: swizzled K-major rows 16 bytes short", EMULATOR, "start + mn / 8 * sbo + mn % 8 * 16 * chunks + k * 2",
     "start + mn / 8 * sbo + mn % 8 * 16 * (chunks - 1) + k * 2", ""),
    ("wgmma: SBO read 2 bits low", EMULATOR, "sbo = (desc >> 32 & 0x3FFF) << 4;", "sbo = (desc >> 30 & 0x3FFF) << 4;",
     ""),
    ("wgmma: no swizzle XOR", EMULATOR, "return a ^ (a >> 7 & (chunks - 1)) << 4;", "return a;", ""),
    ("wgmma: swizzle modes 1 and 3 read as 64 and 16 bytes", EMULATOR, "chunks = mode ? 16 >> mode : 1;",
     "chunks = mode ? 8 >> mode : 1;", ""),
    ("wgmma: scale-d ignored", EMULATOR, "float s = op.scale_d ? op.d[i] : 0.0f;", "float s = op.d[i];", ""),
    ("wgmma: wait_group N leaves N + 1 groups", EMULATOR, "finished = max(groups - keep, 0)",
     "finished = max(groups - keep - 1, 0)", ""),
    ("wgmma: register a's rows and k halves swapped", EMULATOR, ".ra[row % 16 / 8 + 2 * (k / 8)];",
     ".ra[row % 16 / 8 * 2 + k / 8];", ""),
    # the bug 0c883df fixed: a register-a wgmma finished by a wait_group that leaves later groups in flight read
    # its a from lanes whose queues had already moved on
    ("wgmma: register a read from queues already moved on", EMULATOR,
     "    for (unsigned t = t0; t < t0 + 128; t++)                 // every thread's first: a register a is read "
     "from\n        for (int j = 0; j < ops; j++) emu_wgmma_run(j, t);  // the other lanes' queues, at the same "
     "place in each\n    for (unsigned t = t0; t < t0 + 128; t++) {\n",
     "    for (unsigned t = t0; t < t0 + 128; t++) {\n        for (int j = 0; j < ops; j++) emu_wgmma_run(j, t);\n",
     "ar_bn_two_groups"),
    # mbarriers and TMA (the product fed by TMA, and its misuse refused)
    ("mbarrier: try_wait.parity's sense flipped", EMULATOR,
     "if ((emu_mbarrier(address).phase & 1) != (parity & 1)) return true;",
     "if ((emu_mbarrier(address).phase & 1) == (parity & 1)) return true;", "tma_product or misuse"),
    ("mbarrier: expect_tx ignored by arrive.expect_tx", EMULATOR,
     "    m.tx += bytes;                                        // expect-tx, then arrive-on\n", "",
     "tma_product or misuse"),
    ("mbarrier: a phase completes at the first arrival", EMULATOR, "if (m.pending == 0 && m.tx == 0) m.phase++",
     "if (m.tx == 0) m.phase++", "tma_product or misuse"),
    ("TMA: the swizzle not applied to the copy's writes", EMULATOR,
     "a ^= (m.swizzle ? a >> 7 & (m.swizzle / 16 - 1) : 0) << 4;", "a ^= 0;", "tma_product or misuse"),
    ("TMA: a copy's bytes never completed on its mbarrier", EMULATOR,
     "b.tx -= (long long)m.box[0] * m.box[1] * m.element;", "b.tx -= 0;", "tma_product or misuse"),
    ("named barrier: bar.sync passes without waiting", EMULATOR,
     "    while (emu_named_gen[id] == gen) yield_fiber();\n", "", "named_barrier_orders"),
]
SETS = {"spec": (SPEC_MUTATIONS, ["test_spec.py"]), "inputs": (INPUT_MUTATIONS, ["test_inputs.py"]),
        "kernels": (KERNEL_MUTATIONS, ["test_cuda_pipeline.py"]),
        "wgmma": (WGMMA_MUTATIONS, ["test_wgmma.py"]),
        "tools": (TOOL_MUTATIONS, [EXPORT, EVAL, SERVE, "test_gpu_host.py", "test_cuda_pipeline.py"])}
MEMORY_LIMIT = 4 << 30    # a mutant that allocates without bound fails fast instead of filling the machine


def limit_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("-k", default="", help="only the mutants whose name contains this")
    p.add_argument("--set", choices=sorted(SETS), default="spec", help="which mutants, and their tests")
    p.add_argument("--tests", nargs="+", help="test files to run against each mutant (default: the set's)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per mutant")
    args = p.parse_args()
    mutations, tests = SETS[args.set]
    args.tests = args.tests or tests
    # every entry as (name, file, text, what it becomes, pytest -k); "" runs all the tests
    chosen = [m if len(m) == 5 else (m[0], "nanoeuler.py", m[1], m[2], "") for m in mutations if args.k in m[0]]
    files = {"nanoeuler.py", "kernels.cu", "flash_attn.cu"} | {m[1] for m in chosen}
    sources = {f: open(os.path.join(HERE, f)).read() for f in files}
    with tempfile.TemporaryDirectory() as tmp:
        # test_serve imports test_reliability and serves serve.html; test_eval runs get_data.sh
        for name in args.tests + ["pytest.ini", "nanoeuler_cuda.py", "README.md", "BENCHMARKS.md", "serve.py",
                                  "serve.html", "test_reliability.py", "get_data.sh"]:
            shutil.copy(os.path.join(HERE, name), tmp)
        # docs: test_inputs parses the commands on its pages; dev: check's parts; tests: test_eval's data
        for folder in ("data", "docs", "dev", "tests"):
            if os.path.isdir(os.path.join(HERE, folder)):
                os.symlink(os.path.join(HERE, folder), os.path.join(tmp, folder))
        # tools (the emulator, export.py, eval.py) copied, not linked: a mutant of tools/ is written there
        shutil.copytree(os.path.join(HERE, "tools"), os.path.join(tmp, "tools"))

        def run_tests(file, code, k):
            for name, text in {**sources, file: code}.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
            try:
                # (the test that this list still applies would fail every mutant: left out)
                r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                    "--deselect", "test_spec.py::test_every_mutant_of_tools_mutate_still_applies",
                                    *(["-k", k] if k else []), *args.tests], cwd=tmp, capture_output=True,
                                   timeout=args.timeout, preexec_fn=limit_memory)
            except subprocess.TimeoutExpired:
                return False, "timed out"
            lines = r.stdout.decode().strip().splitlines()
            failed = next((ln.split(" - ")[0] for ln in lines if ln.startswith(("FAILED", "ERROR"))), "")
            if r.returncode == 0:
                return True, ""
            if r.returncode == 5:                       # no test ran: not a kill
                sys.exit(f"pytest -k {k!r} selects no test of {' '.join(args.tests)}")
            return False, failed or f"pytest exit code {r.returncode} (out of memory?)"

        ks = {m[4] for m in chosen}
        ok, why = run_tests("nanoeuler.py", sources["nanoeuler.py"],
                            "" if "" in ks or not ks else " or ".join(f"({k})" for k in sorted(ks)))
        if not ok:
            sys.exit(f"the tests fail on the unchanged sources ({why}); fix that first")
        survived, stale = [], []
        for name, file, old, new, k in chosen:
            if sources[file].count(old) != 1:
                stale.append(name)
                print(f"STALE     {name}: its text occurs {sources[file].count(old)} times in {file}")
                continue
            t0 = time.time()
            passed, failed = run_tests(file, sources[file].replace(old, new), k)
            if passed:
                survived.append(name)
            print(f"{'SURVIVED' if passed else 'killed  '}  {name:<55} {time.time() - t0:5.1f} s  {failed}",
                  flush=True)
    print(f"{len(chosen) - len(survived) - len(stale)} of {len(chosen)} mutants killed, "
          f"{len(survived)} survived, {len(stale)} stale")
    sys.exit(1 if survived or stale else 0)


if __name__ == "__main__":
    main()
