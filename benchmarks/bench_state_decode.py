#!/usr/bin/env python
"""Decode with a state cache (issue 14): a ~115M-parameter Mamba2 (or a ~93M MiniMax, or a ~77M
RecurrentGemma) against recompute mode and HF eager.

    python benchmarks/bench_state_decode.py                    # full run: ~115M Mamba2, fp32, CPU
    python benchmarks/bench_state_decode.py --model minimax    # ~93M MiniMax: lightning attention + 1 full layer
    python benchmarks/bench_state_decode.py --model recurrent_gemma  # ~77M RecurrentGemma: RG-LRU + local attention
    python benchmarks/bench_state_decode.py --rounds 2 --steps 16
    python benchmarks/bench_state_decode.py --smoke            # tiny model, short histories: seconds

What it measures, all in one process and one run (interleaved rounds: at every measured point
the engines run one after the other, so machine noise hits them alike; each number is the
median over rounds with its min-max range):

- autodeploy with its state cache (cache mode ``state``: conv window and SSM state per
  sequence): ms per decode step at batch 1 after histories of 64, 512 and 2048 tokens. The
  claim checked: the step time is flat in the history (slowest/fastest history <= 1.3x).
- autodeploy in recompute mode (``recompute_fallback.mode: always``: every step runs the whole
  history again) at the same histories: it grows with the history. Where one such step is
  slow, fewer steps are measured there (``--recompute-budget``).
- HF eager's own cached ``generate`` (``use_cache=True``, greedy) at the same histories, and
  HF eager against autodeploy's state cache at batch sizes 1 and 8 after a 512-token history:
  tokens/s, ms/step and the ratio to HF eager.

A decode step is timed alone, never a prefill: autodeploy's engine is stepped until every
sequence of the batch has its first token, then ``--steps`` steps are timed one by one (each
checked to be a pure decode step of the whole batch) and the requests aborted; HF's generate
is given a streamer that timestamps each new token, and the steps after the first token are
the ones counted (an autodeploy step includes its sampling and incremental detokenization).
Greedy, EOS ignored, the prompt is random token ids (seeded, the same for every engine).

The model is a random-weight Mamba2 (hidden 768, 24 layers, 24 heads of 64, state 128, one
group, conv kernel 4, vocab 32000, chunk 128, tied embeddings: the shape of mamba2-130m with a
smaller vocabulary), or with ``--model minimax`` a MiniMax-Text-01-shaped hybrid (hidden 512,
8 layers: 7 lightning-attention layers with a ``[h, d, d]`` state and one full-attention layer
on the paged KV cache, as MiniMax's 1-in-8; 8 heads of 64, 4 experts top-2, vocab 32000), or with
``--model recurrent_gemma`` a RecurrentGemma (Griffin: two recurrent blocks -- a short conv and the
RG-LRU scan, each with a state -- then one 2048-token local-attention layer; hidden 768, 12 layers,
lru width 768, vocab 32000), written once as a real safetensors checkpoint under ``.cache/bench/`` and reused by later runs. Output: JSON and markdown in ``benchmarks/results/`` (the table is
also printed) and a PNG, ``benchmarks/state-decode.png``. ``--smoke`` writes under
``.cache/bench/smoke-results/`` instead, so a test run does not touch the committed results.
"""

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from autodeploy.bench.runner import cpu_name  # noqa: E402

# The full model: mamba2-130m's shape (hidden 768, 24 layers, tied embeddings), vocab 32000.
FULL_MODEL = dict(model_type="mamba2", hidden_size=768, num_hidden_layers=24, expand=2, head_dim=64, num_heads=24,
                  state_size=128, n_groups=1, conv_kernel=4, vocab_size=32000, chunk_size=128,
                  tie_word_embeddings=True)
SMOKE_MODEL = dict(model_type="mamba2", hidden_size=64, num_hidden_layers=2, expand=2, head_dim=16, num_heads=8,
                   state_size=16, n_groups=1, conv_kernel=4, vocab_size=512, chunk_size=16, tie_word_embeddings=True)
