"""The long-context evaluation's settings (a grid's ``longctx:`` section), apart from
:mod:`experiments.longctx` so that reading a grid never imports torch."""

from __future__ import annotations

from dataclasses import dataclass

from experiments.strict import ConfigError


@dataclass(frozen=True)
class LongContextConfig:
    """What :func:`evaluate_long_context` measures (a grid's ``longctx:`` section).

    Raises:
        ConfigError: a value out of range; ``path`` names the key.
    """

    lengths: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Evaluation lengths, as multiples of the base context the caller passes."""
    yarn_factor: float = 4.0
    """YaRN's scale ``s`` (>= 1) for the YaRN half of the scores."""
    windows: int = 4
    """PPL windows of ``L + 1`` tokens per domain per length."""
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    """Needle positions, as fractions of the haystack in [0, 1]."""
    trials: int = 4
    """Passkeys per depth."""
    candidates: int = 10
    """Keys scored per passkey: the true one and ``candidates - 1`` distractors."""
    key_digits: int = 5
    """Digits of a passkey (no leading zero)."""
    batch_size: int = 4
    """PPL windows per forward pass."""

    def __post_init__(self) -> None:
        if not self.lengths or any(m < 1 for m in self.lengths):
            raise ConfigError(
                "lengths", f"must be a non-empty list of integers >= 1, got {list(self.lengths)}"
            )
        if not self.yarn_factor >= 1.0:
            raise ConfigError("yarn_factor", f"must be >= 1, got {self.yarn_factor}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(
                "depths", f"must be a non-empty list of fractions in [0, 1], got {list(self.depths)}"
            )
        for key in ("windows", "trials", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if not 1 <= self.key_digits <= 9:
            raise ConfigError("key_digits", f"must be in [1, 9], got {self.key_digits}")
        if not 2 <= self.candidates <= 9 * 10 ** (self.key_digits - 1) // 2:
            raise ConfigError(
                "candidates",
                f"must be >= 2 and at most half the {self.key_digits}-digit keys, got {self.candidates}",
            )
