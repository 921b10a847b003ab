"""tf_topk: top-k gradient sparsification with error feedback for TensorFlow/Keras.

Importing the package loads the selection op library once.
"""

from tf_topk.ops import approx_topk

__version__ = "0.1.0"

__all__ = ["approx_topk"]
