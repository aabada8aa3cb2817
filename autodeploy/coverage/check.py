"""One model type end to end: tiny config -> checkpoint -> HF eager reference -> the full default
pipeline -> logits and greedy tokens compared.

The result says how far the model got (``stage``) and how it ended (``status``): ``pass``,
``mismatch`` (everything ran but tokens or logits differ from HF: the failure that must never
hide), ``error`` (an exception, with the stage and its first line), ``timeout`` (set by the
sweep) or ``excluded`` (not a decoder-only text model). During a sweep every check runs in its
own process (``python -m autodeploy.coverage``) so that a crash, a hang or leaked global
state of one model cannot touch another; the child rewrites its result file at every stage so
the parent knows where a killed child was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..transform.interface import Stage
from ..utils.logging import get_logger
from .configs import DECODER_ONLY, classify

logger = get_logger(__name__)

PROMPT_LENGTHS = (5, 13)  # the longer one is past the 8-token sliding window
NEW_TOKENS = 16
LOGITS_RTOL = 1e-4  # relative RMSE of fp32 logits
FIRST_REGULAR_TOKEN = 6  # ids below are the tokenizer's special tokens
PROMPT_SEED = 1234
MAX_SEQ_LEN = 64  # > the longest prompt plus its new tokens

# Where a check can stop, in order: ours around the pipeline's own stages.
PIPELINE_STAGES = tuple(stage.value for stage in Stage)
STAGES = ("config", "checkpoint", "hf_reference", *PIPELINE_STAGES, "runtime", "compare")

PASS, MISMATCH, ERROR, TIMEOUT, EXCLUDED, RUNNING = "pass", "mismatch", "error", "timeout", "excluded", "running"


@dataclass
class CheckResult:
    """What one model type's check found (one row of the coverage table)."""

    model_type: str
    recipe: str = "a"  # the size recipe of the tiny config (coverage/recipes.py)
    category: str = DECODER_ONLY
    reason: str = ""  # why a type is excluded
    status: str = RUNNING
    stage: str = "config"  # the stage reached: where it stopped, "compare" when it ran through
    error: str = ""  # the first error line, or what differs for a mismatch
    failed_transform: Optional[str] = None
    logits_rel_rmse: Optional[float] = None
    tokens_match: Optional[bool] = None
    first_divergence: Optional[List[int]] = None  # [prompt index, token index]
    min_top2_gap: Optional[float] = None  # HF's smallest best-vs-second logit gap on the greedy path
    cache_mode: Optional[str] = None  # "paged_kv", "state", "paged_kv+state", or "recompute" (fallback)
    cache_mode_reason: str = ""
    latent_cache: bool = False  # the MLA layers cache their latent (insert_cached_mla_attention), not per-head K/V
    seconds: Dict[str, float] = field(default_factory=dict)

    @property
    def outcome(self) -> str:
        """The result column: pass, or which kind of failure (never ambiguous)."""
        if self.status == PASS:
            return "pass"
        if self.status == EXCLUDED:
            return "not decoder-only"
        if self.status == MISMATCH:
            wrong = [w for w, bad in (("tokens", self.tokens_match is False),
                                      ("logits", not _logits_ok(self.logits_rel_rmse))) if bad]
            return f"FAIL: wrong {' and '.join(wrong) or 'output'}"
        if self.status == TIMEOUT:
            return "FAIL: timeout"
        return "FAIL: error"

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        value = data["logits_rel_rmse"]
        if value is not None and not math.isfinite(value):  # strict JSON has no inf/nan
            data["logits_rel_rmse"] = None
        data["outcome"] = self.outcome
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "CheckResult":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def _logits_ok(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value) and value < LOGITS_RTOL


