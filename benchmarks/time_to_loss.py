"""Wall time to dense's loss on a slow link: the steps a method needs to reach dense AdamW's loss at a
given step (from the convergence curves of `benchmarks/adamw_candidates.py`, paired by seed), times
the step times `python -m tf_topk.bench e2e` measured on the link, density by density along the
default's density warm-up (benchmarks/RESULTS.md, "Decoupled momentum for AdamW (DeMo)").

    python benchmarks/time_to_loss.py CURVES.jsonl E2E.json --variant demo:warm=auto --density 0.01 \\
        --dataset text --steps 2000 --target-step 800
    python benchmarks/time_to_loss.py CURVES.jsonl E2E.json --variant default:mode=allgather_chunk \\
        --density 0.00456 --exchange-mode allgather_chunk --dataset prose

The e2e run must hold "dense" and "topk:D" for every density of the warm-up (`warmup_densities`
prints them); a step at a density the run lacks is an error, never a guess. Dense's time is
`target_step` of its steps; the method's, the sum of each of its steps' time up to the step at which
its curve (linearly interpolated between evaluations) first reaches that seed's dense loss after
`target_step` steps (from a dense run of that length, or a longer one evaluated there).
"""

import argparse
import json
import statistics
import sys

from tf_topk.config import DEFAULT_DENSITY_WARMUP_STEPS, WARMUP_INITIAL_DENSITY
from tf_topk.schedule import warmup_in_steps


def warmup_densities(density, warmup_steps=DEFAULT_DENSITY_WARMUP_STEPS):
    """[(first step, density), ...]: the default's densities, each from its first step on."""
    return warmup_in_steps(warmup_steps, final=density, initial=WARMUP_INITIAL_DENSITY)


def steps_to_reach(curve, eval_every, target):
    """The first step (fractional, linearly interpolated between evaluations at eval_every, 2 *
    eval_every, ...) at which `curve` is at or below `target`; None where it never is."""
    previous_step, previous = 0, None
    for number, loss in enumerate(curve, start=1):
        step = number * eval_every
        if loss <= target:
            if previous is None or previous == loss:
                return float(step)
            return previous_step + (previous - target) / (previous - loss) * (step - previous_step)
        previous_step, previous = step, loss
    return None


def seconds_for(steps, schedule, step_seconds):
    """Wall seconds of `steps` steps (fractional) along `schedule` [(first step, density), ...], each
    density's step taking step_seconds[density]."""
    total = 0.0
    bounds = [first for first, _ in schedule[1:]] + [float("inf")]
    for (first, density), end in zip(schedule, bounds):
        if steps <= first:
            break
        total += (min(steps, end) - first) * step_seconds[density]
    return total


def e2e_step_seconds(e2e, densities, exchange_mode=None):
    """{density: median step seconds} for `densities` and {"dense": ...} from an e2e JSON result (a
    configuration named within 1% of a density is its: e2e names them as given, to 3 digits), of
    `exchange_mode`'s configurations (`topk:<d>@<mode>`) where one is given, else of `topk:<d>`."""
    rows = {row["config"]: row["step_time_s"] for row in e2e["configs"]}
    if "dense" not in rows:
        raise ValueError("the e2e result has no 'dense' configuration")
    found = {"dense": rows["dense"]}
    for density in densities:
        key = next((name for name in rows if _is_topk_at(name, density, exchange_mode)), None)
        if key is None:
            modes = "" if exchange_mode is None else f" --exchange-modes {exchange_mode}"
            raise ValueError(f"the e2e result has no configuration at density {density:.3g}"
                             f"{'' if exchange_mode is None else ' on ' + exchange_mode} (has: {sorted(rows)}); "
                             f"run e2e with --densities {','.join(f'{d:.3g}' for d in densities)}{modes}")
        found[density] = rows[key]
    return found


def _is_topk_at(name, density, exchange_mode):
    """Whether e2e's configuration `name` is top-k within 1% of `density` on `exchange_mode` (None: the
    configuration names no mode)."""
    if not name.startswith("topk:"):
        return False
    named_density, _, mode = name.split(":", 1)[1].partition("@")
    return (mode or None) == exchange_mode and abs(float(named_density) - density) <= 0.01 * density


