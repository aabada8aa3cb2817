"""The coverage report: a summary, a markdown table and the same data as JSON.

The markdown keeps "wrong tokens/logits" (ran through, output differs from HF) apart from
"error at stage X" (an exception) and "timeout", so a silent numerical failure can never hide
among crashes.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from .check import EXCLUDED, LOGITS_RTOL, MISMATCH, NEW_TOKENS, PASS, PROMPT_LENGTHS, STAGES, CheckResult
from .causes import CAUSES, RECOMPUTE_NEEDS, cause_of
from .configs import DECODER_ONLY
from .recipes import RECIPES


@dataclass
class TypeRow:
    """One model type over the recipes it was checked at (one row of the table)."""

    model_type: str
    results: Dict[str, CheckResult]  # recipe -> result, in recipe order

    @property
    def first(self) -> CheckResult:
        return next(iter(self.results.values()))

    @property
    def category(self) -> str:
        return self.first.category

    @property
    def passed(self) -> bool:
        return all(r.status == PASS for r in self.results.values())

    @property
    def failed(self) -> List[CheckResult]:
        return [r for r in self.results.values() if r.status != PASS]

    @property
    def outcome(self) -> str:
        """pass only when every recipe passed; else the first failing recipe's outcome."""
        return "pass" if self.passed else self.failed[0].outcome

    @property
    def recompute(self) -> bool:
        return any(r.cache_mode == "recompute" for r in self.results.values())

    @property
    def state(self) -> bool:
        """Served with per-sequence state caches (SSM / conv / delta-rule states)."""
        return any("state" in (r.cache_mode or "") for r in self.results.values())


def group_by_type(results: Sequence[CheckResult]) -> List[TypeRow]:
    rows: Dict[str, Dict[str, CheckResult]] = {}
    for r in sorted(results, key=lambda r: (r.model_type, r.recipe)):
        rows.setdefault(r.model_type, {})[r.recipe] = r
    return [TypeRow(t, by_recipe) for t, by_recipe in rows.items()]


def recipes_of(results: Sequence[CheckResult]) -> List[str]:
    return sorted({r.recipe for r in results if r.status != EXCLUDED} or {r.recipe for r in results})


def summarize(results: Sequence[CheckResult]) -> Dict[str, Any]:
    """Counts over the decoder-only types (a type passes when it passes at every recipe) and
    the excluded ones, plus the counts of each recipe on its own."""
    rows = group_by_type(results)
    decoder = [row for row in rows if row.category == DECODER_ONLY]
    passed = sum(row.passed for row in decoder)
    recompute = sum(row.passed and row.recompute for row in decoder)
    with_state = sum(row.passed and not row.recompute and row.state for row in decoder)
    by_outcome = Counter(row.outcome for row in decoder)
    failing = [r for row in decoder for r in row.failed]
    errors_by_stage = Counter(r.stage for r in failing if r.status != MISMATCH)
    per_recipe: Dict[str, Dict[str, Any]] = {}
    for recipe in recipes_of(results):
        mine = [row.results[recipe] for row in decoder if recipe in row.results]
        per_recipe[recipe] = {"checked": len(mine), "passed": sum(r.status == PASS for r in mine),
                              "by_outcome": dict(sorted(Counter(r.outcome for r in mine).items()))}
    only = Counter(row.failed[0].recipe for row in decoder if len(row.failed) == 1 and len(row.results) > 1)
    excluded = Counter(row.category for row in rows if row.category != DECODER_ONLY)
    return {
        "decoder_only": len(decoder),
        "passed": passed,
        "passed_recompute": recompute,
        "passed_state": with_state,
        "pass_rate": round(100.0 * passed / len(decoder), 1) if decoder else 0.0,
        "by_outcome": dict(sorted(by_outcome.items())),
        "per_recipe": per_recipe,
        "failed_only_at": dict(sorted(only.items())),
        "errors_by_stage": {s: errors_by_stage[s] for s in STAGES if errors_by_stage[s]},
        "excluded": dict(sorted(excluded.items())),
    }


def environment() -> Dict[str, str]:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine()}


