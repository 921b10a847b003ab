"""The data sets of the examples and benchmarks, loaded one way everywhere.

digits (scikit-learn, ships with it) and synthetic (scikit-learn's
make_classification: 2500 samples, 64 features, 10 classes) work offline;
mnist and cifar10 download through keras.datasets and fail with a message
that says so.
"""

import sys

DATASETS = ("digits", "synthetic", "mnist", "cifar10")


def load_data(name, seed=0):
    """(x_train, y_train, x_test, y_test): flat float32 features, int32 labels.

    digits and synthetic get a fixed stratified split (20% test, `seed`);
    mnist and cifar10 their published split, features scaled to [0, 1].
    """
    import numpy as np

    if name in ("digits", "synthetic"):
        from sklearn.model_selection import train_test_split

        if name == "digits":
            from sklearn.datasets import load_digits

            x, y = load_digits(return_X_y=True)
            x = x / 16.0
        else:
            from sklearn.datasets import make_classification

            x, y = make_classification(n_samples=2500, n_features=64, n_informative=32, n_redundant=8,
                                       n_classes=10, n_clusters_per_class=2, class_sep=1.5, random_state=seed)
            x = (x - x.mean(0)) / x.std(0)
        x_train, x_test, y_train, y_test = train_test_split(x.astype(np.float32), y.astype(np.int32),
                                                            test_size=0.2, stratify=y, random_state=seed)
        return x_train, y_train, x_test, y_test
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    import keras

    loader = {"mnist": keras.datasets.mnist, "cifar10": keras.datasets.cifar10}[name]
    try:
        (x_train, y_train), (x_test, y_test) = loader.load_data()
    except Exception as error:  # urllib/ssl/OS errors: all mean "no download"
        sys.exit(f"error: could not download {name} through keras.datasets ({type(error).__name__}: {error}).\n"
                 f"It needs internet access, or the file already in the Keras cache (~/.keras/datasets by "
                 f"default). The default --dataset digits works offline.")

    def flat(a):
        return (a.reshape(len(a), -1) / 255.0).astype(np.float32)

    return flat(x_train), y_train.reshape(-1).astype(np.int32), flat(x_test), y_test.reshape(-1).astype(np.int32)
