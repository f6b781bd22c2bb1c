"""The harness: which cell, which run, which store. Importing it imports :mod:`experiments`
first, which pins the CPU arithmetic before torch computes anything (:mod:`experiments.numerics`)."""

import experiments  # noqa: F401
