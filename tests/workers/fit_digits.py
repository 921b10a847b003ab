"""Worker: train a tiny Dense model on sklearn digits under MultiWorkerMirroredStrategy.

Run through the launcher (it sets TF_CONFIG):

    python -m tf_topk.launch --workers 2 tests/workers/fit_digits.py --out /tmp/o --fix

Writes to --out, per worker i: `weights_{i}.npz` (final weights),
`result_{i}.json` (losses per epoch, evaluate() result, whether the fix was
applied) or, when fit/evaluate raised, `error_{i}.json` (exception type and
message) and exits 17.
"""

import argparse
import json
import os
import sys
import traceback

import numpy as np

ERROR_EXIT_CODE = 17


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fix", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--evaluate", action="store_true")
    p.add_argument("--predict", action="store_true")
    args = p.parse_args()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    import tensorflow as tf

    import keras
    from sklearn.datasets import load_digits

    from tf_topk.keras.mwms_fix import apply_mwms_fix, is_mwms_fix_applied

    if args.fix:
        apply_mwms_fix()
    # The strategy must exist before other TF work starts the eager context.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    print(f"worker {index}: {strategy.num_replicas_in_sync} replicas, keras {keras.__version__}")

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    y = y.astype("int32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    result = {"keras": keras.__version__, "fix_applied": is_mwms_fix_applied()}
    try:
        history = model.fit(x, y, batch_size=64, epochs=args.epochs, shuffle=False, verbose=2)
        result["loss"] = [float(v) for v in history.history["loss"]]
        if args.predict:
            pred = model.predict(x, batch_size=64, verbose=0)
            np.save(os.path.join(args.out, f"predict_{index}.npy"), pred)
        if args.evaluate:
            result["evaluate"] = {
                k: float(v) for k, v in model.evaluate(x, y, batch_size=64, verbose=2, return_dict=True).items()
            }
    except Exception as e:  # report the failure for the test, then fail the worker
        traceback.print_exc()
        error = {"type": type(e).__name__, "message": str(e)[:2000], "keras": keras.__version__}
        with open(os.path.join(args.out, f"error_{index}.json"), "w") as f:
            json.dump(error, f)
        sys.stdout.flush()
        os._exit(ERROR_EXIT_CODE)  # skip TF teardown, which can hang on a broken collective

    np.savez(os.path.join(args.out, f"weights_{index}.npz"), *model.get_weights())
    with open(os.path.join(args.out, f"result_{index}.json"), "w") as f:
        json.dump(result, f)
    print(f"worker {index}: done {result}")


if __name__ == "__main__":
    main()
