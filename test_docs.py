"""
The documents' links and shape: every relative link and every backticked path in
README.md, BENCHMARKS.md, docs/*.md and dev/*.md names a file of the repository
(so a moved log or script cannot leave a figure without its source), docs/ holds
only the pages, and BENCHMARKS stays a page of current figures.

    python -m pytest -q test_docs.py
"""

import glob
import os
import re

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
