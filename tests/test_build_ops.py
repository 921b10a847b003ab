"""cc/build_ops.py's choice of GPU architectures (no GPU or nvcc needed)."""

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def build_ops():
    spec = importlib.util.spec_from_file_location("build_ops", os.path.join(REPO, "cc", "build_ops.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_archs_cover_turing_to_hopper(build_ops):
    archs = build_ops.cuda_archs({})
    assert archs == build_ops.DEFAULT_CUDA_ARCHS
    assert {"75", "80", "86", "89", "90"} <= set(archs)
    assert archs[-1] == "90"  # the newest, which also gets PTX for later chips


@pytest.mark.parametrize("value,expected", [("70,80", ("70", "80")), ("9.0, 7.5", ("75", "90")),
                                            ("90,90,80", ("80", "90")), ("120", ("120",))])
def test_archs_from_the_environment(build_ops, value, expected):
    assert build_ops.cuda_archs({"TF_TOPK_CUDA_ARCHS": value}) == expected


@pytest.mark.parametrize("value", ["sm_90", "9", "80,,90", "ampere", "1000"])
def test_bad_archs_name_the_variable_and_value(build_ops, value):
    with pytest.raises(SystemExit) as info:
        build_ops.cuda_archs({"TF_TOPK_CUDA_ARCHS": value})
    message = str(info.value)
    assert "TF_TOPK_CUDA_ARCHS" in message and repr(value) in message