def error_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message``, trimmed (the table cell)."""
    text = str(exc).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def failing_transform(exc: BaseException) -> Optional[Any]:
    """The transform whose ``__call__`` was running when ``exc`` was raised (innermost), if any.

    The optimizer re-raises a transform's error without recording it, but the transform object
    is still in the traceback's frames: that tells the stage without a second build.
    """
    from ..transform.interface import BaseTransform

    found = None
    tb = exc.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, BaseTransform) and tb.tb_frame.f_code.co_name == "__call__":
            found = candidate
        tb = tb.tb_next
    return found


def _stage_after_build(exc: BaseException) -> str:
    """``cache_init`` when ``LLM`` found no KV cache in the built graph (e.g. no attention layer
    was recognised), else ``runtime`` (tokenizer, engine set-up)."""
    from ..llm import LLM

    tb = exc.__traceback__
    while tb is not None:
        llm = tb.tb_frame.f_locals.get("self")
        if isinstance(llm, LLM) and getattr(llm, "build", None) is not None:
            cache = llm.build.cache
            return "cache_init" if cache is None or not cache.caches else "runtime"
        tb = tb.tb_next
    return "factory"


def coverage_prompts(vocab_size: int) -> List[List[int]]:
    """Two token-id prompts of different lengths, the same for every model (seeded)."""
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    high = max(FIRST_REGULAR_TOKEN + 1, vocab_size)
    return [torch.randint(FIRST_REGULAR_TOKEN, high, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).pow(2).mean().sqrt()
    return float(diff / ref.double().pow(2).mean().sqrt().clamp_min(1e-30))


# ---- the check ----------------------------------------------------------------------------------
def run_check(model_type: str, cache_dir: Optional[str] = None, *, recipe: str = "a", include_excluded: bool = False,
              on_progress: Optional[Callable[[CheckResult], None]] = None, mode: str = "graph") -> CheckResult:
    """Check one model type at one size recipe, built in deployment ``mode``; never raises for a
    model's failure (it is in the result)."""
    from .checkpoints import default_cache_dir

    cache_dir = cache_dir or default_cache_dir()
    result = CheckResult(model_type, recipe=recipe)
    notify = on_progress or (lambda r: None)
    try:
        result.category, result.reason = classify(model_type)
    except Exception as exc:  # noqa: BLE001 - reported as a config-stage error
        result.status, result.error = ERROR, error_line(exc)
        return result
    if result.category != DECODER_ONLY and not include_excluded:
        result.status, result.stage = EXCLUDED, "config"
        return result
    start = time.perf_counter()
    try:
        _run_stages(result, cache_dir, notify, mode)
    except Exception as exc:  # noqa: BLE001 - every model failure becomes a table row
        result.status = ERROR
        result.error = error_line(exc)
        transform = failing_transform(exc)
        if transform is not None:
            result.stage = transform.config.stage.value
            result.failed_transform = transform.get_transform_key()
        elif result.stage == "factory":  # the build ran through; LLM refused what it made
            result.stage = _stage_after_build(exc)
        logger.info("%s failed at %s:\n%s", model_type, result.stage, "".join(traceback.format_exception(exc)))
    result.seconds["total"] = round(time.perf_counter() - start, 2)
    notify(result)
    return result


def _run_stages(result: CheckResult, cache_dir: str, notify: Callable[[CheckResult], None], mode: str = "graph") -> None:
    from .checkpoints import ensure_checkpoint
    from .configs import tiny_config
    from .reference import hf_greedy_reference, load_hf_eager

    def enter(stage: str) -> float:
        result.stage = stage
        notify(result)
        return time.perf_counter()

    t = enter("config")
    config = tiny_config(result.model_type, result.recipe)
    t = _lap(result, "config", t)

    enter("checkpoint")
    checkpoint = ensure_checkpoint(config, os.path.join(cache_dir, result.recipe))
    t = _lap(result, "checkpoint", t)

    enter("hf_reference")
    hf = load_hf_eager(checkpoint)
    vocab = int(hf.config.get_text_config().vocab_size)
    prompts = coverage_prompts(vocab)
    ref = hf_greedy_reference(hf, prompts, NEW_TOKENS)
    del hf
    t = _lap(result, "hf_reference", t)

    enter("factory")  # from here the stage is the failing transform's (see run_check)
    llm = _build_llm(checkpoint, mode)
    result.cache_mode = llm.build.context.cache_mode
    result.cache_mode_reason = llm.build.context.recompute_reason or ""
    result.latent_cache = any(name.startswith("mla_cache_") for name in llm.build.cache.paged_names)
    t = _lap(result, "build", t)

    enter("runtime")
    # generation first: the logits pass below then writes into pages nobody reads any more
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy_params(NEW_TOKENS))
    ours_tokens = [list(out.token_ids) for out in outputs]
    ours_logits = _autodeploy_logits(llm, prompts, [tokens[0] for tokens in ref.tokens])
    t = _lap(result, "runtime", t)

    enter("compare")
    reference_logits = torch.stack(ref.prefill_logits + ref.decode_logits)
    result.tokens_match = ours_tokens == ref.tokens
    result.min_top2_gap = min(min(g) for g in ref.top2_gaps)
    shape_problem = ""
    if ours_logits.shape == reference_logits.shape:
        result.logits_rel_rmse = rel_rmse(ours_logits, reference_logits)
    else:
        result.logits_rel_rmse = float("inf")
        shape_problem = f"logits shape {tuple(ours_logits.shape)}, HF {tuple(reference_logits.shape)}"
    problems = [shape_problem] if shape_problem else []
    if not shape_problem and not _logits_ok(result.logits_rel_rmse):
        problems.append(f"logits rel. RMSE {result.logits_rel_rmse:.2e} (limit {LOGITS_RTOL:.0e})")
    if not result.tokens_match:
        i, j = _first_divergence(ours_tokens, ref.tokens)
        result.first_divergence = [i, j]
        gap = ref.top2_gaps[i][j] if j < len(ref.top2_gaps[i]) else float("nan")
        problems.append(f"prompt {i} diverges from HF at new token {j} of {NEW_TOKENS} "
                        f"(HF top-2 logit gap there {gap:.1e})")
    result.status = PASS if not problems else MISMATCH
    result.error = "; ".join(problems)
    _lap(result, "compare", t)


