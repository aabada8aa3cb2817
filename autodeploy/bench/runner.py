"""``autodeploy bench``: autodeploy against HF eager and HF + torch.compile, in one run.

Every engine is built in this process from the same checkpoint and warmed up for every shape
first (compilation excluded from the measurements, reported apart). Then the measurements run
in interleaved rounds (engine A, B, C, A, B, C, ...) so machine noise hits all engines alike;
each number is the median over rounds, with its min-max range.

Metrics: prefill tokens/s and time to first token for one prompt of each prefill length;
decode tokens/s at each batch size (``new_tokens`` generated after a 32-token prompt, prefill
time subtracted); build time; peak RSS growth (and CUDA peak); the memory-bandwidth floor of
batch-1 decode (weight bytes per token / measured read bandwidth) and the share of it each
engine reaches; and for each autodeploy engine its accuracy against HF eager (``accuracy.py``),
so a variant that trades precision for speed shows both.
"""

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..utils.logging import get_logger
from ..utils.memory import measure_peak
from .accuracy import compare_with_hf, random_prompts
from .engines import AutoDeployEngine, BenchEngine, HFEngine, read_bandwidth_gbs, weight_bytes_per_decode_token

logger = get_logger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class BenchConfig:
    model: str = "small"
    registry: Optional[str] = None  # a model-registry entry: its fragments under every autodeploy engine
    dtype: str = "float32"
    device: str = "cpu"
    batch_sizes: List[int] = field(default_factory=lambda: [1, 8, 32])
    new_tokens: int = 128
    decode_prompt_len: int = 32
    prefill_lens: List[int] = field(default_factory=lambda: [128, 512])
    rounds: int = 3
    prefill_reps: int = 3  # prefills per length per round: one ~0.3-1 s prefill is noisy here
    engines: List[str] = field(default_factory=lambda: ["autodeploy", "hf-eager", "hf+torch.compile"])
    yaml_variants: List[str] = field(default_factory=list)
    accuracy_prompts: int = 4  # batch-1 greedy prompts compared with HF eager per autodeploy engine; 0: none
    accuracy_tokens: int = 32
    threads: Optional[int] = None
    out_dir: str = os.path.join(REPO, "benchmarks", "results")
    # ranks of the autodeploy engine (tensor parallelism): rank 0 measures, the others follow it
    # (``follow``); the HF engines run on rank 0 alone
    world_size: int = 1


# CPU features that decide which kernels are fast (recorded with every result: machines differ).
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu_name() -> str:
    """The CPU model and the vector features that matter here, e.g. 'AMD EPYC (avx2 avx512f ...)'."""
    name, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("unknown", platform.processor()):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    present = [f for f in CPU_FEATURES if f in flags]
    return f"{name} ({' '.join(present)})" if present else name


def git_commit() -> str:
    """The checkout's short commit (recorded with every result), or 'unknown' outside git."""
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _meta(cfg: BenchConfig) -> Dict[str, Any]:
    import transformers

    commit = git_commit()
    cpu = cpu_name()
    gpu = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else None
    return {"model": cfg.model, "dtype": cfg.dtype, "device": cfg.device, "gpu": gpu, "cpu": cpu,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "autodeploy_commit": commit, "date": time.strftime("%Y-%m-%d %H:%M"), "rounds": cfg.rounds, "prefill_reps": cfg.prefill_reps,
            "new_tokens": cfg.new_tokens, "decode_prompt_len": cfg.decode_prompt_len}


def _build(name: str, cfg: BenchConfig, checkpoint: str) -> BenchEngine:
    dtype = _DTYPES[cfg.dtype]
    # autodeploy runs with its defaults (max_seq_len, max_batch_size and the KV pool chosen from
    # the model and the machine): what a user who names only the model gets is what is measured.
    settings: Dict[str, Any] = dict(dtype=cfg.dtype, device=cfg.device, world_size=cfg.world_size)
    if cfg.registry is not None:
        settings["registry"] = cfg.registry
    if name == "autodeploy":
        return AutoDeployEngine(cfg.model, **settings)
    if name.startswith("autodeploy:"):
        path = name.split(":", 1)[1]
        return AutoDeployEngine(cfg.model, label=f"autodeploy[{os.path.basename(path)}]", yaml=path, **settings)
    if name == "hf-eager":
        return HFEngine(checkpoint, dtype, compile=False, device=cfg.device)
    if name == "hf+torch.compile":
        return HFEngine(checkpoint, dtype, compile=True, device=cfg.device)
    raise ValueError(f"unknown engine '{name}'")


