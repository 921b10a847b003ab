"""tf_topk: top-k gradient sparsification with error feedback for TensorFlow/Keras.

Public names:
  approx_topk      the selection op (CPU and CUDA kernels)
  SparseExchange   error-compensated top-k exchange for any tf.distribute replica context
  DensitySchedule  constant or scheduled density (k per variable)
  TopKOptimizer    the Keras optimizer wrapper (tf_topk.keras)
  launch           `python -m tf_topk.launch --workers N script.py`: local multi-worker runs

Importing the package loads the selection op library once.
"""

from tf_topk.ops import approx_topk
from tf_topk.schedule import DensitySchedule
from tf_topk.exchange import ExchangeResult, SparseExchange
from tf_topk.keras import TopKOptimizer

__version__ = "0.1.0"

__all__ = ["approx_topk", "DensitySchedule", "ExchangeResult", "SparseExchange", "TopKOptimizer"]
