"""Which method runs: the memory each replica keeps and the way the summed pairs are applied.

Chosen in one place: `memory_for` (the memory an ExchangeConfig asks for) and `default_method` (what
`decoupled_momentum="auto"` resolves to for the Keras wrappers' inner optimizer). `DEFAULT_METHODS`
is the default's table, case by case: the README's "what the default does", the chief's lines
(`tf_topk.autopilot.Plan.method`, the wrappers' note where Adam does not get decoupled momentum) and
the docs read its words, and tests/test_docs_links.py checks that the README's table holds them.

How each method's sum reaches the variables is `tf_topk.updates`'s.
"""

import collections

from tf_topk.config import DECOUPLED_UP_TO_DENSITY
from tf_topk.decoupled_momentum import DecoupledMomentumMemory
from tf_topk.memory import (AdamMomentumCorrectionMemory, ErrorFeedbackMemory, MomentumCorrectionMemory, NoMemory,
                            RateScaledErrorFeedbackMemory)

# What runs, in the words every line and page uses.
EVERY_ENTRY = "every entry, dense"
DECOUPLED = "decoupled momentum (DeMo)"
TOP_K = "top-k with error feedback"

Case = collections.namedtuple("Case", ["optimizer", "density", "runs"])
# The default (no method asked for), case by case: the inner optimizer, the density given, what runs.
DEFAULT_METHODS = (
    Case("any", "none, where every entry is faster (one replica, a fast link, a small model)",
         f"{EVERY_ENTRY}, through the inner optimizer"),
    Case("Adam or AdamW", "none, where the plan sparsifies",
         f"{DECOUPLED} at the plan's density, 0.01, or 0.001's bytes in 14-bit entries"),
    Case("Adam or AdamW", f"{DECOUPLED_UP_TO_DENSITY:g} or less", DECOUPLED),
    Case("Adam or AdamW", f"above {DECOUPLED_UP_TO_DENSITY:g}, adaptive, or with amsgrad=True",
         f"{TOP_K} in front of the inner optimizer"),
    Case("any other", "none, where the plan sparsifies", f"{TOP_K} at a density chosen every step"),
    Case("any other", "given", TOP_K),
)


def memory_for(config, residuals=None):
    """The memory an ExchangeConfig asks for: momentum correction with
    `momentum` (Adam's with `beta_2`), DeMo's decoupled momentum
    (`decoupled_momentum=True`, its step `decoupled_step_scale`; "auto" is
    the Keras wrappers' to resolve,
    and off here), else error feedback (with ready-made `residuals`, if
    given), else none."""
    if config.decoupled_momentum is True:
        if residuals is not None:
            raise ValueError("residuals=... is for plain error feedback; decoupled momentum makes its own state")
        return DecoupledMomentumMemory(step_scale=config.decoupled_step_scale)
    if config.momentum is not None:
        if residuals is not None:
            raise ValueError("residuals=... is for plain error feedback; with momentum the memory makes its state")
        if config.beta_2 is not None:
            return AdamMomentumCorrectionMemory(config.momentum, config.beta_2, config.epsilon,
                                                config.variance_warmup_steps)
        return MomentumCorrectionMemory(config.momentum, nesterov=config.nesterov, masking=config.momentum_masking)
    if not config.error_feedback:
        if residuals is not None:
            raise ValueError("residuals=... keeps what is not sent: it needs error_feedback=True")
        return NoMemory()
    if config.rescale_residuals:
        return RateScaledErrorFeedbackMemory(residuals)
    return ErrorFeedbackMemory(residuals)


def default_method(config, adam, kind, amsgrad=False, skipped_option=None, asked=False):
    """decoupled_momentum="auto" resolved for a wrapper's inner optimizer: (True, False or "auto", the
    line the chief says where an inner Adam or AdamW does not get it, else None), by DEFAULT_METHODS.

    adam: the inner optimizer is Adam or AdamW (`kind`, its class's name); amsgrad: with AMSGrad;
    skipped_option: (name, value) of an inner option decoupled momentum would skip (tf_keras, whose
    exchange runs before the inner optimizer's own update; Keras 3 keeps every option); asked: another
    method was asked for (momentum correction, sparse updates, no error feedback, rescaled residuals,
    exchange parts), which runs.

    True at a fixed density of DECOUPLED_UP_TO_DENSITY or less (in 8-byte pairs' bytes: twice it with
    exchange_mode="allgather_int8"), a fixed route with no density given included (it runs
    FIXED_DEFAULT_DENSITY); "auto" with no density given on exchange_mode="auto" (the autopilot's plan decides:
    decoupled momentum where it sparsifies, `SparseExchange`'s `plan_decoupled_momentum`); False
    otherwise, and for "dense_bf16" (every entry in bfloat16 through the inner optimizer: its 16-bit
    baseline)."""
    if asked or not adam:
        return False, None
    keep = f"tf_topk: {TOP_K} in front of {kind}"
    if amsgrad:
        return False, f"{keep}, not decoupled momentum: amsgrad=True (decoupled momentum has no second moment)"
    if config.exchange_mode == "dense_bf16":
        return False, None
    if skipped_option is not None:
        name, value = skipped_option
        return False, (f"{keep}, not decoupled momentum: tf_keras's {kind} with {name}={value!r}, which decoupled "
                       "momentum would skip (Keras 3's tf_topk.TopKOptimizer keeps it)")
    if config.schedule.autopilot:
        return "auto", None
    density = config.schedule.settled_density()
    if density is None or config.schedule.adaptive is not None:
        return False, f"{keep}, not decoupled momentum: it takes a fixed density, got density={config.density!r}"
    if config.density_in_pair_bytes(density) > DECOUPLED_UP_TO_DENSITY:
        return False, (f"{keep} at density {density:g}; decoupled momentum is taken at "
                       f"{DECOUPLED_UP_TO_DENSITY:g} or less (decoupled_momentum=True takes it here)")
    return True, None
