"""argparse types shared by the examples and benchmarks (standard library only,
so a script can parse its arguments before TensorFlow starts)."""

import argparse


def positive_int(text):
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def density(text):
    """A density in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def densities(text):
    """Comma-separated densities, each in (0, 1]."""
    values = [density(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated densities, got {text!r}")
    return values


def names_among(what, choices):
    """An argparse type: comma-separated names, each one of `choices` (`what` names them in the error)."""
    def parse(text):
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be among {','.join(choices)}, got {text!r}")
        return values

    return parse


def density_warmup_steps(text):
    """`density_warmup_steps`: "auto" (the library's default) or an integer >= 0."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}")
    return value


DENSITY_WARMUP_HELP = ("a fixed density's warm-up (density_warmup_steps): 'auto' (default: 400 steps from 0.25 for "
                       "a density of 0.01 or less), or steps (0: the density from the first step)")
