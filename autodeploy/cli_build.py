"""The commands that build a model: ``export``, ``run`` and ``serve``.

Each one loads and checks every setting (``autodeploy.config``: values, contradictions, the
device) before anything is built, so bad input fails in a second, not after the build.

``run`` and ``serve`` take ``--world-size N`` (tensor parallelism): this process is rank 0 and
starts ranks 1..N-1 with the same command line (``autodeploy.distributed.launcher``), or, under
``torchrun``, joins as the rank the environment names. Rank 0 prints, samples and serves; the
other ranks build their shard and run the steps rank 0 sends until it stops.
"""

import argparse
import logging
import os
import signal
import sys
import textwrap
import time
from collections import Counter
from contextlib import AbstractContextManager
from typing import Any, Dict, List, Optional, Sequence

from .utils.errors import AutoDeployError, RankFailure

DEFAULT_PROMPTS = ("The for statement", "A class definition", "The import statement", "Exceptions are")


def settings_epilog() -> str:
    """Help text for the settings a build command takes beyond its named flags."""
    from .config.deploy_config import DeployConfig

    names = textwrap.fill("Settings: " + ", ".join(DeployConfig.model_fields) + ".", width=96,
                          initial_indent="  ", subsequent_indent="    ")
    return (
        "settings:\n"
        "  Any deployment setting is a flag: --<setting> VALUE or --<setting>=VALUE (the value is read as YAML).\n"
        f"{names}\n"
        "  A transform's field: --transforms.<key>.<field> VALUE ('autodeploy transforms' lists keys and fields).\n"
        "  Example: --max_seq_len 256 --attn_backend torch --transforms.match_rope_pattern.enabled false\n"
        "  Order: default.yaml, then the registry entry's fragments (--use-registry), then each --yaml file, then "
        "these flags."
    )


USE_REGISTRY_HELP = ("--model names a model-registry entry ('autodeploy models'): compose its YAML fragments before "
                     "your --yaml files and flags, and use its model and world size. Without it, a --model that "
                     "is no preset and no existing path but an entry's name uses the entry too")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset name, HF checkpoint directory, hub id or registry entry (default: demo, "
                   "from default.yaml)")
    p.add_argument("--use-registry", action="store_true", help=USE_REGISTRY_HELP)
    p.add_argument("--yaml", action="append", metavar="FILE", help="YAML config layered over the defaults (repeatable)")
    p.add_argument("--device", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): float32 on CPU, the checkpoint's dtype on CUDA")
    p.add_argument("--mode", choices=["graph", "transformers"],
                   help="graph (default): export and optimise the graph; transformers: run the HF module eagerly with "
                        "cached attention over the paged KV cache (for models that do not export)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint repo")
    p.add_argument("--allow-pickle", action="store_true", help="allow pickled .bin/.pt weights")


def registry_name(args: argparse.Namespace) -> Optional[str]:
    """The registry entry ``--model`` names, or ``None`` when it names a model source.

    With ``--use-registry``, ``--model`` is an entry (an unknown one is an error listing close
    names). Without it: a preset, then an existing path (a directory, or a file the factory then
    refuses), then an entry; anything else is a hub id. A model you have locally is so never
    shadowed by an entry of the same name, and entry names hold no '/', so no org/name hub id is.
    """
    from .models.presets import PRESETS
    from .config.registry import is_registry_name, registry_entry, registry_suggestions

    model = getattr(args, "model", None)
    if getattr(args, "use_registry", False):
        if model is None:
            raise AutoDeployError("--use-registry needs --model NAME, a registry entry ('autodeploy models' lists them)")
        return registry_entry(model).name
    if model is None or model in PRESETS or os.path.exists(os.path.expanduser(model)):
        return None
    if is_registry_name(model):
        return model
    hint = registry_suggestions(model)
    if hint and "/" not in model and not model.startswith((".", "~")):  # a bare name: no path, no hub id
        raise AutoDeployError(f"model '{model}' is not a preset, an existing path, a registry entry or a hub id "
                              f"(org/name){hint}; 'autodeploy models' lists the presets and registry entries")
    return None


