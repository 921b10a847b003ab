"""Routes: how a bucket of sparsified gradients travels between replicas.

One class per way (`AllGatherRoute`, `AgreedIndexRoute`, `DenseRoute`,
`Bfloat16DenseRoute`, `Int8AllGatherRoute`, `ChunkAllGatherRoute`, and `AgreedOrDenseRoute`, the run-time switch between
agreed indices and dense), each owning its selection step where it differs,
its collective, its split into the variables' gradients and its bytes per
step. A router picks one per bucket and step: `FixedRouter(route)`,
`AutoRouter()` by bytes and accuracy (`exchange_mode="auto"`, the default),
or `TimedRouter(cost_model)` by predicted seconds (`tf_topk.cost`, measured
by `tf_topk.calibrate`). `SparseExchange(..., router=...)` takes any.
"""

from tf_topk.routes.agreed import AgreedIndexRoute, AgreedOrDenseRoute, agree_indices, nominations, share_indices
from tf_topk.routes.allgather import AllGatherOrDenseRoute, AllGatherRoute
from tf_topk.routes.base import Bucket, Route, all_reduce_dense, gather_bytes, ring_all_reduce_bytes, taken_out
from tf_topk.routes.chunked import ChunkAllGatherRoute
from tf_topk.routes.dense import Bfloat16DenseRoute, DenseRoute
from tf_topk.routes.packed import Int8AllGatherRoute
from tf_topk.routes.router import (ALLGATHER_SHARE, AUTO_AGREED_SLOTS, AUTO_ROUTES, DENSE_CARRY_BYTES, MODE_CODES,
                                   MODES, ROUTES, AutoRouter, FixedRouter, Router, TimedRouter, carries,
                                   carry_in_gather, choose_mode, dense_path_bytes, mode_bytes, router_for)

__all__ = ["ALLGATHER_SHARE", "AUTO_AGREED_SLOTS", "AUTO_ROUTES", "AgreedIndexRoute", "AgreedOrDenseRoute",
           "AllGatherOrDenseRoute", "AllGatherRoute", "AutoRouter", "Bfloat16DenseRoute", "Bucket", "ChunkAllGatherRoute",
           "DENSE_CARRY_BYTES", "DenseRoute", "FixedRouter", "Int8AllGatherRoute", "MODES", "MODE_CODES", "ROUTES", "Route", "Router",
           "TimedRouter", "agree_indices", "all_reduce_dense", "carries", "carry_in_gather", "choose_mode",
           "dense_path_bytes", "gather_bytes", "mode_bytes", "nominations", "ring_all_reduce_bytes", "router_for",
           "share_indices", "taken_out"]
