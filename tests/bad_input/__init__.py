"""The library's bad-input suite: every public entry point called with malformed arguments.

Each rejected call must raise ``ValueError`` or ``TypeError`` naming the argument, and leave
the state it touches as it was (parameters, their ``.grad`` and ``main_grad``, the FP8 weight
cache, the queue of delayed weight gradients). Valid but unusual calls (no rows, empty groups,
one group, one column) must equal a float64 reference written with plain torch loops.

Inputs are counted by class (``type``, ``dtype``, ``device``, ``shape``, ``range``,
``aliasing``, ``order``, ``valid``) in :data:`tests.bad_input.checks.TRIED`; the package's
``conftest.py`` prints the counts at the end of a run.
"""
