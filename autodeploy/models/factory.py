"""The model factory: model source -> HF config -> ``nn.Module`` on the meta device.

A source is a preset name, a local HF checkpoint directory or a hub id. The factory builds the
model without allocating its weights (parameters on the meta device) and remembers what the
later stages need from the source: checkpoint files, load hooks, the initial values of
buffers that are not in the checkpoint (e.g. RoPE ``inv_freq``), and the tokenizer.
"""

import json
import os
import re
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from ..utils.errors import AutoDeployError, ConfigError, ModelSourceError
from ..utils.logging import get_logger
from .checkpoint import CheckpointIndex, find_checkpoint
from .custom import custom_model_for
from .load_hooks import LoadHook
from .presets import PRESETS, preset_dir
from .quantization import QuantizationInfo, check_quantization, quantized_dtype_error

logger = get_logger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files one of which a tokenizer directory holds (fast, SentencePiece, BPE vocab, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "spiece.model", "vocab.txt", "tokenizer.tiktoken", "sentencepiece.bpe.model")
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def resolve_source(source: str, revision: Optional[str] = None, include_code: bool = False) -> str:
    """Local checkpoint directory for a preset, a directory or a hub id (``include_code``: with
    the repository's Python files, which ``trust_remote_code`` needs)."""
    if source in PRESETS:
        return preset_dir(source)
    expanded = os.path.expanduser(source)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.exists(expanded):
        raise ModelSourceError(f"model path '{source}' is a file; pass the checkpoint directory that holds config.json")
    if source.startswith(("/", ".", "~")):
        raise ModelSourceError(f"model path '{source}' does not exist")
    if not HUB_ID.match(source):
        raise ModelSourceError(
            f"model '{source}' is not a preset, an existing directory or a hub id (org/name); "
            f"presets: {', '.join(sorted(PRESETS))}"
        )
    return download_from_hub(source, revision, include_code=include_code)


def download_from_hub(repo_id: str, revision: Optional[str] = None, include_code: bool = False) -> str:
    """Fetch config, safetensors and tokenizer files of ``repo_id``; never pickles, and its
    Python files (the model code ``auto_map`` names) only when ``include_code`` (the user
    trusts the repository's code)."""
    patterns = HUB_ALLOW_PATTERNS + (["*.py"] if include_code else [])
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one actionable message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(
            f"could not fetch '{repo_id}' from the Hugging Face hub ({first}); without network, pass a "
            "local checkpoint directory or a preset"
        ) from None


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while buffers stay real (their values matter:
    RoPE tables are computed in ``__init__`` and are not in the checkpoint)."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