# MiniMax-Text-01's layout (one full-attention layer in eight) at ~93M parameters.
MINIMAX_MODEL = dict(model_type="minimax", hidden_size=512, num_hidden_layers=8, num_attention_heads=8, head_dim=64,
                     num_key_value_heads=8, intermediate_size=1024, num_local_experts=4, num_experts_per_tok=2,
                     vocab_size=32000, block_size=256, layer_types=["linear_attention"] * 7 + ["full_attention"],
                     max_position_embeddings=8192)
MINIMAX_SMOKE = dict(model_type="minimax", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                     num_key_value_heads=2, intermediate_size=64, num_local_experts=2, num_experts_per_tok=1,
                     vocab_size=512, block_size=16, layer_types=["linear_attention", "full_attention"],
                     max_position_embeddings=1024)
# RecurrentGemma-2B's layout (recurrent, recurrent, attention) at ~77M parameters.
RECURRENT_GEMMA_MODEL = dict(model_type="recurrent_gemma", hidden_size=768, lru_width=768, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=1, head_dim=64, intermediate_size=2304,
                             vocab_size=32000, conv1d_width=4, attention_window_size=2048)
RECURRENT_GEMMA_SMOKE = dict(model_type="recurrent_gemma", hidden_size=64, lru_width=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=128,
                             vocab_size=512, conv1d_width=4, attention_window_size=64)
# --model: (full config, smoke config, name in titles, what HF eager runs)
MODELS = {
    "mamba2": (FULL_MODEL, SMOKE_MODEL, "Mamba2", "transformers' PyTorch reference path for Mamba2 (no mamba_ssm / "
               "causal_conv1d kernels on CPU)"),
    "minimax": (MINIMAX_MODEL, MINIMAX_SMOKE, "MiniMax", "transformers' MiniMax (lightning attention: 256-token "
                "blocks in prefill, a K^T V state in its MiniMaxCache, one token at a time in decode)"),
    "recurrent_gemma": (RECURRENT_GEMMA_MODEL, RECURRENT_GEMMA_SMOKE, "RecurrentGemma", "transformers' "
                        "RecurrentGemma (conv and RG-LRU states on its modules, a one-token branch in decode)"),
}


def describe(cfg: Dict[str, Any]) -> str:
    """The model's shape in one phrase, for the report."""
    if cfg["model_type"] == "recurrent_gemma":
        return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers (recurrent, recurrent, attention; "
                f"local window {cfg['attention_window_size']}), lru width {cfg['lru_width']}, "
                f"{cfg['num_attention_heads']} heads of {cfg['head_dim']}, vocab {cfg['vocab_size']}")
    if cfg["model_type"] == "minimax":
        full = cfg["layer_types"].count("full_attention")
        return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers ({cfg['num_hidden_layers'] - full} "
                f"lightning attention, {full} full attention), {cfg['num_attention_heads']} heads of "
                f"{cfg['head_dim']}, {cfg['num_local_experts']} experts top-{cfg['num_experts_per_tok']}, vocab "
                f"{cfg['vocab_size']}")
    return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_heads']} heads of "
            f"{cfg['head_dim']}, state {cfg['state_size']}, vocab {cfg['vocab_size']}")

# Settings not given on the command line come from the profile.
PROFILES = {
    "full": dict(histories=[64, 512, 2048], batch_sizes=[1, 8], batch_history=512, steps=32, rounds=3,
                 recompute_budget=20.0, out=os.path.join(REPO, "benchmarks", "results"),
                 png=os.path.join(REPO, "benchmarks", "state-decode.png"), compile=True),
    "smoke": dict(histories=[8, 40], batch_sizes=[1, 2], batch_history=24, steps=4, rounds=2, compile=False,
                  recompute_budget=5.0, out=os.path.join(REPO, ".cache", "bench", "smoke-results"), png=None),
}
FLAT_CLAIM = 1.3  # state cache: slowest history's ms/step / fastest history's, at most this
SEED = 0
ENGINES = ("autodeploy", "autodeploy-recompute", "hf-eager", "hf+torch.compile")
HISTORY_ENGINES = ENGINES[:3]  # the history sweep; HF + torch.compile joins the batch comparison only


