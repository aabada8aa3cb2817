"""``autodeploy`` command line: a thin layer over the Python API.

Bad input (unknown transform key, bad field, bad YAML, missing model path...) prints one line
``autodeploy: error: ...`` and exits with code 2; ``--debug`` shows the traceback instead.
"""

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence

from .utils.errors import AutoDeployError
from .utils.logging import configure_cli_logging


def _config_from_args(args: argparse.Namespace, overrides: Sequence[str]) -> Any:
    from .config import load_deploy_config

    settings = {
        "model": getattr(args, "model", None),
        "device": getattr(args, "device", None),
        "dtype": getattr(args, "dtype", None),
        "trust_remote_code": True if getattr(args, "trust_remote_code", False) else None,
        "allow_pickle": True if getattr(args, "allow_pickle", False) else None,
    }
    return load_deploy_config(getattr(args, "yaml", None) or [], overrides=list(overrides), **settings)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset name, HF checkpoint directory or hub id (default: from YAML)")
    p.add_argument("--yaml", action="append", metavar="FILE", help="YAML config layered over the defaults (repeatable)")
    p.add_argument("--device", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint repo")
    p.add_argument("--allow-pickle", action="store_true", help="allow pickled .bin/.pt weights")


# ---- transforms --------------------------------------------------------------------------------
def _transform_rows(stage: Optional[str], key: Optional[str]) -> List[Dict[str, Any]]:
    import autodeploy.transform.library  # noqa: F401
    from .config.deploy_config import DEFAULT_YAML
    from .config.merge import load_yaml_file
    from .transform.interface import TransformConfig, TransformRegistry
    from .transform.optimizer import close_matches

    defaults = load_yaml_file(DEFAULT_YAML).get("transforms", {})
    if key is not None and not TransformRegistry.has(key):
        raise AutoDeployError(f"unknown transform '{key}'{close_matches(key, TransformRegistry.keys())}")
    common = set(TransformConfig.model_fields) - {"stage"}
    rows = []
    for name, cls in TransformRegistry.items():
        if key is not None and name != key:
            continue
        cfg_cls = cls.get_config_class()
        st = cfg_cls.model_fields["stage"].default.value
        if stage is not None and st != stage:
            continue
        in_default = name in defaults
        yaml_fields = defaults.get(name) or {}
        enabled = in_default and yaml_fields.get("enabled", cfg_cls.model_fields["enabled"].default)
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        summary = doc[0].split(":", 1)[1].strip() if doc and ":" in doc[0] else (doc[0] if doc else "")
        fields = []
        for fname, finfo in cfg_cls.model_fields.items():
            if fname == "stage" or (fname in common and key is None and fname not in yaml_fields):
                continue
            default = yaml_fields.get(fname, finfo.default if finfo.default_factory is None else finfo.default_factory())
            base = TransformConfig.model_fields.get(fname)
            description = finfo.description or (base.description if base is not None else "") or ""
            fields.append({"name": fname, "type": _type_name(finfo.annotation), "default": default,
                           "description": description})
        rows.append({"key": name, "stage": st, "default": "on" if enabled else "off", "in_default_pipeline": in_default,
                     "summary": summary, "fields": fields,
                     "requires": list(cls.requires), "run_after": list(cls.run_after)})
    from .transform.interface import Stage

    rows.sort(key=lambda r: (Stage(r["stage"]).order, r["key"]))
    return rows


def _type_name(annotation: Any) -> str:
    if getattr(annotation, "__args__", None):
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", None) or str(annotation)


def cmd_transforms(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    rows = _transform_rows(args.stage, args.key)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    from .transform.interface import TransformConfig

    if args.key is None:
        print("Common fields of every transform (set per transform in YAML under transforms.<key>):")
        for fname, finfo in TransformConfig.model_fields.items():
            default = "per transform" if fname == "stage" else finfo.default
            print(f"  {fname} = {default!r}: {finfo.description}")
        print()
    for r in rows:
        state = r["default"] + ("" if r["in_default_pipeline"] else " (not in the default pipeline)")
        print(f"{r['key']}  [stage {r['stage']}, default {state}]")
        if r["summary"]:
            print(f"    {r['summary']}")
        if r["requires"] or r["run_after"]:
            print(f"    runs after: {', '.join(r['requires'] + r['run_after'])}")
        for f in r["fields"]:
            print(f"    {f['name']}: {f['type']} = {f['default']!r}  {f['description']}")
    return 0


# ---- models ------------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .models.presets import DEFAULT_PRESET, PRESETS
    from .utils.paths import cache_root

    rows = []
    for name, preset in sorted(PRESETS.items()):
        cached = preset.bundled_dir is not None or os.path.exists(os.path.join(cache_root(), "presets", name))
        rows.append({"name": name, "description": preset.description, "default": name == DEFAULT_PRESET,
                     "model_type": preset.config.get("model_type"), "materialised": cached})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = " (default)" if r["default"] else ""
        print(f"{r['name'].ljust(width)}  {r['description']}{mark}")
    print(f"\nPresets are written on first use to {os.path.join(cache_root(), 'presets')} (AUTODEPLOY_CACHE).")
    return 0


# ---- export ------------------------------------------------------------------------------------
def _op_histogram(gm: Any) -> Dict[str, int]:
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = str(getattr(node.target, "__name__", node.target))
            if hasattr(node.target, "namespace"):
                name = f"{node.target.namespace}.{name}"
            counts[name] += 1
    return dict(counts.most_common())


def _writable_dir(path: str, flag: str) -> None:
    """Create ``path`` if needed and make sure files can be written there, before minutes of work
    are spent on what would then be lost; a user error (exit 2) naming the flag otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".autodeploy-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise AutoDeployError(f"{flag} {path}: cannot write there ({exc.strerror}); pick a directory you can "
                              "write to") from None


def cmd_export(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .pipeline import build_graph

    config = _config_from_args(args, overrides)
    if args.out:
        _writable_dir(args.out, "--out")
    result = build_graph(config, log_summary=False)
    gm = result.graph_module
    print(result.summary)
    histogram = _op_histogram(gm)
    print("\nops in the transformed graph:")
    for name, n in histogram.items():
        print(f"  {n:5d}  {name}")
    if args.print_graph:
        print("\n" + gm.code)
    if args.out:
        from .transform.visualize import write_graph

        os.makedirs(args.out, exist_ok=True)
        written = write_graph(gm, os.path.join(args.out, "graph"))
        with open(os.path.join(args.out, "graph.py"), "w") as f:
            f.write(gm.code)
        with open(os.path.join(args.out, "summary.txt"), "w") as f:
            f.write(result.summary + "\n")
        with open(os.path.join(args.out, "config.json"), "w") as f:
            f.write(config.model_dump_json(indent=2))
        print(f"\nwrote {', '.join(written + [os.path.join(args.out, n) for n in ('graph.py', 'summary.txt', 'config.json')])}")
    return 0


# ---- run ---------------------------------------------------------------------------------------
def _sampling_params(args: argparse.Namespace) -> Any:
    from .runtime.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )


def _read_prompts(args: argparse.Namespace) -> List[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise AutoDeployError(f"cannot read prompts file '{args.prompts_file}': {exc.strerror}") from None
    return prompts or list(DEFAULT_PROMPTS)


DEFAULT_PROMPTS = ("The for statement", "A class definition", "The import statement", "Exceptions are")


def cmd_run(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    import time

    from .llm import LLM

    prompts = _read_prompts(args)
    params = _sampling_params(args)
    config = _config_from_args(args, overrides)
    start = time.perf_counter()
    llm = LLM(**config.model_dump(exclude_none=True), show_progress=sys.stderr.isatty())
    build_s = time.perf_counter() - start
    print(llm.summary)
    print(f"\nbuilt {config.model} in {build_s:.1f} s "
          f"(KV cache: {llm.build.cache.num_pages} pages x {llm.build.cache.page_size} tokens)\n")
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    gen_s = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        for completion in out.outputs:
            print(f"--- prompt: {prompt!r}  [{completion.finish_reason}, {len(completion.token_ids)} tokens]")
            print(f"{prompt}{completion.text}" if not args.chat else completion.text)
    st = llm.engine.stats
    print(f"\n{len(prompts)} prompts in {gen_s:.2f} s: prefill {st.prefill_tokens} tokens at "
          f"{st.prefill_tokens_per_s:.0f} tok/s, decode {st.decode_tokens} tokens at {st.decode_tokens_per_s:.0f} tok/s, "
          f"{st.steps} steps")
    return 0


# ---- serve -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .llm import LLM
    from .serve.server import bind_socket, check_settings, serve

    limits = dict(max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
                  max_choices_per_request=args.max_choices_per_request)
    check_settings(shutdown_timeout=args.shutdown_timeout, **limits)
    config = _config_from_args(args, overrides)
    # The port first: a port in use is reported now, not after the model is built.
    sock = bind_socket(args.host, args.port)
    try:
        llm = LLM(**config.model_dump(exclude_none=True), show_progress=sys.stderr.isatty())
        print(llm.summary, flush=True)
        name = args.served_model_name or config.model
        auth = " (API key required)" if args.api_key else ""
        print(f"\nserving '{name}' at http://{args.host}:{sock.getsockname()[1]}/v1{auth}", flush=True)
        serve(llm, host=args.host, port=args.port, sock=sock, model_name=name, api_key=args.api_key,
              shutdown_timeout=args.shutdown_timeout, **limits)
    finally:
        sock.close()
    return 0


# ---- bench -------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .bench.report import markdown, write
    from .bench.runner import BenchConfig, run

    if overrides:
        raise AutoDeployError(f"bench takes no dotted overrides; put them in a --yaml variant: {' '.join(overrides)}")
    cfg = BenchConfig(
        model=args.model, dtype=args.dtype, device=args.device, batch_sizes=args.batch_sizes,
        new_tokens=args.new_tokens, prefill_lens=args.prefill_lens, rounds=args.rounds, prefill_reps=args.prefill_reps,
        engines=args.engines, yaml_variants=args.yaml or [], threads=args.threads, out_dir=args.out,
        accuracy_prompts=args.accuracy_prompts, accuracy_tokens=args.accuracy_tokens,
    )
    _writable_dir(cfg.out_dir, "--out")
    data = run(cfg)
    paths = write(data, cfg.out_dir)
    print(markdown(data))
    print("wrote " + ", ".join(paths.values()))
    return 0


# ---- coverage ----------------------------------------------------------------------------------
def cmd_coverage(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    import time

    from .coverage.report import default_meta, summarize, write_report
    from .coverage.sweep import run_sweep, select_model_types

    try:
        model_types = select_model_types(args.only)
    except ValueError as exc:
        raise AutoDeployError(str(exc)) from None
    if args.jobs < 1 or args.timeout <= 0:
        raise AutoDeployError("--jobs must be at least 1 and --timeout positive")
    _writable_dir(os.path.dirname(os.path.abspath(args.out)), "--out")
    from .coverage.recipes import RECIPES

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise AutoDeployError(f"--recipes: unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}")
    if args.mutate:
        from .coverage.mutations import validate_mutation

        try:  # fail here, not in every child
            validate_mutation(args.mutate)
        except ValueError as exc:
            raise AutoDeployError(f"--mutate: {exc}") from None
    from .coverage.configs import DECODER_ONLY
    from .coverage.sweep import category_of

    # excluded types are classified once, without a check per recipe
    total = sum(len(recipes) if args.include_excluded or category_of(t)[0] == DECODER_ONLY else 1
                for t in model_types)
    seen = [0]

    def progress(r: Any) -> None:
        seen[0] += 1
        secs = r.seconds.get("wall", r.seconds.get("total"))
        where = r.stage + (f" ({r.failed_transform})" if r.failed_transform else "")
        detail = r.reason if r.status == "excluded" else r.error
        timing = f"{secs:6.1f}s" if secs is not None else "       "
        print(f"[{seen[0]:{len(str(total))}d}/{total}] {r.model_type:<26} {r.recipe} {r.outcome:<26} {where:<36} "
              f"{timing}  {detail}", flush=True)

    print(f"checking {len(model_types)} model types at recipe(s) {', '.join(recipes)} with {args.jobs} job(s), "
          f"{args.timeout:.0f} s per check" + (f", mutation {args.mutate}" if args.mutate else ""), flush=True)
    start = time.perf_counter()
    results = run_sweep(model_types, jobs=args.jobs, timeout_s=args.timeout, cache_dir=args.cache_dir,
                        include_excluded=args.include_excluded, recipes=recipes, mutate=args.mutate,
                        on_result=progress)
    wall = time.perf_counter() - start
    command = "autodeploy coverage" + "".join(
        f" {flag} {value}" for flag, value in (("--jobs", args.jobs), ("--timeout", f"{args.timeout:g}"),
                                               ("--recipes", ",".join(recipes))))
    if args.mutate:
        command += f" --mutate {args.mutate}"
    if args.only:
        command += " --only " + " ".join(args.only)
    meta = default_meta(command, wall)
    previous = os.path.splitext(args.out)[0] + ".json"
    if args.update and os.path.exists(previous):
        from .coverage.report import load_results, merge_results

        old_meta = json.load(open(previous)).get("meta", {})
        meta = {**old_meta, "updated": f"{meta['date']}: {command}"}
        results = merge_results(load_results(previous), results)
    paths = write_report(results, args.out, meta)
    s = summarize(results)
    parts = [f"decoder-only: {s['passed']}/{s['decoder_only']} pass ({s['pass_rate']:.1f}%)"]
    parts += [f"{k}: {v}" for k, v in s["by_outcome"].items() if k != "pass"]
    parts += [f"{sum(s['excluded'].values())} not decoder-only", f"{wall / 60:.1f} min"]
    print("\n" + "; ".join(parts))
    print("wrote " + ", ".join(paths))
    return 0


# ---- entry point -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autodeploy",
        description="Compile a HuggingFace causal LM into an optimized inference graph.",
        epilog="Any setting can be overridden with dotted flags, e.g. --max_seq_len 1024 "
        "--transforms.match_rope_pattern.enabled false",
    )
    parser.add_argument("--debug", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("transforms", help="list every registered transform with its config fields")
    p.add_argument("--stage", help="only transforms of this stage")
    p.add_argument("--key", help="one transform, with all its fields")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_transforms, accepts_overrides=False)

    p = sub.add_parser("export", help="build the model, run the pipeline, print the summary and graph")
    _add_model_args(p)
    p.add_argument("--print-graph", action="store_true", help="print the transformed graph's code")
    p.add_argument("--out", metavar="DIR", help="write graph (DOT/SVG, text, code), summary and config here")
    p.set_defaults(func=cmd_export, accepts_overrides=True)

    p = sub.add_parser("run", help="build the model and generate for some prompts")
    _add_model_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the EOS token")
    p.set_defaults(func=cmd_run, accepts_overrides=True)

    p = sub.add_parser("serve", help="serve the model behind an OpenAI-compatible HTTP API")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1 endpoints")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask for")
    p.add_argument("--max-choices-per-request", type=int, default=128,
                   help="most sequences one request may ask for, prompts x n (default 128); more is a 400")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown (then they are cut with a 503 "
                        "or a final error event)")
    p.set_defaults(func=cmd_serve, accepts_overrides=True)

    p = sub.add_parser("bench", help="measure autodeploy against HF eager and HF + torch.compile")
    p.add_argument("--model", default="small", help="preset, checkpoint directory or hub id (default small)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128, help="decode length (default 128)")
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (default 3)")
    p.add_argument("--prefill-reps", type=int, default=3, help="prefills per length in each round (default 3)")
    p.add_argument("--engines", nargs="+", default=["autodeploy", "hf-eager", "hf+torch.compile"],
                   choices=["autodeploy", "hf-eager", "hf+torch.compile"])
    p.add_argument("--yaml", action="append", help="an autodeploy variant config to measure too (repeatable)")
    p.add_argument("--accuracy-prompts", type=int, default=4,
                   help="random prompts each autodeploy engine generates alone and compares with HF eager "
                   "(default 4; 0: no accuracy check)")
    p.add_argument("--accuracy-tokens", type=int, default=32, help="greedy tokens per accuracy prompt (default 32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="where the JSON/markdown/PNG go")
    p.set_defaults(func=cmd_bench, accepts_overrides=True)

    p = sub.add_parser("coverage", help="check every causal-LM model type of transformers end to end against HF")
    p.add_argument("--only", nargs="+", metavar="TYPE",
                   help="model types or glob patterns (e.g. llama 'qwen*'), space- or comma-separated")
    p.add_argument("--jobs", type=int, default=1, help="models checked in parallel, one process each (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model before it is killed (default 300)")
    p.add_argument("--out", default=os.path.join("docs", "coverage.md"),
                   help="markdown report; the JSON goes beside it (default docs/coverage.md, docs/coverage.json)")
    p.add_argument("--cache-dir", default=None, help="where tiny checkpoints and logs go (default .cache/coverage)")
    p.add_argument("--include-excluded", action="store_true",
                   help="also run the types that are not decoder-only (reported, never counted)")
    p.add_argument("--update", action="store_true",
                   help="merge into the existing report at --out: re-checked types replace their rows")
    p.add_argument("--recipes", default="a,b",
                   help="size recipes of the tiny configs, comma-separated (default a,b: regular sizes, and odd ones "
                        "where models are sensitive; a type passes only if it passes at every recipe)")
    p.add_argument("--mutate", default=None, metavar="NAME",
                   help="test the sweep itself: break the pipeline on purpose in every check (rope_sign, or "
                        "noop:<transform key>); the report must then show failures. Never use for a real report")
    p.set_defaults(func=cmd_coverage, accepts_overrides=False)

    p = sub.add_parser("models", help="list the built-in model presets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models, accepts_overrides=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    debug = bool(args.debug)
    configure_cli_logging(debug)
    func: Callable[[argparse.Namespace, Sequence[str]], int] = args.func
    if extra and not args.accepts_overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return func(args, extra)
    except AutoDeployError as exc:
        if debug:
            raise
        print(f"autodeploy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except Exception as exc:  # noqa: BLE001 - one line for users, the traceback with --debug
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"autodeploy: internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
