"""One trained model as a folder ``AutoModelForCausalLM`` and ``AutoTokenizer`` load offline.

The folder holds ``config.json``, ``model.safetensors`` (float32), ``generation_config.json``
(greedy), the tokenizer (``tokenizer.json`` and ``tokenizer_config.json``, a
``PreTrainedTokenizerFast`` over the tokenizer the run trained with, padding on the left), a model
card ``README.md`` and, for the custom-code family, ``configuration_gated_qwen3.py`` and
``modeling_gated_qwen3.py``. The three name the same end, padding and beginning ids, all tokens the
tokenizer holds (``experiments.hf.tokens``). It is written beside its destination and renamed into
place: a crash leaves no half-written folder under the destination's name, only a
``.<name>.partial-<pid>`` folder that the next export removes.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from experiments.config import ModelConfig
from experiments.hf import configuration_gated_qwen3, modeling_gated_qwen3
from experiments.hf.layout import CUSTOM_CODE, GATED, QWEN3, QWEN3_MOE, QWEN3_NEXT, config_fields
from experiments.hf.tokens import SpecialTokens, special_tokens
from experiments.hf.weights import hf_state_dict
from experiments.model import YarnScaling

#: (config class, causal-LM class) of each family
CLASSES = {
    QWEN3: (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    QWEN3_MOE: (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    QWEN3_NEXT: (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    GATED: (configuration_gated_qwen3.GatedQwen3Config, modeling_gated_qwen3.GatedQwen3ForCausalLM),
}


def hf_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokens: SpecialTokens,
    yarn: YarnScaling | None = None,
    max_positions: int | None = None,
) -> transformers.PreTrainedModel:
    """The transformers model (eval mode, float32, CPU) holding the weights of ``GatedLM(cfg)``'s
    ``state`` (``experiments.hf.layout`` says which class), ``tokens`` its special ids.

    Raises:
        RuntimeError: the renamed weights do not fill the class's parameters exactly.
    """
    name, fields = config_fields(cfg, tokens, yarn, max_positions)
    config_class, model_class = CLASSES[name]
    config = config_class(**fields, dtype="float32")
    weights = hf_state_dict(cfg, state)
    if cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    with torch.device("meta"), warnings.catch_warnings():  # no initialisation: all assigned below
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")  # the zero-wide shared expert
        model = model_class(config)
    model.load_state_dict(weights, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.tie_weights()
    model.config._attn_implementation = "sdpa"
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokens.eos_id, pad_token_id=tokens.pad_id, bos_token_id=tokens.bos_id, do_sample=False
    )
    return model.eval()


def hf_tokenizer(
    tokenizer: Tokenizer, tokens: SpecialTokens, max_length: int
) -> transformers.PreTrainedTokenizerFast:
    """The run's tokenizer as a ``transformers`` fast tokenizer: its own post-processor (a BOS only
    where the corpus was encoded with one), ``tokens`` its special tokens, padding on the left.

    Raises:
        ValueError: the wrapped tokenizer is not the run's: transformers added a token, or it
            encodes text otherwise (a special token that the tokenizer holds as a plain token,
            which transformers then cuts out of words, ``the`` out of ``there``).
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    specials = [t for t in dict.fromkeys((tokens.eos, tokens.pad, tokens.bos)) if t]
    probe = " ".join(f"x{t}y {t}" for t in specials) + " the cat sat there."
    expected = tokenizer.encode(probe, add_special_tokens=True).ids
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.to_str()),  # its own copy, whatever transformers does
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        bos_token=tokens.bos,
        model_max_length=max_length,
        padding_side="left",  # a decoder-only model generates after the prompt's last token
        clean_up_tokenization_spaces=False,
    )
    if len(wrapped) != size:
        raise ValueError(f"transformers would add tokens to it ({size} ids, {len(wrapped)} wrapped)")
    if wrapped(probe).input_ids != expected:
        shown = ", ".join(map(repr, specials))
        raise ValueError(
            f"transformers would encode text otherwise: its special tokens {shown} are not all special in it"
        )
    return wrapped


def write_folder(
    dest: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer_file: Path,
    eos_id: int,
    card: str,
    yarn: YarnScaling | None = None,
    force: bool = False,
) -> Path:
    """Write the model folder at ``dest`` (module docstring); return ``dest``.

    Args:
        dest: the folder to create.
        cfg, state: the trained model's shape and ``GatedLM`` state dict.
        tokenizer_file: the ``tokenizer.json`` the run trained with; ``eos_id`` its
            end-of-document id (the corpus manifest's).
        card: the text of ``README.md``.
        yarn: YaRN at inference, written as ``rope_parameters`` (``max_position_embeddings`` then
            ``factor * original_max_position``); None: the trained RoPE.
        force: replace an existing ``dest`` (the old folder goes only once the new one is whole).

    Raises:
        FileExistsError: ``dest`` exists and ``force`` is False.
        ValueError: ``eos_id`` is no id of the tokenizer.
    """
    if dest.exists() and not force:
        raise FileExistsError(f"{dest} exists: FORCE=1 replaces it")
    positions = math.ceil(yarn.factor * yarn.original_max_position) if yarn else cfg.max_seq_len
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokens = special_tokens(tokenizer, eos_id)
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.partial-*"):  # left by a crashed export
        shutil.rmtree(stale, ignore_errors=True)
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    try:
        model = hf_model(cfg, state, tokens, yarn, positions)
        model.save_pretrained(partial)
        hf_tokenizer(tokenizer, tokens, positions).save_pretrained(partial)
        if model.config.model_type == GATED:
            for name in CUSTOM_CODE:
                shutil.copyfile(Path(__file__).with_name(name), partial / name)
        (partial / "README.md").write_text(card)
        for path in partial.iterdir():  # safetensors writes its file 0600: readable as any other file
            path.chmod(0o666 & ~_umask())
        _replace(partial, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace(new: Path, dest: Path) -> None:
    """Rename ``new`` to ``dest``; an existing ``dest`` is moved aside first and removed after."""
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    if dest.exists():
        dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
