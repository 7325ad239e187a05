"""
NanoEuler's CPU training step against PyTorch eager's, side by side, over thread
counts: the measurement of BENCHMARKS.md's "CPU: more cores" table. Not part of
NanoEuler (nothing imports it); the PyTorch side needs PyTorch (CPU build is enough).

    python tools/cpu_scaling.py                          # threads 1,2,4,8,16 at batch 8 and 32, 2 rounds
    taskset -c 0,1 python tools/cpu_scaling.py           # the same, pinned to 2 cores
    python tools/cpu_scaling.py --threads 1,2 --batches 8 --rounds 3 --steps 10
    python tools/cpu_scaling.py --no-torch               # NanoEuler's side only

Every figure is one fresh process: NanoEuler's is `bench_train(PRESETS['small'], B,
threads, steps)`, what `train --batch B --threads N` runs a step with (the median
after 2 warm-up steps); PyTorch's is `tools/pytorch_reference.py --model small
--device cpu --precision fp32 --batch B --threads N` (eager, fp32, the median after
5 warm-up steps). The two alternate, and which goes first swaps every round, so a
machine whose speed drifts (a shared VM) drifts under both alike. The ratio is
NanoEuler's speed over PyTorch's (PyTorch's ms / NanoEuler's ms): above 1, NanoEuler
is faster. The last lines say whether NanoEuler's step got slower anywhere as the
threads went up (by more than --slack, the noise of one machine).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def int_list(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return values


def run(cmd, timeout, env=None):
    """stdout of cmd; on a failure, its last stderr line (and None as stdout)"""
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    if p.returncode:
        return None, (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    return p.stdout, ""


def nanoeuler_ms(B, threads, steps, timeout, min_rows=None, blas=None, variant=""):
    """NanoEuler's ms a step, and its engine line; min_rows replaces nanoeuler.MIN_ROWS and blas
    sets OPENBLAS_NUM_THREADS (nanoeuler.py keeps one a caller otherwise), the variants measured;
    variant: 'NAME=VALUE ..', each a nanoeuler setting (MIN_ROWS=2, PROCESSES_ABOVE=64) or,
    for OPENBLAS_NUM_THREADS, the environment's"""
    settings = dict(token.split("=", 1) for token in variant.split())
    blas = settings.pop("OPENBLAS_NUM_THREADS", blas)
    code = ("import nanoeuler as ne\n"
            + (f"ne.MIN_ROWS = {min_rows}\n" if min_rows else "")
            + "".join(f"ne.{name} = {value}\n" for name, value in settings.items())
            + f"ne.check_config(ne.PRESETS['small'], batch={B}, threads={threads})\n"
            + f"args = ne.build_parser().parse_args(['train', '--batch', '{B}', '--threads', '{threads}'])\n"
            + "flat = ne.init_params(ne.PRESETS['small'])\n"
            + "engine = ne.CPUEngine(ne.PRESETS['small'], flat, flat * 0, flat * 0, args)\n"
            + "print(engine.line)\nengine.close()\ndel engine, flat\n"
            + f"print(1e3 * ne.bench_train(ne.PRESETS['small'], {B}, {threads}, steps={steps}))")
    env = dict(os.environ, **({"OPENBLAS_NUM_THREADS": str(blas)} if blas else {}))
    out, err = run([sys.executable, "-c", code], timeout, env)
    if out is None:
        return None, err
    lines = out.strip().splitlines()
    return float(lines[-1]), lines[0]


def torch_ms(B, threads, steps, timeout):
    out, err = run([sys.executable, "tools/pytorch_reference.py", "--model", "small", "--device", "cpu",
                    "--precision", "fp32", "--batch", str(B), "--threads", str(threads), "--steps", str(steps)],
                   timeout)
    if out is None:
        return None, err
    m = re.search(r"([0-9.]+) ms/step", out)
    return (float(m.group(1)), out.strip()) if m else (None, f"no ms/step in {out.strip()!r}")


def has_torch():
    out, err = run([sys.executable, "-c", "import torch; print(torch.__version__)"], 120)
    return out.strip() if out else None


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def span(values):
    good = [v for v in values if v is not None]
    if not good:
        return "failed"
    return f"{min(good):.1f}" if len(good) == 1 else f"{min(good):.1f}-{max(good):.1f}"