def _lap(result: CheckResult, name: str, since: float) -> float:
    now = time.perf_counter()
    result.seconds[name] = round(now - since, 2)
    return now


def _greedy_params(max_tokens: int) -> Any:
    from ..runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _build_llm(checkpoint: str, mode: str = "graph") -> Any:
    """The default pipeline of ``mode``, fp32 on CPU, sized for the two prompts."""
    from ..llm import LLM

    return LLM(checkpoint, dtype="float32", device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch_size=len(PROMPT_LENGTHS),
               max_num_tokens=MAX_SEQ_LEN, mode=mode)


@torch.inference_mode()
def _autodeploy_logits(llm: Any, prompts: Sequence[Sequence[int]], first_tokens: Sequence[int]) -> torch.Tensor:
    """Next-token logits from the cached graph: one prefill step with both prompts, then one
    decode step feeding HF's first greedy token to each; rows in the reference's order
    (prompt 0 prefill, prompt 1 prefill, prompt 0 decode, prompt 1 decode).

    With ``gather_logits_before_lm_head`` the graph returns one row per sequence; without it,
    one per token, and the last token of each sequence is picked.
    """
    from ..cache import build_sequence_info

    graph, cache = llm.build.graph, llm.build.cache
    tables, next_page = [], 0
    for prompt in prompts:
        pages = -(-(len(prompt) + 1) // cache.page_size)
        tables.append(list(range(next_page, next_page + pages)))
        next_page += pages
    rows = []
    steps = [(list(map(list, prompts)), [0] * len(prompts)),
             ([[t] for t in first_tokens], [len(p) for p in prompts])]
    for tokens, starts in steps:
        info = build_sequence_info(tokens, starts, tables, device=cache.device)
        out = graph(*cache.graph_args(info))
        out = out[0] if isinstance(out, (tuple, list)) else out
        index = torch.arange(info.num_sequences) if cache.gathered_logits else info.last_token_indices()
        rows.append(out[0, index.to(out.device)].float().cpu())
    return torch.cat(rows)


def _first_divergence(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> tuple:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if list(a) != list(b):
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return i, j
    return 0, 0


# ---- child-process entry point ------------------------------------------------------------------
def _write_json(path: str, data: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m autodeploy.coverage MODEL_TYPE --result FILE``: one check, result as JSON."""
    parser = argparse.ArgumentParser(prog="python -m autodeploy.coverage")
    parser.add_argument("model_type")
    parser.add_argument("--recipe", default="a", help="size recipe of the tiny config (coverage/recipes.py)")
    parser.add_argument("--mutate", default=None,
                        help="break the pipeline on purpose (coverage/mutations.py): the check must then fail")
    parser.add_argument("--mode", default="graph", choices=("graph", "transformers"), help="deployment mode")
    parser.add_argument("--result", required=True, help="JSON file the result is (re)written to")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--include-excluded", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import logging

    logging.basicConfig(level=os.environ.get("AUTODEPLOY_LOG_LEVEL", "WARNING"), stream=sys.stderr,
                        format="[%(name)s %(levelname)s] %(message)s")
    logger.setLevel(logging.INFO)  # a failure's traceback goes to the child's log
    if args.mutate:
        from .mutations import apply_mutation

        apply_mutation(args.mutate)
    result = run_check(args.model_type, args.cache_dir, recipe=args.recipe, include_excluded=args.include_excluded,
                       mode=args.mode, on_progress=lambda r: _write_json(args.result, r.to_dict()))
    _write_json(args.result, result.to_dict())
    if result.status == ERROR:  # the traceback goes to the child's log
        logger.warning("%s: error at %s: %s", result.model_type, result.stage, result.error)
    return 0