def dense_loss_at(runs, dataset, seed, step):
    """Dense's held-out loss after `step` steps for `seed`: from any dense run of that seed whose
    evaluations include the step (a run of exactly `step` steps ends there; with a constant learning
    rate its first steps are a longer run's), else None."""
    for r in sorted(runs, key=lambda r: r["steps"]):
        if r["variant"] != "dense" or r["dataset"] != dataset or r["seed"] != seed or r.get("replicas", 1) != 1:
            continue
        every = r["steps"] // len(r["curve"])
        if r["steps"] >= step and step % every == 0:
            return r["curve"][step // every - 1]
    return None


def time_to_loss(runs, e2e, variant, density, dataset, steps, target_step,
                 warmup_steps=DEFAULT_DENSITY_WARMUP_STEPS, exchange_mode=None):
    """Rows per seed: (seed, dense loss at target_step, steps the variant's run of `steps` steps took
    to reach it, dense seconds, variant seconds or None where its curve never reached the loss); the
    variant's steps along a density warm-up of `warmup_steps` (0: none), each timed on
    `exchange_mode` (None: e2e's configurations that name no mode)."""
    schedule = warmup_densities(density, warmup_steps)
    step_seconds = e2e_step_seconds(e2e, [d for _, d in schedule], exchange_mode)
    rows = []
    for r in sorted(runs, key=lambda r: r["seed"]):
        if (r["variant"], r["density"], r["dataset"], r["steps"], r.get("replicas", 1)) != \
                (variant, density, dataset, steps, 1):
            continue
        target = dense_loss_at(runs, dataset, r["seed"], target_step)
        if target is None:
            continue
        reached = steps_to_reach(r["curve"], steps // len(r["curve"]), target)
        rows.append((r["seed"], target, reached, target_step * step_seconds["dense"],
                     None if reached is None else seconds_for(reached, schedule, step_seconds)))
    return rows


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("curves", help="JSON lines of benchmarks/adamw_candidates.py run")
    parser.add_argument("e2e", help="python -m tf_topk.bench e2e ... --json output")
    parser.add_argument("--variant", default="demo:warm=auto")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--dataset", default="text")
    parser.add_argument("--steps", type=int, default=2000, help="the length of the variant's runs")
    parser.add_argument("--target-step", type=int, default=800, help="dense's loss at this step is the target")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_DENSITY_WARMUP_STEPS,
                        help="the variant's density warm-up (default the library's; a variant's warm=N: N)")
    parser.add_argument("--exchange-mode", default=None,
                        help="time the variant's steps on e2e's topk:<d>@MODE configurations (the variant's mode, "
                             "e.g. allgather_chunk for default:mode=allgather_chunk)")
    args = parser.parse_args(argv)
    with open(args.curves) as lines:
        runs = [json.loads(line) for line in lines if line.strip()]
    with open(args.e2e) as file:
        e2e = json.load(file)
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    rows = time_to_loss(runs, e2e, args.variant, args.density, args.dataset, args.steps, args.target_step,
                        args.warmup_steps, args.exchange_mode)
    if not rows:
        raise SystemExit(f"no seed of {args.variant} at {args.density:g} paired with dense in {args.curves}")
    for seed, target, reached, dense_s, variant_s in rows:
        faster = "never reached" if variant_s is None else f"{variant_s:8.1f} s  {dense_s / variant_s:5.2f}x sooner"
        print(f"seed {seed}: dense {target:.4f} at step {args.target_step} in {dense_s:8.1f} s; "
              f"{args.variant} reaches it at step {'-' if reached is None else f'{reached:.0f}'}: {faster}")
    ratios = [dense_s / variant_s for _, _, _, dense_s, variant_s in rows if variant_s]
    if ratios:
        print(f"median over {len(ratios)} of {len(rows)} seeds: {statistics.median(ratios):.2f}x sooner "
              f"({min(ratios):.2f}x to {max(ratios):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