def slower_steps(ours, batches, threads, slack):
    """where NanoEuler's median step with more threads is slower than the best with fewer by more
    than slack: ours maps (batch, threads) to ms figures (None: failed)"""
    slower = []
    for B in batches:
        best = None
        for n in threads:
            good = [v for v in ours.get((B, n), []) if v is not None]
            if not good:
                continue
            med = statistics.median(good)
            if best is not None and med > best[1] * (1 + slack):
                slower.append(f"B={B}: {n} threads {med:.1f} ms, {best[0]} threads {best[1]:.1f} ms")
            if best is None or med < best[1]:
                best = (n, med)
    return slower


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int_list, default=[1, 2, 4, 8, 16], help="thread counts (default 1,2,4,8,16)")
    p.add_argument("--batches", type=int_list, default=[8, 32], help="batch sizes (default 8,32)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over every (batch, threads) (default 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps a figure (default 10)")
    p.add_argument("--slack", type=float, default=0.10,
                   help="how much slower a step may get with more threads before it counts (default 0.10)")
    p.add_argument("--no-torch", action="store_true", help="NanoEuler's side only")
    p.add_argument("--min-rows", type=int_list, default=[],
                   help="NanoEuler variants, in the rounds: nanoeuler.MIN_ROWS set to each of these")
    p.add_argument("--blas", type=int_list, default=[],
                   help="NanoEuler variants, in the rounds: OPENBLAS_NUM_THREADS set to each of these")
    p.add_argument("--variant", action="append", default=[],
                   help="a NanoEuler variant, in the rounds: nanoeuler settings as 'MIN_ROWS=2 PROCESSES_ABOVE=64' "
                        "(OPENBLAS_NUM_THREADS=N sets the environment's); may be given again")
    p.add_argument("--timeout", type=int, default=300, help="seconds one figure may take (default 300)")
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")

    import numpy as np
    torch_version = None if args.no_torch else has_torch()
    print(f"{cores()} cores this process may run on (os.cpu_count(): {os.cpu_count()}), "
          f"Python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"PyTorch {torch_version or ('not run (--no-torch)' if args.no_torch else 'not importable: NanoEuler only')}")
    print(f"small model, fp32, T=128; {args.rounds} rounds, {args.steps} timed steps a figure, "
          f"the sides alternated\n", flush=True)
    ours, theirs, variants = {}, {}, {}
    sides = ["nanoeuler"] + (["torch"] if torch_version else [])
    sides += [("min_rows", v) for v in args.min_rows] + [("blas", v) for v in args.blas]
    sides += [("variant", v) for v in args.variant]
    t_start = time.time()
    for r in range(args.rounds):
        for B in args.batches:
            for i, n in enumerate(args.threads):
                k = (r + i) % len(sides)                    # which goes first turns round by round
                for side in sides[k:] + sides[:k]:
                    if side == "nanoeuler":
                        (ms, note), got, label = nanoeuler_ms(B, n, args.steps, args.timeout), ours, side
                    elif side == "torch":
                        (ms, note), got, label = torch_ms(B, n, args.steps, args.timeout), theirs, side
                    else:
                        ms, note = nanoeuler_ms(B, n, args.steps, args.timeout, **{side[0]: side[1]})
                        got, label = variants, side[1] if side[0] == "variant" else f"{side[0]}={side[1]}"
                    got.setdefault((label, B, n) if got is variants else (B, n), []).append(ms)
                    shown = f"{ms:8.1f} ms" if ms is not None else "  failed"
                    print(f"round {r + 1}  B={B:<3d} threads={n:<3d} {label:<11s} {shown}   {note}", flush=True)
    print(f"\n({time.time() - t_start:.0f} s)\n")

    print("| batch | threads | NanoEuler ms | PyTorch eager ms | NanoEuler / PyTorch speed |")
    print("|---:|---:|---:|---:|---:|")
    for B in args.batches:
        for n in args.threads:
            a, b = ours.get((B, n), []), theirs.get((B, n), [])
            ratios = [y / x for x, y in zip(a, b) if x and y]        # same round: measured side by side
            ratio = (f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}-{max(ratios):.2f}x"
                     if ratios else "")
            print(f"| {B} | {n} | {span(a)} | {span(b) if b else 'not run'} | {ratio} |")
    if variants:
        print("\n| NanoEuler variant | batch | threads | ms |\n|---|---:|---:|---:|")
        for (label, B, n), ms in variants.items():
            print(f"| {label} | {B} | {n} | {span(ms)} |")

    print()
    slower = slower_steps(ours, args.batches, args.threads, args.slack)
    if slower:
        print(f"more threads slower (by more than {args.slack:.0%}): " + "; ".join(slower))
    else:
        print(f"more threads never slower (within {args.slack:.0%}): yes")


if __name__ == "__main__":
    main()
