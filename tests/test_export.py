"""Exported models (experiments/hf, sweep/export): every Table 1, 3 and 4 row, written as a
transformers folder and loaded back, gives the harness's logits (float32, relative 1e-5) and greedy
tokens; YaRN maps to ``rope_parameters``; lm-eval's own ``hf`` backend scores a folder to the
harness wrapper's bits per byte. Micro widths, each row's own heads, experts and gate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.config import GateConfig, ModelConfig
from experiments.corpus import EOS
from experiments.hf.folder import write_folder
from experiments.hf.layout import GATED, QWEN3, QWEN3_MOE, QWEN3_NEXT, family
from experiments.lm_wrapper import GatedAttnLM
from experiments.model import GatedLM, YarnScaling
from sweep.grid import load_grid
from tests.support import ROOT, TEXT


def _micro(cfg: ModelConfig) -> ModelConfig:
    """The row's model at micro width: its heads, KV heads, experts, top-k and gate kept."""
    return dataclasses.replace(
        cfg, vocab_size=256, d_model=32, n_layers=2, head_dim=8, max_seq_len=32,
        moe=dataclasses.replace(cfg.moe, expert_dim=16) if cfg.moe else None,
    )  # fmt: skip


def _rows() -> dict[str, ModelConfig]:
    """Every row of Tables 1, 3 and 4 and of the G5 controls at ``tiny``, one per distinct model config."""
    found: dict[ModelConfig, str] = {}
    for table in ("table1", "table3", "table4", "g5_controls"):
        grid = load_grid(ROOT / "grids" / f"{table}.yaml")
        for row in grid.rows:
            found.setdefault(_micro(grid.resolve("tiny", row, 0).model), f"{table}:{row.id}")
    return {name: cfg for cfg, name in found.items()}


ROWS = _rows()
_DENSE = ModelConfig(
    vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32
)
#: beyond Tables 1, 3 and 4: dense models (Table 2's), where Qwen3-Next takes its plain SwiGLU path,
#: and the options only the custom code carries (sandwich norm, no qk-norm), tied embeddings
EXTRA = {
    "dense:baseline": _DENSE,
    "dense:sdpa_headwise": dataclasses.replace(
        _DENSE, gate=GateConfig(granularity="headwise"), match_params=True, ffn_multiple_of=8
    ),
    "dense:sandwich_norm": dataclasses.replace(_DENSE, sandwich_norm=True, tie_embeddings=True),
    "dense:no_qk_norm_key_gate": dataclasses.replace(_DENSE, qk_norm=False, gate=GateConfig(position="key")),
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def trained_like(cfg: ModelConfig, seed: int = 0) -> GatedLM:
    """A model whose every weight is moved off its initial value (norm gains, static gate logits
    and the group-norm gains too), so that no gate or norm is at a value that hides a mistake."""
    torch.manual_seed(seed)
    model = GatedLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def export(model: GatedLM, tokenizer_file: Path, dest: Path, **kwargs) -> Path:
    return write_folder(dest, model.cfg, model.state_dict(), tokenizer_file, 0, "card\n", **kwargs)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / ours.abs().max()).item()


def test_the_tables_rows_map_to_the_classes_the_issue_names() -> None:
    by_row = {name.split(":")[1]: family(cfg) for name, cfg in ROWS.items()}
    assert {r for r, f in by_row.items() if f == QWEN3_MOE} == {"baseline", "kv8", "q48", "add_experts"}
    assert {r for r, f in by_row.items() if f == QWEN3_NEXT} == {"sdpa_elementwise", "sdpa_headwise"}
    assert len(ROWS) == 24 and sum(f == GATED for f in by_row.values()) == 18  # 4 of them G5 controls
    assert [family(cfg) for cfg in EXTRA.values()] == [QWEN3, QWEN3_NEXT, GATED, GATED]