def config_from_args(args: argparse.Namespace, overrides: Sequence[str]) -> Any:
    """The deployment config of a build command, checked whole (values, contradictions, this
    machine's devices) before anything is built. A registry entry (``registry_name``) is the
    layer under the user's --yaml files and flags; its model replaces the --model that named it."""
    from .config import load_deploy_config
    from .config.checks import check_device_available

    from .distributed.process_group import environment

    registry = registry_name(args)
    world_size = getattr(args, "world_size", None)
    if world_size is None and hasattr(args, "world_size") and environment() is not None:
        world_size = environment().world_size  # type: ignore[union-attr]  # torchrun says how many ranks
    settings = {
        "model": getattr(args, "model", None) if registry is None else None,
        "world_size": world_size,
        "device": getattr(args, "device", None),
        "dtype": getattr(args, "dtype", None),
        "mode": getattr(args, "mode", None),
        "trust_remote_code": True if getattr(args, "trust_remote_code", False) else None,
        "allow_pickle": True if getattr(args, "allow_pickle", False) else None,
    }
    config = load_deploy_config(getattr(args, "yaml", None) or [], overrides=list(overrides), registry=registry,
                                launching=hasattr(args, "world_size"), **settings)
    check_device_available(config.device)
    return config


def print_summary(summary: str) -> None:
    """The transform table (each ``skipped`` row says why)."""
    print(summary)


def build_llm(config: Any, driver: bool = True) -> Any:
    """The model, built; rank 0 (the driver) prints the transform table, the other ranks stay quiet."""
    from .llm import LLM

    # the table goes to stdout once, not also to the log
    llm = LLM(**config.model_dump(exclude_none=True), show_progress=driver and sys.stderr.isatty(),
              log_summary=False)
    if driver:
        print_summary(llm.summary)
    return llm


# ---- tensor parallelism ------------------------------------------------------------------------
WORLD_SIZE_HELP = ("ranks (tensor parallelism, default 1): this process is rank 0 and starts the others on this "
                   "machine; under torchrun (one process per rank, on one machine or several) the ranks come from "
                   "its environment and nothing is started")


def launch(config: Any, args: argparse.Namespace) -> "AbstractContextManager[Any]":
    """The command's ranks (``autodeploy.distributed.launcher.ranks``): a no-op at world size 1."""
    from .distributed.launcher import driver_process, ranks
    from .models.presets import PRESETS, preset_dir

    if config.world_size > 1 and driver_process() and config.model in PRESETS:
        preset_dir(config.model)  # written once, before the ranks that read it start
    return ranks(config.world_size, getattr(args, "argv", None) or sys.argv[1:], device=config.device)


def quiet_follower_logging(args: argparse.Namespace) -> None:
    """Ranks other than 0 log warnings and errors only (rank 0 tells the story), unless --debug or
    AUTODEPLOY_LOG_LEVEL asks for more."""
    if not args.debug and "AUTODEPLOY_LOG_LEVEL" not in os.environ:
        logging.getLogger("autodeploy").setLevel(logging.WARNING)


def follow(config: Any, args: argparse.Namespace) -> int:
    """A rank other than 0: build this rank's shard, then run rank 0's steps until it stops."""
    quiet_follower_logging(args)
    llm = build_llm(config, driver=False)
    llm.follow()
    return 0


def writable_dir(path: str, flag: str) -> None:
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


def _write_artifacts(out: str, gm: Any, summary: str, config: Any) -> List[str]:
    from .transform.visualize import write_graph

    written = write_graph(gm, os.path.join(out, "graph"))
    for name, text in (("graph.py", gm.code), ("summary.txt", summary + "\n"),
                       ("config.json", config.model_dump_json(indent=2))):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
        written.append(os.path.join(out, name))
    return written


