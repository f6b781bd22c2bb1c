"""Which numbers the code computes: one CPU arithmetic per class of Intel machine, and its version.

**Why pinned.** Training is chaotic: a difference in the last bit of one matmul grows to about 1 %
of Avg PPL in 400 `tiny` steps. Left alone, torch and MKL pick each CPU's fastest kernels, each
summing in its own order: the same commit and corpus gave Table 1's baseline 147.07 on this
project's Xeon (its AVX-512 kernels), 146.29 on it with AVX2 kernels, and 146.11 on the machine
issue 26 was measured on (docs/reproducing.md). Pinned, torch's vectorised kernels run their AVX2
build (``ATEN_CPU_CAPABILITY=avx2``: every x86-64 CPU since 2013 has it, and it costs nothing
measurable here) and MKL's BLAS runs one fixed branch (``MKL_CBWR``, Intel's "conditional numerical
reproducibility"): ``AVX512`` on a CPU with AVX-512 (every Xeon since Skylake-SP), ``AVX2`` on one
without. Every Intel CPU of one class then computes the same bits (MKL's guarantee; for the AVX2
branch checked under an emulated Haswell, docs/reproducing.md). The two classes differ from each
other: MKL's AVX2 branch would join them, at about 20 % of a `tiny` step on an AVX-512 Xeon, which
the default sweep's 20 minutes cannot spare. MKL honours a branch on Intel CPUs only: an AMD CPU
computes numbers of its own. ARM CPUs have other kernels altogether.

The variables must be set before torch computes anything (importing torch is fine);
``experiments/__init__.py`` and ``sweep/__init__.py`` call :func:`pin_cpu_arithmetic` first.
``GATED_ATTN_CPU_ARITH=native`` leaves the CPU's own kernels; a variable the user set is kept
(``MKL_CBWR=AVX2`` on an AVX-512 machine computes the other class's numbers). Every run records
:func:`cpu_arithmetic`, and a table never mixes runs of different arithmetic
(``sweep.report.runs.one_arithmetic``).

**NUMBERS_VERSION** names what the training code computes. The golden test
(``tests/test_golden.py``) pins a micro dense, a gated and a MoE cell's losses and validation PPLs
under each pinned arithmetic to this version; a change that moves them must bump it, and the
version is part of every run key, so a sweep retrains what the current code computes instead of
reusing runs of older numbers.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: Bump with the golden numbers (``make golden``) when a change moves the training arithmetic.
#: 1: every run before the CPU arithmetic was pinned (not keyed).
NUMBERS_VERSION = 2

OPT_OUT = "GATED_ATTN_CPU_ARITH"  # "native": the CPU's own kernels
X86 = ("x86_64", "amd64", "AMD64")
#: The CPU flags of MKL's AVX-512 branch (Skylake-SP and every Xeon since).
AVX512_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
#: :func:`cpu_arithmetic` of a pinned process on an Intel CPU with AVX-512, and on one without:
#: the two arithmetics the golden numbers are kept for (``tests/golden/micro.json``).
PINNED_ARITHMETICS = ("avx2, mkl AVX512, GenuineIntel", "avx2, mkl AVX2, GenuineIntel")


def cpu_info() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {}
    info = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... (``/proc/cpuinfo``), else the platform's processor
    string, else ``unknown``."""
    return cpu_info().get("vendor_id") or platform.processor() or "unknown"


def mkl_branch() -> str:
    """MKL's CNR branch for this CPU: ``AVX512`` where it has AVX-512 (``/proc/cpuinfo`` lists
    :data:`AVX512_FLAGS`), else ``AVX2``."""
    return "AVX512" if AVX512_FLAGS <= set(cpu_info().get("flags", "").split()) else "AVX2"


def pinned() -> dict[str, str]:
    """The variables that pin the arithmetic here: torch's AVX2 kernels, MKL's :func:`mkl_branch`."""
    return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": mkl_branch()}


def pin_cpu_arithmetic() -> None:
    """Set :func:`pinned` in ``os.environ`` on x86-64 (``setdefault``: the user's values win),
    unless ``GATED_ATTN_CPU_ARITH=native``. Takes effect only in a process whose torch has not
    computed anything yet; :func:`cpu_arithmetic` reports what is actually in force."""
    if os.environ.get(OPT_OUT, "").lower() == "native" or platform.machine() not in X86:
        return
    for key, value in pinned().items():
        os.environ.setdefault(key, value)


def cpu_arithmetic() -> str:
    """The CPU arithmetic in force in this process, as a run's ``cpu_arith`` tag records it:
    torch's kernel build, MKL's branch and the CPU's vendor, e.g. ``avx2, mkl AVX512,
    GenuineIntel`` (pinned: the same bits on every Intel CPU with AVX-512) or ``avx512, mkl auto,
    GenuineIntel`` (the CPU's own kernels). MKL ignores a branch on a non-Intel CPU, so there it
    reads ``mkl auto``."""
    import torch

    vendor = cpu_vendor()
    branch = os.environ.get("MKL_CBWR", "").split(",")[0].upper() or "auto"
    if vendor != "GenuineIntel" and branch != "COMPATIBLE":
        branch = "auto"  # MKL runs its AUTO branch outside Intel's CPUs
    return f"{torch.backends.cpu.get_cpu_capability().lower()}, mkl {branch}, {vendor}"