@pytest.mark.parametrize("row", sorted(ROWS) + sorted(EXTRA))
def test_an_exported_row_gives_the_harness_logits_and_greedy_tokens(
    row: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    cfg = ROWS.get(row) or EXTRA[row]
    model = trained_like(cfg)
    folder = export(model, tokenizer_file, tmp_path / "model")
    remote = family(cfg) == GATED
    assert (folder / "modeling_gated_qwen3.py").exists() == remote
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote).eval()
    assert type(hf).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    tokens = torch.randint(1, cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape == (3, 24, cfg.vocab_size)
    assert relative_error(ours, theirs) <= 1e-5

    prompts, new = tokens[:, :10], 12
    wrapper = GatedAttnLM(model, Tokenizer.from_file(str(tokenizer_file)), eot_id=0)
    expected = wrapper._greedy(prompts, new, [[] for _ in prompts])  # stops at EOS, as generate does
    with torch.no_grad():
        generated = hf.generate(prompts, max_new_tokens=new, do_sample=False)[:, 10:].tolist()
    got = [ids[: ids.index(0)] if 0 in ids else ids for ids in generated]
    assert got == expected and sum(map(len, got)) > 0


def test_qwen3_next_shared_expert_is_zero_wide_and_adds_exactly_nothing(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    cfg = ROWS["table1:sdpa_elementwise"]
    hf = AutoModelForCausalLM.from_pretrained(export(trained_like(cfg), tokenizer_file, tmp_path / "m"))
    block = hf.model.layers[0].mlp
    assert hf.config.shared_expert_intermediate_size == 0 and block.shared_expert.down_proj.weight.shape == (
        32,
        0,
    )
    x = torch.randn(5, 32)
    assert torch.equal(
        torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x), torch.zeros(5, 32)
    )
    assert set(hf.config.layer_types) == {"full_attention"}
    assert hf.config.rope_parameters["partial_rotary_factor"] == 1.0


def test_yarn_at_inference_is_transformers_rope_parameters(tokenizer_file: Path, tmp_path: Path) -> None:
    cfg = dataclasses.replace(ROWS["table1:value_elementwise"], max_seq_len=16)
    model = trained_like(cfg)
    yarn = YarnScaling(factor=4.0, original_max_position=16)
    folder = export(model, tokenizer_file, tmp_path / "yarn", yarn=yarn)
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == 64
    assert config["rope_parameters"] | {} == {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
    }  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    model.set_rope(max_seq_len=64, yarn=yarn)
    tokens = torch.randint(1, cfg.vocab_size, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(model(tokens), hf(tokens).logits) <= 1e-5


def test_the_tokenizer_loads_offline_and_encodes_as_the_corpus_tokenizer(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    folder = export(trained_like(ROWS["table1:baseline"]), tokenizer_file, tmp_path / "tok")
    theirs = AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer.from_file(str(tokenizer_file))
    text = "the cat sat on the mat.\n  a dog <|endoftext|> ran"
    assert theirs(text).input_ids == ours.encode(text).ids
    assert theirs.decode(ours.encode(text).ids) == text
    assert (theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id) == (0, 0, None)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["do_sample"]) == (0, False)


DOCS = [  # {context, choices, gold}: the wheel tasks' lines (sweep/eval/wheel_tasks.py)
    {"context": "the cat sat on the", "choices": [" mat.", " sky is blue."], "gold": 0},
    {"context": "a dog ran in", "choices": [" the park.", " the sun", " hot"], "gold": 0},
    {"context": "the sun is hot and the sky", "choices": [" is blue.", " sat on the mat."], "gold": 0},
    {
        "context": "Question: where did the dog run?\nAnswer:",
        "choices": [" in the park", " on the mat"],
        "gold": 0,
    },
]


@pytest.mark.parametrize("row", ["table1:sdpa_elementwise", "table1:value_elementwise"])
def test_lm_evals_own_hf_backend_scores_an_exported_folder_to_the_wrappers_bits_per_byte(
    row: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    import lm_eval.models  # noqa: F401  (lm-eval reads its model list lazily only while none is registered)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from sweep.eval.suite import WHEEL_HOOK, _wheel_task, _write_task

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "hellaswag.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    _write_task(tasks / "offline_hellaswag.yaml", _wheel_task("offline_hellaswag", tasks / "hellaswag.jsonl"))
    (tasks / "wheel_scores.py").write_text(WHEEL_HOOK)
    model = trained_like(ROWS[row])
    folder = export(model, tokenizer_file, tmp_path / "model")
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    scored = {}
    for name, lm in (
        ("wrapper", GatedAttnLM(model, Tokenizer.from_file(str(tokenizer_file)), eot_id=0, batch_size=2)),
        ("hf", "hf"),
    ):
        out = simple_evaluate(
            model=lm,
            model_args=None if name == "wrapper" else
            f"pretrained={folder},dtype=float32,device=cpu,trust_remote_code={family(ROWS[row]) == GATED}",
            tasks=["offline_hellaswag"], task_manager=manager, log_samples=True, batch_size=2,
        )  # fmt: skip
        scored[name] = [
            s["bpb"] for s in sorted(out["samples"]["offline_hellaswag"], key=lambda s: s["doc_id"])
        ]
        scored[name + "_mean"] = out["results"]["offline_hellaswag"]["bpb,none"]
    assert len(scored["hf"]) == len(DOCS) and all(b > 0 for b in scored["hf"])
    assert scored["hf"] == pytest.approx(scored["wrapper"], abs=1e-4)
    assert scored["hf_mean"] == pytest.approx(scored["wrapper_mean"], abs=1e-4)
