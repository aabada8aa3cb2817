"""Tiny configs written as real checkpoints, cached on disk.

The check loads models exactly as a user's checkpoint is loaded (``config.json``,
``model.safetensors``, ``generation_config.json``, a tokenizer), so the coverage numbers
measure the real loading path. A checkpoint is rewritten only when its config, seed or the
transformers version changes (a stamp file holds the fingerprint). Parameters that HF's init
leaves all zero get random values, so that no path of a model is invisible in its logits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Dict

from ..utils.logging import get_logger

logger = get_logger(__name__)

# 2: parameters HF's init leaves all zero get random values (ZERO_PARAMETER_STD)
CHECKPOINT_FORMAT_VERSION = 2
STAMP = ".coverage-checkpoint"
SEED = 0
# std of the values given to all-zero parameters (biases excepted): large enough that a zero-init
# key scale, router or gate projection moves the logits, small enough for a (1 + w) norm scale
ZERO_PARAMETER_STD = 0.1


def default_cache_dir() -> str:
    """``.cache/coverage`` under the current directory (the repository's cache is gitignored)."""
    return os.path.join(os.getcwd(), ".cache", "coverage")


def fingerprint(config: Dict[str, Any], seed: int = SEED) -> str:
    import torch
    import transformers

    blob = json.dumps({"v": CHECKPOINT_FORMAT_VERSION, "config": config, "seed": seed,
                       "transformers": transformers.__version__, "torch": torch.__version__},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_checkpoint(config: Dict[str, Any], cache_dir: str, seed: int = SEED) -> str:
    """The checkpoint directory of ``config`` under ``cache_dir``, written on first use.

    Written into a temporary directory and renamed, so a run killed by its time limit never
    leaves a half-written checkpoint behind.
    """
    from ..models.presets import write_random_checkpoint

    target = os.path.join(cache_dir, config["model_type"])
    stamp = os.path.join(target, STAMP)
    want = fingerprint(config, seed)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == want:
                return target
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{config['model_type']}-", dir=cache_dir)
    try:
        write_random_checkpoint(config, tmp, seed=seed, zero_parameter_std=ZERO_PARAMETER_STD)
        with open(os.path.join(tmp, STAMP), "w") as f:
            f.write(want)
        if os.path.exists(target):
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote the tiny %s checkpoint to %s", config["model_type"], target)
    return target
