"""
Export a NanoEuler model to the formats other programs load: a Hugging Face
Llama folder (transformers, and what reads its files) and a GGUF file
(llama.cpp, and the tools built on it). A tool beside the two programs, as
llm.c's export_hf.py is: nanoeuler.py knows nothing of it.

    python tools/export.py --model out/small/best.safetensors --hf small-hf
    python tools/export.py --model out/small/best.safetensors --gguf small.gguf [--outtype q8_0]

NanoEuler's architecture is Llama's: RMSNorm (eps 1e-5), rotate-half RoPE
(theta 10000), SwiGLU, grouped-query attention, no biases, an output head
untied from the embedding. So the weights map one to one, with three changes:
- wqkv is split into q, k and v; heads.0 is the output head.
- the K-1 extra heads (multi-token prediction, what --speculative drafts with)
  have no place in a Llama model: they are left out, and the exported model
  predicts as NanoEuler's head 0 does. Keep the .safetensors for --speculative.
- GGUF only: llama.cpp's llama architecture rotates neighbouring pairs of a
  head's dimensions (0,1), (2,3), ... where we rotate (i, i + D/2) (rotate-half,
  as Hugging Face does), so the rows of q and k are reordered (permute_rope).

The tokenizer becomes a byte-level BPE the others run themselves: each token's
bytes through GPT-2's byte-to-unicode table, our merges in order, the four
special tokens. docs/export.md says where its ids can differ from ours.
Nothing is written in place: a folder or file is written under a temporary
name and renamed once complete, and an existing output is refused.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanoeuler as ne  # noqa: E402  (first: it sets the BLAS thread count before numpy loads)

import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402

# -----------------------------------------------------------------------------
# the tokenizer as byte-level BPE

def bytes_to_unicode():
    """GPT-2's table: each of the 256 bytes -> a printable character (bytes that are
    printable Latin-1 stand for themselves, the others get chr(256 + n) in order),
    so that a token's bytes are a string every tokenizer file can hold"""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_CHAR = bytes_to_unicode()


def token_strings(tok, source="the tokenizer"):
    """-> one string per id: the specials as themselves, every other token its bytes
    through BYTE_CHAR. Refuses a vocabulary in which two ids have the same bytes: the
    others find a token by its string, so one of the two ids could never come out."""
    strings = [t.decode() if i in range(256, ne.FIRST_MERGE_ID) else "".join(BYTE_CHAR[b] for b in t)
               for i, t in enumerate(tok.vocab)]
    first = {}
    for i, t in enumerate(tok.vocab):
        if t in first:
            raise ne.NanoEulerError(
                f"{source} has two tokens with the same bytes {t!r} (ids {first[t]} and {i}); no other "
                "program's tokenizer can hold both, so this model cannot be exported faithfully")
        first[t] = i
    return strings


# Our split pattern (nanoeuler.py SPLIT_PATTERN) is written for Python's re, whose
# classes are not Unicode's: [^\W\d_] (a letter) also takes numbers that are not
# digits (², ½, Ⅻ: Unicode's No and Nl), and \s also takes \x1c-\x1f. The others
# run Oniguruma (Hugging Face tokenizers) or their own code (llama.cpp), where
# \p{L}, \p{N} and \s are Unicode's; this is the same pattern spelled for them.
# Checked on every code point Python's Unicode tables know: the same pieces.
SPACE = r"\s\x1c-\x1f"
ONIG_PATTERN = (r"'(?:[sdmt]|ll|ve|re)| ?[\p{L}\p{Nl}\p{No}]+| ?\p{Nd}+| ?[^" + SPACE + r"\p{L}\p{N}]+"
                r"|[" + SPACE + r"]+(?![^" + SPACE + r"])|[" + SPACE + r"]+")


def cut_pattern(max_bytes):
    """our bound on a piece's bytes (nanoeuler.py cut_piece), for pieces already turned into
    BYTE_CHAR characters (one a byte): the longest run of at most max_bytes that does
    not stop before a UTF-8 continuation byte (0b10xxxxxx)"""
    continuation = "".join(BYTE_CHAR[b] for b in range(0x80, 0xC0))
    return f".{{1,{max_bytes}}}(?![{continuation}])"