# ---- the checkpoint ------------------------------------------------------------------------------
def checkpoint(config: Dict[str, Any], seed: int = SEED) -> str:
    """The random-weight checkpoint of ``config`` under ``.cache/bench/``, written on first use
    (atomically: a temporary directory renamed into place) and reused while config and seed match."""
    from autodeploy.models.presets import write_random_checkpoint

    blob = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    name = f"{config['model_type']}-h{config['hidden_size']}-l{config['num_hidden_layers']}-" \
           f"{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
    root = os.path.join(REPO, ".cache", "bench")
    target = os.path.join(root, name)
    stamp = os.path.join(target, ".bench-checkpoint")
    if os.path.exists(stamp):
        return target
    os.makedirs(root, exist_ok=True)
    print(f"writing the random-weight checkpoint to {target} (once)", flush=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
    try:
        write_random_checkpoint(config, tmp, seed=seed)
        with open(os.path.join(tmp, ".bench-checkpoint"), "w") as f:
            f.write(blob)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def parameter_count(config: Dict[str, Any]) -> int:
    """Parameters of the model (tied embeddings counted once), from a weightless copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


# ---- the engines -------------------------------------------------------------------------------------
class AutoDeployDecoder:
    """autodeploy's engine, stepped by hand: prefill until every sequence has its first token,
    then each decode step timed alone."""

    def __init__(self, name: str, path: str, max_seq_len: int, max_batch_size: int, recompute: bool):
        from autodeploy import LLM, SamplingParams
        from autodeploy.transform import library  # noqa: F401  (module imports are not build time)

        self.name, self._params = name, SamplingParams
        extra = {"transforms": {"recompute_fallback": {"mode": "always"}}} if recompute else {}
        start = time.perf_counter()
        self.llm = LLM(path, dtype="float32", max_seq_len=max_seq_len, max_batch_size=max_batch_size, **extra)
        self.build_s = time.perf_counter() - start
        ctx, cache = self.llm.build.context, self.llm.build.cache
        self.cache_mode = ctx.cache_mode
        # the state cache, beside a paged KV cache for a hybrid's attention layers
        ok = self.cache_mode == "recompute" if recompute else "state" in self.cache_mode.split("+")
        if not ok:
            expected = "recompute" if recompute else "state (with or without paged_kv)"
            raise SystemExit(f"{name}: the build's cache mode is '{self.cache_mode}', this benchmark needs "
                             f"'{expected}' (recompute reason: {ctx.recompute_reason})")
        self.info = {"cache_mode": self.cache_mode, "build_s": round(self.build_s, 2),
                     "max_seq_len": cache.max_seq_len, "max_batch_size": cache.max_batch_size,
                     "max_num_tokens": cache.max_num_tokens, "compile_backend": ctx.compile_backend,
                     "state_mib_per_sequence": round(sum(cache.handlers[n].bytes_per_slot()
                                                         for n in cache.state_names) / 2**20, 3)}

    def decode_steps(self, prompts: List[List[int]], steps: int) -> List[float]:
        engine, batch = self.llm.engine, len(prompts)
        limit = engine.max_seq_len - max(len(p) for p in prompts)
        if limit <= steps:
            raise SystemExit(f"max_seq_len {engine.max_seq_len} leaves no room for {steps} steps after the prompt")
        # more tokens than are timed: a sequence that finished its prefill early decodes ahead of the
        # others, and none may finish inside the timed steps; the requests are aborted after them
        params = self._params(max_tokens=limit, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(self.llm.processor.prepare({"prompt_token_ids": p}, params)) for p in prompts]
        seqs = [s for rid in ids for s in engine.requests[rid].sequences]
        try:
            while any(s.num_output_tokens == 0 for s in seqs):
                engine.step()
            stats = engine.stats
            before = (stats.prefill_tokens, stats.decode_tokens, stats.steps)
            times = []
            gc.collect()
            gc.disable()
            try:
                for _ in range(steps):
                    start = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start)
            finally:
                gc.enable()
            after = (stats.prefill_tokens, stats.decode_tokens, stats.steps)
            if after != (before[0], before[1] + batch * steps, before[2] + steps):
                raise RuntimeError(f"{self.name}: the timed steps were not {steps} pure decode steps of "
                                   f"{batch} sequences (prefill, decode tokens, steps: {before} -> {after})")
        finally:
            for rid in ids:
                engine.abort(rid)
        return times


class _Clock(BaseStreamer):
    """A ``generate`` streamer that only notes when each put (the prompt, then every new token) happens."""

    def __init__(self) -> None:
        self.times: List[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFDecoder:
    """HF eager ``generate`` with its own cache (``use_cache=True``), greedy, EOS ignored; with
    ``compile``, the model's forward wrapped in ``torch.compile`` (default mode, graph breaks
    allowed: Mamba2's cache code branches in Python, and its cache is not the static KV cache the
    transformers docs compile with; compilation happens in the warm-up)."""

    def __init__(self, path: str, compile: bool = False):
        from transformers import AutoModelForCausalLM

        self.name = "hf+torch.compile" if compile else "hf-eager"
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        if compile:
            import torch._dynamo as dynamo

            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
            self.model.forward = torch.compile(self.model.forward)
        self.build_s = time.perf_counter() - start
        self.info = {"build_s": round(self.build_s, 2)}

    def decode_steps(self, prompts: List[List[int]], steps: int) -> List[float]:
        clock = _Clock()
        ids = torch.tensor(prompts)
        gc.collect()
        gc.disable()
        try:
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                                          min_new_tokens=steps + 1, do_sample=False, use_cache=True,
                                          streamer=clock)
        finally:
            gc.enable()
        if out.shape[1] != ids.shape[1] + steps + 1 or len(clock.times) != steps + 2:
            raise RuntimeError(f"{self.name}: expected {steps + 1} new tokens, got {out.shape[1] - ids.shape[1]} "
                               f"({len(clock.times)} streamer calls)")
        tokens = clock.times[1:]  # [0]: the prompt, before the prefill; [1]: the first token, after it
        return [b - a for a, b in zip(tokens, tokens[1:])]


# ---- the run -----------------------------------------------------------------------------------------
def prompts_for(history: int, batch: int, vocab: int, seed: int) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed * 7919 + history * 31 + batch)
    # ids past the special tokens (the tokenizer's first few), the same prompts for every engine
    return torch.randint(8, vocab, (batch, history), generator=g).tolist()


def plan(args: argparse.Namespace) -> Dict[Tuple[int, int], List[str]]:
    """Measured points ``(history, batch)`` and the engines measured at each."""
    points: Dict[Tuple[int, int], List[str]] = {}
    for h in args.histories:  # history sweep at batch 1: the state cache, recompute mode, HF eager
        points[(h, 1)] = list(HISTORY_ENGINES)
    for b in args.batch_sizes:  # batch sweep: the state cache against HF eager (and HF + torch.compile)
        names = points.setdefault((args.batch_history, b), [])
        for name in ("autodeploy", "hf-eager") + (("hf+torch.compile",) if args.compile else ()):
            if name not in names:
                names.append(name)
    return {p: [n for n in ENGINES if n in names] for p, names in sorted(points.items(), key=lambda kv: kv[0][::-1])}


def _cell(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def key(history: int, batch: int) -> str:
    return f"h{history}_b{batch}"


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    full, smoke, label, _ = MODELS[args.model]
    model_config = smoke if args.smoke else full
    params = parameter_count(model_config)
    print(f"model: {label} {'(smoke) ' if args.smoke else ''}{params:,} parameters ({_params(params)})", flush=True)
    path = checkpoint(model_config)
    points = plan(args)
    max_history = max(h for h, _ in points)
    max_seq_len = max_history + args.steps + 64

    engines: Dict[str, Any] = {}
    used = [n for n in ENGINES if any(n in names for names in points.values())]
    for name in used:
        print(f"building {name}", flush=True)
        if name.startswith("hf"):
            engines[name] = HFDecoder(path, compile=name == "hf+torch.compile")
        else:
            engines[name] = AutoDeployDecoder(name, path, max_seq_len, max(args.batch_sizes),
                                              recompute=name == "autodeploy-recompute")
        print(f"  {name}: {engines[name].info}", flush=True)

    # Warm-up at every point (first runs, lazily built kernels). It also times recompute mode's
    # step there, to choose how many of its steps fit the budget.
    steps: Dict[Tuple[str, Tuple[int, int]], int] = {}
    for point, names in points.items():
        h, b = point
        prompts = prompts_for(h, b, model_config["vocab_size"], SEED)
        for name in names:
            times = engines[name].decode_steps(prompts, 2)
            n = args.steps
            if name == "autodeploy-recompute":
                n = max(2, min(args.steps, int(args.recompute_budget / max(times))))
            steps[(name, point)] = n
        print(f"warm-up h={h} b={b} done", flush=True)

    samples: Dict[str, Dict[str, List[float]]] = {n: {} for n in used}
    for r in range(args.rounds):
        for point, names in points.items():
            h, b = point
            prompts = prompts_for(h, b, model_config["vocab_size"], SEED + 1 + r)
            for name in names:
                times = engines[name].decode_steps(prompts, steps[(name, point)])
                samples[name].setdefault(key(*point), []).append(sum(times) / len(times))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    results: Dict[str, Dict[str, Any]] = {}
    for name in used:
        row: Dict[str, Any] = {"info": engines[name].info}
        for point, names in points.items():
            if name not in names:
                continue
            k, b = key(*point), point[1]
            per_step = samples[name][k]
            cell = {"ms_per_step": _cell([s * 1e3 for s in per_step]),
                    "tok_s": _cell([b / s for s in per_step]),
                    "steps": steps[(name, point)]}
            hf = samples["hf-eager"].get(k)
            if hf:
                cell["tok_s_vs_hf_eager"] = statistics.median(hf) / statistics.median(per_step)
            row[k] = cell
        results[name] = row

    lo, hi = min(args.histories), max(args.histories)
    checks = {}
    for name in HISTORY_ENGINES:
        ms = [results[name][key(h, 1)]["ms_per_step"]["median"] for h in args.histories]
        checks[name] = {"ms_per_step_b1_longest_over_shortest": results[name][key(hi, 1)]["ms_per_step"]["median"] /
                        results[name][key(lo, 1)]["ms_per_step"]["median"], "slowest_over_fastest": max(ms) / min(ms)}
    checks["autodeploy"]["flat_claim"] = FLAT_CLAIM
    checks["autodeploy"]["flat"] = checks["autodeploy"]["slowest_over_fastest"] <= FLAT_CLAIM

    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                         stderr=subprocess.DEVNULL).strip()
        dirty = bool(subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                             text=True, stderr=subprocess.DEVNULL).strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "autodeploy_commit": commit + ("+dirty" if dirty else ""), "dtype": "float32", "device": "cpu",
            "smoke": args.smoke, "rounds": args.rounds, "steps": args.steps, "histories": args.histories,
            "batch_sizes": args.batch_sizes, "batch_history": args.batch_history, "compile": args.compile,
            "recompute_budget_s": args.recompute_budget}
    model = {"type": args.model, "config": model_config, "parameters": params, "checkpoint": path, "seed": SEED}
    return {"meta": meta, "model": model, "results": results, "checks": checks}


# ---- the report -------------------------------------------------------------------------------------
def _fmt(cell: Dict[str, float], digits: int = 1) -> str:
    return f"{cell['median']:.{digits}f} ({cell['min']:.{digits}f}-{cell['max']:.{digits}f})"


def _params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def markdown(data: Dict[str, Any]) -> str:
    meta, model, results, checks = data["meta"], data["model"], data["results"], data["checks"]
    hist, cfg = meta["histories"], model["config"]
    _, _, label, hf_path = MODELS[model["type"]]
    lines = [
        f"## State-cache decode: {label} {_params(model['parameters'])} ({meta['dtype']}, {meta['device']}, "
        f"{meta['cpu']}, {meta['threads']} threads)", "",
        f"Random weights: {describe(cfg)}. torch {meta['torch']}, "
        f"transformers {meta['transformers']}, autodeploy {meta['autodeploy_commit']}, {meta['date']}. Median "
        f"(min-max) over {meta['rounds']} interleaved rounds of the mean decode step ({meta['steps']} steps, "
        "fewer for recompute mode where noted); a step is timed alone, after the prefill.", "",
        "### ms per decode step at batch 1 after a history of L tokens", "",
        "| engine | cache | " + " | ".join(f"L={h}" for h in hist) + f" | L={max(hist)} / L={min(hist)} |",
        "|---|---|" + "---|" * (len(hist) + 1),
    ]
    for name, row in results.items():
        if name not in checks:  # not in the history sweep
            continue
        cells = []
        for h in hist:
            c = row[key(h, 1)]
            note = f" [{c['steps']} steps]" if c["steps"] != meta["steps"] else ""
            cells.append(_fmt(c["ms_per_step"]) + note)
        ratio = checks[name]["ms_per_step_b1_longest_over_shortest"]
        mode = row["info"].get("cache_mode", "HF cache").replace("+", " + ")
        lines.append(f"| {name} | {mode} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    flat, growth = checks["autodeploy"], checks["autodeploy-recompute"]["ms_per_step_b1_longest_over_shortest"]
    lines += ["", f"State cache flat in the history (slowest / fastest history <= {flat['flat_claim']}x): "
              f"{flat['slowest_over_fastest']:.2f}x, {'met' if flat['flat'] else 'missed'}. Recompute mode, "
              f"L={max(hist)} / L={min(hist)}: {growth:.2f}x."]
    bh, batches = meta["batch_history"], meta["batch_sizes"]
    lines += ["", f"### Against HF eager's cached generate after a {bh}-token history", "",
              "| engine | " + " | ".join(f"b={b} tok/s | b={b} ms/step" for b in batches) + " |",
              "|---|" + "---|---|" * len(batches)]
    for name, row in results.items():
        if any(key(bh, b) not in row for b in batches):  # recompute mode: batch 1 only
            continue
        cells = []
        for b in batches:
            c = row[key(bh, b)]
            cells += [f"{_fmt(c['tok_s'])} [{c['tok_s_vs_hf_eager']:.2f}x]", _fmt(c["ms_per_step"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "In brackets: tokens/s relative to HF eager at the same point (same run). An autodeploy step "
              f"includes its sampling and incremental detokenization; HF eager runs {hf_path}; "
              "HF + torch.compile wraps its "
              "forward in torch.compile (default mode, graph breaks allowed), compiled during the warm-up.", "",
              "Builds: " + "; ".join(f"{n} {r['info']['build_s']} s" for n, r in results.items()) + ". "
              f"autodeploy state per sequence: {results['autodeploy']['info']['state_mib_per_sequence']} MiB."]
    return "\n".join(lines) + "\n"


def plot(data: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import ScalarFormatter
    except ImportError:
        print("matplotlib is not installed: no PNG", flush=True)
        return None
    meta, results = data["meta"], data["results"]
    hist, batches, bh = meta["histories"], meta["batch_sizes"], meta["batch_history"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"autodeploy": ("state cache (autodeploy)", "o-"),
              "autodeploy-recompute": ("recompute (autodeploy)", "s-"),
              "hf-eager": ("HF eager, cached generate", "^--")}
    for name, (label, style) in styles.items():
        cells = [results[name][key(h, 1)]["ms_per_step"] for h in hist]
        med = [c["median"] for c in cells]
        err = [[m - c["min"] for m, c in zip(med, cells)], [c["max"] - m for m, c in zip(med, cells)]]
        left.errorbar(hist, med, yerr=err, fmt=style, capsize=3, label=label)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(hist)
    left.set_xticklabels([str(h) for h in hist])
    left.yaxis.set_major_formatter(ScalarFormatter())
    low, high = left.get_ylim()
    if high / low < 10:  # less than a decade shown: label the minor ticks too
        left.yaxis.set_minor_formatter(ScalarFormatter())
    left.set_xlabel("history [tokens]")
    left.set_ylabel("ms / decode step (batch 1)")
    left.set_title("decode step time vs history")
    left.legend()
    bars = [n for n in ("autodeploy", "hf-eager", "hf+torch.compile") if n in results]
    styles["hf+torch.compile"] = ("HF + torch.compile", "")
    width = 0.8 / len(bars)
    for i, name in enumerate(bars):
        xs = [j + i * width for j in range(len(batches))]
        cells = [results[name][key(bh, b)] for b in batches]
        right.bar(xs, [c["tok_s"]["median"] for c in cells], width, label=styles[name][0])
        for x, c in zip(xs, cells):
            right.annotate(f"{c['tok_s_vs_hf_eager']:.2f}x", (x, c["tok_s"]["median"]), ha="center", va="bottom",
                           fontsize=8)
    right.set_ylim(0, 1.3 * max(results[n][key(bh, b)]["tok_s"]["median"] for n in bars for b in batches))
    right.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(batches))])
    right.set_xticklabels([f"batch {b}" for b in batches])
    right.set_ylabel("tokens / s")
    right.set_title(f"decode after a {bh}-token history (x: vs HF eager)")
    right.legend(loc="upper left")
    fig.suptitle(f"{MODELS[data['model']['type']][2]}, {_params(data['model']['parameters'])} parameters, random weights, fp32, "
                 f"{meta['cpu']}, {meta['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(data: Dict[str, Any], out_dir: str, png: Optional[str]) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    model = "" if data["model"]["type"] == "mamba2" else f"-{data['model']['type']}"
    stem = os.path.join(out_dir, f"state-decode{model}{'-smoke' if data['meta']['smoke'] else ''}-"
                                 f"{time.strftime('%Y%m%d-%H%M%S')}")
    paths = {"json": stem + ".json", "md": stem + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=2)
    with open(paths["md"], "w") as f:
        f.write(markdown(data))
    drawn = plot(data, png or stem + ".png")
    if drawn:
        paths["png"] = drawn
    return paths


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Settings left out take the full run's values (in each flag's help) or, with "
                                       "--smoke, the smoke run's: histories 8 40, batch sizes 1 2, batch history 24, "
                                       "4 steps, 2 rounds, recompute budget 5 s.")
    p.add_argument("--model", choices=sorted(MODELS), default="mamba2",
                   help="mamba2: ~115M Mamba2 (SSM state caches); minimax: ~93M MiniMax (lightning-attention "
                        "states and one paged-KV attention layer); recurrent_gemma: ~77M RecurrentGemma (conv and "
                        "RG-LRU states, local attention on the paged KV cache)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model (hidden 64, 2 layers) and short histories: checks the script in seconds; "
                        "results go to .cache/bench/smoke-results unless --out is given")
    p.add_argument("--histories", type=int, nargs="+", help="history lengths (tokens before the timed decode steps) "
                   "of the batch-1 sweep (full: 64 512 2048)")
    p.add_argument("--batch-sizes", type=int, nargs="+", help="batch sizes compared with HF eager (full: 1 8)")
    p.add_argument("--batch-history", type=int, help="history of the batch-size comparison (full: 512)")
    p.add_argument("--steps", type=int, help="decode steps timed per point and round (full: 32)")
    p.add_argument("--rounds", type=int, help="interleaved rounds; each number is the median over them (full: 3)")
    p.add_argument("--recompute-budget", type=float, metavar="SECONDS",
                   help="recompute mode: at most about this many seconds of timed steps per point and round "
                        "(at least 2 steps; full: 20)")
    p.add_argument("--out", help="directory of the JSON and markdown results (full: benchmarks/results)")
    p.add_argument("--png", help="where the plot goes (full: benchmarks/state-decode.png, with another --model "
                   "benchmarks/state-decode-<model>.png; smoke: beside the JSON)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice, recorded)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure HF + torch.compile in the batch comparison (full: on; smoke: off, it "
                        "would spend most of the smoke run compiling)")
    args = p.parse_args(argv)
    for name, value in PROFILES["smoke" if args.smoke else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model != "mamba2" and not args.smoke and args.png == PROFILES["full"]["png"]:
        args.png = args.png.replace(".png", f"-{args.model}.png")
    if args.steps < 1 or args.rounds < 1 or min(args.histories + args.batch_sizes + [args.batch_history]) < 1:
        p.error("--steps, --rounds, --histories, --batch-sizes and --batch-history must be positive")
    args.histories = sorted(set(args.histories))
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    data = run(args)
    paths = write(data, args.out, args.png)
    print()
    print(markdown(data))
    print("written: " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