def run(cfg: BenchConfig) -> Dict[str, Any]:
    from ..models.presets import PRESETS
    from ..models.factory import resolve_source

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    checkpoint = resolve_source(cfg.model) if cfg.model in PRESETS or os.path.isdir(cfg.model) else cfg.model
    names = list(cfg.engines) + [f"autodeploy:{y}" for y in cfg.yaml_variants]
    if cfg.world_size > 1:  # the other ranks build it as they start: build it first here too
        names.sort(key=lambda name: name != "autodeploy")
    engines: Dict[str, BenchEngine] = {}
    memory: Dict[str, Dict[str, float]] = {}
    for name in names:
        logger.info("building %s", name)
        device = torch.device(cfg.device)
        with measure_peak(device) as peak:
            engine = _build(name, cfg, checkpoint)
            engine.warm_up(cfg.decode_prompt_len, cfg.batch_sizes, cfg.new_tokens, cfg.prefill_lens)
        engines[engine.name] = engine
        memory[engine.name] = {"peak_growth_mb": round(peak[0] / 2**20, 1)}
        logger.info("%s: build %.1f s, warm-up %.1f s", engine.name, engine.build_s, engine.warmup_s)

    samples: Dict[str, Dict[str, List[float]]] = {n: {} for n in engines}
    for r in range(cfg.rounds):
        for name, engine in engines.items():
            s = samples[name]
            for length in cfg.prefill_lens:
                for _ in range(cfg.prefill_reps):
                    t = engine.timed([[5] * length], 1)
                    s.setdefault(f"ttft_ms_{length}", []).append(t * 1e3)
                    s.setdefault(f"prefill_tok_s_{length}", []).append(length / t)
            for b in cfg.batch_sizes:
                prompts = [[5 + (i % 7)] * cfg.decode_prompt_len for i in range(b)]
                t1 = engine.timed(prompts, 1)
                tn = engine.timed(prompts, cfg.new_tokens)
                decode_s = max(tn - t1, 1e-9)
                s.setdefault(f"decode_tok_s_b{b}", []).append(b * (cfg.new_tokens - 1) / decode_s)
                s.setdefault(f"decode_ms_per_step_b{b}", []).append(decode_s / (cfg.new_tokens - 1) * 1e3)
        logger.info("round %d/%d done", r + 1, cfg.rounds)

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(_config(checkpoint), dtype=getattr(torch, cfg.dtype))
    weights = weight_bytes_per_decode_token(ref)
    bandwidth = read_bandwidth_gbs(cfg.device)
    floor_ms = weights["per_token"] / (bandwidth * 1e9) * 1e3

    accuracy = _accuracy(cfg, engines, checkpoint, int(ref.config.vocab_size))

    results = {}
    base = "hf-eager" if "hf-eager" in samples else None
    for name, s in samples.items():
        row: Dict[str, Any] = {"build_s": round(engines[name].build_s, 2), "warmup_s": round(engines[name].warmup_s, 2),
                               **memory[name]}
        if engines[name].settings:
            row["settings"] = engines[name].settings
        for key, values in s.items():
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        if base:
            for key in s:
                if key.startswith(("prefill_tok_s", "decode_tok_s")):
                    row[f"{key}_vs_hf_eager"] = row[key]["median"] / statistics.median(samples[base][key])
                if key.startswith("ttft_ms"):
                    row[f"{key}_vs_hf_eager"] = statistics.median(samples[base][key]) / row[key]["median"]
        if "decode_ms_per_step_b1" in s:
            row["bandwidth_floor_fraction_b1"] = floor_ms / row["decode_ms_per_step_b1"]["median"]
        if name in accuracy:
            row["accuracy_vs_hf_eager"] = accuracy[name]
        results[name] = row
    for engine in engines.values():
        engine.close()
    return {"meta": {**_meta(cfg), "read_bandwidth_gbs": round(bandwidth, 1),
                     "weight_mb_per_decode_token": round(weights["per_token"] / 2**20, 1),
                     "b1_floor_ms_per_step": round(floor_ms, 2)},
            "config": asdict(cfg), "results": results}


def follow(cfg: BenchConfig) -> None:
    """A rank other than 0 of ``cfg.world_size``: build the autodeploy engine's shard as rank 0
    does (``_build``), then run the steps rank 0 sends until its measurements are done."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    engine = _build("autodeploy", cfg, cfg.model)
    assert isinstance(engine, AutoDeployEngine)
    engine.llm.follow()


def _accuracy(cfg: BenchConfig, engines: Dict[str, BenchEngine], checkpoint: str,
              vocab_size: int) -> Dict[str, Dict[str, Any]]:
    ours = {n: e for n, e in engines.items() if isinstance(e, AutoDeployEngine)}
    if cfg.accuracy_prompts <= 0 or not ours:
        return {}
    hf = engines.get("hf-eager")
    if not isinstance(hf, HFEngine):  # not among the measured engines: load it for this comparison only
        hf = HFEngine(checkpoint, _DTYPES[cfg.dtype], compile=False, device=cfg.device)
    prompts = random_prompts(cfg.accuracy_prompts, cfg.decode_prompt_len, vocab_size)
    out = {}
    for name, engine in ours.items():
        out[name] = compare_with_hf(engine.llm, hf.model, prompts, cfg.accuracy_tokens)
        logger.info("%s accuracy vs HF eager: %s", name, out[name])
    return out


def _config(checkpoint: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint)
