"""
The NanoEuler model in PyTorch, only to measure what nanoeuler.py and
nanoeuler_cuda.py are compared against (BENCHMARKS.md). Not part of NanoEuler:
nothing imports it, and it needs PyTorch.

    python tools/pytorch_reference.py [--compile [reduce-overhead]] [--precision bf16|tf32] [--batch 16]   # big, GPU
    python tools/pytorch_reference.py --attention --batch 16     # scaled_dot_product_attention alone
    python tools/pytorch_reference.py --model small --device cpu --precision fp32 --batch 8 [--threads 4]
    python tools/pytorch_reference.py --decode [--compile]    # batch-1 greedy decoding with a KV cache

Same model as SPEC.md (RMSNorm, RoPE, GQA, SwiGLU, K untied heads, mtp_weight),
AdamW, bf16 autocast, tf32 or fp32, the step timed after warm-up. --compile
compiles the model's forward and loss (and so their backward) with
torch.compile; --compile reduce-overhead also replays them as CUDA graphs.
--attention times causal GQA attention of one layer (forward, and forward +
backward) in bf16 at the model's shape, what nanoeuler_cuda.py bench --profile
prints for its own kernels.
--decode: greedy decoding at batch 1 with a static KV cache, weights in bf16 (as
nanoeuler_cuda.py's decoder), one token per step; --compile compiles the step
with mode="reduce-overhead" (CUDA graphs), as gpt-fast does.
"""

import argparse
import time

import torch
import torch.nn.functional as F

