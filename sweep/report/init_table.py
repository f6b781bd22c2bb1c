"""``make init-table``: the gate at initialisation at the `tiny` and the paper's width, with the
fixed init (std 0.02 everywhere) and the width-aware one (``ModelConfig.init_ref_width``):
``results/init_distribution.md``.

One layer of each width (Table 1's attention shape at that scale, dense FFN: the FFN does not
touch these numbers) on random tokens, whose pre-normed embeddings are what layer 0's gate reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments import names as N
from experiments.config import PAPER_WIDTH, GateConfig, ModelConfig
from experiments.init_stats import init_statistics
from experiments.model import GatedLM
from sweep.report.display import markdown_table

#: (scale, d_model, query heads, KV heads, head_dim) of Table 1 (grids/table1.yaml)
WIDTHS = (("tiny", 128, 16, 2, 16), ("paper", 2048, 32, 4, 128))
GATES = {
    "sigmoid": GateConfig(),
    "silu": GateConfig(activation="silu"),
    "group_norm": GateConfig(kind="rmsnorm"),
}
TOKENS, SEQS, SEQ_LEN = 512, 4, 128


def init_rows(seed: int = 0) -> pd.DataFrame:
    """One line per (scale, init): gate logit std, the sigmoid score's 5-95 % range and the
    branch scale of the sigmoid gate, the multiplicative SiLU gate and the group-norm control."""
    lines = []
    tokens = torch.randint(0, TOKENS, (SEQS, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    for scale, d, heads, kv, head_dim in WIDTHS:
        for init, ref in (("fixed 0.02", None), ("width-aware", PAPER_WIDTH)):
            line: dict[str, object] = {"scale": scale, "d_model": d, "init": init}
            for name, gate in GATES.items():
                cfg = ModelConfig(
                    vocab_size=TOKENS, d_model=d, n_layers=1, n_heads=heads, n_kv_heads=kv,
                    head_dim=head_dim, ffn_dim=128, gate=gate, init_ref_width=ref,
                )  # fmt: skip
                torch.manual_seed(seed)
                model = GatedLM(cfg)
                stats = init_statistics(model, tokens)
                line[f"{name}_branch_scale"] = stats[N.BRANCH_SCALE_INIT]
                if name == "sigmoid":
                    line["linear_std"] = cfg.linear_init_std()
                    line["logit_std"] = stats[N.GATE_LOGIT_STD_INIT]
                    line["score_q05"], line["score_q95"] = _score_range(model, tokens)
            lines.append(line)
    return pd.DataFrame(lines)


@torch.no_grad()
def _score_range(model: GatedLM, tokens: torch.Tensor) -> tuple[float, float]:
    attn = model.blocks[0].attn
    x = model.blocks[0].attn_norm(model.embed(tokens))
    scores = torch.sigmoid(attn.in_proj(x)[..., -attn.split_sizes[-1] :]).flatten().numpy()
    low, high = np.quantile(scores, [0.05, 0.95])
    return float(low), float(high)


def markdown(table: pd.DataFrame, command: str) -> str:
    """The table as Markdown with its notes."""
    shown = pd.DataFrame(
        {
            "Scale (d)": [f"{s} ({d})" for s, d in zip(table["scale"], table["d_model"])],
            "Init": table["init"],
            "Linear std": [f"{v:.4f}" for v in table["linear_std"]],
            "Gate logit std": [f"{v:.3f}" for v in table["logit_std"]],
            "Sigmoid score 5-95 %": [
                f"{a:.2f}-{b:.2f}" for a, b in zip(table["score_q05"], table["score_q95"])
            ],
            "Branch scale: sigmoid": [f"{v:.2f}" for v in table["sigmoid_branch_scale"]],
            "SiLU gate": [f"{v:.2f}" for v in table["silu_branch_scale"]],
            "Group-norm control": [f"{v:.2f}" for v in table["group_norm_branch_scale"]],
        }
    )
    return (
        "# The gate at initialisation, by width and init\n\n"
        f"Written by `{command}`: one layer of Table 1's attention shape at each width, "
        f"{SEQS} x {SEQ_LEN} random tokens, seed 0.\n\n"
        + markdown_table(shown)
        + "\n\nGate logit std: std of XW (X the pre-normed input). Branch scale: RMS of the attention "
        "output with the gate over its RMS with the gate bypassed (same input). Width-aware: linear "
        f"weights at 0.02 sqrt({PAPER_WIDTH} / d), embeddings at 0.02.\n"
    )


def main(argv: list[str] | None = None) -> int:
    from sweep.cli_parser import OneLineParser  # a bad option: one line, exit 2

    parser = OneLineParser(prog="python -m sweep.report.init_table", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"), help="an existing, writable folder")
    args = parser.parse_args(argv)
    if not args.results.is_dir() or not os.access(args.results, os.W_OK | os.X_OK):  # before a minute's work
        parser.error(f"--results {args.results}: not a folder this user can write into")
    out = args.results / "init_distribution.md"
    text = markdown(init_rows(), "make init-table")
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
