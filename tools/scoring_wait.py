"""What OpenMP's wait policy does to a process's first scoring pass: ``python -m tools.scoring_wait``.

Runs the same forward passes (the ``tiny`` model of Table 1, batches of 4 x 128 tokens, log-softmax,
as lm-eval's log-likelihood requests do) in fresh processes on every core, alternately with
OpenMP's default wait policy and with ``OMP_WAIT_POLICY=PASSIVE`` (what ``sweep.cli`` sets), and
prints each one's seconds. The difference shows on a machine others are loading; on a quiet one
the two agree. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

_PASS = """
import os, time
import torch
from experiments.config import ModelConfig
from experiments.model import GatedLM
torch.set_num_threads(len(os.sched_getaffinity(0)))
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=16, n_kv_heads=2, head_dim=16,
                  ffn_dim=352, max_seq_len=128)
model = GatedLM(cfg).eval()
x = torch.randint(0, 2048, (4, 128))
t0 = time.perf_counter()
with torch.no_grad():
    for _ in range(int(os.environ["PASSES"])):
        model(x).float().log_softmax(-1)
print(f"{time.perf_counter() - t0:.2f}")
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the two policies")
    p.add_argument("--passes", type=int, default=150, help="forward passes a process")
    args = p.parse_args(argv)
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"PASSES": str(args.passes)}
    for r in range(1, args.rounds + 1):
        for name, env in (("default", base), ("PASSIVE", base | {"OMP_WAIT_POLICY": "PASSIVE"})):
            out = subprocess.run(
                [sys.executable, "-c", _PASS], env=env, capture_output=True, text=True, check=True
            )
            print(
                f"round {r}: {args.passes} forward passes, OMP_WAIT_POLICY {name}: {out.stdout.strip()} s",
                flush=True,
            )
    print(f"(load average now: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
