"""Run-time stops that are not configuration errors (kept free of heavy imports for train.py)."""


class NonFiniteError(Exception):
    """Training stopped on a non-finite loss or gradient (train.on_nonfinite=stop)."""
