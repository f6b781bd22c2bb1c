"""Trained models as Hugging Face ``transformers`` folders (``make export``; docs/export.md).

- :mod:`experiments.hf.layout`: which transformers class carries a :class:`ModelConfig` (Qwen3,
  Qwen3-MoE, Qwen3-Next or the shipped custom code) and its ``config.json`` fields.
- :mod:`experiments.hf.weights`: a :class:`~experiments.model.GatedLM` state dict renamed and
  reshaped into that class's.
- :mod:`experiments.hf.folder`: the folder itself, written beside its destination and renamed.
- ``configuration_gated_qwen3.py`` and ``modeling_gated_qwen3.py``: the custom code copied into the
  folders of the variants transformers has no class for (``trust_remote_code``); they import only
  torch and transformers, never this package.

Needs the ``export`` extra (``pip install -e '.[export]'``): transformers, safetensors, accelerate.
"""
