#!/usr/bin/env python
"""Build time against depth and expert count: ``autodeploy export`` of three models, each build in a
fresh process, optionally for several source trees interleaved (before/after a change).

    python benchmarks/bench_build_time.py                                   # this tree, 2 rounds
    python benchmarks/bench_build_time.py --trees before=/tmp/wt after=.    # a worktree of an older commit

Models: the ``small`` preset (12 layers), ``deep48`` (a 48-layer Llama of hidden 256: what grows
with depth, the weights are small), ``moe16`` (a 16-layer Qwen3-MoE of 128 experts, 6,293 weight
tensors: what grows with the expert count) and ``moe16-fp8`` (the same with its routed experts in
fine-grained FP8, DeepSeek-V3's format: a ``weight_scale_inv`` beside every expert weight, 12,437
tensors). The test checkpoints are written once with random weights under
``$AUTODEPLOY_CACHE/bench-build`` (``autodeploy.models.presets.write_random_checkpoint``; the FP8
one quantized from ``moe16`` with ``quantize_fp8_blocks``).
Each build reports the transform summary table; the JSON keeps every transform's time, the table
(printed, and written beside the JSON as ``.md``) the total and the largest items, the chart
(``benchmarks/build-time.png``) torch.export's share of each total. The pattern cache should be
warm (one build of each model first, not counted, does that). Writes
``benchmarks/results/build-time-<time>.{json,md}``.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import write_report  # noqa: E402

TEST_MODELS = {
    "deep48": dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=48,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4000,
                   max_position_embeddings=2048, tie_word_embeddings=False),
    "moe16": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=4000,
                  num_experts=128, num_experts_per_tok=8, max_position_embeddings=2048, tie_word_embeddings=False,
                  decoder_sparse_step=1, mlp_only_layers=[]),
}
ROW = re.compile(r"^([a-z_0-9]+)\s+[a-z_]+\s+\d*\s+([0-9.]+)\s")
TOTAL = re.compile(r"^total\s+([0-9.]+)")


# test models quantized from another: name -> (the float model, fine-grained FP8 block)
QUANTIZED_MODELS = {"moe16-fp8": ("moe16", (128, 128))}


def model_path(name: str) -> str:
    """A preset's name as it is, a test model's checkpoint directory (written on first use)."""
    if name not in TEST_MODELS and name not in QUANTIZED_MODELS:
        return name
    from autodeploy.models.presets import cache_root, write_random_checkpoint

    path = os.path.join(cache_root(), "bench-build", name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if name in QUANTIZED_MODELS:
        source, block = QUANTIZED_MODELS[name]
        write_finegrained_fp8_experts(model_path(source), path, block)
    else:
        write_random_checkpoint(TEST_MODELS[name], path)
    return path


def write_finegrained_fp8_experts(source: str, path: str, block: Tuple[int, int]) -> None:
    """A copy of checkpoint ``source`` whose routed experts are fine-grained FP8 (e4m3 weights, a
    float32 ``weight_scale_inv`` per ``block`` tile; DeepSeek-V3's format), the rest float."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from autodeploy.ops.quant.formats import quantize_fp8_blocks

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in sorted(os.listdir(source)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, f)))
    out = {}
    for key, t in tensors.items():
        if ".experts." in key and key.endswith(".weight"):
            out[key], out[key[: -len("weight")] + "weight_scale_inv"] = quantize_fp8_blocks(t.float(), block)
        else:
            out[key] = t
    save_file(out, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block),
                                  "modules_to_not_convert": ["self_attn", "mlp.gate", "lm_head", "embed_tokens"]}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.rename(tmp, path)


def build_once(tree: str, model: str) -> Tuple[float, Dict[str, float]]:
    """(total transform time, each transform's time) of one ``autodeploy export`` run from ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run([sys.executable, "-m", "autodeploy.cli", "export", "--model", model], cwd=tree, env=env,
                         capture_output=True, text=True, check=True).stdout
    steps = {m.group(1): float(m.group(2)) for m in map(ROW.match, out.splitlines()) if m}
    total = next(float(m.group(1)) for m in map(TOTAL.match, out.splitlines()) if m)
    return total, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "deep48", "moe16", "moe16-fp8"])
    parser.add_argument("--trees", nargs="+", default=[f"this={ROOT}"], help="name=path of a source tree")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    models = {m: model_path(m) for m in args.models}
    for model in models.values():  # warm the pattern cache of each tree
        for tree in trees.values():
            build_once(tree, model)
    runs: Dict[str, Dict[str, List]] = {m: {t: [] for t in trees} for m in models}
    for r in range(args.rounds):
        for name, model in models.items():
            for tree_name, tree in trees.items():
                total, steps = build_once(tree, model)
                runs[name][tree_name].append({"total_s": total, "steps": steps})
                print(f"round {r + 1} {name} {tree_name}: {total:.2f} s", flush=True)
    path = write_report("build-time", {"trees": trees, "runs": runs})
    medians = {name: {tree_name: _medians(runs[name][tree_name]) for tree_name in trees} for name in models}
    lines = ["| model | tree | transforms total [s] (median) | export_to_gm [s] | largest other steps [s] |",
             "|---|---|---|---|---|"]
    for name in models:
        for tree_name in trees:
            total, steps = medians[name][tree_name]
            steps = dict(steps)
            export = steps.pop("export_to_gm", 0.0)
            top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(steps.items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"| {name} | {tree_name} | {total:.2f} | {export:.2f} | {top} |")
    table = "\n".join(lines) + "\n"
    stem = path[: -len(".json")]
    with open(stem + ".md", "w") as f:
        f.write(table)
    png = plot(medians, os.path.join(ROOT, "benchmarks", "build-time.png"))
    print("\n" + table)
    print(f"raw: {os.path.relpath(path, ROOT)}, table {os.path.relpath(stem + '.md', ROOT)}"
          + (f", chart {os.path.relpath(png, ROOT)}" if png else ""))


def _medians(rs: List[Dict]) -> Tuple[float, Dict[str, float]]:
    """(median total, median time of each transform) over the rounds of one model and tree."""
    total = statistics.median(x["total_s"] for x in rs)
    return total, {k: statistics.median(x["steps"].get(k, 0.0) for x in rs) for k in rs[0]["steps"]}


def plot(medians: Dict[str, Dict[str, Tuple[float, Dict[str, float]]]], path: str) -> Optional[str]:
    """Stacked bars per model and tree: torch.export, then every other transform."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from autodeploy.bench.runner import cpu_name

    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * sum(len(t) for t in medians.values()), 4.2))
    labels, exports, others = [], [], []
    for name, trees in medians.items():
        for tree_name, (total, steps) in trees.items():
            labels.append(f"{name}\n{tree_name}")
            exports.append(steps.get("export_to_gm", 0.0))
            others.append(total - exports[-1])
    xs = range(len(labels))
    ax.bar(xs, exports, label="export_to_gm (torch.export)")
    ax.bar(xs, others, bottom=exports, label="the other transforms")
    for x, e, o in zip(xs, exports, others):
        ax.annotate(f"{e + o:.1f}", (x, e + o), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("build time [s] (transforms, median)")
    ax.set_title(f"autodeploy export, warm pattern cache\n{cpu_name()}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
