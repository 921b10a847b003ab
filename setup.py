"""Packaging: `pip install --no-build-isolation -e .` builds the op library.

The library is compiled by cc/build_ops.py against the TensorFlow installed in
the environment (flags from tf.sysconfig); CUDA kernels are added whenever nvcc
is found (TF_TOPK_CUDA=0|1 forces it either way).
"""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _build_ops_module():
    spec = importlib.util.spec_from_file_location("build_ops", os.path.join(ROOT, "cc", "build_ops.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildOpLibrary(build_ext):
    """Builds the TensorFlow op library instead of a Python extension."""

    def _target_dir(self):
        # Editable installs and in-place builds load the library from the
        # source tree; wheels carry it in the build tree.
        if self.inplace or getattr(self, "editable_mode", False):
            return os.path.join(ROOT, "tf_topk")
        return os.path.join(self.build_lib, "tf_topk")

    def build_extension(self, ext):
        _build_ops_module().build(os.path.join(self._target_dir(), "_tf_topk_ops.so"))

    def get_outputs(self):
        if getattr(self, "editable_mode", False):
            return []  # already in place: nothing for the editable wheel to map
        return [os.path.join(self._target_dir(), name) for name in ("_tf_topk_ops.so", "_tf_topk_ops.json")]

    def get_output_mapping(self):
        return {}

    def copy_extensions_to_source(self):
        pass  # editable builds already wrote the library into the source tree


setup(
    ext_modules=[Extension("tf_topk._tf_topk_ops", sources=[])],
    cmdclass={"build_ext": BuildOpLibrary},
)
