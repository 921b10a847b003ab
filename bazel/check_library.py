"""Check that the Bazel-built op library is the same op as the setup.py one.

    .venv/bin/python bazel/check_library.py bazel-bin/_tf_topk_ops.so \
        [--reference tf_topk/_tf_topk_ops.so]

Each library is loaded in a fresh process (an op can be registered only once
per process) and described: the OpDef of "ImportTfTopk>ApproxTopK", the op
wrappers the library module exposes, and the kernels it registers (device,
dtype). The check fails unless the library registers that op, registers GPU
kernels whenever its sidecar JSON says it was built with CUDA, and, with
--reference, matches the reference library's description (kernels are
compared only when both were built with the same CUDA setting). Registered GPU
kernels need no GPU: this runs anywhere. Then `import tf_topk` with
TF_TOPK_LIBRARY set must pick the library up.
"""

import argparse
import json
import os
import subprocess
import sys

OP_NAME = "ImportTfTopk>ApproxTopK"

_DESCRIBE = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
from tensorflow.python.framework import kernels, op_def_registry
library = tf.load_op_library(sys.argv[1])
op_def = op_def_registry.get(sys.argv[2])
registered = kernels.get_registered_kernels_for_op(sys.argv[2]).kernel
kernel_list = sorted({(k.device_type, tf.dtypes.as_dtype(c.allowed_values.list.type[0]).name)
                      for k in registered for c in k.constraint if c.name == "T"})
print("DESCRIPTION " + json.dumps({
    "op_def": str(op_def) if op_def is not None else None,
    "wrappers": sorted(n for n in dir(library) if n[:1].isupper() and not n.startswith("TV_")),
    "kernels": kernel_list,
}))
"""


def describe(library):
    result = subprocess.run([sys.executable, "-c", _DESCRIBE, os.path.abspath(library), OP_NAME],
                            capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith("DESCRIPTION "):
            return json.loads(line[len("DESCRIPTION "):])
    raise SystemExit(f"check_library: loading {library} failed:\n{result.stdout}{result.stderr}")


def build_info(library):
    path = os.path.splitext(library)[0] + ".json"
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", help="the op library to check (e.g. bazel-bin/_tf_topk_ops.so)")
    parser.add_argument("--reference", help="a library to compare with (e.g. tf_topk/_tf_topk_ops.so)")
    args = parser.parse_args(argv)
    errors = []

    info = build_info(args.library)
    got = describe(args.library)
    if got["op_def"] is None:
        errors.append(f"{args.library} does not register {OP_NAME}")
    devices = sorted({device for device, _ in got["kernels"]})
    if info.get("cuda") and "GPU" not in devices:
        errors.append(f"{args.library} was built with CUDA but registers no GPU kernel: {got['kernels']}")

    if args.reference:
        ref_info = build_info(args.reference)
        ref = describe(args.reference)
        if got["op_def"] != ref["op_def"]:
            errors.append(f"the OpDef differs from {args.reference}'s:\n{got['op_def']}\nvs\n{ref['op_def']}")
        if got["wrappers"] != ref["wrappers"]:
            errors.append(f"op wrappers {got['wrappers']} differ from {args.reference}'s {ref['wrappers']}")
        kernels_compared = bool(info.get("cuda")) == bool(ref_info.get("cuda"))
        if kernels_compared and got["kernels"] != ref["kernels"]:
            errors.append(f"kernels {got['kernels']} differ from {args.reference}'s {ref['kernels']}")

    env = dict(os.environ, TF_TOPK_LIBRARY=os.path.abspath(args.library), TF_CPP_MIN_LOG_LEVEL="3")
    loaded = subprocess.run([sys.executable, "-c", "import tf_topk.ops as o; print('LIBRARY', o.library_path())"],
                            capture_output=True, text=True, env=env)
    if f"LIBRARY {os.path.abspath(args.library)}" not in loaded.stdout:
        errors.append(f"import tf_topk with TF_TOPK_LIBRARY={args.library} failed:\n{loaded.stdout}{loaded.stderr}")

    if errors:
        print("[check_library] FAILED:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    kernels = ", ".join(f"{d}:{t}" for d, t in got["kernels"])
    same = ""
    if args.reference:
        compared = ("op, wrappers and kernels" if kernels_compared else
                    "op and wrappers (kernels not compared: one was built without CUDA)")
        same = f"; same {compared} as {args.reference}"
    print(f"[check_library] {args.library}: op {OP_NAME}, kernels {kernels}{same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
