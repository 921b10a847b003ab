"""Cluster settings that must be made before MultiWorkerMirroredStrategy is built.

`configure_coordination` sets the heartbeat timeout of TensorFlow's
coordination service, the service MultiWorkerMirroredStrategy (MWMS) starts
to notice dead workers. Each worker sends it a heartbeat RPC every few
seconds; when one has not arrived within the timeout (10 s, MWMS's default),
the whole cluster aborts with "The following tasks are unhealthy (stopped
sending heartbeats)". On a slow link that happens to healthy workers: the
heartbeat shares its gRPC connection with the bulk collective traffic (at
start the chief broadcasts every variable, 150 MB for a 12.6M-parameter
model with TopKOptimizer, 12 s at 100 Mbit/s) and waits behind it. A longer
timeout keeps such a job alive. A worker that really dies is still noticed:
its process exits, and the launcher (`python -m tf_topk.launch`, or the
cluster manager) stops and restarts the job.

TensorFlow reads the setting once, when the strategy starts the worker's
server, so the call comes first in every worker::

    import tensorflow as tf
    import tf_topk

    tf_topk.configure_coordination(heartbeat_timeout_s=600)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

This module imports TensorFlow only inside `configure_coordination`.
"""

from __future__ import annotations

import math

__all__ = ["configure_coordination", "DEFAULT_HEARTBEAT_TIMEOUT_S"]

# What TensorFlow's coordination service uses when MWMS configures it (0 in
# its config means this default).
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0

_COORDINATED_JOBS = ("chief", "worker")  # the jobs MWMS registers with the service


def _heartbeat_timeout_ms(heartbeat_timeout_s) -> int:
    """The timeout in whole milliseconds, TensorFlow's unit; a ValueError if not usable."""
    valid = (
        isinstance(heartbeat_timeout_s, (int, float))
        and not isinstance(heartbeat_timeout_s, bool)
        and math.isfinite(heartbeat_timeout_s)
        and heartbeat_timeout_s >= 0.001  # 0 ms would mean TensorFlow's default, not "no time"
    )
    if not valid:
        raise ValueError(
            "heartbeat_timeout_s must be a finite number of seconds >= 0.001, got "
            f"{heartbeat_timeout_s!r}"
        )
    return int(round(heartbeat_timeout_s * 1000))


def configure_coordination(heartbeat_timeout_s: float = 600.0, *, cluster_resolver=None):
    """Configure TF's coordination service as MWMS would, with this heartbeat timeout.

    Call it in every worker before `tf.distribute.MultiWorkerMirroredStrategy()`
    is built (MWMS keeps a coordination service that is already configured,
    and configures one with the 10 s default otherwise).

    Args:
      heartbeat_timeout_s: seconds without a heartbeat after which the
        coordination service declares a worker dead and aborts the job. The
        default, 600, suits slow links; MWMS's own is 10.
      cluster_resolver: where the cluster comes from, the same resolver the
        strategy is given (e.g. `SlurmClusterResolver`); default: TF_CONFIG,
        as `MultiWorkerMirroredStrategy()` reads it.

    Returns:
      The `CoordinationServiceConfig` proto now in effect, or None when there
      is nothing to coordinate (no TF_CONFIG, a single worker, or a task that
      is neither chief nor worker): MWMS then starts no coordination service.

    Raises:
      ValueError: `heartbeat_timeout_s` is not a finite number >= 0.001.
      RuntimeError: the coordination service is already configured with a
        different timeout, because the strategy was built first (or an
        earlier call chose another value). TensorFlow cannot change it in a
        running process; move the call before the strategy. A repeated call
        with the same timeout returns the config in effect.

    Example::

        tf_topk.configure_coordination(heartbeat_timeout_s=600)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    """
    timeout_ms = _heartbeat_timeout_ms(heartbeat_timeout_s)

    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as mwms_module
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    # Where MWMS itself finds the proto module in this TensorFlow (it moved between releases).
    coordination_config_pb2 = mwms_module.coordination_config_pb2

    resolver = cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster_spec = resolver.cluster_spec()
    jobs = [job for job in _COORDINATED_JOBS if job in cluster_spec.jobs]
    tasks = sum(cluster_spec.num_tasks(job) for job in jobs)
    if tasks < 2 or resolver.task_type not in jobs:
        return None

    ctx = context.context()
    existing = ctx.coordination_service
    if existing is not None:
        if existing.heartbeat_timeout_in_ms == timeout_ms:
            return existing
        current_s = (existing.heartbeat_timeout_in_ms or DEFAULT_HEARTBEAT_TIMEOUT_S * 1000) / 1000
        raise RuntimeError(
            f"configure_coordination(heartbeat_timeout_s={heartbeat_timeout_s!r}) comes too late: the "
            f"coordination service is already configured with a {current_s:g} s heartbeat timeout, by "
            "tf.distribute.MultiWorkerMirroredStrategy (built before this call) or by an earlier "
            "configure_coordination call. TensorFlow reads the setting once, when the strategy starts; "
            "call configure_coordination before building the strategy, once per process."
        )
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        heartbeat_timeout_in_ms=timeout_ms,
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in jobs
        ],
    )
    return ctx.coordination_service
