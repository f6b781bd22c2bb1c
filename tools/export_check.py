"""Exported folders against their runs: ``python -m tools.export_check results/export/<exp>/<row>_s0 ...``.

Each folder is loaded offline with ``AutoModelForCausalLM`` and ``AutoTokenizer``
(``trust_remote_code`` only where ``config.json`` has an ``auto_map``). Its run's ``final.ckpt``
is loaded in the harness's own model (the run id and the store come from the folder's model card
and ``--results``). One line per folder: the class, the parameters, the largest logit difference
on 4 x 128 tokens of the run's English test split (absolute, and over the largest logit), and
whether 32 greedy tokens after 16 equal the harness's (docs/export.md). Exit status 1 when a
folder's logits differ by more than 1e-5 relative or its greedy tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools.export_check", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="exported folders (make export)")
    parser.add_argument("--results", default="results", help="the results folder the runs are in")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import yaml
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experiments.checkpointing import load_weights
    from experiments.config import RunConfig, from_dict
    from experiments.corpus import build_corpus
    from experiments.lm_wrapper import GatedAttnLM
    from experiments.model import GatedLM
    from sweep.store_urls import tracking_uri

    client = MlflowClient(tracking_uri=tracking_uri(Path(args.results)))
    failed = 0
    for folder in map(Path, args.folders):
        card = (folder / "README.md").read_text()
        run_id = next(line.split("|")[2].strip() for line in card.splitlines() if line.startswith("| run id"))
        run = client.get_run(run_id)
        stored = Path(client.download_artifacts(run_id, "config.yaml")).read_text()
        config = from_dict(RunConfig, yaml.safe_load(stored))
        model = GatedLM(config.model).eval()
        state = load_weights(Path(run.data.tags["checkpoint"]))
        model.load_state_dict(
            {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        )
        corpus = build_corpus(config.data, None, log=lambda _msg: None)
        tokens = torch.from_numpy(corpus.tokens("test", "english")[: 4 * 128].astype("int64")).view(4, 128)
        remote = "auto_map" in json.loads((folder / "config.json").read_text())
        hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote).eval()
        AutoTokenizer.from_pretrained(folder, trust_remote_code=remote)
        with torch.no_grad():
            ours, theirs = model(tokens), hf(tokens).logits
            wrapper = GatedAttnLM(model, corpus.tokenizer(), eot_id=corpus.eos_id)
            expected = wrapper._greedy(tokens[:, :16], 32, [[] for _ in range(4)])
            generated = hf.generate(tokens[:, :16], max_new_tokens=32, do_sample=False)[:, 16:].tolist()
        got = [g[: g.index(corpus.eos_id)] if corpus.eos_id in g else g for g in generated]
        diff = (ours - theirs).abs().max().item()
        relative = diff / ours.abs().max().item()
        params = sum(p.numel() for p in hf.parameters())
        print(
            f"{folder}: {type(hf).__name__}, trust_remote_code={remote}, {params:,} parameters; "
            f"logits max |diff| {diff:.1e} (relative {relative:.1e}); greedy 4 x 32 equal: {got == expected}"
        )
        failed += relative > 1e-5 or got != expected
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
