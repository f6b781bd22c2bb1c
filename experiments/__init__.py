"""The science: model, gates, data and training, usable without the sweep harness."""

#: Model bases this code can build; a grid row that ``requires`` another is reported, not trained.
SUPPORTED_FEATURES = frozenset({"dense", "moe"})
