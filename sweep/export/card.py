"""The model card (``README.md``) of an exported folder: where the weights come from and what
they scored, from the run's tags, params and metrics."""

from __future__ import annotations

from experiments import names as N
from experiments.hf.layout import CAUSAL_LM, GATED, family
from sweep.export.runs import ExportJob


def model_card(job: ExportJob, folder_name: str, tokenizer: str = "—") -> str:
    """Markdown with a YAML header (``library_name: transformers``): grid, row and the paper's
    row, scale, training tokens, run id, commit, numbers version, the transformers class, the
    tokenizer (``tokenizer``: where it came from, its special tokens) and how to load it, then Avg
    PPL per domain and every benchmark score of the run."""
    run, cfg = job.run, job.config
    tags, metrics = run.data.tags, run.data.metrics
    name = family(cfg.model)
    remote = name == GATED
    train = cfg.train
    facts = [
        ("grid", tags.get("grid", "—")),
        ("row", f"{tags.get('row', '—')}: {tags.get('label', '')}".rstrip(": ")),
        ("paper row", job.paper_row),
        ("scale", tags.get("scale", "—")),
        ("seed", str(cfg.seed)),
        ("training tokens", f"{train.max_steps * train.batch_size * train.seq_len:,}"),
        ("run id", run.info.run_id),
        ("experiment", job.experiment),
        ("commit", tags.get("git_commit", "—")),
        ("numbers version", tags.get("numbers", "—")),
        ("transformers class", CAUSAL_LM[name] + (" (custom code in this folder)" if remote else "")),
        ("tokenizer", tokenizer),
    ]
    lines = [
        "---",
        "library_name: transformers",
        "tags: [gated-attention, qwen3]",
        "---",
        "",
        f"# {tags.get('grid', 'run')} / {tags.get('row', run.info.run_id)} (seed {cfg.seed})",
        "",
        'A model of the gated-attention ablation harness ("Gated Attention for Large Language Models",',
        "Qiu et al. 2025), exported from its Lightning checkpoint.",
        "Its float32 logits equal the harness model's (relative 1e-5; tests/test_export.py).",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in facts),
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'path = "{folder_name}"',
        "model = AutoModelForCausalLM.from_pretrained(path"
        + (", trust_remote_code=True)" if remote else ")"),
        "tokenizer = AutoTokenizer.from_pretrained(path" + (", trust_remote_code=True)" if remote else ")"),
        "```",
        "",
        "## Validation perplexity (last evaluation)",
        "",
        "| domain | PPL |",
        "|---|---|",
    ]
    domains = sorted(k for k in metrics if N.domain_of(k) is not None)
    lines += [f"| {N.domain_of(k)} | {metrics[k]:.3f} |" for k in domains]
    if N.VAL_PPL_AVG in metrics:
        lines.append(f"| **Avg PPL** | **{metrics[N.VAL_PPL_AVG]:.3f}** |")
    bench = sorted(k for k in metrics if k.startswith("bench/") and not k.endswith("_stderr"))
    lines += ["", "## Benchmark scores", ""]
    if bench:
        lines += [
            "| score | value |",
            "|---|---|",
            *(f"| {k.removeprefix('bench/')} | {metrics[k]:.4f} |" for k in bench),
        ]
    else:
        lines.append("None logged (`make eval` scores a run).")
    return "\n".join(lines) + "\n"