def tokenizer_json(tok):
    """Hugging Face tokenizers' tokenizer.json: the specials as added tokens, then our
    split pattern, the bytes as characters, our piece bound, and BPE with our merges"""
    strings = token_strings(tok)
    specials = [{"id": tok.special(s), "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for s in ne.SPECIALS]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": ONIG_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            {"type": "Split", "pattern": {"Regex": cut_pattern(tok.max_piece_bytes)}, "behavior": "Isolated",
             "invert": False}]},
        "post_processor": None,                            # no BOS: NanoEuler's prompts start bare
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False,           # True would take a whole piece found in the vocab: not ours
                  "vocab": {s: i for i, s in enumerate(strings)},
                  "merges": [[strings[a], strings[b]] for a, b in tok.merges]},
    }


# The conversation as chat renders it (nanoeuler.py render_turn): <|user|> the
# question <|assistant|> the reply <|end|>, turn after turn, nothing between
# them, no BOS. One line: transformers renders with trim_blocks and lstrip_blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '<|user|>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '<|assistant|>' + message['content'] + '<|end|>' }}"
    "{%- else -%}{{ raise_exception('NanoEuler knows the roles user and assistant only, not ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}")


def stop_ids(tok):
    """where a reply ends: <|end|> first, then the other specials (chat stops at any of them)"""
    end = tok.special("<|end|>")
    return [end] + [tok.special(s) for s in ne.SPECIALS if tok.special(s) != end]


# -----------------------------------------------------------------------------
# Hugging Face: a LlamaForCausalLM folder

