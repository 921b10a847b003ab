"""Keras's own optimizer tests, run against TopKOptimizer (tests/keras_conformance.py wraps every
optimizer they build), in three configurations: density 1.0; the library's default (no density); and
density 1.0 with min_size=1, so that every variable goes through the top-k path.

The test files are taken from the installed keras package when the test runs (not copied here):
`keras/src/optimizers/*_test.py` and `keras/src/backend/tensorflow/optimizer_distribute_test.py`
(two replicas on logical CPUs). What still fails reads the object's private state, identity or
variable count: each is listed below with its reason, and each run must fail exactly those. A new
failure is a defect, and a listed one that passes must leave the list. The plugin counts the
TopKOptimizers each case builds: a case that passes without building one ran against Keras alone and
fails this test, unless it is on the short list of those that rightly build none (BUILDS_NONE); the
count of cases that passed with a wrapper is the one docs/keras.md states.
"""

import json
import re
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import keras
import pytest

from multiworker import PYTHON, REPO_ROOT, subprocess_env

KERAS_SRC = Path(keras.__file__).resolve().parent / "src"
TEST_FILES = sorted(str(p) for p in (KERAS_SRC / "optimizers").glob("*_test.py")) + \
    [str(KERAS_SRC / "backend" / "tensorflow" / "optimizer_distribute_test.py")]

# The test reads the wrapper's private state, identity or variable count, not a behaviour; what it
# checks through them is tested on the wrapper's public behaviour where it applies.
ADAPTED = {
    "NadamTest::test_build_with_empty_var_list": "reads Nadam's private `_u_product`",
    "SGDTest::test_single_step": "counts `optimizer.variables`, which hold the wrapper's own state (its skipped "
                                 "steps) beside the inner optimizer's",
    "OptimizerTest::test_optimizer_auto_naming": "expects Keras's names (`sgd`, `sgd_1`); the wrapper is "
                                                 "`topk_optimizer`, numbered the same way",
    "MultiOptimizerTest::test_serialization": "compares the sub-optimizers' class names with Keras's",
    "MultiOptimizerTest::test_tensorboard_logging_with_multi_optimizer": "expects log keys named after Keras's "
                                                                         "class names",
    "OptimizerTest::test_overwrite_with_gradient_with_gradient_accumulation": "reads `_iterations` and "
        "`_accumulated_gradients` (the inner optimizer's accumulates; the variables' values: "
        "tests/test_keras_contract.py::test_overwrite_with_gradient_under_accumulation_acts_as_keras)",
    "OptimizerTest::test_gradient_accumulation": "reads `gradient_accumulation_steps` on the wrapper (None: the "
                                                 "inner optimizer's accumulates; tests/test_keras_order.py)",
    "OptimizerDistributeTest::test_gradient_accumulation": "reads `gradient_accumulation_steps` (as above)",
    "MuonTest::test_Newton_Schulz": "calls Muon's own `zeropower_via_newtonschulz5` on the optimizer",
    "MuonTest::test_lr_adjust_2d": "calls Muon's own `lr_adjust` on the optimizer",
    "MuonTest::test_lr_adjust_none": "calls Muon's own `lr_adjust` on the optimizer",
    "MuonTest::test_should_use_adamw": "calls Muon's own `_should_use_adamw` on the optimizer",
    "MuonTest::test_muon_weight_decay": "calls the optimizer's private `_apply_weight_decay`",
    "MuonTest::test_adamw_weight_decay": "calls the optimizer's private `_apply_weight_decay`",
    "OptimizerSparseTest::test_sparse_gradients": "expects sparse updates through `optimizer.assign`; the wrapper "
        "makes sparse gradients dense before the exchange (documented; the values: its test_sparse_correctness "
        "cases pass)",
}
# Tests that pass without building a TopKOptimizer, and rightly: they check what Keras refuses before
# any optimizer exists (an invalid argument raises in the inner constructor), or build no Keras 3
# optimizer of their own.
BUILDS_NONE = {
    "AdamWTest::test_weight_decay_is_none": "AdamW(weight_decay=None) raises in AdamW's constructor",
    "FtrlTest::test_invalid_initial_accumulator_value": "an invalid argument raises in Ftrl's constructor",
    "FtrlTest::test_invalid_l1_regularization_strength": "likewise",
    "FtrlTest::test_invalid_l2_regularization_strength": "likewise",
    "FtrlTest::test_invalid_l2_shrinkage_regularization_strength": "likewise",
    "FtrlTest::test_invalid_learning_rate_power": "likewise",
    "LionTest::test_invalid_beta_1": "an invalid argument raises in Lion's constructor",
    "SGDTest::test_invalid_momentum": "an invalid argument raises in SGD's constructor",
    "LossScaleOptimizerTest::test_deserialization_backwards_compatibility": "reads a LossScaleOptimizer's "
        "saved config, which names Keras's SGD inside it",
    "OptimizerDistributeTest::test_single_step": "its second case is tf_keras's SGD, which the Keras 3 wrapper "
        "does not take (tf_topk.tf_keras.TopKOptimizer has tests of its own); the first case builds a wrapper",
}
CONFIGS = {"density 1.0": {"density": 1.0}, "default": {}, "every variable top-k": {"density": 1.0, "min_size": 1}}


