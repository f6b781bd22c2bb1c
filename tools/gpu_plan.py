"""What ``make gpu-check`` runs and how long each part takes on one H100, cold: the plan its budget
is checked against (``--dry-run`` prints it in one line) and that skips what does not fit.

A check's cost is counted from what it runs: compiled graphs, training steps at ``small`` or at
the micro scale, GPU tests, and the fixed work around them (a process start, a corpus to build, a
kernel warm-up). Every constant below is an estimate for one H100 with a cold compile cache, each
with where it comes from in docs/performance.md ("The plan's costs"); the report gives each
check's measured seconds, which replace them once a GPU has run it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds a new Python process needs before its first step: torch, Lightning and the project
#: imported, the CUDA context created.
START_S = 20.0
#: Seconds to build the offline text corpus of a ``small`` cell (3M characters, BPE of 16,384)
#: and of the micro cell (200k characters, BPE of 512), each in its own cache.
CORPUS_SMALL_S = 30.0
CORPUS_MICRO_S = 5.0
#: Seconds to compile one graph of ``small``'s training step (forward and backward), cold; one
#: this machine compiled before (inductor's on-disk cache); a GPU test's micro model.
COMPILE_S = 90.0
COMPILE_WARM_S = 25.0
COMPILE_MICRO_S = 45.0
#: Seconds Lightning takes to set up a cell (trainer, loaders, the first batch), beside its steps.
CELL_S = 10.0
#: Seconds a ``small`` step takes (32 x 512 tokens), compiled and eager; a micro step.
SMALL_STEP_S = {True: 0.10, False: 0.25}
MICRO_STEP_S = 0.05
#: Seconds of one GPU test (a micro model; one of them compiles), and of pytest's start.
TEST_S = 5.0
PYTEST_S = 15.0
#: The expert kernels (parity, bf16 and fp32; three paths timed) and the routing check.
KERNELS_S = 20.0
ROUTING_S = 5.0
#: Steps of a ``small`` cell, its warm-up before a packed window, and a packed window.
SMALL_STEPS = 100
PACK_WARMUP, PACK_WINDOW = 20, 60
#: Steps of the micro cell that counts host syncs.
MICRO_STEPS = 12


@dataclass(frozen=True)
class Check:
    """One check of ``make gpu-check``: its name, stage, and what it runs."""

    name: str
    stage: int
    fixed_s: float = 0.0
    compiles: int = 0
    warm_compiles: int = 0
    small_steps: dict[bool, int] | None = None  # compiled? -> steps
    micro_steps: int = 0
    tests: int = 0

    @property
    def seconds(self) -> float:
        """Its planned seconds on one H100 (module docstring)."""
        steps = sum(n * SMALL_STEP_S[compiled] for compiled, n in (self.small_steps or {}).items())
        tests = self.tests * TEST_S + (PYTEST_S + COMPILE_MICRO_S if self.tests else 0.0)
        return (
            self.fixed_s + self.compiles * COMPILE_S + self.warm_compiles * COMPILE_WARM_S + steps
            + self.micro_steps * MICRO_STEP_S + tests
        )  # fmt: skip


def checks(gpu_tests: int, pack: tuple[int, ...] = (2, 3)) -> list[Check]:
    """Every check in the order it runs: stage 1 (the most value per second: kernels, host syncs,
    one compiled ``small`` cell, the same eager), stage 2 (the GPU tests, ``pack`` cells packed
    on the GPU), stage 3 (a longer G1 cell). ``gpu_tests``: the tests ``pytest -m gpu`` runs."""
    packed = [
        # processes of their own; the first packing compiles cold, the next finds inductor's cache
        Check(
            f"{n} cells packed on one GPU",
            2,
            fixed_s=START_S + CELL_S + CORPUS_SMALL_S * (i == 0),
            compiles=int(i == 0),
            warm_compiles=int(i > 0),
            small_steps={True: n * (PACK_WARMUP + PACK_WINDOW)},
        )  # fmt: skip
        for i, n in enumerate(pack)
    ]
    return [
        Check("expert kernels", 1, fixed_s=START_S + KERNELS_S),
        Check("routing", 1, fixed_s=ROUTING_S),
        Check("host syncs, micro cell", 1, fixed_s=CORPUS_MICRO_S + CELL_S, micro_steps=MICRO_STEPS),
        Check(
            "small, compiled", 1, fixed_s=CORPUS_SMALL_S + CELL_S, compiles=1, small_steps={True: SMALL_STEPS}
        ),
        Check("small, eager", 1, fixed_s=CELL_S, small_steps={False: SMALL_STEPS}),
        Check("GPU tests", 2, fixed_s=START_S, tests=gpu_tests),
        *packed,
        Check(
            "small G1, compiled",
            3,
            fixed_s=START_S + CORPUS_SMALL_S + CELL_S,
            compiles=1,
            small_steps={True: 2 * SMALL_STEPS},
        ),  # fmt: skip
    ]


def planned(stage: int, gpu_tests: int) -> float:
    """The seconds ``stage``'s checks are planned to take on one H100, from a cold start."""
    return sum(c.seconds for c in checks(gpu_tests) if c.stage == stage)