def hf_config(cfg, tok):
    """config.json: every size, and each value whose library default is not ours written out"""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.V,
        "hidden_size": cfg.C,
        "intermediate_size": cfg.F,
        "num_hidden_layers": cfg.L,
        "num_attention_heads": cfg.Hq,
        "num_key_value_heads": cfg.Hkv,
        "head_dim": cfg.D,
        "max_position_embeddings": cfg.T,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,                              # the library's default is 1e-6
        "rope_theta": 10000.0,                             # transformers 4
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},   # transformers 5
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": tok.special("<|endoftext|>"),      # the library's defaults 1 and 2 are bytes here
        "eos_token_id": tok.special("<|end|>"),
        "pad_token_id": tok.special("<|endoftext|>"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


# Llama's tensors as each format names them: ours, with wqkv split into q, k and v, and
# heads.0 the output head; a layer's own in the order written, each after its prefix
HF_NAMES = {"tok_emb": "model.embed_tokens.weight", "layer": "model.layers.{}.",
            "attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
            "mlp_norm": "post_attention_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
            "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
            "final_norm": "model.norm.weight", "heads.0": "lm_head.weight"}
GGUF_NAMES = {"tok_emb": "token_embd.weight", "layer": "blk.{}.",
              "attn_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
              "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
              "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
              "final_norm": "output_norm.weight", "heads.0": "output.weight"}
LAYER_PARTS = ("attn_norm", "q", "k", "v", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def llama_tensors(cfg, params, names, permute=lambda w, H: w):
    """(name, array) in names' spelling; the rows of q and k through permute(w, their heads)"""
    Hq, Hkv, D = cfg.Hq, cfg.Hkv, cfg.D
    out = [(names["tok_emb"], params["tok_emb"])]
    for l in range(cfg.L):
        p = ne.layer_params(params, l)
        q, k, v = np.split(p["wqkv"], [Hq * D, (Hq + Hkv) * D])      # wqkv: ((Hq+2Hkv)*D, C)
        p = {**p, "q": permute(q, Hq), "k": permute(k, Hkv), "v": v}
        out += [(names["layer"].format(l) + names[part], p[part]) for part in LAYER_PARTS]
    return out + [(names["final_norm"], params["final_norm"]), (names["heads.0"], params["heads.0"])]


def hf_tensors(cfg, params):
    """Hugging Face's Llama names; rotate-half is their layout too: no permutation"""
    return llama_tensors(cfg, params, HF_NAMES)


def write_hf(folder, cfg, params, tok):
    """the folder's six files, into folder (which must not exist yet)"""
    os.mkdir(folder)
    ne.write_safetensors(os.path.join(folder, "model.safetensors"), hf_tensors(cfg, params), {"format": "pt"})
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|end|>", "pad_token": "<|endoftext|>"}
    files = {
        "config.json": hf_config(cfg, tok),
        "generation_config.json": {"bos_token_id": tok.special("<|endoftext|>"), "eos_token_id": stop_ids(tok),
                                   "pad_token_id": tok.special("<|endoftext|>")},
        "tokenizer.json": tokenizer_json(tok),
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                                  "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces":
                                  False, "model_max_length": cfg.T, "chat_template": CHAT_TEMPLATE},
        "special_tokens_map.json": specials,
    }
    for name, content in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
            f.write("\n")


# -----------------------------------------------------------------------------
# GGUF: llama.cpp's llama architecture

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def permute_rope(w, H):
    """w (H*D, C), rows of H heads in rotate-half order (dimension i turns with i + D/2)
    -> rows in llama.cpp's interleaved order (2i turns with 2i+1): row j + s*D/2 of a
    head goes to row 2j + s. Queries and keys move alike, so q.k is unchanged."""
    HD, C = w.shape
    return w.reshape(H, 2, HD // H // 2, C).swapaxes(1, 2).reshape(HD, C)


def gguf_tensors(cfg, params, permute=permute_rope):
    """llama.cpp's names, q and k permuted (k with its Hkv heads)"""
    return llama_tensors(cfg, params, GGUF_NAMES, permute)


def write_gguf(path, cfg, params, tok, outtype, name, permute=permute_rope):
    """the GGUF file at path (written there: the caller gives a temporary name). Matrices in
    outtype, norms in f32 (as llama.cpp's own converter does); a matrix whose rows do not
    split into Q8_0's blocks of 32 stays f16 -> returns those tensors' (name, row length)"""
    import gguf                                        # only the export needs it
    Q = gguf.GGMLQuantizationType
    qtype = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_vocab_size(cfg.V)
    w.add_context_length(cfg.T)
    w.add_embedding_length(cfg.C)
    w.add_block_count(cfg.L)
    w.add_feed_forward_length(cfg.F)
    w.add_head_count(cfg.Hq)
    w.add_head_count_kv(cfg.Hkv)
    w.add_key_length(cfg.D)
    w.add_value_length(cfg.D)
    w.add_rope_dimension_count(cfg.D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    # the tokenizer: GPT-2's kind with GPT-2's pre-tokenizer named (without the name
    # llama.cpp warns and splits text its default way), our specials, no automatic BOS
    strings = token_strings(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(strings)
    w.add_token_types([gguf.TokenType.CONTROL if i in range(256, ne.FIRST_MERGE_ID) else gguf.TokenType.NORMAL
                       for i in range(len(strings))])
    w.add_token_merges([f"{strings[a]} {strings[b]}" for a, b in tok.merges])
    w.add_bos_token_id(tok.special("<|endoftext|>"))
    w.add_eos_token_id(tok.special("<|end|>"))
    w.add_eot_token_id(tok.special("<|end|>"))
    w.add_pad_token_id(tok.special("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    kept_f16 = []
    for tname, t in gguf_tensors(cfg, params, permute):
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(tname, t)
        elif qtype == Q.F16 or (qtype == Q.Q8_0 and t.shape[1] % 32):
            w.add_tensor(tname, t.astype(np.float16))
            kept_f16 += [(tname, t.shape[1])] if qtype == Q.Q8_0 else []
        else:
            w.add_tensor(tname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kept_f16


# -----------------------------------------------------------------------------
# the command

def refuse_existing(path, flag):
    """an output must be new, in a folder that exists: export never overwrites"""
    if os.path.lexists(path):
        raise ne.NanoEulerError(f"{path} already exists; give {flag} a new name (export never overwrites)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ne.NanoEulerError(f"{parent} is not a folder; give {flag} a path in a folder that exists")


def temp_name(path):
    return f"{path}.{os.getpid()}.tmp"


def export_to(path, flag, write):
    """write(temp) then rename temp -> path; on any failure the temp is removed, path never appears"""
    tmp = temp_name(path)
    try:
        result = write(tmp)
        if os.path.lexists(path):                      # made while we wrote: keep theirs
            raise ne.NanoEulerError(f"{path} appeared while exporting; give {flag} a new name")
        os.rename(tmp, path)
        return result
    except OSError as e:                               # a full disk, a read-only folder: name ours, not the temp
        raise ne.NanoEulerError(f"{path} could not be written ({(e.strerror or str(e)).lower()}); give {flag} a "
                                "place with room that you may write to") from None
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)


def cmd_export(args):
    if args.hf and args.hf.endswith("/") and args.hf.strip("/"):     # small-hf/ names the folder small-hf
        args.hf = args.hf.rstrip("/")
    if args.gguf and args.gguf.endswith("/"):
        raise ne.NanoEulerError(f"--gguf {args.gguf} ends in /, a folder's name; give a file name such as "
                                "small.gguf")
    if args.gguf is None and args.outtype != "f32":
        raise ne.NanoEulerError(f"--outtype {args.outtype} is the number format of --gguf's file, and no --gguf is "
                                "given (--hf is always float32); add --gguf FILE, or drop --outtype")
    for flag, path in (("--hf", args.hf), ("--gguf", args.gguf)):
        if path == "":
            raise ne.NanoEulerError(f"{flag} is empty; give a new {'folder' if flag == '--hf' else 'file'} name")
        if path is not None:
            refuse_existing(path, flag)
    if args.hf is not None and args.gguf is not None and os.path.abspath(args.hf) == os.path.abspath(args.gguf):
        raise ne.NanoEulerError(f"--hf and --gguf are both {args.gguf}; give each its own name (the Hugging "
                                "Face folder would be written and the GGUF file then refused)")
    cfg, flat, tok = ne.load_model(args.model)
    token_strings(tok, f"{args.model}'s tokenizer")    # refuse an unfaithful vocabulary before writing
    params = ne.carve(flat, cfg)
    if cfg.K > 1:
        print(f"note: the model's {cfg.K - 1} extra heads (multi-token prediction, used by --speculative) have "
              "no place in a Llama model and are left out; the export predicts as head 0 does")
    if args.hf is not None:
        export_to(args.hf, "--hf", lambda tmp: write_hf(tmp, cfg, params, tok))
        print(f"wrote {args.hf} (LlamaForCausalLM, float32, {ne.num_params(cfg) - (cfg.K - 1) * cfg.V * cfg.C:,} "
              "parameters)")
    if args.gguf is not None:
        name = os.path.splitext(os.path.basename(args.model))[0]
        kept = export_to(args.gguf, "--gguf", lambda tmp: write_gguf(tmp, cfg, params, tok, args.outtype, name))
        if kept:
            rows = " or ".join(str(n) for n in sorted({n for _, n in kept}))
            print(f"note: {len(kept)} of the matrices ({kept[0][0]}, ...) have rows of {rows} numbers, not a "
                  "multiple of Q8_0's blocks of 32; they are stored as f16")
        print(f"wrote {args.gguf} (llama, {args.outtype})")


def build_parser():
    p = ne.ArgumentParser(prog="tools/export.py", description="export a NanoEuler model to a Hugging Face "
                          "Llama folder and/or a GGUF file (docs/export.md)")
    p.add_argument("--model", required=True, metavar="FILE", help="the .safetensors model to export")
    p.add_argument("--hf", default=None, metavar="FOLDER", help="a new folder for the Hugging Face files "
                   "(transformers)")
    p.add_argument("--gguf", default=None, metavar="FILE", help="a new .gguf file (llama.cpp)")
    p.add_argument("--outtype", default="f32", choices=OUTTYPES,
                   help="--gguf's number format for the matrices (norms stay f32); --hf is always float32")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hf is None and args.gguf is None:
        parser.error("give --hf FOLDER, --gguf FILE, or both")
    ne.run_command(cmd_export, args)


if __name__ == "__main__":
    main()
