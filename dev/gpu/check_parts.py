"""
One part of `python nanoeuler_cuda.py check`, on its own, for a device script's
fallback: when check fails or raises, each part runs in a process of its own (a
kernel that faults leaves its CUDA context unusable), so that one part's error
hides no other, and the summary says which part broke. NAME=VALUE arguments set
nanoeuler_cuda's switches first, to see whether a fallback mends the part:
BF16_ACTIVATIONS=False, GRAPH_STEP=False, DECODE_ATTENTION="'single'",
DECODE_PDL=False, PRODUCT_TMA=False, PRODUCT_TMA_BACKWARD=False. Not part of NanoEuler.

    python dev/gpu/check_parts.py --list
    python dev/gpu/check_parts.py --failed check.log     # the parts to run again, from check's output
    python dev/gpu/check_parts.py "model bf16" [NAME=VALUE ...]
"""

import ast
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import nanoeuler_cuda as nc  # noqa: E402


def parts(rng, reporter):
    """{part: run()}, in cmd_check's order, with its bars"""
    fp32 = lambda: reporter(nc.TOLERANCE["fp32"])

    def attention(precision):
        nc.init_gpu(precision)
        nc.check_attention(rng, reporter(nc.TOLERANCE[precision]))

    table = {"kernels fp32": lambda: nc.check_kernels(rng, fp32(), is_bf16=False),
             "kernels bf16": lambda: nc.check_kernels(rng, reporter(nc.KERNEL_BF16_TOLERANCE), is_bf16=True),
             "products": lambda: nc.check_products(rng, reporter(nc.KERNEL_BF16_TOLERANCE)),
             "optimizer": lambda: nc.check_optimizer(rng, fp32())}
    for precision in ("fp32", "tf32", "bf16"):
        table[f"attention {precision}"] = lambda p=precision: attention(p)
        table[f"model {precision}"] = lambda p=precision: nc.check_model(rng, reporter, p)
    for precision in ("fp32", "bf16"):
        table[f"step {precision}"] = lambda p=precision: nc.check_step(rng, fp32(), p)
        table[f"sft {precision}"] = lambda p=precision: nc.check_sft(rng, reporter, p)
        table[f"decoding {precision}"] = lambda p=precision: nc.check_decoding(rng, reporter(nc.DECODE_TOLERANCE[p]),
                                                                               p)
    return table


def part_of(what):
    """the part that printed check line `what`"""
    words = what.split()
    if words[0] in ("attention", "model", "sft", "step"):
        return f"{words[0]} {words[1].rstrip(':')}"
    if words[0] == "product":
        return "products"
    if words[0] == "decode":
        return f"decoding {words[1]}"
    if words[0] in ("to_bf16", "grad_norm", "adamw,", "clip_grad_norm"):
        return "optimizer"
    return "kernels bf16" if "(bf16)" in what else "kernels fp32"


def failed_parts(log, names):
    """the parts whose lines in check's output `log` are NOT OK, or every part if check did
    not finish (it raised: what came after is unchecked)"""
    lines = open(log, errors="replace").read().splitlines()
    if not any(line.startswith("overall okay") for line in lines):
        return list(names)
    bad = {part_of(line) for line in lines if line.endswith("NOT OK")}
    return [name for name in names if name in bad]


def main():
    failed = []

    def reporter(tol):
        def report(what, err):
            ok = err < tol
            failed.extend([] if ok else [what])
            print(f"{what:<48} {err:9.1e}  {tol:.0e}  {'OK' if ok else 'NOT OK'}", flush=True)
        return report

    table = parts(np.random.default_rng(1337), reporter)
    if sys.argv[1:] == ["--list"]:
        print("\n".join(table))
        return
    if sys.argv[1] == "--failed":
        print("\n".join(failed_parts(sys.argv[2], table)))
        return
    part, switches = sys.argv[1], sys.argv[2:]
    for switch in switches:
        name, value = switch.split("=", 1)
        assert hasattr(nc, name), f"nanoeuler_cuda has no switch {name}"
        setattr(nc, name, ast.literal_eval(value))
    label = f"PART {part}" + (f" [{' '.join(switches)}]" if switches else "")
    try:
        nc.init_gpu("fp32")
        table[part]()
    except Exception as e:                                # what broke, in one line, then on to the next part
        print(f"{label}: RAISED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        sys.exit(2)
    print(f"{label}: " + (f"NOT OK ({len(failed)}: {', '.join(failed[:4])})" if failed else "OK"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
