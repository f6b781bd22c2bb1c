"""Finished runs as Hugging Face transformers folders: ``make export RUNS=a,b`` (docs/export.md).

A job of its own beside ``sweep.run``, ``sweep.report`` and ``sweep.eval``: it reads the store
and the checkpoints through the shared base and writes with :mod:`experiments.hf`.
"""
