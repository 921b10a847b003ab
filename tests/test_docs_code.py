"""Every Python block of the README and the guide (docs/) runs as written.

A complete block runs in a new process from an empty folder, and TensorFlow
warns of nothing there (the process is forked from one that has imported
TensorFlow, tests/forkserver.py; a block that sets up Keras 2 runs in the
interpreter itself). A block that cannot run alone (it needs a Slurm
cluster, say) is a fragment and says so on its first line,
`# A fragment of examples/NAME.py ...`: the example it names exists and a test
runs it, the block is valid Python, and every `tf_topk.` name it uses exists.
"""

import importlib
import re
import subprocess
from pathlib import Path

import pytest

from multiworker import PYTHON, REPO_ROOT, subprocess_env
from tensorflow_warnings import tensorflow_warnings

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "examples" / "README.md"]
FRAGMENT = re.compile(r"^# A fragment of (examples/\w+\.py)\b")


def python_blocks(page):
    """(first line number, code) of each ```python block of `page`."""
    lines, blocks, start = page.read_text().splitlines(), [], None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = number
        elif start is not None and line.strip() == "```":
            blocks.append((start + 1, "\n".join(lines[start:number - 1]) + "\n"))
            start = None
    return blocks


BLOCKS = [(f"{page.relative_to(REPO_ROOT)}:{line}", code) for page in PAGES for line, code in python_blocks(page)]
COMPLETE = [(where, code) for where, code in BLOCKS if not FRAGMENT.match(code)]
FRAGMENTS = [(where, code) for where, code in BLOCKS if FRAGMENT.match(code)]


def test_the_guide_shows_code_and_most_of_it_runs():
    assert len(BLOCKS) >= 15 and len(FRAGMENTS) <= 2, [where for where, _ in FRAGMENTS]
    assert any(where.startswith("README.md") for where, _ in COMPLETE)
    assert any(where.startswith("docs/custom_loops.md") for where, _ in COMPLETE)


@pytest.mark.slow
@pytest.mark.parametrize("where,code", COMPLETE, ids=[where for where, _ in COMPLETE])
def test_a_complete_block_runs_as_written(where, code, tmp_path):
    env = subprocess_env()
    env.pop("TF_USE_LEGACY_KERAS", None)
    # subprocess.run kills the block's process if it runs past the timeout.
    proc = subprocess.run([*PYTHON, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{where}\n{code}\n--- stderr\n{proc.stderr[-4000:]}"
    assert tensorflow_warnings(proc.stdout + proc.stderr) == [], where


@pytest.mark.parametrize("where,code", FRAGMENTS, ids=[where for where, _ in FRAGMENTS])
def test_a_fragment_names_a_tested_example_and_existing_names(where, code):
    example = FRAGMENT.match(code).group(1)
    assert (REPO_ROOT / example).is_file(), f"{where}: {example} does not exist"
    runners = [t.name for t in (REPO_ROOT / "tests").glob("test_*.py") if Path(example).name in t.read_text()]
    assert runners, f"{where}: no test runs {example}"
    compile(code, where, "exec")
    for dotted in sorted(set(re.findall(r"\btf_topk(?:\.\w+)+", code))):
        parts = dotted.split(".")
        target = importlib.import_module("tf_topk")
        for i, name in enumerate(parts[1:], 1):
            if not hasattr(target, name):  # a submodule not imported by its package
                target = importlib.import_module(".".join(parts[:i + 1]))
            else:
                target = getattr(target, name)
        assert target is not None, f"{where}: {dotted}"
