"""Run the coverage check over many model types: one child process per model type and size
recipe, ``jobs`` at a time, each with a wall-clock limit.

A child that runs past its limit is killed (its whole process group) and reported as a
timeout at the stage its result file last named; a child that dies without a result (a
segfault, the OOM killer) is reported as an error with its exit code and its last stderr line.
Each child's stderr is kept in ``<cache_dir>/logs/<model_type>.<recipe>.log``.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, List, Optional, Sequence

from ..utils.logging import get_logger
from .check import ERROR, EXCLUDED, TIMEOUT, CheckResult
from .configs import DECODER_ONLY, causal_lm_model_types, classify
from .recipes import DEFAULT_RECIPES, get_recipe

logger = get_logger(__name__)

DEFAULT_TIMEOUT_S = 300.0


def select_model_types(only: Optional[Sequence[str]] = None, all_types: Optional[Sequence[str]] = None) -> List[str]:
    """The model types to check: all of the causal-LM mapping, or those matching ``only``.

    ``only`` holds names or glob patterns (``qwen*``), comma-separated or not. A name that is no
    model type of the mapping, or a pattern that matches none, is an error naming the close
    matches: almost certainly a typo, and better caught before a sweep than reported as one
    error row of it.
    """
    universe = list(all_types) if all_types is not None else causal_lm_model_types()
    if not only:
        return universe
    patterns = [p.strip() for item in only for p in item.split(",") if p.strip()]
    chosen: List[str] = []
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            matches = fnmatch.filter(universe, pattern)
            if not matches:
                raise ValueError(f"--only pattern '{pattern}' matches no model type{_close_matches(pattern, universe)}")
        elif pattern in universe:
            matches = [pattern]
        else:
            raise ValueError(f"--only: '{pattern}' is no causal-LM model type of transformers "
                             f"{_transformers_version()}{_close_matches(pattern, universe)}")
        chosen.extend(m for m in matches if m not in chosen)
    return chosen


def _close_matches(name: str, universe: Sequence[str]) -> str:
    """'; did you mean ...?' with the model types spelled most like ``name`` (or ones it starts)."""
    stem = name.strip("*?[]")
    close = difflib.get_close_matches(stem, universe, n=5, cutoff=0.6)
    close += [t for t in universe if stem and t.startswith(stem) and t not in close][: 5 - len(close)]
    if close:
        return f"; did you mean {', '.join(close)}?"
    return " (no close match; the types are the keys of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def run_one_in_subprocess(model_type: str, cache_dir: str, timeout_s: float, threads: int = 1,
                          include_excluded: bool = False, recipe: str = "a",
                          mutate: Optional[str] = None, mode: str = "graph") -> CheckResult:
    """Check one model type at one size recipe in a child process with a time limit
    (``mutate``: a deliberate breakage the check must catch, see ``mutations``)."""
    log_dir = os.path.join(cache_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    fd, result_path = tempfile.mkstemp(prefix=f"{model_type}.{recipe}-", suffix=".json", dir=log_dir)
    os.close(fd)
    os.unlink(result_path)  # the child creates it at its first stage
    cmd = [sys.executable, "-m", "autodeploy.coverage", model_type, "--recipe", recipe, "--result", result_path,
           "--cache-dir", cache_dir, "--threads", str(threads)]
    if include_excluded:
        cmd.append("--include-excluded")
    if mutate:
        cmd += ["--mutate", mutate]
    if mode != "graph":
        cmd += ["--mode", mode]
    log_path = os.path.join(log_dir, f"{model_type}.{recipe}.log")
    start = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(threads),
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
    elapsed = round(time.perf_counter() - start, 2)
    result = _read_result(result_path, model_type, recipe)
    if os.path.exists(result_path):
        os.unlink(result_path)
    if timed_out:
        result.status = TIMEOUT
        result.error = f"no result within {timeout_s:.0f} s (killed during stage {result.stage})"
    elif result.status == "running":  # the child died without finishing
        result.status = ERROR
        result.error = f"child process exited with code {proc.returncode}: {_last_line(log_path)}"
    result.seconds["wall"] = elapsed
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child we started and anything it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_result(path: str, model_type: str, recipe: str) -> CheckResult:
    try:
        with open(path) as f:
            return CheckResult.from_dict(json.load(f))
    except (OSError, ValueError):
        category, reason = category_of(model_type)
        return CheckResult(model_type, recipe=recipe, category=category, reason=reason)


def category_of(model_type: str) -> tuple:
    """``classify``, with an unknown type counted as decoder-only (its check reports it)."""
    try:
        return classify(model_type)
    except Exception:  # noqa: BLE001
        return DECODER_ONLY, ""


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else "(no output)"


def run_sweep(
    model_types: Iterable[str],
    *,
    jobs: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cache_dir: Optional[str] = None,
    include_excluded: bool = False,
    recipes: Sequence[str] = DEFAULT_RECIPES,
    mutate: Optional[str] = None,
    mode: str = "graph",
    on_result: Optional[Callable[[CheckResult], None]] = None,
) -> List[CheckResult]:
    """Check every model type at every size recipe (children in parallel), results sorted by
    model type and recipe.

    Excluded (not decoder-only) types are classified here without a child (one result, at the
    first recipe), unless ``include_excluded`` asks to run them too. ``on_result`` is called as
    each one finishes. ``mutate`` breaks the pipeline on purpose in every child (``mutations``).
    ``mode``: the deployment mode every child builds (``graph``, or ``transformers``: the HF module
    with cached attention, no export).
    """
    recipes = [get_recipe(r).name for r in recipes]  # unknown names fail here, not in every child
    from .checkpoints import default_cache_dir

    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    jobs = max(1, int(jobs))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    results: List[CheckResult] = []
    lock = threading.Lock()
    todo: List[tuple] = []

    def done(result: CheckResult) -> None:
        with lock:
            results.append(result)
            if on_result is not None:
                on_result(result)

    for model_type in model_types:
        category, reason = category_of(model_type)
        if category != DECODER_ONLY and not include_excluded:
            done(CheckResult(model_type, recipe=recipes[0], category=category, reason=reason, status=EXCLUDED))
        else:
            todo.extend((model_type, recipe) for recipe in recipes)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one_in_subprocess, t, cache_dir, timeout_s, threads, include_excluded, r, mutate,
                               mode):
                   (t, r) for t, r in todo}
        for future in as_completed(futures):
            try:
                done(future.result())
            except Exception as exc:  # noqa: BLE001 - a bug of the sweep itself: still one row
                t, r = futures[future]
                done(CheckResult(t, recipe=r, status=ERROR, error=f"sweep: {type(exc).__name__}: {exc}"))
    return sorted(results, key=lambda r: (r.model_type, r.recipe))