PRESETS = {"big": (4096, 768, 12, 4, 16, 512, 2048), "small": (512, 128, 4, 2, 4, 128, 344)}
V, C, Hq, Hkv, L, T, FF = PRESETS["big"]
K, MTP = 4, 0.5
D = C // Hq


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = torch.nn.RMSNorm(C, eps=1e-5), torch.nn.RMSNorm(C, eps=1e-5)
        self.wqkv = torch.nn.Linear(C, (Hq + 2 * Hkv) * D, bias=False)
        self.wo = torch.nn.Linear(Hq * D, C, bias=False)
        self.w_gate_up = torch.nn.Linear(C, 2 * FF, bias=False)
        self.w_down = torch.nn.Linear(FF, C, bias=False)

    def forward(self, x, cos, sin):
        B = x.shape[0]
        q, k, v = self.wqkv(self.attn_norm(x)).split([Hq * D, Hkv * D, Hkv * D], -1)
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))
        q, k = (torch.cat([t[..., :D // 2] * cos - t[..., D // 2:] * sin,
                           t[..., D // 2:] * cos + t[..., :D // 2] * sin], -1) for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.w_down(F.silu(gate) * up)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList(Block() for _ in range(L))
        self.final_norm = torch.nn.RMSNorm(C, eps=1e-5)
        self.heads = torch.nn.Linear(C, K * V, bias=False)            # K untied heads, one matmul
        freq = 10000.0 ** (-torch.arange(0, D // 2) * 2.0 / D)
        angle = torch.arange(T)[:, None] * freq
        self.register_buffer("cos", angle.cos())
        self.register_buffer("sin", angle.sin())

    def forward(self, idx, targets):
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.heads(self.final_norm(x)).view(*idx.shape, K, V).float()
        ce = [F.cross_entropy(logits[:, :, k].reshape(-1, V), targets[:, :, k].reshape(-1), ignore_index=-1)
              for k in range(K)]
        return ce[0] + MTP * sum(ce[1:]) / (K - 1)


def time_attention(batch, dev, reps=50):
    """per layer: causal GQA scaled_dot_product_attention forward, and forward + backward, in bf16"""
    q = torch.randn(batch, Hq, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, Hkv, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dy = torch.randn(batch, Hq, T, D, device=dev, dtype=torch.bfloat16)
    forward = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    result = []
    for step in (forward, lambda: forward().backward(dy)):
        for _ in range(3):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        result.append(1e3 * start.elapsed_time(end) / reps)
    print(f"PyTorch {torch.__version__}, {torch.cuda.get_device_name()}, scaled_dot_product_attention, bf16, "
          f"B={batch}, T={T}, {Hq} query and {Hkv} kv heads, D={D}, causal: forward {result[0]:.1f} us, "
          f"forward+backward {result[1]:.1f} us")


class Decoder(torch.nn.Module):
    """Model's weights with a static KV cache (L, 1, Hkv, T, D); step() feeds one token at pos"""

    def __init__(self, model, dtype):
        super().__init__()
        self.model = model
        shape = (L, 1, Hkv, T, D)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def forward(self, tok, pos):                   # tok (1,), pos (1,) long tensors on the GPU
        m = self.model
        x = m.tok_emb(tok)[None]                   # (1,1,C)
        cos, sin = m.cos[pos].to(x.dtype), m.sin[pos].to(x.dtype)   # (1,D/2)
        mask = (torch.arange(T, device=tok.device) <= pos)[None, None, None]   # (1,1,1,T)
        for l, layer in enumerate(m.layers):
            q, k, v = layer.wqkv(layer.attn_norm(x)).split([Hq * D, Hkv * D, Hkv * D], -1)
            q, k, v = (t.view(1, 1, -1, D).transpose(1, 2) for t in (q, k, v))
            q, k = (torch.cat([t[..., :D // 2] * cos - t[..., D // 2:] * sin,
                               t[..., D // 2:] * cos + t[..., :D // 2] * sin], -1) for t in (q, k))
            self.k_cache[l][:, :, pos] = k
            self.v_cache[l][:, :, pos] = v
            y = F.scaled_dot_product_attention(q, self.k_cache[l], self.v_cache[l], attn_mask=mask, enable_gqa=True)
            x = x + layer.wo(y.transpose(1, 2).reshape(1, 1, -1))
            gate, up = layer.w_gate_up(layer.mlp_norm(x)).chunk(2, -1)
            x = x + layer.w_down(F.silu(gate) * up)
        logits = F.linear(m.final_norm(x), m.heads.weight[:V])      # head 0
        return logits.argmax(-1).view(1)


def decode(args):
    """tokens/s of greedy decoding, 16-token prompt fed one token at a time, then new tokens to
    the end of the window (T - 16; no slide), the median of 3 runs after a warm-up"""
    dev, dtype = "cuda", torch.bfloat16 if args.precision == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    model = Model().to(dev).to(dtype).eval()
    dec = Decoder(model, dtype).to(dev)
    step = torch.compile(dec, mode="reduce-overhead", fullgraph=True) if args.compile else dec
    prompt = list(range(16))
    n = min(args.new_tokens, T - len(prompt))
    times = []
    with torch.no_grad():
        for run in range(4):
            t0 = time.perf_counter()
            for i, t in enumerate(prompt):
                nxt = step(torch.tensor([t], device=dev), torch.tensor([i], device=dev))
            out = []
            for i in range(len(prompt), len(prompt) + n):
                t = int(nxt.item())
                out.append(t)
                nxt = step(torch.tensor([t], device=dev), torch.tensor([i], device=dev))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    dt = sorted(times[1:])[1]
    print(f"PyTorch {torch.__version__}, {torch.cuda.get_device_name()}, decoding batch 1, "
          f"{'compiled (reduce-overhead: CUDA graphs)' if args.compile else 'eager'}, {args.precision} weights, "
          f"{len(prompt)}-token prompt + {n} new tokens: {(len(prompt) + n) / dt:,.0f} tok/s "
          f"({dt * 1e3 / (len(prompt) + n):.3f} ms/token)")


def main():
    global V, C, Hq, Hkv, L, T, FF, D
    p = argparse.ArgumentParser()
    p.add_argument("--compile", nargs="?", const="default", choices=["default", "reduce-overhead"],
                   help="torch.compile the forward and loss, in this mode (reduce-overhead: CUDA graphs)")
    p.add_argument("--attention", action="store_true", help="time only SDPA attention of one layer")
    p.add_argument("--precision", default="bf16", choices=["bf16", "tf32", "fp32"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="big", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, help="CPU: torch.set_num_threads (default: PyTorch's, one per core)")
    p.add_argument("--decode", action="store_true", help="time batch-1 greedy decoding with a KV cache instead")
    p.add_argument("--new-tokens", type=int, default=500, help="--decode: new tokens (at most T - 16)")
    args = p.parse_args()
    V, C, Hq, Hkv, L, T, FF = PRESETS[args.model]
    D = C // Hq
    if args.decode:
        return decode(args)
    dev = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attention:
        return time_attention(args.batch, dev)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision != "fp32"
    model = Model().to(dev)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev == "cuda")
    step_model = torch.compile(model, mode=args.compile) if args.compile else model
    rows = torch.randint(0, V, (args.batch, T + K), device=dev)
    idx = rows[:, :T]
    targets = torch.stack([rows[:, 1 + k:1 + k + T] for k in range(K)], -1)
    times = []
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for step in range(args.steps + 5):
        sync()
        t0 = time.perf_counter()
        if args.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()        # the last step's graph outputs may be overwritten
        with torch.autocast(dev, torch.bfloat16, enabled=args.precision == "bf16"):
            loss = step_model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    dt = sorted(times[5:])[len(times[5:]) // 2]
    name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"PyTorch {torch.__version__}, {name}, {n:,} parameters, "
          f"{'compiled (' + args.compile + ')' if args.compile else 'eager'}, {args.precision}, batch {args.batch} x {T}: "
          f"{dt * 1e3:.1f} ms/step, {args.batch * T / dt:,.0f} tok/s")


if __name__ == "__main__":
    main()
