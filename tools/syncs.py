"""Count the host syncs a piece of training code would make on a GPU, on any device.

A host sync is the CPU waiting for the device: reading a number off it (``.item()``,
``float(t)``, ``if t:``, ``.tolist()``, ``.numpy()``), or an op whose output size depends on the
values (``nonzero``, ``bincount``, ``unique``, ``masked_select``, ``repeat_interleave`` by a
tensor without its ``output_size``). On the CPU nothing waits, but the same calls happen, so a
count taken there is the count a CUDA step makes: ``tests/test_syncs.py`` keeps the training
step's steady state at zero, and ``make gpu-check`` counts them on the GPU.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that read a value on the host or size their output by the values.
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.bincount",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.masked_select",
        "aten.equal",
        "aten.is_nonzero",
    }
)
#: Tensor methods that copy to the host without an aten op on a CPU tensor.
HOST_READS = ("tolist", "numpy")


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _crosses_host(args: tuple, kwargs: dict) -> bool:
    """A copy between the CPU and another device (a blocking one from pageable memory)."""
    tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    devices = {t.device.type for t in tensors}
    if kwargs.get("device") is not None:
        devices.add(torch.device(kwargs["device"]).type)
    return "cpu" in devices and len(devices) > 1


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.counts`` (a Counter of op names) and
    ``syncs.total``. Counts the dispatcher's :data:`SYNC_OPS`, ``repeat_interleave`` by a tensor
    with no ``output_size``, indexing by a boolean mask (a ``nonzero`` inside), copies between the
    host and a device, and the Python-level :data:`HOST_READS` of any tensor. On a GPU,
    :class:`StepSyncs` adds what CUDA's own sync debug mode reports."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    @property
    def total(self) -> int:
        """Host syncs counted so far."""
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.counts[name] += 1
        elif name == "aten.repeat_interleave" and isinstance(args[0], torch.Tensor):
            if kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None):
                self.counts["aten.repeat_interleave(tensor repeats)"] += 1
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and _bool_index(args):
            self.counts[f"{name}(boolean mask)"] += 1
        elif name in ("aten._to_copy", "aten.copy_") and _crosses_host(args, kwargs):
            self.counts[f"{name}(host <-> device)"] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        for method in HOST_READS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            setattr(torch.Tensor, method, self._counted(method, original))
        return super().__enter__()

    def _counted(self, method: str, original: Any) -> Any:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.counts[f"Tensor.{method}"] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc: object) -> None:
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)


class StepSyncs(pl.Callback):
    """A Lightning callback: the host syncs of each training step, from its start to the next
    step's start (everything the step causes), in ``steps`` (global step -> op -> count)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, int]] = {}
        self._mode: HostSyncCounter | None = None
        self._caught: list | None = None
        self._step = -1

    def _close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            counts = dict(self._mode.counts)
            if self._caught is not None:  # CUDA's own count: every synchronising call it saw
                torch.cuda.set_sync_debug_mode(0)
                seen = sum("synchroniz" in str(w.message) for w in self._caught)
                self._warnings.__exit__(None, None, None)
                if seen:
                    counts["cuda sync debug mode"] = seen
            self.steps[self._step] = counts
            self._mode, self._caught = None, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._close()
        if torch.cuda.is_available():
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)  # warn at each synchronising CUDA call
        self._step, self._mode = trainer.global_step, HostSyncCounter().__enter__()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def steady(self, log_every: int) -> dict[int, dict[str, int]]:
        """The steps between checks (not the last of a ``log_every`` window, not the first step)."""
        return {s: c for s, c in self.steps.items() if s > 0 and (s + 1) % log_every}
