"""Configure the Bazel build of the op library against the installed TensorFlow.

Run it with the Python whose TensorFlow the library is for (the venv's):

    .venv/bin/python bazel/configure.py              # CUDA kernels when nvcc is found
    .venv/bin/python bazel/configure.py --no-cuda    # CPU kernels only
    TF_TOPK_CUDA=0|1 .venv/bin/python bazel/configure.py   # same switch as cc/build_ops.py

It asks this TensorFlow for its header folder, its framework library and its
compile flags (tf.sysconfig), finds nvcc and the CUDA toolkit the same way as
cc/build_ops.py, and writes everything to `.tf_configure.bazelrc` at the top of
the repository as `--repo_env` settings. `.bazelrc` imports that file, and the
repository rule in `bazel/tf_configure.bzl` turns the settings into the local
repository `@local_config_tf` (symlinks to the pip package's headers and
libtensorflow_framework.so.2, the CUDA headers and static runtime, and the
flags). Nothing is downloaded. Re-run it after TensorFlow or CUDA changes;
Bazel then refreshes `@local_config_tf` on its own.
"""

import argparse
import importlib.util
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAZELRC = os.path.join(ROOT, ".tf_configure.bazelrc")


def _build_ops():
    """cc/build_ops.py, the reference build: same nvcc/CUDA detection, same archs."""
    spec = importlib.util.spec_from_file_location("build_ops", os.path.join(ROOT, "cc", "build_ops.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _framework_library(link_flags):
    """Absolute path of libtensorflow_framework.so.N from tf.sysconfig's link flags."""
    lib_dirs = [f[2:] for f in link_flags if f.startswith("-L")]
    names = [f[len("-l:"):] for f in link_flags if f.startswith("-l:")]
    names += ["lib" + f[2:] + ".so" for f in link_flags if f.startswith("-l") and not f.startswith("-l:")]
    for lib_dir in lib_dirs:
        for name in names:
            path = os.path.join(lib_dir, name)
            if os.path.exists(path):
                return os.path.abspath(path)
    raise SystemExit(f"configure: no TensorFlow framework library found from link flags {link_flags}")


def tensorflow_config():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    compile_flags = tf.sysconfig.get_compile_flags()
    include_dirs = [f[2:] for f in compile_flags if f.startswith("-I")]
    if len(include_dirs) != 1:
        raise SystemExit(f"configure: expected one -I in tf.sysconfig.get_compile_flags(), got {compile_flags}")
    copts = [f for f in compile_flags if not f.startswith("-I")]
    return {
        "version": tf.__version__,
        "include": os.path.abspath(include_dirs[0]),
        "framework": _framework_library(tf.sysconfig.get_link_flags()),
        "copts": copts,
    }


def cuda_config(build_ops, want_cuda):
    """(cuda_home, nvcc) or ("", "") when the CUDA kernels are left out.

    want_cuda None: as cc/build_ops.py (nvcc if found; TF_TOPK_CUDA=0|1 forces)."""
    if want_cuda is False:
        return "", ""
    if want_cuda is True:
        os.environ["TF_TOPK_CUDA"] = "1"  # build_ops.find_nvcc() then fails loudly without nvcc
    nvcc = build_ops.find_nvcc()
    if nvcc is None:
        return "", ""
    cuda_home = os.path.realpath(build_ops.find_cuda_home(nvcc))
    # The toolkit's own nvcc, not a wrapper script: it finds its siblings from there.
    real_nvcc = os.path.join(cuda_home, "bin", "nvcc")
    nvcc = real_nvcc if os.path.exists(real_nvcc) else os.path.realpath(nvcc)
    static_runtime = os.path.join(cuda_home, "lib64", "libcudart_static.a")
    if not os.path.exists(static_runtime):
        raise SystemExit(f"configure: {static_runtime} is missing (TF_TOPK_CUDA=0 or --no-cuda builds without CUDA)")
    return cuda_home, nvcc


def _quote(value):
    # .bazelrc lines are split like a shell command line.
    return shlex.quote(value)


def write_bazelrc(tf_config, cuda_home, nvcc, archs, path=BAZELRC):
    settings = {
        "TF_TOPK_TF_VERSION": tf_config["version"],
        "TF_TOPK_TF_INCLUDE": tf_config["include"],
        "TF_TOPK_TF_FRAMEWORK": tf_config["framework"],
        "TF_TOPK_TF_COPTS": " ".join(tf_config["copts"]),
        "TF_TOPK_CUDA_HOME": cuda_home,
        "TF_TOPK_NVCC": nvcc,
        "TF_TOPK_CUDA_ARCHS": ",".join(archs) if cuda_home else "",
    }
    lines = ["# Written by bazel/configure.py (python: %s); imported by .bazelrc. Do not edit." % sys.executable]
    # build (and test, run, info, cquery, aquery, which inherit it) and the
    # commands that load packages without it: the same settings everywhere, or
    # Bazel refetches @local_config_tf (or fails) as commands alternate.
    for command in ("build", "query", "fetch"):
        for key, value in settings.items():
            lines.append(f"{command} --repo_env={_quote(f'{key}={value}')}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return settings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cuda", dest="cuda", action="store_true", default=None,
                       help="require the CUDA kernels (fail without nvcc)")
    group.add_argument("--no-cuda", dest="cuda", action="store_false", help="CPU kernels only")
    parser.add_argument("--output", default=BAZELRC, help="the bazelrc file to write (default: %(default)s)")
    args = parser.parse_args(argv)

    build_ops = _build_ops()
    tf_config = tensorflow_config()
    cuda_home, nvcc = cuda_config(build_ops, args.cuda)
    archs = build_ops.cuda_archs()
    write_bazelrc(tf_config, cuda_home, nvcc, archs, args.output)
    print(f"[configure] wrote {os.path.relpath(args.output)}: TensorFlow {tf_config['version']} "
          f"({tf_config['include']}), CUDA kernels: "
          + (f"yes ({nvcc}, sm_{', sm_'.join(archs)})" if cuda_home else "no"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
