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


class DeferredChecks:
    """The divergence and spike checks of training figures that stay on the device until read.

    Reading a number off a GPU waits for every kernel queued before it, so the training step
    queues its global-batch loss and gradient norm here as 0-d tensors and :meth:`check` reads
    them all in one transfer: every ``train.log_every`` steps, before a checkpoint and at the
    end of training. At ``log_every: 1`` each step is checked at once, before its backward pass
    (its loss) and before its optimiser step (its gradient norm). Between checks a non-finite
    gradient norm skips the optimiser step on the device (:class:`experiments.lit.LMModule`), so
    no weight ever turns non-finite, and a diverged loss is reported at the next check with the
    step it happened at.

    Args:
        spikes: the run's :class:`SpikeDetector`, fed each loss in step order.
        bound: the divergence bound, nats (:func:`divergence_bound`).
    """

    def __init__(self, spikes: SpikeDetector, bound: float) -> None:
        self.spikes, self.bound = spikes, bound
        self._pending: list[tuple[int, int, object]] = []  # (step, 0 loss / 1 grad norm, 0-d tensor)

    def add_loss(self, step: int, loss: object) -> None:
        """Queue the 0-d training loss of optimiser step ``step``."""
        self._pending.append((step, 0, loss))

    def add_grad_norm(self, step: int, norm: object) -> None:
        """Queue the 0-d gradient norm (before clipping) of optimiser step ``step``."""
        self._pending.append((step, 1, norm))

    def check(self, strict: bool = True) -> list[tuple[int, float]]:
        """Read the queued figures in one transfer and check them in step order (a step's loss
        before its gradient norm); returns the (step, loss) pairs read, spikes included.

        Raises:
            Diverged: at the first diverged loss or non-finite gradient norm (``strict``; with
                ``strict`` False the checks only feed the spike detector, for a run already ending).
        """
        if not self._pending:
            return []
        import torch

        pending, self._pending = sorted(self._pending, key=lambda p: (p[0], p[1])), []
        values = torch.stack([p[2].detach().float().reshape(()) for p in pending]).tolist()
        losses = []
        for (step, kind, _), value in zip(pending, values):
            if kind == 1:
                if strict and not math.isfinite(value):  # the step was skipped on the device
                    raise Diverged(step, value, math.inf, what="gradient norm")
                continue
            if strict:
                check_divergence(step, value, self.bound)
            self.spikes.update(step, value)
            losses.append((step, value))
        return losses
