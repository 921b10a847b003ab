"""Keras adapter of tf_topk: the optimizer wrapper, callbacks and the narrowly scoped Keras fix.

`BackupAndRestore` is Keras's callback of that name made multi-worker aware:
one shared `backup_dir`, the chief's backup kept, atomic commits, restored by
every worker (see `tf_topk.keras.backup`).

`TopKOptimizer` applies the keras#20585 fix (`apply_mwms_fix`) when it is
constructed; a plain optimizer trained with `model.fit` under
MultiWorkerMirroredStrategy needs `tf_topk.keras.apply_mwms_fix()` first.
"""

from tf_topk.keras.mwms_fix import apply_mwms_fix, is_mwms_fix_applied
from tf_topk.keras.optimizer import TopKOptimizer, disable_dense_all_reduce
from tf_topk.keras.callbacks import CompressionStats, StepTimer
from tf_topk.keras.backup import BackupAndRestore

__all__ = ["BackupAndRestore", "CompressionStats", "StepTimer", "TopKOptimizer", "apply_mwms_fix",
           "disable_dense_all_reduce", "is_mwms_fix_applied"]
