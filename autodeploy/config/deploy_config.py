"""``DeployConfig``: everything a deployment needs, validated before anything runs."""

import functools
import os
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..utils.cpu import native_bf16
from ..utils.errors import ConfigError
from ..utils.logging import get_logger
from .chat_template import read_chat_template
from .checks import check_settings, check_shortcut_value
from .merge import deep_merge, load_yaml_file, parse_dotted_overrides

DEFAULT_YAML = os.path.join(os.path.dirname(__file__), "default.yaml")
TRANSFORMERS_YAML = os.path.join(os.path.dirname(__file__), "transformers.yaml")
logger = get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeployConfig(BaseModel):
    """One deployment. Built by ``load_deploy_config`` from default.yaml, user YAML files and
    overrides; unknown keys are errors that list the close matches."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="Preset name, local HF checkpoint directory, or hub id (org/name).")
    mode: Literal["graph", "transformers"] = Field(
        default="graph",
        description="graph: export the model and optimise the graph (the fast path). transformers: no export; the "
        "HF module runs eagerly with its attention swapped for the cached attention over the paged KV cache "
        "(config/transformers.yaml's pipeline), for models that do not export; models whose attention the cache "
        "cannot serve run in recompute mode.",
    )
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
    world_size: int = Field(default=1, ge=1, description="Number of ranks (tensor parallelism). Above 1 every "
                            "rank builds its own shard inside a torch.distributed group of that size and rank 0 "
                            "drives the others: 'autodeploy run|serve|export|bench --world-size N' starts the "
                            "ranks on this machine, torchrun starts them on one machine or several, and in Python each process "
                            "calls autodeploy.distributed.initialize first (then LLM.follow on ranks above 0).")
    max_batch_size: Optional[int] = Field(
        default=None, ge=1,
        description="Most sequences in one step; unset: chosen from the KV-cache pool (resize_kv_cache): the "
        "full-length sequences it holds, at least 64, at most 256.",
    )
    max_seq_len: Optional[int] = Field(
        default=None, ge=2,
        description="Longest sequence (prompt + generated tokens); unset: the model's own limit from its config "
        "(max_position_embeddings, n_positions, ...; 2048 when it names none). A value above the model's "
        "limit is an error.",
    )
    max_num_tokens: int = Field(default=2048, ge=1, description="Most tokens in one step (prefill budget).")
    page_size: int = Field(default=16, ge=1, description="Tokens per KV-cache page.")
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse the KV-cache pages of a prompt prefix computed before (a shared system prompt, the "
        "earlier turns of a chat): a new sequence computes only the tokens after the longest cached prefix of "
        "whole pages. Exact (pages are matched by their tokens). Off for requests asking for prompt logprobs or "
        "hidden states. Models with per-sequence state caches (SSM, convolution, recurrences) resume only where a "
        "copy of the state was kept (prefix_state_snapshots).",
    )
    prefix_state_snapshots: Optional[int] = Field(
        default=None, ge=0,
        description="Prefix caching for models with state caches: how many copies of a sequence's state at a page "
        "boundary are kept (each one running state's size, taken out of the cache memory budget of resize_kv_cache; "
        "least recently used dropped first). A copy is taken "
        "where two prompts were seen to part (the second request sharing a system prompt computes it again and "
        "leaves one; later ones start from it), at an n > 1 request's last whole prompt page, and, in spare copies "
        "only, at the end of each sequence (a conversation's next turn resumes there). Unset: "
        "min(16, max_batch_size); 0: prefix caching off for such models. No effect on models without state caches.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="The order requests are served in (vLLM's): fcfs by arrival; priority by each request's "
        "priority (lower first; LLM.generate(priority=...), the server's 'priority' field), then arrival: "
        "admissions, steps and the sequence preempted when pages run out follow it. Under fcfs a request with "
        "a priority other than 0 is refused.",
    )
    skip_tokenizer_init: bool = Field(
        default=False,
        description="Never load a tokenizer: prompts must be token ids and outputs carry token ids only "
        "(text is empty). Without it the tokenizer is still loaded only when first needed.",
    )
    chat_template: Optional[str] = Field(
        default=None,
        description="A Jinja chat template used instead of the tokenizer's own (vLLM's --chat-template): its text, "
        "or the path of a file holding it. For a tokenizer without one, or to change how conversations and tools "
        "are rendered (llm.chat, the server's /v1/chat/completions and /tokenize).",
    )
    attn_backend: Optional[str] = Field(
        default=None,
        description="Shortcut for transforms.insert_cached_attention.backend (sdpa by default); setting both "
        "to different values is an error.",
    )
    compile_backend: Optional[str] = Field(
        default=None,
        description="Shortcut for transforms.compile_model.backend (auto by default: torch-cudagraph on a CUDA "
        "device, torch-simple elsewhere); setting both to "
        "different values is an error.",
    )
    kv_cache_dtype: Optional[Literal["auto", "fp8"]] = Field(
        default=None,
        description="Shortcut for transforms.insert_cached_attention.kv_cache_dtype (auto by default: the "
        "model's dtype; fp8: float8_e4m3fn pages with per-tensor k/v scales, a ModelOpt checkpoint's calibrated "
        "ones or 1.0); setting both to different values is an error.",
    )
    quantization: Optional[Literal["int8", "int4", "fp8"]] = Field(
        default=None,
        description="Shortcut for transforms.quantize_weights.method: quantization of a float checkpoint's "
        "linears at load (int8: weight-only, per output channel; int4: weight-only, per group of "
        "transforms.quantize_weights.group_size inputs, 128 by default; fp8: fine-grained FP8, 128x128 weight "
        "tiles and dynamic per-token activations), the LM head included unless transforms.quantize_weights.exclude "
        "names it; setting both to different values is an error.",
    )
    build_cache: bool = Field(
        default=False,
        description="Store the built graph and weights under $AUTODEPLOY_CACHE/builds/<key> and load them instead of "
        "exporting and transforming again when the model files, this config, autodeploy (version and source), "
        "torch/transformers and the device are unchanged (autodeploy.build_cache). Off by default: an entry takes "
        "about the model's weights again on disk.",
    )
    transforms: Dict[str, Optional[Dict[str, Any]]] = Field(
        default_factory=dict, description="The transform pipeline: {key: {field: value}}."
    )

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            read_chat_template(value)  # kept as given; read where the tokenizer is loaded
        return value

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
        """The dtype to run in. On CPU ``auto`` is fp32: exact against HF's float32 reference, and
        some CPUs have no fast half-precision GEMM at all; where the CPU computes bf16 natively and
        the checkpoint is bf16, a log line (once) says ``bfloat16`` would prefill faster (lossy).
        On CUDA ``auto`` follows the checkpoint (fp32 checkpoints stay fp32)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if torch.device(self.device).type == "cpu":
            if checkpoint_dtype == torch.bfloat16 and native_bf16():
                _hint_bfloat16_once()
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.float32


