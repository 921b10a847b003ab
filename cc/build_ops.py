"""Compile the op library in `cc/` against the TensorFlow that is installed.

Used by `setup.py` (so `pip install -e .` builds it) and runnable on its own:

    python cc/build_ops.py                      # writes tf_topk/_tf_topk_ops.so
    TF_TOPK_CUDA=0 python cc/build_ops.py       # CPU kernels only
    TF_TOPK_CUDA_ARCHS=70,80 python cc/build_ops.py   # other GPU architectures
    python cc/build_ops.py --output /tmp/lib.so

The CUDA sources (`cc/kernels/*.cu.cc`) are compiled whenever `nvcc` is found
(or forced with TF_TOPK_CUDA=1; TF_TOPK_CUDA=0 skips them). CUDA code is linked
against the static CUDA runtime, so the library loads on machines without a
GPU or CUDA installation; its GPU kernels are simply never placed there.

Next to the library a JSON file records the TensorFlow version it was built
against; `tf_topk` reads it at import to give a clear rebuild message.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CC_DIR = os.path.join(ROOT, "cc")
DEFAULT_OUTPUT = os.path.join(ROOT, "tf_topk", "_tf_topk_ops.so")

# GPU architectures (compute capabilities) with machine code in the library:
# every one that CUDA 13's nvcc still builds from Turing on (T4 7.5, A100 8.0,
# A10/RTX 30xx 8.6, L4/RTX 40xx 8.9, H100/H200 9.0), plus PTX of the newest
# for later chips (Blackwell), which the driver compiles at first use. CUDA 13
# dropped Volta (V100, 7.0) and older: build those with an older nvcc and
# TF_TOPK_CUDA_ARCHS=70,... (a comma-separated list of compute capabilities).
DEFAULT_CUDA_ARCHS = ("75", "80", "86", "89", "90")


def cuda_archs(environ=None):
    """The architectures to build: TF_TOPK_CUDA_ARCHS ("75,80" or "7.5,8.0"),
    else DEFAULT_CUDA_ARCHS. The last one also gets PTX."""
    value = (os.environ if environ is None else environ).get("TF_TOPK_CUDA_ARCHS", "").strip()
    if not value:
        return DEFAULT_CUDA_ARCHS
    archs = []
    for item in value.split(","):
        digits = item.strip().replace(".", "")
        if not (digits.isdigit() and 2 <= len(digits) <= 3):
            raise SystemExit(f"TF_TOPK_CUDA_ARCHS must be a comma-separated list of compute capabilities "
                             f"such as 75,80,90 (or 7.5,8.0,9.0); got {value!r} (bad entry {item!r})")
        archs.append(digits)
    return tuple(sorted(set(archs), key=int))



def build_info_path(library_path):
    """The JSON file that records how `library_path` was built."""
    return os.path.splitext(library_path)[0] + ".json"


def _log(message):
    print(f"[build_ops] {message}", flush=True)


def _run(command):
    _log(" ".join(command))
    subprocess.run(command, check=True)


def find_nvcc():
    """Path of nvcc, or None. TF_TOPK_CUDA=0 disables, =1 requires it."""
    forced = os.environ.get("TF_TOPK_CUDA", "").strip()
    if forced == "0":
        return None
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for candidate in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(candidate):
                nvcc = candidate
    if forced == "1" and nvcc is None:
        raise SystemExit("TF_TOPK_CUDA=1 but nvcc was not found on PATH or in /usr/local/cuda/bin")
    return nvcc


def find_cuda_home(nvcc):
    """The CUDA toolkit folder: CUDA_HOME, else the one holding nvcc (through
    wrapper scripts such as /usr/local/bin/nvcc), else /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME", ""),
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    raise SystemExit(f"nvcc found at {nvcc}, but no CUDA toolkit with include/cuda_runtime.h; set CUDA_HOME "
                     "(or TF_TOPK_CUDA=0 to build without CUDA kernels)")


def cuda_shim_include(cuda_home, workdir):
    """TensorFlow's GPU headers include "third_party/gpus/cuda/include/...";
    the pip wheel does not ship that folder, so point it at the CUDA toolkit."""
    shim = os.path.join(workdir, "cuda_shim")
    link_dir = os.path.join(shim, "third_party", "gpus", "cuda")
    os.makedirs(link_dir, exist_ok=True)
    os.symlink(os.path.join(cuda_home, "include"), os.path.join(link_dir, "include"))
    return shim


def tensorflow_flags():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf  # imported late: setup.py needs it only when building

    return tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def sources():
    cpu = sorted(glob.glob(os.path.join(CC_DIR, "ops", "*.cc")))
    cpu += sorted(p for p in glob.glob(os.path.join(CC_DIR, "kernels", "*.cc")) if not p.endswith(".cu.cc"))
    cuda = sorted(glob.glob(os.path.join(CC_DIR, "kernels", "*.cu.cc")))
    return cpu, cuda


def build(output=DEFAULT_OUTPUT):
    """Compile and link the op library to `output`; returns its build info."""
    tf_version, compile_flags, link_flags = tensorflow_flags()
    cpu_sources, cuda_sources = sources()
    nvcc = find_nvcc()
    with_cuda = nvcc is not None and bool(cuda_sources)
    archs = cuda_archs() if with_cuda else ()
    common = ["-I", os.path.join(CC_DIR, "kernels"), "-I", CC_DIR] + compile_flags
    # TensorFlow's own headers trigger these warnings; they say nothing about cc/.
    gxx_only = ["-O3", "-fPIC", "-Wno-deprecated-declarations", "-Wno-interference-size"]
    with tempfile.TemporaryDirectory(prefix="tf_topk_build_") as workdir:
        objects = []
        link_extra = []
        if with_cuda:
            cuda_home = find_cuda_home(nvcc)
            shim = cuda_shim_include(cuda_home, workdir)
            common += ["-DGOOGLE_CUDA=1", "-I", shim, "-I", os.path.join(cuda_home, "include")]
            gencode = []
            for arch in archs:
                gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
            gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
            for source in cuda_sources:
                obj = os.path.join(workdir, os.path.basename(source) + ".o")
                host_flags = [f for f in common if f != "--std=c++17"]
                _run([nvcc, "-c", "-std=c++17", "-O3", "-x", "cu", "-Xcompiler", "-fPIC",
                      "--expt-relaxed-constexpr", "-DNDEBUG", *gencode, *host_flags, source, "-o", obj])
                objects.append(obj)
            link_extra = ["-L", os.path.join(cuda_home, "lib64"), "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
        for source in cpu_sources:
            obj = os.path.join(workdir, os.path.basename(source) + ".o")
            _run(["g++", "-c", *gxx_only, *common, source, "-o", obj])
            objects.append(obj)
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        tmp_output = output + ".tmp"
        _run(["g++", "-shared", "-o", tmp_output, *objects, *link_flags, *link_extra])
        os.replace(tmp_output, output)  # never leave a half-written library behind
    info = {"tensorflow_version": tf_version, "cuda": with_cuda,
            "cuda_archs": list(archs) if with_cuda else []}
    with open(build_info_path(output), "w") as f:
        json.dump(info, f, indent=1)
    _log(f"built {output} (TensorFlow {tf_version}, CUDA kernels: {'yes' if with_cuda else 'no'})")
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="path of the shared library to write")
    args = parser.parse_args(argv)
    build(args.output)


if __name__ == "__main__":
    sys.exit(main())