def run_keras_tests(options, tmp_path):
    """({"Class::case": "passed" | "failed" | "skipped"}, {"Class::case": TopKOptimizers it built}) of
    Keras's tests run against the wrapper; a case is a parametrized test's one case."""
    report, built = tmp_path / "report.xml", tmp_path / "built.json"
    env = subprocess_env(TF_TOPK_CONFORMANCE=json.dumps(options), TF_TOPK_CONFORMANCE_BUILT=str(built))
    # pytest run with this folder on sys.path (for the plugin), in a process of its own.
    run_pytest = f"import sys; sys.path.insert(0, {str(REPO_ROOT / 'tests')!r}); import pytest; " \
                 "sys.exit(pytest.main(sys.argv[1:]))"
    proc = subprocess.run([*PYTHON, "-c", run_pytest, "-q", "-p", "no:cacheprovider", "-p", "keras_conformance",
                           "--rootdir", str(tmp_path), f"--junitxml={report}", *TEST_FILES],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists() and built.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        cases[name] = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
    counts = {"::".join(nodeid.split("::")[-2:]): count for nodeid, count in json.loads(built.read_text()).items()}
    return cases, counts


def keras_test_of(case):
    """`Class::test` of one case: absl's parametrized cases are `test_x0`, `test_x_adam`, pytest's `test_x[a]`."""
    cls, name = case.split("::")
    base = name.split("[")[0]
    for test in _TEST_NAMES.get(cls, ()):
        if base == test or base.startswith(test + "_") or (base[len(test):].isdigit() and base.startswith(test)):
            return f"{cls}::{test}"
    return f"{cls}::{base}"


def _test_names():
    """Each Keras test class's test method names as written (longest first, so that `test_ema` does
    not take `test_ema_overwrite_frequency`'s cases)."""
    import ast

    names = {}
    for path in TEST_FILES:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.ClassDef):
                tests = [f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
                names[node.name] = sorted(tests, key=len, reverse=True)
    return names


_TEST_NAMES = _test_names()


def by_test(cases):
    """{"Class::test": outcome}: a parametrized test fails if any of its cases fails."""
    outcomes = {}
    for case, outcome in cases.items():
        name = keras_test_of(case)
        if outcomes.get(name) != "failed":
            outcomes[name] = outcome
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_keras_optimizer_tests_pass_against_the_wrapper_but_the_listed_ones(config, tmp_path):
    cases, built = run_keras_tests(CONFIGS[config], tmp_path)
    outcomes = by_test(cases)
    failed = {name for name, outcome in outcomes.items() if outcome == "failed"}
    new = sorted(failed - set(ADAPTED))
    assert not new, f"new failures of Keras's optimizer tests against TopKOptimizer ({config}): {new}"
    fixed = sorted(name for name in ADAPTED if outcomes.get(name) == "passed")
    assert not fixed, f"listed as failing but passing now ({config}), take them off the list: {fixed}"
    # A case that passed without building a wrapper ran against Keras alone: it proves nothing here.
    unwrapped = sorted(case for case, outcome in cases.items()
                       if outcome == "passed" and not built.get(case) and keras_test_of(case) not in BUILDS_NONE)
    assert not unwrapped, f"cases that passed without building a TopKOptimizer ({config}): {unwrapped}"
    ran = sum(outcome == "passed" and built.get(case, 0) > 0 for case, outcome in cases.items())
    stated = re.search(r"(\d+) of (\d+) cases pass against the\s+wrapper", (REPO_ROOT / "docs" / "keras.md").read_text())
    assert stated, "docs/keras.md does not state the conformance count"
    assert (int(stated.group(1)), int(stated.group(2))) == (ran, len(cases)), \
        f"docs/keras.md says {stated.group(0)}; measured ({config}): {ran} of {len(cases)}"


def test_the_guide_lists_every_adapted_test():
    guide = (REPO_ROOT / "docs" / "keras.md").read_text()
    missing = [name for name in {**ADAPTED, **BUILDS_NONE} if f"`{name}`" not in guide]
    assert not missing, f"docs/keras.md does not list {missing}"
