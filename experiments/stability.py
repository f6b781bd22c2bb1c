"""Training stability: loss spikes (Figure 1 right) and divergence (Table 2's "–" rows).

Spike rule (after OLMo-core's stability monitor): a finite training loss is a spike when it
exceeds the mean of the previous ``window`` losses by more than ``z`` sample standard
deviations of those losses. Every finite loss, spikes included, then enters the window. No
spike can be called before the window is full.

Divergence: a non-finite loss, or a loss above ``factor * ln(V)``; ``ln V`` nats is what a
uniform prediction over the vocabulary costs, so a model that far above it has blown up. A
non-finite gradient norm is divergence too (a finite loss can still back-propagate NaN), caught
before the optimiser step so no checkpoint ever holds non-finite weights.
"""

from __future__ import annotations

import math
from collections import deque


class Diverged(RuntimeError):
    """Training stopped because the loss (or the gradient) diverged.

    Attributes:
        step: the optimiser step (0-based) that diverged.
        loss: the value that diverged (may be NaN or inf).
        what: ``"training loss"`` or ``"gradient norm"``.
    """

    def __init__(self, step: int, loss: float, bound: float, what: str = "training loss") -> None:
        self.step, self.loss, self.bound, self.what = step, loss, bound, what
        why = "is not finite" if not math.isfinite(loss) else f"exceeds the bound {bound:.3g}"
        super().__init__(f"{what} {loss:.4g} at step {step} {why}")

    def __reduce__(self) -> tuple:
        """Pickles with its fields (a rank of a multi-process run hands it to its parent)."""
        return Diverged, (self.step, self.loss, self.bound, self.what)


def divergence_bound(vocab_size: int, factor: float) -> float:
    """The largest acceptable training loss in nats: ``factor * ln(vocab_size)``."""
    return factor * math.log(vocab_size)


class SpikeDetector:
    """Counts loss spikes with the running-window z-score rule of this module's docstring.

    Args:
        window: number of previous losses the mean and standard deviation are taken over.
        z: threshold in standard deviations.
    """

    def __init__(self, window: int, z: float) -> None:
        self.window, self.z = window, z
        self.recent: deque[float] = deque(maxlen=window)
        self.spikes: list[tuple[int, float]] = []  # (step, loss)

    def update(self, step: int, loss: float) -> bool:
        """Feed the loss of ``step``; True when it is a spike. Non-finite losses are ignored
        here (they are divergence, see :func:`check_divergence`)."""
        if not math.isfinite(loss):
            return False
        spike = False
        if len(self.recent) == self.window:
            n = len(self.recent)
            mean = sum(self.recent) / n
            std = math.sqrt(sum((v - mean) ** 2 for v in self.recent) / (n - 1))
            spike = loss > mean + self.z * std
        if spike:
            self.spikes.append((step, loss))
        self.recent.append(loss)
        return spike

    def state_dict(self) -> dict:
        """Plain state for checkpoints."""
        return {"recent": list(self.recent), "spikes": [list(s) for s in self.spikes]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.recent = deque(state["recent"], maxlen=self.window)
        self.spikes = [(int(s), float(v)) for s, v in state["spikes"]]


def check_divergence(step: int, loss: float, bound: float) -> None:
    """Raise :class:`Diverged` when ``loss`` is non-finite or above ``bound`` (nats)."""
    if not math.isfinite(loss) or loss > bound:
        raise Diverged(step, loss, bound)