class ModelFactory:
    """Knows one model source; builds its module and serves its weights and tokenizer."""

    def __init__(
        self,
        model: str,
        *,
        revision: Optional[str] = None,
        trust_remote_code: bool = False,
        allow_pickle: bool = False,
        model_kwargs: Optional[Dict[str, Any]] = None,
        tokenizer: Optional[str] = None,
        load_hooks: Optional[List[LoadHook]] = None,
    ):
        self.source = model
        self.revision = revision
        self.trust_remote_code = trust_remote_code
        self.allow_pickle = allow_pickle
        self.model_kwargs = dict(model_kwargs or {})
        self.tokenizer_source = tokenizer
        self.load_hooks: List[LoadHook] = list(load_hooks or [])
        self._directory: Optional[str] = None
        self._config: Any = None
        self._remote_class: Optional[type] = None  # see remote_model_class
        # The quantization the checkpoint declares (only ever a supported one; see quantization.py).
        self.quantization: Optional[QuantizationInfo] = None
        # Initial values of buffers, by name: restored at weight load for those not in the checkpoint.
        self.initial_buffers: Dict[str, torch.Tensor] = {}
        # Parameter names that share storage with another (tied embeddings), name -> canonical name.
        self.tied_parameters: Dict[str, str] = {}
        # The HF class's base prefix ("model" for *ForCausalLM): checkpoints saved from the base
        # model lack it.
        self.base_model_prefix: str = "model"
        # The registered custom class build_model built, None when it built the HF class: the
        # record of which implementation a graph came from.
        self.custom_model: Optional[type] = None

    # ---- source ---------------------------------------------------------------------------
    @property
    def directory(self) -> str:
        if self._directory is None:
            self._directory = resolve_source(self.source, self.revision, include_code=self.trust_remote_code)
        return self._directory

    def checkpoint_index(self) -> CheckpointIndex:
        return find_checkpoint(self.directory, allow_pickle=self.allow_pickle)

    # ---- config ---------------------------------------------------------------------------
    def _raw_config(self) -> Dict[str, Any]:
        path = os.path.join(self.directory, "config.json")
        if not os.path.exists(path):
            raise ModelSourceError(f"{self.directory} has no config.json; is it an HF checkpoint directory?")
        return _read_json_object(path, "the model's config (as written by save_pretrained)")

    def _check_remote_code(self, raw: Optional[Dict[str, Any]] = None) -> None:
        raw = self._raw_config() if raw is None else raw
        if "auto_map" in raw and not self.trust_remote_code:
            raise ModelSourceError(
                f"{self.source} needs custom model code from its repository (config.json has auto_map); "
                "running it executes that code. Opt in with trust_remote_code=True "
                "(CLI: --trust-remote-code) only if you trust it"
            )

    @property
    def config(self) -> Any:
        if self._config is None:
            from transformers import AutoConfig

            raw = self._raw_config()
            self._check_remote_code(raw)
            # A quantized checkpoint would load as garbage (narrow weights cast, scales dropped):
            # refuse the formats autodeploy cannot load before anything is built.
            self.quantization = check_quantization(self.directory, raw, self.source)
            try:
                config = AutoConfig.from_pretrained(self.directory, trust_remote_code=self.trust_remote_code)
            except (ValueError, KeyError, OSError) as exc:
                raise ModelSourceError(f"cannot read the config of {self.source}: {str(exc).splitlines()[0]}") from None
            for key, value in self.model_kwargs.items():
                if not hasattr(config, key):
                    raise ModelSourceError(f"model_kwargs.{key}: {type(config).__name__} has no field '{key}'")
                try:
                    setattr(config, key, value)
                except Exception as exc:  # noqa: BLE001 - the config's own validation of a user's value
                    raise ConfigError(
                        f"model_kwargs.{key}: {type(config).__name__} refuses {value!r} ({_last_line(exc)}); "
                        f"give a value of the field's type (it is {getattr(config, key)!r} in config.json)"
                    ) from None
            config.use_cache = False  # export without HF's cache objects; caches are ours
            self._config = config
        return self._config

    @property
    def vocab_size(self) -> int:
        return int(self.config.get_text_config().vocab_size)

    # ---- model ----------------------------------------------------------------------------
    def build_model(self, dtype: torch.dtype = torch.float32, use_custom_model: bool = True) -> nn.Module:
        """The model with parameters on the meta device, in eval mode: the lean custom model
        registered for the config class if there is one and ``use_custom_model``, else the HF
        class (or the checkpoint's own, with ``trust_remote_code``)."""
        config = self.config
        self._check_checkpoint_dtypes(dtype)
        custom_cls = custom_model_for(config)
        if custom_cls is not None and not use_custom_model:
            logger.info("custom model %s for %s is registered but turned off (build_model.use_custom_model); "
                        "building the HF class", custom_cls.__name__, type(config).__name__)
            custom_cls = None
        self.custom_model = custom_cls
        with _parameters_on_meta():
            if custom_cls is not None:
                logger.info("building custom model %s for %s", custom_cls.__name__, type(config).__name__)
                model = custom_cls(config)
                # HF classes take the dtype in from_config; a custom model is built in the default
                # dtype, so its float parameters are cast here (buffers such as RoPE tables keep theirs)
                for param in model.parameters():
                    if param.is_floating_point() and param.dtype != dtype:
                        param.data = param.data.to(dtype)
                self.load_hooks.extend(getattr(custom_cls, "load_hooks", lambda: [])())
            else:
                from transformers import AutoModelForCausalLM

                remote_cls = self.remote_model_class()
                try:
                    if remote_cls is not None:
                        logger.info("building %s from the checkpoint's own code (%s; trust_remote_code)",
                                    remote_cls.__name__, self._auto_map_ref())
                        model = remote_cls._from_config(config, dtype=dtype)
                    else:
                        model = AutoModelForCausalLM.from_config(
                            config, dtype=dtype, trust_remote_code=self.trust_remote_code
                        )
                except ValueError as exc:
                    if self.model_kwargs or "Unrecognized configuration class" not in str(exc):
                        raise self._unbuildable(config, exc) from None
                    raise ModelSourceError(
                        f"transformers has no causal-LM class for {type(config).__name__}: {str(exc).splitlines()[0]}"
                    ) from None
                except KeyError as exc:  # e.g. an unknown hidden_act: ACT2FN[name]
                    raise self._unbuildable(config, exc) from None
        model.eval()
        self.initial_buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}
        self.tied_parameters = _tied_parameters(model)
        self.base_model_prefix = getattr(model, "base_model_prefix", "") or "model"
        return model.to("meta")

    def _auto_map_ref(self) -> Optional[str]:
        """config.json's ``auto_map["AutoModelForCausalLM"]`` ("modeling_x.XForCausalLM"), if any."""
        auto_map = self._raw_config().get("auto_map")
        ref = auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None
        return ref if isinstance(ref, str) else None

    def remote_model_class(self) -> Optional[type]:
        """The causal-LM class of the checkpoint's own code (config.json ``auto_map``), when the
        user trusts it (``trust_remote_code``); None when there is none or it is not trusted.

        Imported from the modeling file itself (transformers names its module after the file's
        content), not through ``AutoModelForCausalLM.from_config``: that consults transformers'
        auto-class registry first, which maps a config class to the model class first built for
        it. Two checkpoints with the same configuration code share a config class (so does one
        whose modeling code was edited since), so from_config would build another checkpoint's
        class, never importing this one's modeling file, and report success."""
        if self._remote_class is not None or not self.trust_remote_code:
            return self._remote_class
        ref = self._auto_map_ref()
        if ref is None:
            if "auto_map" in self._raw_config():
                logger.info("config.json's auto_map names no AutoModelForCausalLM class; building transformers' own "
                            "class for %s", type(self.config).__name__)
            return None
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        repo, class_ref = self.directory, ref
        if "--" in ref:  # code kept in another hub repository ("org/repo--modeling_x.Class")
            repo, class_ref = ref.split("--", 1)
        module_file = class_ref.rsplit(".", 1)[0] + ".py"
        if repo == self.directory and not os.path.isfile(os.path.join(self.directory, module_file)):
            raise ModelSourceError(
                f"config.json's auto_map names {ref} for AutoModelForCausalLM, but {self.directory} has no "
                f"{module_file}; add the checkpoint's modeling code, or remove that auto_map entry to use "
                "transformers' own class"
            )
        try:
            self._remote_class = get_class_from_dynamic_module(class_ref, repo)
        except Exception as exc:  # noqa: BLE001 - importing the checkpoint's code: any failure is that code's
            raise ModelSourceError(
                f"cannot import {ref}, the model class config.json's auto_map names for AutoModelForCausalLM "
                f"({type(exc).__name__}: {_last_line(exc)}); fix the checkpoint's modeling code or install what "
                "it imports"
            ) from None
        return self._remote_class

    def load_eager(self, dtype: torch.dtype, device: Any = "cpu") -> nn.Module:
        """The model with its weights, as transformers runs it (the reference of build-time
        checks): the class ``build_model`` builds, the checkpoint's own one included."""
        from transformers import AutoModelForCausalLM

        remote_cls = self.remote_model_class()
        if remote_cls is not None:
            model = remote_cls.from_pretrained(self.directory, dtype=dtype, use_safetensors=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.directory, dtype=dtype, use_safetensors=True,
                                                         trust_remote_code=self.trust_remote_code)
        return model.to(device).eval()

    def _unbuildable(self, config: Any, exc: BaseException) -> AutoDeployError:
        """The model class refused the config's values: the checkpoint's config.json or the
        user's model_kwargs, whichever set them, is what to fix."""
        detail = f"{type(exc).__name__}: {_last_line(exc)}"
        if self.model_kwargs:
            keys = ", ".join(f"model_kwargs.{k}={v!r}" for k, v in self.model_kwargs.items())
            return ConfigError(f"cannot build {type(config).__name__} with {keys} ({detail}); check those values")
        return ModelSourceError(
            f"cannot build the model of {self.source} from its config.json ({detail}); the config holds a value "
            "its model class does not accept"
        )

    def _check_checkpoint_dtypes(self, dtype: torch.dtype) -> None:
        """Refuse FP8/FP4 checkpoint tensors from the safetensors headers, before export (the loader
        checks every tensor again; this only makes a quantized checkpoint whose config.json does
        not say so fail early)."""
        if self.quantization is not None:
            return  # a supported quantized format: its loader knows its dtypes
        try:
            index = self.checkpoint_index()
        except ModelSourceError:
            return  # no (safe) weights here yet: the load stage reports it
        quantized = index.quantized_dtype_tensors()
        if quantized:
            raise quantized_dtype_error(index.directory, quantized, dtype)

    # ---- tokenizer ------------------------------------------------------------------------
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (or ``tokenizer``'s). A directory without tokenizer files is
        an error: transformers 5 would build an empty tokenizer from the config alone, which turns
        every text into no tokens."""
        from transformers import AutoTokenizer

        source = self.tokenizer_source or self.directory
        local = os.path.isdir(os.path.expanduser(source))
        if local and not any(os.path.exists(os.path.join(source, name)) for name in TOKENIZER_FILES):
            raise ModelSourceError(f"{source} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
        try:
            tok = AutoTokenizer.from_pretrained(source, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError, TypeError) as exc:
            raise ModelSourceError(f"cannot load a tokenizer from {source}: {str(exc).splitlines()[0]}") from None
        if len(tok) < 2:
            raise ModelSourceError(f"the tokenizer loaded from {source} has an empty vocabulary")
        return tok

    def generation_config(self) -> Dict[str, Any]:
        path = os.path.join(self.directory, "generation_config.json")
        if not os.path.exists(path):
            return {}
        return _read_json_object(path, "generation defaults; remove the file to use none")


def _read_json_object(path: str, what: str) -> Dict[str, Any]:
    """A JSON object from a checkpoint file; a file that is not one is the user's to fix."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{path} is not valid JSON ({exc}); it should hold {what}") from None
    if not isinstance(value, dict):
        raise ModelSourceError(f"{path} holds a JSON {type(value).__name__}, not an object; it should hold {what}")
    return value


def _last_line(exc: BaseException) -> str:
    """The most specific line of an exception's message (validation errors put it last)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _tied_parameters(model: nn.Module) -> Dict[str, str]:
    """Map each duplicate parameter name to the first name that owns the same tensor."""
    owner: Dict[int, str] = {}
    tied: Dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = owner.setdefault(id(param), name)
        if first != name:
            tied[name] = first
    return tied
