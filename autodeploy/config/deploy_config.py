"""``DeployConfig``: everything a deployment needs, validated before anything runs."""

import os
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..utils.errors import ConfigError
from .merge import deep_merge, load_yaml_file, parse_dotted_overrides

DEFAULT_YAML = os.path.join(os.path.dirname(__file__), "default.yaml")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeployConfig(BaseModel):
    """One deployment. Built by ``load_deploy_config`` from default.yaml, user YAML files and
    overrides; unknown keys are errors that list the close matches."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="Preset name, local HF checkpoint directory, or hub id (org/name).")
    revision: Optional[str] = Field(default=None, description="Hub revision (branch, tag or commit).")
    tokenizer: Optional[str] = Field(default=None, description="Tokenizer source if not the model's own.")
    trust_remote_code: bool = Field(default=False, description="Allow running model code from the checkpoint repo.")
    allow_pickle: bool = Field(default=False, description="Allow loading pickled (.bin/.pt) weights.")
    model_kwargs: Dict[str, Any] = Field(
        default_factory=dict, description="Overrides of HF config fields, e.g. {num_hidden_layers: 2}."
    )
    device: str = Field(default="cpu", description="'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Compute/weight dtype; auto = float32 on CPU, checkpoint dtype on CUDA."
    )
    world_size: int = Field(default=1, ge=1, description="Number of ranks (tensor parallelism).")
    max_batch_size: int = Field(default=8, ge=1, description="Most sequences in one step.")
    max_seq_len: int = Field(default=512, ge=2, description="Longest sequence (prompt + generated tokens).")
    max_num_tokens: int = Field(default=2048, ge=1, description="Most tokens in one step (prefill budget).")
    page_size: int = Field(default=16, ge=1, description="Tokens per KV-cache page.")
    attn_backend: str = Field(
        default="sdpa", description="Cached attention backend (sets transforms.insert_cached_attention.backend)."
    )
    compile_backend: str = Field(
        default="torch-simple", description="Compile backend (sets transforms.compile_model.backend)."
    )
    transforms: Dict[str, Optional[Dict[str, Any]]] = Field(
        default_factory=dict, description="The transform pipeline: {key: {field: value}}."
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        try:
            dev = torch.device(value)
        except RuntimeError:
            raise ValueError(f"'{value}' is not a device; use 'cpu' or 'cuda[:N]'") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device type '{dev.type}' is not supported; use 'cpu' or 'cuda[:N]'")
        return value

    def torch_dtype(self, checkpoint_dtype: Optional[torch.dtype] = None) -> torch.dtype:
        """The dtype to run in. CPUs here have no fast half-precision GEMM, so ``auto`` is fp32
        there; on CUDA ``auto`` follows the checkpoint (fp32 checkpoints stay fp32)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if torch.device(self.device).type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.float32


def _close(word: str, options: Sequence[str]) -> str:
    import difflib

    found = difflib.get_close_matches(word, list(options), n=3, cutoff=0.6)
    return f" (did you mean: {', '.join(found)}?)" if found else ""


def _format_error(err: ValidationError) -> str:
    fields = list(DeployConfig.model_fields)
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            problems.append(f"unknown setting '{loc}'{_close(loc, fields)}")
        else:
            problems.append(f"{loc}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(problems)


def load_deploy_config(
    yaml_files: Sequence[str] = (),
    overrides: Optional[Mapping[str, Any] | Sequence[str]] = None,
    **settings: Any,
) -> DeployConfig:
    """default.yaml, then each YAML file, then ``settings`` (API keywords), then ``overrides``
    (a nested mapping or dotted CLI tokens); validates settings and the whole pipeline."""
    data: Dict[str, Any] = load_yaml_file(DEFAULT_YAML)
    for path in yaml_files:
        data = deep_merge(data, load_yaml_file(path))
    data = deep_merge(data, {k: v for k, v in settings.items() if v is not None})
    if overrides:
        parsed = parse_dotted_overrides(overrides) if not isinstance(overrides, Mapping) else dict(overrides)
        data = deep_merge(data, parsed)
    try:
        config = DeployConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    config = config.model_copy(update={"transforms": _apply_shortcuts(config)})
    validate_pipeline(config.transforms)
    return config


# Top-level settings that are the user-facing knob of one transform field.
SHORTCUTS = {
    "attn_backend": ("insert_cached_attention", "backend"),
    "compile_backend": ("compile_model", "backend"),
}


def _apply_shortcuts(config: DeployConfig) -> Dict[str, Any]:
    transforms = {k: dict(v or {}) for k, v in config.transforms.items()}
    for setting, (key, field) in SHORTCUTS.items():
        if key in transforms:
            transforms[key][field] = getattr(config, setting)
    return transforms


def validate_pipeline(transforms: Mapping[str, Any]) -> List[str]:
    """Build (but do not run) the pipeline, so bad keys/fields/ordering fail before any work."""
    import autodeploy.transform.library  # noqa: F401  (registers transforms)
    from ..transform.optimizer import InferenceOptimizer

    optimizer = InferenceOptimizer(transforms)
    return [t.get_transform_key() for t in optimizer.transforms]
