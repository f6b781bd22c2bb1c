"""``make throughput``: training speed measured in one process, variants interleaved.

- :mod:`tools.throughput.bare`: tokens/s of a bare PyTorch loop (the recipe's loss, router
  losses and AdamW; no Lightning, no MLflow) for each row, and a MoE row's dense twin.
- :mod:`tools.throughput.harness`: the harness's Lightning + MLflow loop against that bare loop.
- :mod:`tools.throughput.breakdown`: where one step's time goes: attention, FFN or experts,
  the rest of the model, the optimiser, the metric logging.

Run as ``python -m tools.throughput``; nothing else imports this package.
"""
