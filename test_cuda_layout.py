"""
The order of nanoeuler_cuda.py's sections (issue 30): the story first (the device and
its kernels, the model on the GPU, training, decoding, SFT and chat, the command
line), then what a first reading may skip (check, the benchmark, several GPUs, several
hosts), and the __main__ block last. Reads the file; imports nothing from it.

    python -m pytest -q test_cuda_layout.py
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
RULE = "# " + "-" * 77

STORY = ["compiling the kernels", "CUDA plumbing", "kernel launchers", "matmuls (cuBLAS)", "the model on the GPU",
         "training", "decoding", "supervised fine-tuning and chat", "command line"]
AFTER = ["check", "benchmark", "several GPUs", "several hosts"]


def sections(lines):
    """the titles of the sections (the line after each rule), in file order"""
    return [lines[i + 1][2:] for i, line in enumerate(lines[:-1]) if line == RULE and lines[i + 1].startswith("# ")]


def test_the_story_comes_first_then_check_bench_and_several_gpus():
    with open(os.path.join(HERE, "nanoeuler_cuda.py")) as f:
        lines = f.read().splitlines()
    titles = sections(lines)
    assert len(titles) == len(STORY + AFTER), titles
    for title, start in zip(titles, STORY + AFTER):
        assert title == start or title.startswith((start + " ", start + ":")), (title, start)
    assert lines.index('if __name__ == "__main__":') > lines.index("# " + titles[-1])


def test_sections_reads_titles_in_order():
    text = ["x = 1", RULE, "# b: two", "", RULE, "# a", "#", "def f(): pass"]
    assert sections(text) == ["b: two", "a"]
