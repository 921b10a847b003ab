"""Test configuration: quiet TensorFlow logs, a `slow` marker."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or long-running tests")
