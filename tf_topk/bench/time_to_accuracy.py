"""Time to accuracy on a stated cluster: each step charged its compute plus its predicted exchange.

The convergence benchmark trains in one process, so its wall time says
nothing about a cluster. With `--time-links` every recorded step (what it
sent: k pairs or every entry, by which route) is charged, per link model
(`tf_topk.cost.CostModel.from_link(workers, link)`):

    compute (the dense run's median step on this machine, the same model for
    every method) + the route's predicted time for the sparsified entries
    (selection included) with the small variables carried beside them

where the route is the one the library takes at `workers` workers: the
default "auto" router's choice by bytes for fixed densities, the autopilot's
`CostModel.choose` for it, dense for steps that sent every entry. Then
`time_to_target` finds when a method's mean test-accuracy curve first
reaches dense's final accuracy minus a margin.
"""

from tf_topk.cost import CostModel, LinkModel
from tf_topk.routes import MODE_CODES, choose_mode

ROUTE_OF_CODE = {code: name for name, code in MODE_CODES.items()}


def cost_model(link, workers, latency_ms=0.5):
    """The stated cluster of one `link` rate ("100mbit", ...)."""
    return CostModel.from_link(workers, LinkModel.from_rate(link, latency_s=latency_ms / 1e3))


def step_route(step, model, sparse_entries, chooser):
    """The route name a recorded step takes at the stated cluster.

    step: {"selected", "density", "mode"} from the benchmark's callback (mode:
    the route code the run took, None for the plain dense optimizer);
    chooser: "auto" (AutoRouter's bytes rule), "timed" (the cost model's
    choice) or a fixed route name.
    """
    if step["mode"] is None or step["density"] >= 1.0 or ROUTE_OF_CODE.get(step["mode"]) in ("dense", "dense_bf16"):
        return "dense_bf16" if ROUTE_OF_CODE.get(step["mode"]) == "dense_bf16" else "dense"
    k = step["selected"]
    if chooser == "auto":
        return choose_mode(model.replicas, k, sparse_entries)
    if chooser == "timed":
        return model.choose(sparse_entries, k)
    return chooser


def step_seconds(step, model, compute_s, sparse_entries, small_entries, chooser):
    """Seconds one recorded step takes at the stated cluster."""
    route = step_route(step, model, sparse_entries, chooser)
    if step["mode"] is None:  # the plain optimizer: one all-reduce of every gradient
        return compute_s + model.route_time("dense", 0, sparse_entries + small_entries)
    return compute_s + model.route_time(route, step["selected"], sparse_entries, small_entries)


def epoch_times(steps, epoch_ends, model, compute_s, sparse_entries, small_entries, chooser):
    """Cumulative seconds at the end of each epoch (`epoch_ends`: steps done by then)."""
    times, total, done = [], 0.0, 0
    for end in epoch_ends:
        total += sum(step_seconds(s, model, compute_s, sparse_entries, small_entries, chooser)
                     for s in steps[done:end])
        done = end
        times.append(total)
    return times


def time_to_target(curve, times, target):
    """The time of the first epoch whose score reaches `target` (higher is better), or None."""
    for score, seconds in zip(curve, times):
        if score >= target:
            return seconds
    return None
