"""The engines a benchmark compares, behind one small interface.

Each engine answers the same questions on the same checkpoint: how long a ``generate`` of
``new_tokens`` takes for a batch of prompts (and, with ``new_tokens=1``, how long the prefill
takes). Greedy decoding everywhere, EOS ignored, so every engine does the same work.
"""

import gc
import time
from typing import Any, Dict, List, Optional

import torch

from ..utils.logging import get_logger

logger = get_logger(__name__)


def _hf_load_kwargs(checkpoint: str) -> Dict[str, Any]:
    """What HF needs to load ``checkpoint`` on this machine: an MXFP4 checkpoint (GPT-OSS) loads
    on CPU only dequantized (``Mxfp4Config(dequantize=True)``; its kernels need triton), a
    fine-grained FP8 one likewise (``FineGrainedFP8Config(dequantize=True)``, which needs
    ``accelerate``: weights decoded at load, activations not quantized)."""
    import json
    import os

    path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        method = (json.load(f).get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4":
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if method == "fp8" and not torch.cuda.is_available():
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    return {}


class BenchEngine:
    name: str = ""
    build_s: float = 0.0  # model creation (and for autodeploy: export, transforms, cache init)
    warmup_s: float = 0.0  # compilation and first runs, excluded from the measurements
    settings: Optional[Dict[str, int]] = None  # limits the engine resolved (autodeploy's defaults)

    def generate(self, prompts: List[List[int]], new_tokens: int) -> float:
        """Seconds to generate ``new_tokens`` for every prompt (one batch, greedy)."""
        raise NotImplementedError

    def timed(self, prompts: List[List[int]], new_tokens: int) -> float:
        """``generate`` as a measurement: collected first and without the cyclic garbage
        collector running inside it (as ``timeit`` does). With the ``small`` engine and an HF
        model in one process, a full collection took 0.3 s: one landing in a 0.2 s prefill would
        decide that sample, whichever engine's objects caused it."""
        gc.collect()
        gc.disable()
        try:
            return self.generate(prompts, new_tokens)
        finally:
            gc.enable()

    # Engines that specialise on exact shapes (static caches) warm up with the measured ones.
    exact_warmup = False
    warmup_note = ""  # what makes this engine's warm-up slow, said before it starts

    def warm_up(self, prompt_len: int, batch_sizes: List[int], new_tokens: int, prefill_lens: List[int]) -> None:
        """Run every measured shape once, untimed.

        Why the progress bar and the line before it: HF + torch.compile compiles each (batch,
        prompt, cache length) shape here, 28 s on the ``small`` preset, which looked like a hang.
        """
        from tqdm import tqdm

        lengths = (1, new_tokens) if self.exact_warmup else (1, 2)
        runs = [([[5] * prompt_len for _ in range(b)], n) for b in batch_sizes for n in lengths]
        runs += [([[5] * length], 1) for length in prefill_lens]
        logger.info("warming up %s: %d runs, one per measured shape%s ...", self.name, len(runs), self.warmup_note)
        start = time.perf_counter()
        for prompts, n in tqdm(runs, desc=f"warming up {self.name}", unit="run", leave=False, disable=None):
            self.generate(prompts, n)
        self.warmup_s += time.perf_counter() - start

    def close(self) -> None:
        pass


class AutoDeployEngine(BenchEngine):
    def __init__(self, model: str, label: str = "autodeploy", yaml: Optional[str] = None, **settings: Any):
        from ..llm import LLM
        from ..runtime.sampling_params import SamplingParams
        from ..transform import library  # noqa: F401  (module imports are once per process, not build)

        self.name = label
        # the rounds send the same prompts again: with prefix caching a repeat would skip its
        # prefill, which HF's engines cannot, so the comparison runs without it
        settings.setdefault("enable_prefix_caching", False)
        start = time.perf_counter()
        self.llm = LLM(model, yaml=yaml, **settings)
        self.build_s = time.perf_counter() - start
        self._params = SamplingParams
        cache = self.llm.build.cache
        # the limits the defaults resolved to, reported with the results
        self.settings = {"max_seq_len": cache.max_seq_len, "max_batch_size": cache.max_batch_size,
                         "max_num_tokens": cache.max_num_tokens, "num_pages": cache.num_pages}
        history = {r.key: r.time_s for r in self.llm.build.context.history}
        # compile_model's time is compilation and warm-up, reported apart from the build
        self.warmup_s = history.get("compile_model", 0.0)
        self.build_s -= self.warmup_s

    def generate(self, prompts: List[List[int]], new_tokens: int) -> float:
        params = self._params(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - start

    def close(self) -> None:
        self.llm.shutdown()  # at several ranks: the others stop following


class HFEngine(BenchEngine):
    """HF ``generate`` (eager), or with ``compile=True`` the PyTorch-native fast path: a static
    KV cache and ``torch.compile`` of the forward, as the transformers docs describe it."""

    def __init__(self, checkpoint: str, dtype: torch.dtype, compile: bool = False, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.name = "hf+torch.compile" if compile else "hf-eager"
        self.device = device
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, **_hf_load_kwargs(checkpoint))
        self.model = self.model.to(device).eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        if compile:
            # Static shapes: every (batch, prompt, cache length) compiles once, at warm-up.
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.model.generation_config.cache_implementation = "static"
            self.model.forward = torch.compile(self.model.forward, fullgraph=True)
            self.exact_warmup = True
            self.warmup_note = " (torch.compile compiles each shape: tens of seconds)"
        self.build_s = time.perf_counter() - start

    def generate(self, prompts: List[List[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False)
        if self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def weight_bytes_per_decode_token(model: torch.nn.Module) -> Dict[str, int]:
    """Bytes a batch-1 decode step must read: every weight once, except the embedding table
    (one row is read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
    emb_bytes = 0 if tied else emb.numel() * emb.element_size()
    return {"total": total, "per_token": total - emb_bytes}


def read_bandwidth_gbs(device: str = "cpu", size_mb: int = 1024, reps: int = 5) -> float:
    """Measured read bandwidth: a reduction over a tensor much larger than the caches."""
    x = torch.ones(size_mb * 2**20 // 4, device=device)
    best = float("inf")
    for _ in range(reps):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - start)
    del x
    return size_mb * 2**20 / best / 1e9
