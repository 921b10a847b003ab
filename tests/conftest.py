"""Test configuration: quiet TensorFlow logs, the repository on sys.path, the `slow` and `timing` markers.

`make test` runs every test not marked `timing` in three processes (pytest-xdist, each test file whole in
one of them), then the `timing` tests alone; `make test-fast` runs what is marked neither `slow` nor
`timing` (docs/testing.md).
"""

import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or long-running tests (left out of `make test-fast`)")
    config.addinivalue_line("markers", "timing: what it checks depends on how long things take (a calibration "
                                       "within its time budget): run alone, after the parallel run")


def pytest_collection_modifyitems(config, items):
    """Modules with the most `slow` tests first, each module's tests in their order: under `make test`'s
    three processes the longest files then start first instead of last."""
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])