@functools.lru_cache(maxsize=None)
def _hint_bfloat16_once() -> None:
    logger.info("dtype auto runs this bfloat16 checkpoint in float32 on CPU (exact against HF's float32); this "
                "CPU computes bfloat16 natively (AVX-512 BF16 / AMX), where dtype: bfloat16 prefilled ~2.8x faster "
                "(lossy: README, dtype)")


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
    registry: Optional[str] = None,
    launching: bool = False,
    **settings: Any,
) -> DeployConfig:
    """default.yaml, then the model-registry entry ``registry`` (its fragments in order, its
    model and world size), then each YAML file, then ``settings`` (API keywords), then
    ``overrides`` (a nested mapping or dotted CLI tokens); validates settings and the whole
    pipeline. ``launching``: the caller starts the ranks itself (the CLI's ``run``/``serve``/``export``/``bench``), so
    a registry entry of several ranks needs no process group yet."""
    base = load_yaml_file(DEFAULT_YAML)
    entry = None
    if registry is not None:
        from .registry import registry_entry

        entry = registry_entry(registry)
        base = deep_merge(base, registry_layer(entry))
    user: Dict[str, Any] = {}  # what the user set, over the defaults (shortcuts read it)
    for path in yaml_files:
        user = deep_merge(user, load_yaml_file(path))
    user = deep_merge(user, {k: v for k, v in settings.items() if v is not None})
    if overrides:
        parsed = parse_dotted_overrides(overrides) if not isinstance(overrides, Mapping) else dict(overrides)
        user = deep_merge(user, parsed)
    data = deep_merge(base, user)
    if data.get("mode") == "transformers":
        data["transforms"] = _transformers_mode_transforms(user)
    try:
        config = DeployConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    config = config.model_copy(update={"transforms": _apply_shortcuts(config, user)})
    validate_pipeline(config.transforms)
    check_settings(config, user)
    if entry is not None:
        from .registry import check_world_size

        check_world_size(entry, config.world_size, launching=launching)
    return config


