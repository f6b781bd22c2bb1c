"""What the training device changes: the precision ``auto`` means, scoring under autocast, the
random generators a checkpoint carries, and the arithmetic a run is tagged with.

On the CPU nothing here changes a number: ``auto`` is fp32, scoring runs in fp32 as it always did,
and the arithmetic tag is :func:`experiments.numerics.cpu_arithmetic`'s. On a CUDA GPU with native
bf16, training runs in bf16-mixed, and so does everything that scores a model (probes, step-0
statistics, long context, benchmarks); an older GPU trains and scores in fp32.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def auto_precision(requested: str) -> str:
    """Lightning's precision for ``train.precision``: ``auto`` is ``bf16-mixed`` on a CUDA GPU
    with native bf16 (Ampere and later) and ``32-true`` elsewhere: on the CPU, and on an older GPU,
    where bf16 would be emulated without flash attention, and fp16 would need a loss scale that
    the fused optimiser's clipping and the divergence checks do not handle. Any other value is
    returned as it is."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16-mixed"
    return "32-true"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a Lightning precision (``bf16-mixed`` -> bfloat16), or None."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


@contextlib.contextmanager
def scoring_precision(device: torch.device | str, precision: str = "auto") -> Iterator[None]:
    """Score a model on ``device`` in the precision it trains in there (``precision``: the run's
    ``train.precision`` or Lightning's resolved one): under bf16 autocast for ``bf16-mixed`` on
    CUDA; unchanged on the CPU (the fp32 numbers every table holds) and for fp32. Matmuls left in
    fp32 (the router) stay true fp32. Reductions (PPL sums, probe statistics) stay in fp32 or
    fp64: callers cast before summing."""
    dtype = autocast_dtype(auto_precision(precision))
    if torch.device(device).type != "cuda" or dtype is None:
        yield
        return
    with torch.autocast("cuda", dtype=dtype):
        yield


def rng_state() -> dict:
    """Python, NumPy, torch CPU and (when present) the current CUDA device's generator states, in
    a form ``torch.load(weights_only=True)`` accepts (tensors, ints, strings, lists)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned. A CUDA state restores the current device's
    generator (a checkpoint of an older version holds every device's: the first, where every
    worker trained), so a resume on a machine with fewer GPUs, or none, works."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"][0])


def gpu_arithmetic() -> str | None:
    """The GPU's side of a run's arithmetic, e.g. ``cuda 12.8, sm_90`` (its CUDA build and compute
    capability: the kernels cuBLAS and flash attention pick); None on the CPU, where
    :func:`experiments.numerics.cpu_arithmetic` names it. The precision is the run's own tag."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"cuda {torch.version.cuda}, sm_{major}{minor}"
