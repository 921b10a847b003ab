"""ExchangeConfig: every option of the sparse exchange, validated once, in one object.

`SparseExchange`, `tf_topk.TopKOptimizer` and `tf_topk.tf_keras.TopKOptimizer`
all take the same options; they live here once, with their checks, so that a
wrapper hands the exchange one object instead of spelling the options out
again, and `get_config` / `from_config` write and read them in one place.

    >>> config = tf_topk.ExchangeConfig(density=0.01, exchange_mode="auto")
    >>> exchange = tf_topk.SparseExchange(model.trainable_variables, config)
    >>> config.replace(density=0.001)          # a new, checked config
"""

import dataclasses
import math
from typing import Any, Optional

from tf_topk.ops import check_method
from tf_topk.schedule import DensitySchedule

# Below this many entries a variable takes the dense all-reduce: its k would be
# a handful of entries, so sparsifying saves almost nothing, while all small
# tensors (biases, normalisation parameters) travel together in one packed
# all-reduce and stay exact. 4096 float32 entries are 16 KiB.
DEFAULT_MIN_SIZE = 4096

EXCHANGE_MODES = ("auto", "allgather", "allreduce")


def check_min_size(min_size):
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")


def check_local_clipnorm(local_clipnorm):
    if local_clipnorm is not None and (isinstance(local_clipnorm, bool) or not isinstance(local_clipnorm, (int, float))
                                       or not local_clipnorm > 0 or local_clipnorm == float("inf")):
        raise ValueError(f"local_clipnorm must be None or a finite float > 0, got {local_clipnorm!r}")


def check_exchange_mode(exchange_mode):
    if exchange_mode not in EXCHANGE_MODES:
        raise ValueError(f"exchange_mode must be one of {EXCHANGE_MODES}, got {exchange_mode!r}")


def check_bucket_bytes(bucket_bytes):
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 8):
        raise ValueError(f"bucket_bytes must be None or an int >= 8, got {bucket_bytes!r}")


def check_momentum(momentum):
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 < momentum < 1.0:
        raise ValueError(f"momentum must be a float in (0, 1), got {momentum!r}")
    return float(momentum)


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """The options of a sparse exchange (see `tf_topk.SparseExchange` for each).

    Args:
      density: a float in (0, 1], (step, density) pairs, a callable, or
        "adaptive" / a `tf_topk.schedule.AdaptiveDensity`.
      method: "gaussian" or "exact" (the default selector's).
      min_size: variables with fewer entries take the dense all-reduce.
      bucket_bytes: bound on a bucket's pair bytes; None: one bucket.
      error_feedback: keep residuals (default), or drop unsent entries.
      momentum: None, or m in (0, 1) for momentum correction (DGC).
      nesterov, momentum_masking: momentum correction's variants.
      local_clipnorm: DGC's local gradient clipping (None: off).
      exchange_mode: "allgather", "allreduce" (agreed indices) or "auto".
      sparse_output: hand sparsified gradients out as pairs.

    Frozen and checked when made: a bad value raises a ValueError that names
    it. `replace(**changes)` makes a checked copy.
    """

    density: Any = 0.001
    method: str = "gaussian"
    min_size: int = DEFAULT_MIN_SIZE
    bucket_bytes: Optional[int] = None
    error_feedback: bool = True
    momentum: Optional[float] = None
    nesterov: bool = False
    momentum_masking: bool = True
    local_clipnorm: Optional[float] = None
    exchange_mode: str = "allgather"
    sparse_output: bool = False

    def __post_init__(self):
        check_method(self.method)
        DensitySchedule(self.density)  # validates
        check_min_size(self.min_size)
        check_bucket_bytes(self.bucket_bytes)
        check_local_clipnorm(self.local_clipnorm)
        check_exchange_mode(self.exchange_mode)
        if self.momentum is not None:
            object.__setattr__(self, "momentum", check_momentum(self.momentum))
            if not self.error_feedback:
                raise ValueError("momentum correction accumulates the velocity in the residual: it needs "
                                 "error_feedback=True")
        elif self.nesterov:
            raise ValueError("nesterov=True needs momentum=... (momentum correction)")
        for name in ("error_feedback", "nesterov", "momentum_masking", "sparse_output"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    @property
    def schedule(self):
        """The DensitySchedule of `density`."""
        return DensitySchedule(self.density)

    def max_pairs(self, size):
        """The most pairs a variable of `size` entries sends in a step (its k
        at the schedule's largest density), for sizing buckets."""
        max_density = self.schedule.max_density()
        return size if max_density is None else max(1, min(size, math.ceil(max_density * size)))

    def replace(self, **changes):
        """A copy with `changes`, checked again."""
        return dataclasses.replace(self, **changes)

    def get_config(self):
        """A JSON-friendly dict (`from_config` reads it back)."""
        config = dataclasses.asdict(self)
        config["density"] = self.schedule.get_config()
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("density"), list):  # JSON turns (step, density) pairs into lists
            config["density"] = [tuple(pair) if isinstance(pair, list) else pair for pair in config["density"]]
        return cls(**config)
