"""The science: model, gates, data and training, usable without the sweep harness.

``experiments.train.Training`` trains one :class:`~experiments.config.RunConfig`; nothing here
imports ``sweep``.
"""
