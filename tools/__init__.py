"""Operational scripts, run from a checkout with ``python -m tools.<name>`` (the Makefile's
``gpu-check``, ``ui-check``, ``servers-check``, ``corpus-bench``, ``throughput``): checks and
benchmarks that print figures. Not part of the installed package; nothing in ``experiments`` or
``sweep`` imports them."""
