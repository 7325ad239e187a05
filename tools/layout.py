"""
The shape of nanoeuler.py and the front door, in the numbers issue 30 asks for:

    python tools/layout.py              # the numbers
    python tools/layout.py --verbose    # and the names and functions behind them
    python tools/layout.py --json       # the numbers as JSON (test_layout.py reads them)
    python tools/layout.py --no-trace   # leave out the one count that runs `train`

The parts of nanoeuler.py are found by their section headers: the story runs from
line 1 to the line before the "# benchmark" section, the benchmark (and the loss
plot after it) from there to the "# ====" banner whose next line is "# operations",
and the operations part from that banner (with the guarantees it opens with) to the
end of the file.

- comment share: lines holding a comment or a docstring, over the lines that are
  not blank
- names the story uses from operations: names defined at the top level of the
  operations part that code in the story reads (the benchmark is counted apart)
- functions to the first model_forward: distinct nanoeuler.py functions (lambdas
  included, comprehensions and generator expressions not) entered from main()
  up to and including the first model_forward, for `train --steps 1`, counted
  with sys.setprofile (and threading.setprofile: the training step runs its forward
  on a pool thread) in a child process after a first run has filled the token
  cache (cache warm); main() and model_forward are both counted
"""

import argparse
import ast
import io
import json
import os
import subprocess
import sys
import tempfile
import tokenize

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(HERE, "nanoeuler.py")

# run in the child: profile main() for `train --steps 1 --out RUN` until the first model_forward
TRACE = r"""
import json, os, sys, threading
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import nanoeuler
nanoeuler.PROCESSES_ABOVE = 10 ** 9          # the step on threads: a profile does not follow a forked worker
target = os.path.abspath(nanoeuler.__file__)
seen, done = {}, []

def profile(frame, event, arg):
    if done or event != "call":
        return
    code = frame.f_code
    if os.path.abspath(code.co_filename) != target:
        return
    if code.co_name.startswith("<") and code.co_name != "<lambda>":
        return
    seen.setdefault((code.co_name, code.co_firstlineno), len(seen))
    if code.co_name == "model_forward":
        done.append(True)

sys.setprofile(profile)
threading.setprofile(profile)                # the training step's forward runs on a pool thread
try:
    nanoeuler.main(["train", "--steps", "1", "--out", sys.argv[2]])
except SystemExit:
    pass
finally:
    sys.setprofile(None)
    threading.setprofile(None)
with open(sys.argv[3], "w") as f:
    json.dump({"reached": bool(done), "functions": sorted(seen, key=seen.get)}, f)
"""


def parts(lines):
    """-> (story_end, ops_start) as 0-based line indexes: story is lines[:story_end],
    the benchmark lines[story_end:ops_start], operations lines[ops_start:]"""
    ops_start = next(i for i in range(len(lines) - 1)
                     if lines[i].startswith("# ====") and lines[i + 1].strip() == "# operations")
    story_end = next((i for i in range(ops_start - 1)
                      if lines[i].startswith("# ----") and lines[i + 1].strip() == "# benchmark"), ops_start)
    return story_end, ops_start


def commented_lines(text):
    """the 1-based numbers of lines that hold a comment or are part of a docstring"""
    marked = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            marked.add(tok.start[0])
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                marked.update(range(first.lineno, first.end_lineno + 1))
    return marked


