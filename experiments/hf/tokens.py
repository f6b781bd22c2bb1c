"""The special tokens of an exported folder, as the tokenizer the run trained with has them.

The folder's tokenizer, ``config.json`` and ``generation_config.json`` name the same ids, and each is
a token the tokenizer already holds: nothing is added that the model never saw.

- **eos**: the corpus's end-of-document id, which ends every document the model trained on
  (``experiments.corpus``: ``<|endoftext|>`` of the trained BPE, or a pretrained file's own,
  ``</s>`` say).
- **bos**: the one token the tokenizer's post-processor puts before a text, if it puts one; the
  corpus build encoded each document with that post-processor, so the model saw it. None
  otherwise (the trained BPE adds nothing).
- **pad**: the tokenizer's own padding token (an added special token named as in
  :data:`KNOWN_PAD`), else eos. Decoder-only folders pad on the left, so padding never sits
  between a prompt and what is generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

#: the names a tokenizer's padding token goes by (GPT-NeoX's ``<|padding|>``, T5's and Llama
#: derivatives' ``<pad>``, BERT's ``[PAD]``), looked up among its added special tokens
KNOWN_PAD = ("<pad>", "<|padding|>", "<|pad|>", "[PAD]")
_PROBE = "a"  # any text: what the post-processor puts around it is what it puts around every text


@dataclass(frozen=True)
class SpecialTokens:
    """The end, padding and beginning tokens of an exported folder (module docstring)."""

    eos: str
    eos_id: int
    pad: str
    pad_id: int
    bos: str | None = None
    bos_id: int | None = None


def special_tokens(tokenizer: Tokenizer, eos_id: int) -> SpecialTokens:
    """The folder's special tokens, all ids the tokenizer holds.

    Args:
        tokenizer: the ``tokenizer.json`` the run trained with.
        eos_id: the corpus's end-of-document id (its manifest's ``tokenizer.eos_id``).

    Raises:
        ValueError: ``eos_id`` is no id of ``tokenizer``.
    """
    eos = tokenizer.id_to_token(eos_id)
    if eos is None:
        raise ValueError(f"the tokenizer has no id {eos_id} (its end-of-document id)")
    added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    pad = next((name for name in KNOWN_PAD if name in added), eos)
    bos_id = _prefix_id(tokenizer)
    return SpecialTokens(
        eos=eos,
        eos_id=eos_id,
        pad=pad,
        pad_id=added.get(pad, eos_id),
        bos=None if bos_id is None else tokenizer.id_to_token(bos_id),
        bos_id=bos_id,
    )


def _prefix_id(tokenizer: Tokenizer) -> int | None:
    """The one id the post-processor puts before a text, or None (none, or several)."""
    plain = tokenizer.encode(_PROBE, add_special_tokens=False).ids
    full = tokenizer.encode(_PROBE, add_special_tokens=True).ids
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    return full[0] if start == 1 else None
