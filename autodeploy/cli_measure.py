"""The commands that measure: ``bench`` (speed against HF) and ``coverage`` (every model type)."""

import argparse
import json
import os
import time
from typing import Any, Callable, List, Sequence, Tuple

from .cli_build import WORLD_SIZE_HELP, quiet_follower_logging, registry_name, writable_dir
from .utils.errors import AutoDeployError

ENGINES = ["autodeploy", "hf-eager", "hf+torch.compile"]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (a bad value is a one-line error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be at least {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, written as one would type it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text or not action.option_strings:
            return text
        default = action.default
        shown = " ".join(str(v) for v in default) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


# ---- bench -------------------------------------------------------------------------------------
def _check_bench_inputs(cfg: Any) -> None:
    """What can be checked before minutes of measuring: the device, the registry entry and each
    --yaml variant."""
    from .config import load_deploy_config
    from .config.checks import check_device_available

    check_device_available(cfg.device, setting="--device")
    # at --world-size N the entry runs on the N ranks bench starts; otherwise it must fit one
    ranks = dict(world_size=cfg.world_size, launching=True) if cfg.world_size > 1 else {}
    if cfg.registry is not None:
        load_deploy_config(model=cfg.model, device=cfg.device, registry=cfg.registry, **ranks)
    for path in cfg.yaml_variants:
        load_deploy_config([path], model=cfg.model, device=cfg.device, registry=cfg.registry, **ranks)


def cmd_bench(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .bench.report import markdown, write
    from .bench.runner import BenchConfig, run

    if overrides:
        raise AutoDeployError(f"bench takes no dotted overrides; put them in a --yaml variant: {' '.join(overrides)}")
    registry = registry_name(args)
    if registry is not None:  # the entry's fragments are the base of every autodeploy engine
        from .config.registry import registry_entry

        args.model = registry_entry(registry).model
    from .distributed.launcher import driver_process, ranks
    from .distributed.process_group import environment

    env = environment()
    world_size = args.world_size or (env.world_size if env is not None else 1)
    cfg = BenchConfig(
        model=args.model, registry=registry, dtype=args.dtype, device=args.device, batch_sizes=args.batch_sizes,
        new_tokens=args.new_tokens, prefill_lens=args.prefill_lens, rounds=args.rounds, prefill_reps=args.prefill_reps,
        engines=args.engines, yaml_variants=args.yaml or [], threads=args.threads, out_dir=args.out,
        accuracy_prompts=args.accuracy_prompts, accuracy_tokens=args.accuracy_tokens, world_size=world_size,
    )
    if world_size > 1:
        _check_bench_ranks(cfg)
    driver = driver_process()
    if driver:
        writable_dir(cfg.out_dir, "--out")
        _check_bench_inputs(cfg)
    with ranks(world_size, args.argv, device=cfg.device) as group:
        if not group.is_driver:
            from .bench.runner import follow

            quiet_follower_logging(args)
            follow(cfg)
            return 0
        data = run(cfg)
    paths = write(data, cfg.out_dir)
    print(markdown(data))
    print("wrote " + ", ".join(paths.values()))
    return 0


def _check_bench_ranks(cfg: Any) -> None:
    """At several ranks, one autodeploy engine is measured (HF's engines run on rank 0 alone)."""
    if cfg.world_size < 1:
        raise AutoDeployError(f"--world-size {cfg.world_size} must be at least 1")
    if "autodeploy" not in cfg.engines:
        raise AutoDeployError(f"--world-size {cfg.world_size} measures the autodeploy engine across ranks; keep "
                              "'autodeploy' in --engines")
    if cfg.yaml_variants:
        raise AutoDeployError(f"--yaml variants are not measured at --world-size {cfg.world_size} (the other ranks "
                              "follow one engine); measure each variant in its own run")
    from .models.presets import PRESETS, preset_dir

    if cfg.model in PRESETS and cfg.registry is None:
        preset_dir(cfg.model)  # written once, before the ranks that read it start


# ---- coverage ----------------------------------------------------------------------------------
def _recipes(text: str) -> List[str]:
    from .coverage.recipes import RECIPES

    recipes = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise AutoDeployError(f"--recipes: unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}")
    return recipes


def _check_coverage_inputs(args: argparse.Namespace) -> List[str]:
    """The model types to check; every flag checked first (exit 2), not in every child."""
    from .coverage.report import default_report_path
    from .coverage.sweep import select_model_types

    if args.out is None:  # the committed docs/coverage.md is written only when named
        args.out = default_report_path(args.cache_dir)
    try:
        model_types = select_model_types(args.only)
    except ValueError as exc:
        raise AutoDeployError(str(exc)) from None
    if args.jobs < 1 or args.timeout <= 0:
        raise AutoDeployError("--jobs must be at least 1 and --timeout positive")
    writable_dir(os.path.dirname(os.path.abspath(args.out)), "--out")
    if args.mutate:
        from .coverage.mutations import validate_mutation

        try:
            validate_mutation(args.mutate)
        except ValueError as exc:
            raise AutoDeployError(f"--mutate: {exc}") from None
    return model_types


def _progress_printer(model_types: List[str], recipes: List[str], include_excluded: bool) -> Callable[[Any], None]:
    from .coverage.configs import DECODER_ONLY
    from .coverage.sweep import category_of

    # excluded types are classified once, without a check per recipe
    total = sum(len(recipes) if include_excluded or category_of(t)[0] == DECODER_ONLY else 1 for t in model_types)
    seen = [0]

    def progress(r: Any) -> None:
        seen[0] += 1
        secs = r.seconds.get("wall", r.seconds.get("total"))
        where = r.stage + (f" ({r.failed_transform})" if r.failed_transform else "")
        detail = r.reason if r.status == "excluded" else r.error
        timing = f"{secs:6.1f}s" if secs is not None else "       "
        print(f"[{seen[0]:{len(str(total))}d}/{total}] {r.model_type:<26} {r.recipe} {r.outcome:<26} {where:<36} "
              f"{timing}  {detail}", flush=True)

    return progress


def _command_line(args: argparse.Namespace, recipes: List[str]) -> str:
    command = "autodeploy coverage" + "".join(
        f" {flag} {value}" for flag, value in (("--jobs", args.jobs), ("--timeout", f"{args.timeout:g}"),
                                               ("--recipes", ",".join(recipes))))
    if args.mutate:
        command += f" --mutate {args.mutate}"
    if args.mode != "graph":
        command += f" --mode {args.mode}"
    if args.only:
        command += " --only " + " ".join(args.only)
    return command


def _write_coverage(args: argparse.Namespace, results: List[Any], recipes: List[str],
                    wall: float) -> Tuple[List[str], List[Any]]:
    from .coverage.report import default_meta, write_report

    command = _command_line(args, recipes)
    meta = default_meta(command, wall, mode=args.mode)
    previous = os.path.splitext(args.out)[0] + ".json"
    if args.update and os.path.exists(previous):
        from .coverage.report import load_results, merge_results

        with open(previous) as f:
            old_meta = json.load(f).get("meta", {})
        # every update since the full sweep, oldest first: each re-checked some rows
        updates = [u for u in (old_meta.get("updated"), f"{meta['date']}: {command}") if u]
        meta = {**old_meta, "updated": "; ".join(updates)}
        results = merge_results(load_results(previous), results)
    return write_report(results, args.out, meta), results


def cmd_coverage(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .coverage.report import summarize
    from .coverage.sweep import run_sweep

    model_types = _check_coverage_inputs(args)
    recipes = _recipes(args.recipes)
    print(f"checking {len(model_types)} model types at recipe(s) {', '.join(recipes)} in mode {args.mode} with "
          f"{args.jobs} job(s), "
          f"{args.timeout:.0f} s per check" + (f", mutation {args.mutate}" if args.mutate else ""), flush=True)
    start = time.perf_counter()
    results = run_sweep(model_types, jobs=args.jobs, timeout_s=args.timeout, cache_dir=args.cache_dir,
                        include_excluded=args.include_excluded, recipes=recipes, mutate=args.mutate, mode=args.mode,
                        on_result=_progress_printer(model_types, recipes, args.include_excluded))
    wall = time.perf_counter() - start
    paths, results = _write_coverage(args, results, recipes, wall)
    s = summarize(results)
    parts = [f"decoder-only: {s['passed']}/{s['decoder_only']} pass ({s['pass_rate']:.1f}%)"]
    parts += [f"{k}: {v}" for k, v in s["by_outcome"].items() if k != "pass"]
    parts += [f"{sum(s['excluded'].values())} not decoder-only", f"{wall / 60:.1f} min"]
    print("\n" + "; ".join(parts))
    print("wrote " + ", ".join(paths))
    return 0


# ---- parsers -----------------------------------------------------------------------------------
def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    _add_bench_parser(sub, common)
    _add_coverage_parser(sub, common)


def _add_bench_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("bench", parents=[common], help="measure autodeploy against HF eager and HF + torch.compile",
                       formatter_class=DefaultsFormatter)
    p.add_argument("--model", default="small", help="preset, checkpoint directory, hub id or registry entry")
    p.add_argument("--use-registry", action="store_true",
                   help="--model names a model-registry entry ('autodeploy models'): measure its model, with its YAML "
                   "fragments under every autodeploy engine (--dtype, --device and each --yaml variant apply over "
                   "them). Without it, a --model that is no preset and no existing path but an entry's name uses the "
                   "entry too")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and compute")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 8, 32], metavar="N",
                   help="decode batch sizes")
    p.add_argument("--new-tokens", type=at_least(1), default=128, metavar="N", help="decode length")
    p.add_argument("--prefill-lens", type=at_least(1), nargs="+", default=[128, 512], metavar="N",
                   help="prompt lengths of the prefill measurements")
    p.add_argument("--rounds", type=at_least(1), default=3, metavar="N", help="interleaved measurement rounds")
    p.add_argument("--prefill-reps", type=at_least(1), default=3, metavar="N",
                   help="prefills per length in each round")
    p.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES, help="what to measure")
    p.add_argument("--yaml", action="append", metavar="FILE",
                   help="an autodeploy variant config to measure too (repeatable)")
    p.add_argument("--accuracy-prompts", type=at_least(0), default=4, metavar="N",
                   help="random prompts each autodeploy engine generates alone and compares with HF eager "
                   "(0: no accuracy check)")
    p.add_argument("--accuracy-tokens", type=at_least(1), default=32, metavar="N",
                   help="greedy tokens per accuracy prompt")
    p.add_argument("--threads", type=at_least(1), default=None, metavar="N",
                   help="torch threads (default: torch's own choice)")
    p.add_argument("--world-size", type=at_least(1), default=None, metavar="N",
                   help=WORLD_SIZE_HELP + "; the HF engines run on rank 0 alone (default: 1, or torchrun's WORLD_SIZE)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), metavar="DIR",
                   help="where the JSON, markdown and PNG go")
    p.set_defaults(func=cmd_bench, accepts_overrides=True)


def _add_coverage_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("coverage", parents=[common],
                       help="check every causal-LM model type of transformers end to end against HF")
    p.add_argument("--only", nargs="+", metavar="TYPE",
                   help="model types or glob patterns (e.g. llama 'qwen*'), space- or comma-separated")
    p.add_argument("--jobs", type=int, default=1, help="models checked in parallel, one process each (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model before it is killed (default 300)")
    p.add_argument("--out", default=None,
                   help="markdown report; the JSON goes beside it (default: report.md in --cache-dir; regenerate the "
                        "committed report with --out docs/coverage.md)")
    p.add_argument("--cache-dir", default=None, help="where tiny checkpoints and logs go (default .cache/coverage)")
    p.add_argument("--include-excluded", action="store_true",
                   help="also run the types that are not decoder-only (reported, never counted)")
    p.add_argument("--update", action="store_true",
                   help="merge into the existing report at --out: re-checked types replace their rows")
    p.add_argument("--recipes", default="a,b",
                   help="size recipes of the tiny configs, comma-separated (default a,b: regular sizes, and odd ones "
                        "where models are sensitive; a type passes only if it passes at every recipe)")
    p.add_argument("--mode", default="graph", choices=("graph", "transformers"),
                   help="deployment mode every check builds: graph (export, the default) or transformers (the HF "
                        "module eagerly with cached attention; committed as docs/coverage_transformers.md)")
    p.add_argument("--mutate", default=None, metavar="NAME",
                   help="test the sweep itself: break the pipeline on purpose in every check (rope_sign, or "
                        "noop:<transform key>); the report must then show failures. Never use for a real report")
    p.set_defaults(func=cmd_coverage, accepts_overrides=False)