def _transformers_mode_transforms(user: Mapping[str, Any]) -> Dict[str, Any]:
    """transformers.yaml's pipeline with the user's fields for its keys; a user's key of the graph
    pipeline would silently do nothing here, so it is an error."""
    own = load_yaml_file(TRANSFORMERS_YAML)["transforms"]
    user_transforms = dict(user.get("transforms") or {})
    foreign = sorted(k for k in user_transforms if k not in own)
    if foreign:
        raise ConfigError(f"transforms {', '.join(foreign)} do not run in mode 'transformers' (its pipeline: "
                          f"{', '.join(own)}); drop them or use mode 'graph'")
    return deep_merge(own, user_transforms)


def registry_layer(entry: Any) -> Dict[str, Any]:
    """A registry entry as one layer between default.yaml and the user's settings: its fragments
    merged in order, its model and world size. It is a base, not a user layer: the shortcuts a
    fragment sets are written into their transform fields here, so a user's shortcut or field
    overrides them instead of conflicting with them."""
    from .registry import entry_yaml_files

    layer: Dict[str, Any] = {}
    for path in entry_yaml_files(entry):
        layer = deep_merge(layer, load_yaml_file(path))
    transforms = dict(layer.get("transforms") or {})
    for setting, (key, field) in SHORTCUTS.items():
        value = layer.pop(setting, None)
        if value is None:
            continue
        fields = dict(transforms.get(key) or {})
        if fields.get(field) is not None and fields[field] != value:
            raise ConfigError(f"registry entry '{entry.name}': {setting} is '{value}' but transforms.{key}.{field} is "
                              f"'{fields[field]}' in its fragments; they are the same setting: set one of them")
        check_shortcut_value(setting, value, key, field)
        fields[field] = value
        transforms[key] = fields
    if transforms:
        layer["transforms"] = transforms
    logger.info("registry entry '%s': model %s, fragments %s, world_size %d (your --yaml files and settings apply "
                "over them)", entry.name, entry.model, ", ".join(entry.yaml) or "none", entry.world_size)
    return deep_merge(layer, {"model": entry.model, "world_size": entry.world_size})


# Top-level settings that are the user-facing knob of one transform field.
SHORTCUTS = {
    "attn_backend": ("insert_cached_attention", "backend"),
    "kv_cache_dtype": ("insert_cached_attention", "kv_cache_dtype"),
    "compile_backend": ("compile_model", "backend"),
    "quantization": ("quantize_weights", "method"),
}


def _apply_shortcuts(config: DeployConfig, user: Mapping[str, Any]) -> Dict[str, Any]:
    """Write each shortcut the user set into its transform field. The transform field is the one
    source of truth: an unset shortcut changes nothing, and a shortcut that disagrees with a
    transform field the user also set is an error (no silent winner)."""
    transforms = {k: dict(v or {}) for k, v in config.transforms.items()}
    user_transforms = user.get("transforms") or {}
    shortcuts = dict(SHORTCUTS)
    if config.mode == "transformers":  # the one shortcut whose transform this mode has
        shortcuts["attn_backend"] = ("transformers_replace_cached_attn", "backend")
    for setting, (key, field) in shortcuts.items():
        value = getattr(config, setting)
        if value is None:
            continue
        explicit = (user_transforms.get(key) or {}).get(field) if isinstance(user_transforms, Mapping) else None
        if explicit is not None and explicit != value:
            raise ConfigError(
                f"{setting} is '{value}' but transforms.{key}.{field} is '{explicit}'; they are the same setting: "
                f"set one of them"
            )
        if key not in transforms:
            raise ConfigError(f"{setting} is set but the pipeline has no '{key}' transform to apply it to")
        check_shortcut_value(setting, value, key, field)
        transforms[key][field] = value
    return transforms


def validate_pipeline(transforms: Mapping[str, Any]) -> List[str]:
    """Build (but do not run) the pipeline, so bad keys/fields/ordering fail before any work."""
    import autodeploy.transform.library  # noqa: F401  (registers transforms)
    from ..transform.optimizer import InferenceOptimizer

    optimizer = InferenceOptimizer(transforms)
    return [t.get_transform_key() for t in optimizer.transforms]
