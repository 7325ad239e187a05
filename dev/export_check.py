"""
tools/export.py's files run by the programs users load them with, against
nanoeuler.py's own forward: transformers' LlamaForCausalLM (float32) and
llama.cpp through llama-cpp-python (f32 KV cache), for every GGUF number format.
Needs torch, transformers and llama-cpp-python (not in any requirements file);
test_export.py's slow tests call measure() and assert on what it returns.

    python dev/export_check.py --model out/small/best.safetensors --out /tmp/export_check [--chat]
    python dev/export_check.py --init big --out /tmp/export_big      # an untrained big model
    python dev/export_check.py --scan-pattern       # where the split patterns differ, code point by code point

It prints, and returns: the largest logit difference relative to the largest logit
over a prompt and 100 greedy tokens; how many of the 100 greedy tokens agree with
ours from the first on; whether apply_chat_template gives chat's ids; the texts
on which each tokenizer's ids differ from ours; and two negative controls, a GGUF
file written without the q/k permutation and one without the pre-tokenizer name.
"""

import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [HERE, os.path.join(HERE, "tools")]
import nanoeuler as ne  # noqa: E402

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402

import numpy as np  # noqa: E402

import export  # noqa: E402

N_NEW = 100

# text in many scripts and the corners where the split patterns differ
CHECK_TEXT = [
    "hello world", "don't  stop\tme", "I'LL SAY 'tis", "naïve café", "Ünïcödé Straße", "Ελληνικά κείμενα",
    "Русский текст", "עברית ימין לשמאל", "العربية", "हिन्दी", "ภาษาไทย", "日本語のテキスト", "中文文本", "한국어",
    "emoji 🎉👍🏽 and flags 🇫🇷", "zwj 👩‍👩‍👧 family", "e\u0301 combining", "NUL\x00byte", "\x01\x02 control \x7f",
    "\u00a0nbsp\u2003em\u3000ideographic", "\r\n windows\r\n", "snake_case_name __init__", "mixed 123abc 45.6 -7",
    "x²³ ½ Ⅻ", "\x1c\x1d\x1e\x1f separators", " " * 200 + "x", "abc" * 60,
]


def corpus_samples(n=100_000):
    data = os.path.join(HERE, "data")
    paths = [os.path.join(data, "tinyshakespeare.txt"), os.path.join(data, "instructions.jsonl")]
    paths += sorted(os.path.join(data, "gutenberg", f) for f in os.listdir(os.path.join(data, "gutenberg")))[:3]
    return {os.path.relpath(p, HERE): open(p, encoding="utf-8").read()[n:2 * n] for p in paths}


def rel_diff(a, b):
    """largest difference relative to the largest of b"""
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def agree(a, b):
    """how many tokens agree from the first on"""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def versions():
    import importlib.metadata as md
    out = [f"python {platform.python_version()}"]
    for p in ("numpy", "torch", "transformers", "tokenizers", "gguf", "llama_cpp_python", "jinja2"):
        try:
            out.append(f"{p} {md.version(p)}")
        except md.PackageNotFoundError:
            out.append(f"{p} absent")
    return ", ".join(out)


def write_files(model, out, tok, cfg, params):
    """the HF folder and a GGUF file per format, and the two negative controls"""
    os.makedirs(out, exist_ok=True)
    paths = {"hf": os.path.join(out, "hf")}
    if not os.path.exists(paths["hf"]):
        export.write_hf(paths["hf"], cfg, params, tok)
    name = os.path.basename(model)
    for t in export.OUTTYPES:
        paths[t] = os.path.join(out, f"{t}.gguf")
        if not os.path.exists(paths[t]):
            export.write_gguf(paths[t], cfg, params, tok, t, name)
    paths["unpermuted"] = os.path.join(out, "unpermuted.gguf")
    if not os.path.exists(paths["unpermuted"]):
        export.write_gguf(paths["unpermuted"], cfg, params, tok, "f32", name, permute=lambda w, H: w)
    paths["no_pre"] = os.path.join(out, "no_pre.gguf")
    if not os.path.exists(paths["no_pre"]):
        import gguf
        keep = gguf.GGUFWriter.add_tokenizer_pre
        gguf.GGUFWriter.add_tokenizer_pre = lambda self, pre: None
        try:
            export.write_gguf(paths["no_pre"], cfg, params, tok, "f32", name)
        finally:
            gguf.GGUFWriter.add_tokenizer_pre = keep
    return paths


def chat_ids(tok, messages):
    """chat's ids for a conversation (nanoeuler.py cmd_chat): render_turn per exchange"""
    ids = []
    for i in range(0, len(messages), 2):
        reply = messages[i + 1]["content"] if i + 1 < len(messages) else None
        ids += ne.render_turn(tok, messages[i]["content"], reply)[0]
    return ids


CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "Name a river there."}]
ASK = [{"role": "user", "content": "Give me three tips for staying healthy."}]     # --chat's prompt: room for 100


def check_transformers(paths, cfg, tok, seq, n_prompt, ours_logits, ours_greedy, texts):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)
    t = AutoTokenizer.from_pretrained(paths["hf"])
    m.generation_config.eos_token_id = None            # ours goes on past a special token (min_new_tokens
    with torch.no_grad():                              # would forbid them instead)
        logits = m(torch.tensor([seq])).logits[0].numpy()
        out = m.generate(torch.tensor([seq[:n_prompt]]), do_sample=False, max_new_tokens=len(ours_greedy),
                         attention_mask=torch.ones(1, n_prompt, dtype=torch.long))
    greedy = out[0, n_prompt:].tolist()
    template = t.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    template = template["input_ids"] if isinstance(template, dict) or hasattr(template, "keys") else template
    differ = [k for k, s in texts.items() if t(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]
              != tok.encode(s)]
    return {"logits_rel": rel_diff(logits, ours_logits), "greedy_agree": agree(greedy, ours_greedy),
            "chat_template_ok": list(template) == chat_ids(tok, CHAT), "tokenizer_differs": differ,
            "bos_eos": (t.bos_token_id, t.eos_token_id)}


def llama(path, cfg):
    import llama_cpp
    return llama_cpp.Llama(path, n_ctx=max(cfg.T, 64), logits_all=True, verbose=False, n_threads=2,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, seed=0)


def llama_logits(llm, seq):
    llm.reset()
    llm.eval(seq)
    return np.array(llm.scores[:len(seq)])


def llama_greedy(llm, prompt, n):
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        llm.eval([t])
    return out


def llama_chat_ids(llm):
    """the prompt ids of create_chat_completion: the file's chat template rendered by
    llama-cpp-python's Jinja2ChatFormatter, tokenized as its handler does"""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    meta = llm.metadata
    prompt = Jinja2ChatFormatter(meta["tokenizer.chat_template"], eos_token="<|end|>",
                                 bos_token="<|endoftext|>")(messages=CHAT).prompt
    return llm.tokenize(prompt.encode(), add_bos=True, special=True)     # add_bos: as the handler; the file says no


def llama_tokenize_differs(llm, tok, texts):
    return [k for k, s in texts.items() if llm.tokenize(s.encode(), add_bos=False, special=False) != tok.encode(s)]


def check_llama_cpp(paths, cfg, tok, seq, n_prompt, ours_logits, ours_greedy, texts):
    res = {}
    for name in export.OUTTYPES + ("unpermuted",):
        llm = llama(paths[name], cfg)
        r = {"logits_rel": rel_diff(llama_logits(llm, seq), ours_logits),
             "greedy_agree": agree(llama_greedy(llm, seq[:n_prompt], len(ours_greedy)), ours_greedy)}
        if name == "f32":
            r["tokenizer_differs"] = llama_tokenize_differs(llm, tok, texts)
            r["chat_template_ok"] = llama_chat_ids(llm) == chat_ids(tok, CHAT)
            r["bos_eos_eot"] = (llm.token_bos(), llm.token_eos(), llm._model.token_eot())
            r["add_bos"] = llm._model.add_bos_token()
        res[name] = r
        del llm
    res["no_pre"] = {"tokenizer_differs": llama_tokenize_differs(llama(paths["no_pre"], cfg), tok, texts)}
    return res