def cmd_export(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    """Build and show the graph. With ``--world-size N`` (or under torchrun) every rank builds its
    shard; rank 0 shows (and writes) its own, once all ranks have built theirs."""
    import torch.distributed as dist

    from .pipeline import build_graph

    config = config_from_args(args, overrides)
    if args.out:
        writable_dir(args.out, "--out")
    with launch(config, args) as group:
        if not group.is_driver:
            quiet_follower_logging(args)
        result = build_graph(config, log_summary=False)
        if config.world_size > 1:
            dist.barrier()  # rank 0 leaves (and waits for the ranks it started) only after every build
        if not group.is_driver:
            return 0
        _show_export(args, config, result)
    return 0


def _show_export(args: argparse.Namespace, config: Any, result: Any) -> None:
    """The transform table, the op histogram, optionally the code and the artifacts in --out."""
    gm = result.graph_module
    print_summary(result.summary)
    print("\nops in the transformed graph:")
    for name, n in _op_histogram(gm).items():
        print(f"  {n:5d}  {name}")
    if args.print_graph:
        print("\n" + gm.code)
    if args.out:
        print(f"\nwrote {', '.join(_write_artifacts(args.out, gm, result.summary, config))}")


# ---- run ---------------------------------------------------------------------------------------
def _sampling_params(args: argparse.Namespace) -> Any:
    from .runtime.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos, min_p=args.min_p,
        min_tokens=args.min_tokens, repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        guided=_guided(args),
    )


def _guided(args: argparse.Namespace) -> Any:
    """The output constraint of ``run``'s --json-schema / --regex / --choice / --json-object (None: none)."""
    from .runtime.guided.params import GuidedDecodingParams

    schema = args.json_schema
    if schema is not None and not schema.lstrip().startswith("{"):
        try:
            with open(schema) as f:
                schema = f.read()
        except OSError as exc:
            raise AutoDeployError(f"cannot read JSON Schema file '{schema}': {exc.strerror}") from None
    given = {k: v for k, v in (("json", schema), ("regex", args.regex), ("choice", args.choice)) if v is not None}
    if args.json_object:
        given["json_object"] = True
    return GuidedDecodingParams(**given) if given else None


