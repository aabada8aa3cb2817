"""How long a sequence the model itself can take, read from its HF config.

A model with a learned position table (GPT-2, OPT, GPT-J's ``n_positions``, MPT's ALiBi bias of
``max_seq_len``) fails inside the graph past its table (``index out of range in self``), so
``max_seq_len`` defaults to the model's limit and a larger value is refused before anything is
built. Configs spell the limit many ways; the smallest named one wins (as vLLM derives
``max_model_len``). RoPE scaling that extends the context (``linear``, ``dynamic``, ``yarn`` with
a ``factor``) raises it to ``original_max_position_embeddings * factor`` where that is larger.
"""

from dataclasses import dataclass
from typing import Any, Optional

# Config fields that name the longest sequence a model takes, in the order they are reported.
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
    "n_ctx",
    "max_target_positions",
)
# max_seq_len when the config names no limit (recurrent models, ALiBi without a table), as vLLM does.
DEFAULT_WHEN_UNKNOWN = 2048
_EXTENDING_ROPE = ("linear", "dynamic", "yarn")


@dataclass(frozen=True)
class ContextLimit:
    """The model's longest sequence (``None``: its config names none) and the field it came from."""

    tokens: Optional[int]
    source: str

    def describe(self) -> str:
        return f"{self.tokens} tokens ({self.source} in the model's config)" if self.tokens else "no limit"


def _rope_extended(config: Any, limit: int) -> int:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return limit
    rope_type = params.get("rope_type", params.get("type"))
    factor = params.get("factor")
    if rope_type not in _EXTENDING_ROPE or not isinstance(factor, (int, float)) or factor <= 1:
        return limit
    original = params.get("original_max_position_embeddings") or limit
    return max(limit, int(original * factor))


def model_context_limit(hf_config: Any) -> ContextLimit:
    """The smallest sequence limit the (text) config names."""
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    found = []
    for key in LENGTH_KEYS:
        try:
            value = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a config property that raises names nothing
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append((value, key))
    if not found:
        return ContextLimit(None, "none")
    value, key = min(found)
    extended = _rope_extended(config, value)
    if extended != value:
        return ContextLimit(extended, f"{key} with RoPE scaling")
    return ContextLimit(value, key)