def to_json(results: Sequence[CheckResult], meta: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return {"meta": dict(meta or {}), "summary": summarize(results), "results": [r.to_dict() for r in results]}


def _cell(text: Any, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("|", "\\|") if text else ""


def _stage_cell(r: CheckResult) -> str:
    if r.failed_transform:
        return f"{r.stage} ({r.failed_transform})"
    return r.stage


def _mode_cell(r: CheckResult) -> str:
    mode = {"paged_kv": "paged KV", "state": "state", "paged_kv+state": "paged KV + state",
            "recompute": "recompute"}.get(r.cache_mode or "", "")
    return mode + " (MLA latent)" if r.latent_cache and r.cache_mode != "recompute" else mode


def _rmse_cell(r: CheckResult) -> str:
    return f"{r.logits_rel_rmse:.1e}" if r.logits_rel_rmse is not None else ""


def _recipe_cell(r: Optional[CheckResult]) -> str:
    if r is None:
        return "not run"
    if r.status in (PASS, MISMATCH):
        return r.outcome
    return f"{r.outcome} at {_stage_cell(r)}"


def _type_mode_cell(row: TypeRow) -> str:
    modes = [_mode_cell(r) for r in row.results.values()]
    return modes[0] if len(set(modes)) == 1 else " / ".join(m or "-" for m in modes)


def _type_note(row: TypeRow) -> str:
    if row.failed:
        several = len(row.results) > 1
        return "; ".join(f"{r.recipe}: {r.error}" if several else r.error for r in row.failed if r.error)
    reasons = list(dict.fromkeys(_cell(r.cache_mode_reason, 160) for r in row.results.values()
                                 if r.cache_mode == "recompute"))
    return " / ".join(reasons)


def _recipe_lines(recipes: Sequence[str]) -> List[str]:
    return [f"* recipe `{name}`: {RECIPES[name].summary}." for name in recipes if name in RECIPES]


def _cause_lines(rows: Sequence[TypeRow]) -> List[str]:
    """The failing types with the cause found for each (``causes.py``), and stale entries."""
    failing = [row for row in rows if row.category == DECODER_ONLY and not row.passed]
    if not failing:
        return []
    lines = ["", "## Why they fail", ""]
    for row in failing:
        recipes = ", ".join(r.recipe for r in row.failed)
        lines.append(f"* **{row.model_type}** ({recipes}): {cause_of(row.model_type) or 'not investigated yet.'}")
    passing = {row.model_type for row in rows if row.passed}
    stale = sorted(t for t in CAUSES if t in passing)
    if stale:
        lines += ["", "Causes listed for types that now pass (remove them from coverage/causes.py): "
                  + ", ".join(stale) + "."]
    return lines


def _recompute_lines(rows: Sequence[TypeRow]) -> List[str]:
    """What the stateful types still in recompute mode need (``causes.RECOMPUTE_NEEDS``)."""
    listed = [row for row in rows if row.passed and row.recompute and row.model_type in RECOMPUTE_NEEDS]
    if not listed:
        return []
    lines = ["", "## What the stateful types in recompute mode need", ""]
    lines += [f"* **{row.model_type}**: {RECOMPUTE_NEEDS[row.model_type]}" for row in listed]
    return lines


def markdown(results: Sequence[CheckResult], meta: Optional[Dict[str, Any]] = None) -> str:
    meta = dict(meta or {})
    s = summarize(results)
    recipes = recipes_of(results)
    rows = group_by_type(results)
    transformers_mode = meta.get("mode", "graph") == "transformers"
    lines: List[str] = ["# Architecture coverage" + (" in the transformers mode" if transformers_mode else ""), ""]
    env = ", ".join(f"{k} {v}" for k, v in meta.get("environment", {}).items())
    pipeline = ("the transformers mode (`--mode transformers`: no export; the HF module eagerly with its attention "
                "calls answered by the cached attention over the paged KV cache, recompute mode where the probe or "
                "the consistency check says the cache cannot serve the model; the default mode is in "
                "[coverage.md](coverage.md))" if transformers_mode else
                "the full default pipeline (export, canonicalisation, fusions, cached attention, runtime)")
    lines += [
        f"Generated by `autodeploy coverage` ({meta.get('date', '')}; {env}). Every model type in "
        f"transformers' causal-LM auto-mapping gets a tiny random checkpoint at each of {len(recipes)} size "
        f"recipe(s) (the fewest layers that hold every kind of layer), built with {pipeline} "
        "in fp32 on CPU and compared with HF eager "
        "on the same weights: next-token logits after the prompt and after the first new token (relative RMSE < "
        f"{LOGITS_RTOL:.0e}) and {NEW_TOKENS} greedy tokens for a batch of {len(PROMPT_LENGTHS)} prompts of "
        f"{' and '.join(map(str, PROMPT_LENGTHS))} tokens (token-identical). A model type passes only if it passes "
        "at every recipe:",
        "",
        *_recipe_lines(recipes),
        "",
        f"**Decoder-only: {s['passed']} of {s['decoder_only']} pass end to end at every recipe "
        f"({s['pass_rate']:.1f}%); {s['passed'] - s['passed_recompute']} of them with the paged KV cache "
        f"and/or state caches ({s.get('passed_state', 0)} with state caches), {s['passed_recompute']} in "
        "recompute mode.**",
        "",
        *_other_mode_lines(meta.get("transformers_mode_summary")),
        "Cache mode: `paged KV` is the normal path (cached attention); `state` means per-sequence state caches "
        "(convolution windows, SSM and delta-rule states: one slot per running sequence), `paged KV + state` "
        "both (hybrid models); `(MLA latent)` marks multi-head latent attention caching its compressed latent "
        "and roped key part per token instead of per-head keys and values. `recompute` means `recompute_fallback` found that the caches cannot serve the "
        "model and ran it exactly, but re-running each sequence's whole history every step; the last column "
        "says why (state outside attention that no state cache holds yet, attention the matchers did not "
        "canonicalise, or a model that only exports with a static sequence length).",
        "",
        "Results: `pass`; `FAIL: wrong tokens` / `FAIL: wrong logits` (ran through, output differs from HF); "
        "`FAIL: error` (an exception at the stage shown, with the failing transform); `FAIL: timeout`. "
        "Stages in order: " + ", ".join(f"`{st}`" for st in STAGES) + ".",
        "",
        "| result (all recipes) | model types |",
        "|---|---|",
    ]
    for outcome, n in s["by_outcome"].items():
        lines.append(f"| {outcome} | {n} |")
    if len(recipes) > 1:
        lines += ["", "| recipe | passed | failures |", "|---|---|---|"]
        for recipe, counts in s["per_recipe"].items():
            fails = ", ".join(f"{k} {v}" for k, v in counts["by_outcome"].items() if k != "pass") or "none"
            lines.append(f"| {recipe} | {counts['passed']} of {counts['checked']} | {fails} |")
        if s["failed_only_at"]:
            lines += ["", "Types that fail at one recipe only: " + ", ".join(
                f"{n} at `{recipe}`" for recipe, n in s["failed_only_at"].items()) + "."]
    if s["errors_by_stage"]:
        lines += ["", "| errors and timeouts at stage (all recipes) | checks |", "|---|---|"]
        for stage, n in s["errors_by_stage"].items():
            lines.append(f"| {stage} | {n} |")
    head = " | ".join(f"recipe {r}" for r in recipes)
    lines += ["", "## Decoder-only model types", "",
              f"| model type | result | {head} | cache mode | logits rel. RMSE ({' / '.join(recipes)}) | "
              "first error line, or why recompute |",
              "|---|---|" + "---|" * len(recipes) + "---|---|---|"]
    for row in rows:
        if row.category != DECODER_ONLY:
            continue
        cells = " | ".join(_recipe_cell(row.results.get(r)) for r in recipes)
        rmse = " / ".join(_rmse_cell(row.results[r]) or "-" if r in row.results else "-" for r in recipes)
        lines.append(f"| {row.model_type} | {'pass' if row.passed else 'FAIL'} | {cells} | {_type_mode_cell(row)} | "
                     f"{rmse} | {_cell(_type_note(row), 300)} |")
    lines += _cause_lines(rows)
    lines += _recompute_lines(rows)
    excluded = [r for r in results if r.category != DECODER_ONLY]
    if excluded:
        ran = any(r.status != EXCLUDED for r in excluded)
        lines += ["", "## Not decoder-only (excluded from the percentage)", ""]
        if ran:  # --include-excluded: they were run too, for information
            lines += ["| model type | recipe | category | why | stage reached | result | first error line |",
                      "|---|---|---|---|---|---|---|"]
            for r in excluded:
                lines.append(f"| {r.model_type} | {r.recipe} | {r.category} | {_cell(r.reason)} | {_stage_cell(r)} | "
                             f"{r.outcome} | {_cell(r.error)} |")
        else:
            lines += ["| model type | category | why |", "|---|---|---|"]
            for row in rows:
                if row.category != DECODER_ONLY:
                    lines.append(f"| {row.model_type} | {row.category} | {_cell(row.first.reason)} |")
    if meta.get("command"):
        lines += ["", f"Command: `{meta['command']}`"
                  + (f", {meta['wall_s'] / 60:.1f} min wall time" if meta.get("wall_s") else "") + "."]
    if meta.get("updated"):
        lines += ["", f"Rows updated since: {_cell(meta['updated'], 1000)}."]
    return "\n".join(lines) + "\n"


def default_meta(command: str = "", wall_s: Optional[float] = None, **extra: Any) -> Dict[str, Any]:
    meta: Dict[str, Any] = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "environment": environment(), "command": command}
    if wall_s is not None:
        meta["wall_s"] = round(wall_s, 1)
    meta.update(extra)
    return meta


def load_results(json_path: str) -> List[CheckResult]:
    """The results of an earlier report's JSON (for ``--update``)."""
    with open(json_path) as f:
        data = json.load(f)
    return [CheckResult.from_dict(row) for row in data.get("results", [])]


def merge_results(old: Sequence[CheckResult], new: Sequence[CheckResult]) -> List[CheckResult]:
    """``old`` with every (model type, recipe) that ``new`` re-checked replaced, sorted."""
    merged = {(r.model_type, r.recipe): r for r in old}
    merged.update({(r.model_type, r.recipe): r for r in new})
    return sorted(merged.values(), key=lambda r: (r.model_type, r.recipe))


COMMITTED_REPORT = os.path.join("docs", "coverage.md")


def default_report_path(cache_dir: Optional[str] = None) -> str:
    """Where a sweep's report goes when ``--out`` names no file: ``report.md`` (and ``.json``)
    in the coverage cache, beside the checkpoints and logs.

    Why not the committed ``docs/coverage.md``: a partial sweep (``--only llama``) written there
    replaced the whole table with one row. The docs are regenerated only on request, by naming
    them (``--out docs/coverage.md``, with ``--update`` to merge a partial sweep into them).
    """
    from .checkpoints import default_cache_dir

    return os.path.join(cache_dir or default_cache_dir(), "report.md")


def _other_mode_lines(summary: Optional[Dict[str, Any]]) -> List[str]:
    """The transformers-mode sweep's headline in the default mode's report (when one lies beside it)."""
    if not summary:
        return []
    return [f"In the transformers mode (no export: the HF module with cached attention; "
            f"[coverage_transformers.md](coverage_transformers.md), recipe(s) {', '.join(summary['recipes'])}): "
            f"{summary['passed']} of {summary['decoder_only']} decoder-only types pass ({summary['pass_rate']:.1f}%), "
            f"{summary['passed'] - summary['passed_recompute']} of them with the paged KV cache, "
            f"{summary['passed_recompute']} in recompute mode.", ""]


TRANSFORMERS_MODE_REPORT = "coverage_transformers.json"


def _transformers_mode_summary(directory: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(directory, TRANSFORMERS_MODE_REPORT)
    if not os.path.exists(path):
        return None
    results = load_results(path)
    s = summarize(results)
    return {"passed": s["passed"], "decoder_only": s["decoder_only"], "pass_rate": s["pass_rate"],
            "passed_recompute": s["passed_recompute"], "recipes": recipes_of(results)}


def write_report(results: Sequence[CheckResult], markdown_path: str, meta: Optional[Dict[str, Any]] = None) -> List[str]:
    """Write the markdown table and, beside it, the JSON (same name, ``.json``). A default-mode
    report names the transformers-mode sweep's result when its JSON lies beside it."""
    results = sorted(results, key=lambda r: (r.model_type, r.recipe))
    json_path = os.path.splitext(markdown_path)[0] + ".json"
    directory = os.path.dirname(os.path.abspath(markdown_path))
    meta = dict(meta or {})
    if meta.get("mode", "graph") == "graph" and os.path.basename(json_path) != TRANSFORMERS_MODE_REPORT:
        meta["transformers_mode_summary"] = _transformers_mode_summary(directory)
    os.makedirs(directory, exist_ok=True)
    with open(markdown_path, "w") as f:
        f.write(markdown(results, meta))
    with open(json_path, "w") as f:
        json.dump(to_json(results, meta), f, indent=1, default=str)
        f.write("\n")
    return [markdown_path, json_path]
