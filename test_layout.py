"""
The shape of nanoeuler.py (issue 30), as a ratchet: each number may only get
better; and the README stays a front door (at most 150 lines, the CPU quick
start in its first 40). tools/layout.py measures them; when a change makes one
better, lower its limit here to the new figure (never raise one; except that guard code
moved from the story into operations may raise the operations and file limits by
what the move adds there, said in its commit).

    python -m pytest -q test_layout.py

Where the limits are going (issue 30): the story at most 1,750 lines, the
operations part 900, the file 2,650; the story calling into operations through
at most 12 names; `train --steps 1` entering at most 25 functions on its way to
the first model_forward.
"""

import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "tools"))
import layout  # noqa: E402

# The limits are today's figures (python tools/layout.py on main, 2026-12-06 evening). How each moved,
# step by step and why, is in `git log -p test_layout.py`: the first figures (2026-12-04 morning) were story
# 2,413, file 3,493, 31 names, 80 functions, comment share 0.280. The story's limit is the (1,750);
# the others are above the issue's targets because every guarantee stays (issue 30's closing notes say why):
STORY_LINES = 1651                    # issue 30: 1,750; moves of guards and the run's log out; chat's 1 MB line +2
FILE_LINES = 3474                     # issue 30: 2,650; Workers +96 (+11: map's timed waits); --minutes +17; saves +13
STORY_NAMES_FROM_OPERATIONS = 12      # issue 30: 12
OPERATIONS_LINES = 1586               # issue 30: 900; the story's moves out of it, Workers.map's timed waits (+11)
FUNCTIONS_TO_MODEL_FORWARD = 52       # issue 30: 25; what is left on train's path is real steps (parser, run
                                      # folder, config and memory, data, model, workers, loop, step; Workers.map)
COMMENT_SHARE = 0.340                 # lines holding a comment or docstring; explanations are not cut to fit
LINES_OVER_120 = 0

# the model's mathematics, which belongs to the story and never to operations
MATH = ["model_forward", "model_backward", "block_forward", "attention_forward", "adamw_update",
        "cross_entropy_forward", "rmsnorm_forward", "init_params", "generate", "class Tokenizer"]


@pytest.fixture(scope="module")
def shape():
    return layout.measure(trace=False)


def test_the_story_and_the_file_stay_within_their_lines(shape):
    assert shape["story_lines"] <= STORY_LINES, shape["story_lines"]
    assert shape["file_lines"] <= FILE_LINES, shape["file_lines"]
    assert shape["operations_lines"] <= OPERATIONS_LINES, shape["operations_lines"]
    assert shape["lines_over_120"] <= LINES_OVER_120, shape["lines_over_120"]


def test_comments_are_not_cut_to_meet_the_budget(shape):
    assert shape["comment_share"] >= COMMENT_SHARE, shape["comment_share"]


def test_the_story_calls_into_operations_through_few_names(shape):
    assert shape["story_uses_from_operations"] <= STORY_NAMES_FROM_OPERATIONS, shape["story_names_from_operations"]


def test_the_operations_part_opens_with_its_guarantees_and_holds_no_model_mathematics():
    with open(os.path.join(HERE, "nanoeuler.py"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    story_end, ops_start = layout.parts(lines)
    opening = "\n".join(lines[ops_start:ops_start + 40])
    assert "guarantees" in opening
    ops = "\n".join(lines[ops_start:])
    for name in MATH:
        assert not re.search(rf"^{'' if name.startswith('class') else 'def '}{name}\b", ops, re.M), name
    story = "\n".join(lines[:story_end])
    for name in MATH:                                   # and each is in the story
        assert re.search(rf"^{'' if name.startswith('class') else 'def '}{name}\b", story, re.M), name


def test_the_part_finder_follows_the_headers():
    lines = ["x = 1", "# " + "-" * 20, "# benchmark", "b = 2", "# " + "=" * 20, "# operations", "o = 3"]
    assert layout.parts(lines) == (1, 4)
    assert layout.parts(lines[3:]) == (1, 1)            # no benchmark section: the story runs to the banner


def test_names_read_are_module_names_only():
    import ast
    tree = ast.parse("def f(a):\n    b = 1\n    return a + b + c\n\nc = 2\ng = lambda d: d + e\n")
    assert {n for n, _ in layout.global_reads(tree)} == {"c", "e"}
    assert layout.used_before_defined(tree, 99) == {"c": (3, 5)}


def test_train_reaches_model_forward_through_few_functions():
    got = layout.trace_functions()
    names = [name for name, _ in got]
    assert names[0] == "main" and names[-1] == "model_forward", names
    assert len(got) <= FUNCTIONS_TO_MODEL_FORWARD, names


def test_the_readme_is_a_front_door_with_the_cpu_quick_start_first(shape):
    assert shape["readme_lines"] <= 150, shape["readme_lines"]
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        first = "".join(f.readlines()[:40])
    for command in ("train", "sample", "sft", "chat"):     # the CPU flow, in the first screen or two
        assert f"python nanoeuler.py {command}" in first, command