def _read_prompts(args: argparse.Namespace) -> List[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise AutoDeployError(f"cannot read prompts file '{args.prompts_file}': {exc.strerror}") from None
    return prompts or list(DEFAULT_PROMPTS)


def cmd_run(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    prompts = _read_prompts(args)
    params = _sampling_params(args)
    config = config_from_args(args, overrides)
    with launch(config, args) as group:
        if not group.is_driver:
            return follow(config, args)
        start = time.perf_counter()
        llm = build_llm(config)
        group.on_failure(llm.report_rank_failure)
        try:
            return _generate(args, prompts, params, config, llm, time.perf_counter() - start)
        finally:
            llm.shutdown()


def _generate(args: argparse.Namespace, prompts: List[str], params: Any, config: Any, llm: Any,
              build_s: float) -> int:
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
          f"{st.prefill_tokens_per_s:.0f} tok/s, decode {st.decode_tokens} tokens at "
          f"{st.decode_tokens_per_s:.0f} tok/s, {st.steps} steps")
    return 0


# ---- serve -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .serve.server import bind_socket, check_settings, serve

    limits = dict(max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
                  max_choices_per_request=args.max_choices_per_request, tool_call_parser=args.tool_call_parser)
    check_settings(shutdown_timeout=args.shutdown_timeout, **limits)
    config = config_from_args(args, overrides)
    from .distributed.launcher import driver_process

    if not driver_process():
        with launch(config, args):
            return follow(config, args)
    # The port first: a port in use is reported now, not after the model is built.
    sock = bind_socket(args.host, args.port)
    try:
        with launch(config, args) as group:
            llm = build_llm(config)
            # a rank gone: the server shuts down as on SIGTERM (requests in flight fail), then exits 1
            group.on_failure(llm.report_rank_failure)
            llm.on_rank_failure(lambda reason: os.kill(os.getpid(), signal.SIGTERM))
            try:
                sys.stdout.flush()
                name = args.served_model_name or config.model
                auth = " (API key required)" if args.api_key else ""
                ranks = f" on {config.world_size} ranks" if config.world_size > 1 else ""
                print(f"\nserving '{name}' at http://{args.host}:{sock.getsockname()[1]}/v1{auth}{ranks}", flush=True)
                serve(llm, host=args.host, port=args.port, sock=sock, model_name=name, api_key=args.api_key,
                      shutdown_timeout=args.shutdown_timeout,
                      trust_request_chat_template=args.trust_request_chat_template, **limits)
            finally:
                llm.shutdown()
            if llm.rank_failure is not None:
                raise RankFailure(f"the server stopped: {llm.rank_failure}")
    finally:
        sock.close()
    return 0


# ---- parsers -----------------------------------------------------------------------------------
def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    epilog = settings_epilog()
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("export", parents=[common], epilog=epilog, formatter_class=fmt,
                       help="build the model, run the pipeline, print the summary and graph")
    add_model_args(p)
    p.add_argument("--print-graph", action="store_true", help="print the transformed graph's code")
    p.add_argument("--out", metavar="DIR", help="write graph (DOT/SVG, text, code), summary and config here")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help=WORLD_SIZE_HELP + "; rank 0's shard is shown and written")
    p.set_defaults(func=cmd_export, accepts_overrides=True)

    p = sub.add_parser("run", parents=[common], help="build the model and generate for some prompts",
                       epilog=epilog, formatter_class=fmt)
    add_model_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a few built-in prompts)")
    p.add_argument("--prompts-file", metavar="FILE", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=48, metavar="N", help="tokens to generate per prompt (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the most likely (default 0: off)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed for sampling (default: none)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the EOS token")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no EOS, stop token or stop string ends the output before N tokens (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide positive / multiply negative logits of tokens in prompt or output (default 1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F per occurrence in the output, -2..2 (default 0: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F from tokens the output has, -2..2 (default 0: off)")
    guided = p.add_mutually_exclusive_group()
    guided.add_argument("--json-schema", metavar="SCHEMA", help="constrain the output to a JSON Schema (its JSON "
                        "text, or a file holding it)")
    guided.add_argument("--json-object", action="store_true", help="constrain the output to one JSON object")
    guided.add_argument("--regex", metavar="PATTERN", help="constrain the output to match a regular expression")
    guided.add_argument("--choice", action="append", metavar="TEXT",
                        help="constrain the output to one of these strings (repeatable)")
    p.add_argument("--world-size", type=int, default=None, metavar="N", help=WORLD_SIZE_HELP)
    p.set_defaults(func=cmd_run, accepts_overrides=True)
    _add_serve_parser(sub, common, epilog)


def _add_serve_parser(sub: Any, common: argparse.ArgumentParser, epilog: str) -> None:
    p = sub.add_parser("serve", parents=[common], help="serve the model behind an OpenAI-compatible HTTP API",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--world-size", type=int, default=None, metavar="N", help=WORLD_SIZE_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1 endpoints")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask for")
    p.add_argument("--max-choices-per-request", type=int, default=128,
                   help="most sequences one request may ask for, prompts x n (default 128); more is a 400")
    p.add_argument("--tool-call-parser", default=None, metavar="{hermes,llama3_json,pythonic,mistral}",
                   help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>, Qwen 2.5/3, Hermes and "
                        "the presets; llama3_json: Llama 3.1/3.2's JSON calls; pythonic: [f(a=1), g()], Llama 3.2/4; "
                        "mistral: [TOOL_CALLS] and a JSON array or name[ARGS]{...}, Mistral/Mixtral): enables "
                        "tool_choice 'auto'")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own 'chat_template' (vLLM's flag; off: such a request is a 400). A "
                        "template is code the server runs: Jinja's sandbox keeps it from the machine, not from "
                        "running long, so only for clients you trust")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown (default 30; then they are cut with "
                        "a 503 or a final error event)")
    p.set_defaults(func=cmd_serve, accepts_overrides=True)