def top_level_names(tree, lo, hi):
    """names bound at the module's top level by statements starting on lines lo..hi (1-based)"""
    names = set()
    for node in tree.body:
        if not lo <= node.lineno <= hi:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def local_names(fn):
    """names a function binds itself: its arguments and what it assigns (not inner functions' locals)"""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x}
    stack = list(fn.body) if not isinstance(fn, ast.Lambda) else [fn.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((x.asname or x.name).split(".")[0] for x in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        stack.extend(ast.iter_child_nodes(node))
    return names


def global_reads(tree):
    """(name, line) for every read of a name that no enclosing function binds: a module-level name"""
    reads = []

    def visit(node, bound):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(node, "decorator_list", []) + node.args.defaults + node.args.kw_defaults:
                if d is not None:
                    visit(d, bound)
            inner = bound | local_names(node)
            for child in (node.body if isinstance(node.body, list) else [node.body]):
                visit(child, inner)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
            reads.append((node.id, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, bound)
    visit(tree, frozenset())
    return reads


def names_read(tree, lo, hi):
    """module-level names read by code on lines lo..hi (1-based)"""
    return {name for name, line in global_reads(tree) if lo <= line <= hi}


def used_before_defined(tree, story_end):
    """story names read, at the top level or inside a function, on a line above the
    top-level statement that defines them (Python looks a name up when the code runs,
    so this works; a reader meets the name before its meaning)"""
    defined_at = {}
    for node in tree.body:
        for name in top_level_names(ast.Module(body=[node], type_ignores=[]), node.lineno, node.lineno):
            defined_at.setdefault(name, node.lineno)
    early = {}
    for name, line in global_reads(tree):
        at = defined_at.get(name)
        if line <= story_end and at is not None and at > line:
            early.setdefault(name, (line, at))
    return early


def trace_functions():
    """-> the list of (name, first line) entered from main() to the first model_forward"""
    with tempfile.TemporaryDirectory() as tmp:
        run, result = os.path.join(tmp, "runs", "warm"), os.path.join(tmp, "trace.json")
        env = dict(os.environ, PYTHONHASHSEED="0")
        # the token cache is runs/cache, shared by runs beside each other: fill it first
        subprocess.run([sys.executable, SCRIPT, "train", "--steps", "1", "--out", run], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=600)
        subprocess.run([sys.executable, "-c", TRACE, SCRIPT, os.path.join(tmp, "runs", "traced"), result],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=600)
        with open(result) as f:
            got = json.load(f)
    if not got["reached"]:
        raise SystemExit("layout: train --steps 1 never reached model_forward")
    return [tuple(x) for x in got["functions"]]


def measure(trace=True):
    with open(SCRIPT, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    tree = ast.parse(text)
    story_end, ops_start = parts(lines)
    commented = commented_lines(text)

    def share(lo, hi):                                  # 0-based [lo, hi)
        nonblank = [i + 1 for i in range(lo, hi) if lines[i].strip()]
        return round(sum(i in commented for i in nonblank) / max(len(nonblank), 1), 4)

    ops_names = top_level_names(tree, ops_start + 1, len(lines))
    story_uses = sorted(ops_names & names_read(tree, 1, story_end))
    bench_uses = sorted(ops_names & names_read(tree, story_end + 1, ops_start))
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        readme = f.read().splitlines()
    docs = [os.path.join(d, name) for d, _, names in os.walk(os.path.join(HERE, "docs")) for name in names]
    out = {
        "file_lines": len(lines),
        "story_lines": story_end,
        "bench_lines": ops_start - story_end,
        "operations_lines": len(lines) - ops_start,
        "lines_over_120": sum(len(line) > 120 for line in lines),
        "comment_share": share(0, len(lines)),
        "story_comment_share": share(0, story_end),
        "operations_comment_share": share(ops_start, len(lines)),
        "story_uses_from_operations": len(story_uses),
        "story_names_from_operations": story_uses,
        "bench_names_from_operations": bench_uses,
        "story_names_used_before_defined": {k: list(v) for k, v in
                                            sorted(used_before_defined(tree, story_end).items())},
        "readme_lines": len(readme),
        "docs_files": len(docs),
    }
    if trace:
        functions = trace_functions()
        out["functions_to_model_forward"] = len(functions)
        out["functions_to_model_forward_list"] = [f"{name}:{line}" for name, line in functions]
        out["operations_functions_to_model_forward"] = sum(line > ops_start for _, line in functions)
    return out


def main():
    p = argparse.ArgumentParser(description="the shape of nanoeuler.py and the README, in numbers")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.add_argument("--verbose", action="store_true", help="also list the names and functions counted")
    p.add_argument("--no-trace", action="store_true", help="skip running train --steps 1 (the function count)")
    args = p.parse_args()
    got = measure(trace=not args.no_trace)
    if args.json:
        print(json.dumps(got, indent=1))
        return
    rows = [("nanoeuler.py lines", got["file_lines"]),
            ("  story (line 1 to the benchmark)", got["story_lines"]),
            ("  benchmark and loss plot", got["bench_lines"]),
            ("  operations (its banner to the end)", got["operations_lines"]),
            ("lines over 120 columns", got["lines_over_120"]),
            ("comment share (whole file / story / operations)",
             f"{got['comment_share']:.1%} / {got['story_comment_share']:.1%} / {got['operations_comment_share']:.1%}"),
            ("operations names the story uses", got["story_uses_from_operations"]),
            ("story names used above their definition", len(got["story_names_used_before_defined"]))]
    if "functions_to_model_forward" in got:
        rows.append(("functions from main() to the first model_forward (train --steps 1)",
                     f"{got['functions_to_model_forward']} ({got['operations_functions_to_model_forward']} "
                     "of them in operations)"))
    rows += [("README.md lines", got["readme_lines"]), ("docs/ files", got["docs_files"])]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.verbose:
        print("\noperations names the story uses:", ", ".join(got["story_names_from_operations"]))
        print("operations names the benchmark uses:", ", ".join(got["bench_names_from_operations"]))
        print("story names used above their definition (name: first use, definition):")
        for name, (use, at) in got["story_names_used_before_defined"].items():
            print(f"  {name}: line {use}, defined at {at}")
        if "functions_to_model_forward_list" in got:
            print("functions from main() to the first model_forward, in the order entered:")
            print("  " + ", ".join(got["functions_to_model_forward_list"]))


if __name__ == "__main__":
    main()
