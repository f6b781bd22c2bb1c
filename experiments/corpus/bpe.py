"""The byte-level BPE a corpus trains on its train split when the grid names no pretrained tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments.corpus.reader import EOS


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts``; ``EOS`` is id 0, the
    only special token."""
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decoding must give back the document exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        texts, trainer=trainer, length=len(texts) if isinstance(texts, list) else None
    )
    return tokenizer
