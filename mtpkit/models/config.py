"""Base of the per-family config dataclasses: shared validation with messages that say the fix."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..checkpoint.errors import CheckpointError


class ConfigError(CheckpointError):
    """A config.json field is missing or inconsistent."""


@dataclass
class ConfigBase:
    """Fields every family has; subclasses add theirs and a ``from_hf_config``."""

    def fail(self, msg: str) -> None:
        """Raise a ConfigError about this config."""
        raise ConfigError(f"config.json ({self.model_type}): {msg}")

    def validate(self) -> None:
        """Check the fields every decoder config shares."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int",) and isinstance(v, int) and v < 0:
                self.fail(f"{f.name}={v} must not be negative")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name, 1) <= 0:
                self.fail(f"{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            self.fail(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )


def require(d: dict, *keys: str, model_type: str = "?") -> None:
    """Fail with the names of required keys missing from an HF config dict."""
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise ConfigError(
            f"config.json ({model_type}): missing required field(s) {', '.join(missing)}; "
            "copy them from the original model's config.json"
        )


def rope_settings(d: dict) -> tuple[float, dict | None, dict]:
    """(rope_theta, scaling dict or None for plain rope, the raw rope dict) of an HF config.

    Older configs put rope_theta at the top level and scaling in rope_scaling; newer ones put
    both in rope_parameters.
    """
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    plain = rope.get("rope_type", rope.get("type")) in (None, "default")
    return theta, (None if plain else rope), rope
