"""Typed run configuration: the single source of truth; YAML is only a serialisation of it.

One :class:`RunConfig` is one trainable cell: the model (``experiments.model_config``: shape,
gate, experts), the training recipe (``experiments.train_config``), the data
(``experiments.data_config``) and the seed. This module re-exports them all, so
``from experiments.config import ...`` names every part.

Every dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError`, which
carries the dotted key path of the offending field so the grid loader can name it.
``from_dict`` (``experiments.strict``) builds a dataclass tree from plain mappings strictly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.data_config import BackcopyConfig, DataConfig, DataSource
from experiments.model_config import PAPER_WIDTH, GateConfig, ModelConfig, MoEConfig
from experiments.strict import ConfigError, from_dict, identity_dict, to_dict
from experiments.train_config import MAX_STEPS, TrainConfig

__all__ = [
    "MAX_STEPS", "PAPER_WIDTH", "BackcopyConfig", "ConfigError", "DataConfig", "DataSource", "GateConfig",
    "ModelConfig", "MoEConfig", "RunConfig", "TrainConfig", "from_dict", "identity_dict", "to_dict",
]  # fmt: skip


def embedding_rows(token_ids: int) -> int:
    """The most embedding rows a model of a tokenizer of ``token_ids`` ids may have: the ids
    rounded up to a multiple of 128 (as Qwen pads its vocabulary); 0 for 0 (not known yet)."""
    return -(-token_ids // 128) * 128


@dataclass(frozen=True)
class RunConfig:
    """One trainable cell: model, training, data and seed. Its hash is the cell's ``run_key``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**32:  # what NumPy and Lightning's seed_everything accept
            raise ConfigError("seed", f"must be in [0, 2^32), got {self.seed}")
        if self.model.max_seq_len < self.train.seq_len:
            raise ConfigError(
                "model.max_seq_len",
                f"must cover train.seq_len={self.train.seq_len}, got {self.model.max_seq_len}",
            )
        if self.model.vocab_size < self.data.token_vocab():
            raise ConfigError(
                "model.vocab_size",
                f"must hold the data's {self.data.token_vocab()} token ids, got {self.model.vocab_size}",
            )
        most = embedding_rows(self.data.token_vocab()) if self.data.synthetic is None else 0  # a BPE's
        if self.model.vocab_size > most > 0:
            raise ConfigError(
                "model.vocab_size",
                f"must be at most the data's {self.data.token_vocab()} token ids rounded up to a multiple of "
                f"128 ({most}), got {self.model.vocab_size}: no token would ever train the other rows",
            )
        task = self.data.synthetic
        if task is not None and self.train.seq_len + 1 > task.seq_tokens:
            raise ConfigError(
                "train.seq_len",
                f"a window of seq_len + 1 tokens must fit in data.synthetic.seq_tokens={task.seq_tokens}, "
                f"got seq_len={self.train.seq_len}",
            )
