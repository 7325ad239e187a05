"""
The documents' links and shape: every relative link and every backticked path in
README.md, BENCHMARKS.md, docs/*.md and dev/*.md names a file of the repository
(so a moved log or script cannot leave a figure without its source), docs/ holds
only the pages, BENCHMARKS stays a page of current figures, and the number of
instructions the pages say sft trains on is the one sft prints.

    python -m pytest -q test_docs.py
"""

import glob
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PAGES = ["README.md", "BENCHMARKS.md"] + sorted(glob.glob("docs/*.md", root_dir=HERE)) + \
    sorted(glob.glob("dev/*.md", root_dir=HERE))


def read(page):
    with open(os.path.join(HERE, page), encoding="utf-8") as f:
        return f.read()


def missing_targets(page, text):
    """the links ([text](target), relative to the page) and backticked paths (`dev/...`, relative to the
    repository) in text that name nothing in the repository"""
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:|#", target):                  # a web address or an anchor in the page
            continue
        path = os.path.normpath(os.path.join(HERE, os.path.dirname(page), target.split("#")[0]))
        if not os.path.exists(path):
            missing.append(target)
    for path in re.findall(r"`((?:dev|docs|tools)/[^`\s]*)", text):
        path = path.rstrip(".,;:)")
        if page.startswith("dev/") and path.startswith("docs/"):
            continue                                        # the layout before dev/, as dev/LOG.md explains
        if not glob.glob(os.path.join(HERE, path)):
            missing.append(path)
    return missing


def test_every_link_and_path_in_the_documents_names_a_file_of_the_repository():
    assert "dev/LOG.md" in PAGES and "docs/SPEC.md" in PAGES
    broken = {page: missing for page in PAGES if (missing := missing_targets(page, read(page)))}
    assert not broken, f"links or paths to nothing: {broken}"


def test_a_link_to_a_moved_file_is_caught():
    text = "see [the log](dev/logs/h200_final/summary.log), `dev/logs/h200_final/` and `dev/gpu/final.sh`"
    assert missing_targets("BENCHMARKS.md", text) == []
    moved = text.replace("h200_final/summary", "logs_h200_final/summary").replace("gpu/final", "gpu_final")
    assert missing_targets("BENCHMARKS.md", moved) == ["dev/logs/logs_h200_final/summary.log", "dev/gpu_final.sh"]
    # a page links relative to its own folder: from docs/, the same link needs ../
    assert missing_targets("docs/READING.md", "[SPEC](SPEC.md), [numbers](../BENCHMARKS.md)") == []
    assert missing_targets("docs/READING.md", "[numbers](BENCHMARKS.md)") == ["BENCHMARKS.md"]


def test_docs_holds_only_pages_and_benchmarks_only_current_figures():
    # scripts, logs, diffs and archives live under dev/; a page may carry its images
    others = [name for name in os.listdir(os.path.join(HERE, "docs"))
              if not name.endswith((".md", ".png", ".svg", ".jpg"))]
    assert others == [], f"docs/ should hold pages only; move {others} to dev/"
    assert len(read("BENCHMARKS.md").splitlines()) <= 300     # the dated chapters go to dev/LOG.md


def test_the_pages_name_as_many_sft_instructions_as_sft_prints(tmp_path):
    # the README's quick start and docs/chat.md say how many instructions the flow's sft trains on;
    # sft prints it ('data | ...: N train + M val examples'), and it moves when sft's rule for leaving
    # an example out does (2026-12-04: 1,853 became 1,852). A random model with the tokenizer that
    # train makes from tinyshakespeare (vocabulary 512) has the flow's context, so sft keeps the same
    import nanoeuler as ne
    cfg = ne.PRESETS["small"]
    text = ne.tokenizer_sample(ne.corpus_files(os.path.join(HERE, "data", "tinyshakespeare.txt")))
    model = str(tmp_path / "m.safetensors")
    ne.save_model(model, cfg, ne.init_params(cfg), ne.Tokenizer.train(text, cfg.V, progress=False))
    r = subprocess.run([sys.executable, os.path.join(HERE, "nanoeuler.py"), "sft", "--model", model, "--steps", "1",
                        "--out", str(tmp_path / "sft")], capture_output=True, text=True, timeout=300, cwd=HERE)
    assert r.returncode == 0, r.stderr
    n = re.search(r"^data +\| .*: ([\d,]+) train \+", r.stdout, re.M).group(1)
    assert f"600 steps on {n} instructions" in read("README.md")
    assert f"read Shakespeare and {n} short answers" in " ".join(read("docs/chat.md").split())   # across a line end
