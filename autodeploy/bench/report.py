"""Write a benchmark result as JSON, a markdown table and a PNG bar chart."""

import json
import os
import time
from typing import Any, Dict, List, Optional

TARGETS = {  # from the runtime issue (defaults, small preset, exact tokens); measured, never asserted
    "decode_tok_s_b32": ("decode b32 >= 2x HF eager", 2.0),
    "decode_tok_s_b1": ("decode b1 >= 2x HF eager", 2.0),
    "prefill_tok_s_512": ("prefill 512 >= 1.0x HF eager", 1.0),
}


def _fmt(cell: Any, digits: int = 1) -> str:
    if isinstance(cell, dict):
        return f"{cell['median']:.{digits}f} ({cell['min']:.{digits}f}-{cell['max']:.{digits}f})"
    return f"{cell:.{digits}f}" if isinstance(cell, float) else str(cell)


def markdown(data: Dict[str, Any]) -> str:
    meta, results = data["meta"], data["results"]
    keys: List[str] = []
    for row in results.values():
        for k in row:
            if k.startswith(("prefill_tok_s_", "decode_tok_s_b", "ttft_ms_")) and "_vs_" not in k and k not in keys:
                keys.append(k)
    hw = meta["gpu"] or meta["cpu"]
    lines = [
        f"## {meta['model']} ({meta['dtype']}, {meta['device']}, {hw}, {meta['threads']} threads)", "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, autodeploy {meta['autodeploy_commit']}, "
        f"{meta['date']}. Median (min-max) of {meta['rounds']} interleaved rounds "
        f"({meta.get('prefill_reps', 1)} prefills per length per round); decode: {meta['new_tokens']} new "
        f"tokens after a {meta['decode_prompt_len']}-token prompt. In parentheses after the engine rows' ratios: "
        "speed relative to HF eager.", "",
        # measure_peak: the process's RSS on a CPU, the CUDA allocator's peak on a GPU
        f"| engine | build [s] | warm-up [s] | {'peak GPU memory growth' if meta['device'].startswith('cuda') else 'peak RSS growth'} "
        "[MiB] | " + " | ".join(keys) + " |",
        "|---|---|---|---|" + "---|" * len(keys),
    ]
    for name, row in results.items():
        cells = []
        for k in keys:
            cell = _fmt(row.get(k, "-"))
            ratio = row.get(f"{k}_vs_hf_eager")
            cells.append(f"{cell} [{ratio:.2f}x]" if ratio is not None else cell)
        lines.append(f"| {name} | {row['build_s']} | {row['warmup_s']} | {row['peak_growth_mb']} | " + " | ".join(cells) + " |")
    lines += ["", f"Batch-1 decode bandwidth floor: {meta['weight_mb_per_decode_token']} MiB of weights per token / "
              f"{meta['read_bandwidth_gbs']} GB/s measured read bandwidth = {meta['b1_floor_ms_per_step']} ms/step. "
              "Share of the floor reached: " + ", ".join(
                  f"{n} {r['bandwidth_floor_fraction_b1']:.0%}" for n, r in results.items()
                  if "bandwidth_floor_fraction_b1" in r) + "."]
    ours = {n: r for n, r in results.items() if n.startswith("autodeploy")}
    accurate = {n: r["accuracy_vs_hf_eager"] for n, r in ours.items() if "accuracy_vs_hf_eager" in r}
    if accurate:
        first = next(iter(accurate.values()))  # every engine ran the same prompts
        lines += ["", f"Accuracy against HF eager ({first['prompts']} random {meta['decode_prompt_len']}-token "
                  f"prompts, each alone, {first['new_tokens']} greedy tokens; HF teacher-forced on each engine's "
                  "own tokens):"]
        for name, a in accurate.items():
            lines.append(f"- {name}: {a['greedy_step_match']:.1%} of steps pick HF's token, "
                         f"{a['prompts_equal_hf']}/{a['prompts']} continuations equal HF greedy, "
                         f"largest log-probability difference {a['max_logprob_abs_err']:.1e}")
    if ours and "hf-eager" in results:
        lines += ["", "Targets (measured, not asserted):"]
        for name, row in ours.items():
            for key, (label, goal) in TARGETS.items():
                ratio = row.get(f"{key}_vs_hf_eager")
                if ratio is None:
                    continue
                verdict = "met" if ratio >= goal else f"missed by {goal / ratio:.2f}x"
                lines.append(f"- {name}: {label}: {ratio:.2f}x, {verdict}")
            comp = results.get("hf+torch.compile")
            if comp and "decode_tok_s_b1" in row and "decode_tok_s_b1" in comp:
                ratio = row["decode_tok_s_b1"]["median"] / comp["decode_tok_s_b1"]["median"]
                lines.append(f"- {name}: decode b1 faster than HF + torch.compile: {ratio:.2f}x, "
                             f"{'met' if ratio > 1 else 'missed'}")
            lines.append(f"- {name}: build time (no torch.compile) < 20 s: {row['build_s']} s, "
                         f"{'met' if row['build_s'] < 20 else 'missed'}")
    return "\n".join(lines) + "\n"


def plot(data: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = data["results"]
    keys = sorted({k for r in results.values() for k in r if k.startswith("decode_tok_s_b") and "_vs_" not in k},
                  key=lambda k: int(k.rsplit("b", 1)[1]))
    keys += sorted(k for r in list(results.values())[:1] for k in r if k.startswith("prefill_tok_s_") and "_vs_" not in k)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4))
    width = 0.8 / max(1, len(results))
    for i, (name, row) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [row[k]["median"] if k in row else 0 for k in keys], width, label=name)
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([k.replace("_tok_s_", " ").replace("decode b", "decode b=") for k in keys])
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    meta = data["meta"]
    ax.set_title(f"{meta['model']} {meta['dtype']} on {meta['gpu'] or 'CPU'} ({meta['threads']} threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(data: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    model = data["meta"]["model"]
    # a checkpoint directory by its own name, a hub id "org/name" as "org_name"
    name = os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model.replace("/", "_")
    stem = os.path.join(out_dir, f"e2e-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    paths = {"json": stem + ".json", "md": stem + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=2)
    with open(paths["md"], "w") as f:
        f.write(markdown(data))
    png = plot(data, stem + ".png")
    if png:
        paths["png"] = png
    return paths
