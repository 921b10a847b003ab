"""Keras adapter of tf_topk: the optimizer wrapper, callbacks and narrowly scoped Keras fixes."""

from tf_topk.keras.mwms_fix import apply_mwms_fix, is_mwms_fix_applied
