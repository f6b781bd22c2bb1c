"""The science: model, gates, data and training, usable without the sweep harness.

``experiments.train.Training`` trains one :class:`~experiments.config.RunConfig`; nothing here
imports ``sweep``. Importing the package pins the CPU arithmetic first
(:mod:`experiments.numerics`), so a cell computes the same numbers on every x86-64 Intel machine.
"""

from experiments.numerics import pin_cpu_arithmetic

pin_cpu_arithmetic()
