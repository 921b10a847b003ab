"""TensorFlow's warnings in a process's output, for the journey tests.

The library's code must not make TensorFlow warn in `fit`, a custom loop,
saving or loading: a warning from its Python logger ("WARNING:tensorflow:"),
or AutoGraph's request to report a bug for a function it could not convert,
tells a user something is wrong that they cannot fix.
"""

import re

_WARNING = re.compile(r"^(\[worker \d+\] )?WARNING:tensorflow:|AutoGraph could not transform|"
                      r"Please report this to the TensorFlow team")


def tensorflow_warnings(output):
    """The lines of `output` (a process's stdout or stderr text) that are TensorFlow's warnings."""
    return [line for line in output.splitlines() if _WARNING.search(line)]