def measure(model, out, prompt="First Citizen:\n", chat=False, llama_cpp=True, transformers=True, log=print):
    """-> {"transformers": {...}, "llama_cpp": {format: {...}}} for the model file, written under out"""
    cfg, flat, tok = ne.load_model(model)
    params = ne.carve(flat, cfg)
    paths = write_files(model, out, tok, cfg, params)
    if chat:
        prompt_ids = chat_ids(tok, ASK)
    else:
        prompt_ids = tok.encode(prompt)
    n_new = min(N_NEW, cfg.T - len(prompt_ids))          # no sliding window: the others have none
    ours_greedy = list(ne.generate(params, cfg, prompt_ids, n_new, temperature=0))
    seq = prompt_ids + ours_greedy
    ours_logits, _ = ne.model_forward(ne.carve(flat.astype(np.float64), cfg), cfg, np.array([seq]))
    ours_logits = ours_logits[0]
    texts = {**corpus_samples(), **{repr(s[:24]): s for s in CHECK_TEXT}}
    log(f"{datetime.date.today()}  {model}: V={cfg.V} C={cfg.C} L={cfg.L} Hq={cfg.Hq} Hkv={cfg.Hkv} T={cfg.T}; "
        f"{'chat' if chat else 'prompt'} of {len(prompt_ids)} tokens, {n_new} greedy tokens of ours: "
        f"{tok.decode(ours_greedy)!r}")
    log(versions())
    res = {"n_new": n_new}
    if transformers:
        r = res["transformers"] = check_transformers(paths, cfg, tok, seq, len(prompt_ids), ours_logits,
                                                     ours_greedy, texts)
        log(f"transformers LlamaForCausalLM fp32: logits rel diff {r['logits_rel']:.2e}, greedy "
            f"{r['greedy_agree']}/{n_new} agree, apply_chat_template gives chat's ids: {r['chat_template_ok']}, "
            f"bos/eos {r['bos_eos']}, tokenizer ids differ on: {r['tokenizer_differs'] or 'none'}")
    if llama_cpp:
        res["llama_cpp"] = check_llama_cpp(paths, cfg, tok, seq, len(prompt_ids), ours_logits, ours_greedy, texts)
        for name, r in res["llama_cpp"].items():
            if "logits_rel" in r:
                log(f"llama.cpp {name:10s} (f32 KV cache): logits rel diff {r['logits_rel']:.2e}, greedy "
                    f"{r['greedy_agree']}/{n_new} agree")
        r = res["llama_cpp"]["f32"]
        log(f"llama.cpp bos/eos/eot {r['bos_eos_eot']}, adds BOS: {r['add_bos']}, the GGUF's chat template "
            f"(llama-cpp-python's Jinja2ChatFormatter) gives chat's ids: {r['chat_template_ok']}; "
            "tokenizer ids differ on: "
            f"{r['tokenizer_differs'] or 'none'}")
        log(f"llama.cpp without tokenizer.ggml.pre: ids differ on {res['llama_cpp']['no_pre']['tokenizer_differs']}")
    return res


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def scan_pattern(log=print):
    """every code point between letters, digits, spaces and punctuation, split by our pattern
    (Python's re), by export.ONIG_PATTERN and by GPT-2's in Hugging Face tokenizers: where
    they differ, counted by the character's Unicode category in Python's tables"""
    import collections
    import unicodedata
    from tokenizers import Regex, pre_tokenizers
    ours = pre_tokenizers.Split(Regex(export.ONIG_PATTERN), "isolated")
    gpt2 = pre_tokenizers.Split(Regex(GPT2_PATTERN), "isolated")
    differ = {"ONIG_PATTERN": collections.Counter(), "GPT-2's pattern": collections.Counter()}
    examples = collections.defaultdict(list)
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:                      # surrogates: not text
            continue
        c = chr(cp)
        text = f"a{c}b 1{c}2 {c}{c} x {c} !{c}! \t{c}"
        want = ne.SPLIT_PATTERN.findall(text)
        for name, split in (("ONIG_PATTERN", ours), ("GPT-2's pattern", gpt2)):
            if [p for p, _ in split.pre_tokenize_str(text)] != want:
                differ[name][unicodedata.category(c)] += 1
                if len(examples[name]) < 12:
                    examples[name].append(f"U+{cp:04X}")
    log(f"Python {platform.python_version()} (Unicode {unicodedata.unidata_version}), {versions()}")
    for name, counts in differ.items():
        log(f"{name} splits otherwise than nanoeuler's on {sum(counts.values()):,} code points, by category "
            f"{dict(counts.most_common())}; first: {' '.join(examples[name])}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the model file to export and check")
    p.add_argument("--scan-pattern", action="store_true", help="instead: where the split patterns differ")
    p.add_argument("--init", choices=sorted(ne.PRESETS), help="instead of --model: an untrained model of this "
                   "preset (init_params), its tokenizer trained on data/tinyshakespeare.txt, saved in --out")
    p.add_argument("--out", help="a folder for the exported files (reused if there)")
    p.add_argument("--prompt", default="First Citizen:\n")
    p.add_argument("--chat", action="store_true", help="prompt with a chat conversation (an SFT model)")
    args = p.parse_args()
    if args.scan_pattern:
        return scan_pattern()
    if args.init:
        cfg = ne.PRESETS[args.init]
        text = open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()
        os.makedirs(args.out, exist_ok=True)
        args.model = os.path.join(args.out, f"{args.init}_init.safetensors")
        ne.save_model(args.model, cfg, ne.init_params(cfg), ne.Tokenizer.train(text, cfg.V, progress=False))
    measure(args.model, args.out, args.prompt, args.chat, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
