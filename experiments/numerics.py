"""Which numbers the code computes: one CPU arithmetic on every x86-64 machine, and its version.

**Why pinned.** Training is chaotic: a difference in the last bit of one matmul grows to about 1 %
of Avg PPL in 400 `tiny` steps. Left alone, torch and MKL pick each CPU's fastest kernels (AVX-512
on one Xeon, AVX2 on another, AMX-tuned blocking on a third), and each sums in its own order. The
same commit and the same corpus then gave Table 1's baseline 147.07 on this project's Xeon
(AVX-512), 146.29 on it with AVX2 kernels, and 146.11 on another machine (issue 26). Pinned, torch's
vectorised kernels run their AVX2 build (``ATEN_CPU_CAPABILITY``) and MKL's BLAS its AVX2 branch
(``MKL_CBWR``, Intel's "conditional numerical reproducibility"), so every Intel CPU since Haswell
(2013) computes the same bits: checked under emulated Haswell, Cascade Lake and EPYC CPUs
(docs/reproducing.md). MKL honours the branch on Intel CPUs only: an AMD CPU runs MKL's own path
and gets numbers of its own (``MKL_CBWR=COMPATIBLE`` would agree everywhere, at 2.2x the time).
The pin costs about 10 % of a `tiny` cell's speed on an AVX-512 Xeon.

The variables must be set before torch computes anything (importing torch is fine);
``experiments/__init__.py`` and ``sweep/__init__.py`` call :func:`pin_cpu_arithmetic` first.
``GATED_ATTN_CPU_ARITH=native`` leaves the CPU's own kernels (faster, not reproducible elsewhere);
a variable already set by the user is kept. Every run records :func:`cpu_arithmetic`, and a table
never mixes runs of different arithmetic (``sweep.report.runs.one_arithmetic``).

**NUMBERS_VERSION** names what the training code computes on that arithmetic. The golden test
(``tests/test_golden.py``) pins a micro dense and a micro MoE cell's losses and validation PPL to
this version; a change that moves them must bump it, and the version is part of every run key, so
a sweep retrains what the current code computes instead of reusing runs of older numbers.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: Bump with the golden numbers (``pytest tests/test_golden.py --update-golden``) when a change
#: moves the training arithmetic. 1: every run before the CPU arithmetic was pinned (not keyed).
NUMBERS_VERSION = 2

#: The variables that pin the arithmetic on x86-64, set unless the user set them already.
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
OPT_OUT = "GATED_ATTN_CPU_ARITH"  # "native": the CPU's own kernels
X86 = ("x86_64", "amd64", "AMD64")


def pin_cpu_arithmetic() -> None:
    """Set :data:`PINNED` in ``os.environ`` on x86-64 (``setdefault``: the user's values win),
    unless ``GATED_ATTN_CPU_ARITH=native``. Takes effect only in a process whose torch has not
    computed anything yet; :func:`cpu_arithmetic` reports what is actually in force."""
    if os.environ.get(OPT_OUT, "").lower() == "native" or platform.machine() not in X86:
        return
    for key, value in PINNED.items():
        os.environ.setdefault(key, value)


def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... from ``/proc/cpuinfo`` (Linux), else the
    platform's processor string, else ``unknown``."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_arithmetic() -> str:
    """The CPU arithmetic in force in this process, as a run's ``cpu_arith`` tag records it:
    torch's kernel build, MKL's branch and the CPU's vendor, e.g. ``avx2, mkl AVX2, GenuineIntel``
    (pinned on Intel: the same bits on every such machine) or ``avx512, mkl auto, GenuineIntel``.
    MKL ignores a branch on a non-Intel CPU, so there it reads ``mkl auto``."""
    import torch

    vendor = cpu_vendor()
    branch = os.environ.get("MKL_CBWR", "").upper() or "auto"
    if vendor != "GenuineIntel" and branch not in ("COMPATIBLE", "AUTO", "auto"):
        branch = "auto"  # MKL runs its AUTO branch outside Intel's CPUs
    return f"{torch.backends.cpu.get_cpu_capability().lower()}, mkl {branch}, {vendor}"


def is_pinned() -> bool:
    """Whether this process computes the pinned arithmetic the golden numbers were made with."""
    return cpu_arithmetic() == PINNED_ARITHMETIC


#: :func:`cpu_arithmetic` of a pinned process on an Intel CPU: the golden numbers' arithmetic.
PINNED_ARITHMETIC = "avx2, mkl AVX2, GenuineIntel"
