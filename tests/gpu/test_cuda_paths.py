"""The CUDA paths, on a GPU: ``make test-gpu`` (``pytest -m gpu``). Deselected by ``make test`` and
skipped without CUDA, so on the CPU machines these never run: a session with a GPU runs them
(issue 21), and what fails there is that session's first work.

What each checks on the GPU: greedy tokens of the engine equal HF eager's on the same GPU for every
compile backend (float32, where the two must agree), and in bfloat16 the share of equal tokens;
NCCL at world size 1 (a group of one over NCCL, a real all-reduce, and the engine built inside
it); the FP8 GEMM backend (``torch._scaled_mm``) against the reference quantized linear; a ModelOpt
FP8 checkpoint's greedy tokens against the float reference (on GPUs with FP8 tensor cores the
linears run as FP8 GEMMs).
"""

from typing import List

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

PROMPTS = [[3, 17, 29, 41, 5, 11, 2], [7, 8, 9]]
NEW = 8


def _hf_tokens(model: torch.nn.Module) -> List[List[int]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
    return out


def _engine_tokens(checkpoint: str, **settings) -> List[List[int]]:
    from autodeploy import LLM, SamplingParams

    llm = LLM(checkpoint, device="cuda", max_seq_len=64, max_batch_size=4, **settings)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf(checkpoint: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("backend", ["auto", "torch-simple", "torch-compile", "torch-cudagraph", "torch-opt"])
def test_float32_greedy_tokens_equal_hf_on_the_gpu(backend):
    from helpers import family_checkpoint

    checkpoint = family_checkpoint("llama")
    assert _engine_tokens(checkpoint, dtype="float32", compile_backend=backend) == \
        _hf_tokens(_hf(checkpoint, torch.float32))


def test_bfloat16_agreement_with_hf():
    """bf16 rounds differently in each implementation: the first token must agree, and the share
    of equal tokens is printed for the report."""
    from helpers import family_checkpoint

    checkpoint = family_checkpoint("llama")
    ours = _engine_tokens(checkpoint, dtype="bfloat16", compile_backend="torch-cudagraph")
    theirs = _hf_tokens(_hf(checkpoint, torch.bfloat16))
    equal = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    print(f"bf16 greedy agreement with HF eager: {equal}/{NEW * len(PROMPTS)}")
    assert all(x[0] == y[0] for x, y in zip(ours, theirs))


def test_nccl_world_size_one():
    import torch.distributed as dist

    from autodeploy.distributed import process_group
    from helpers import family_checkpoint

    process_group.initialize(rank=0, world_size=1, device="cuda", master_port=29517)
    try:
        assert dist.get_backend() == "nccl"
        x = torch.arange(4.0, device="cuda")
        dist.all_reduce(x)  # a real NCCL call on the group of one
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
        checkpoint = family_checkpoint("llama")
        assert _engine_tokens(checkpoint, dtype="float32", world_size=1) == _hf_tokens(_hf(checkpoint, torch.float32))
    finally:
        process_group.shutdown()


def test_fp8_gemm_equals_the_reference_linear():
    from autodeploy.ops.quant.fp8_gemm import scaled_mm_fp8_linear, scaled_mm_supported

    device = torch.device("cuda")
    why = scaled_mm_supported(device, 64, 128)
    if why is not None:
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5, 128, device=device, generator=g)
    weight = (torch.randn(64, 128, device=device, generator=g) * 20).to(torch.float8_e4m3fn)
    input_scale, weight_scale = torch.tensor(0.02, device=device), torch.tensor(0.01, device=device)
    expected = torch.ops.autodeploy.torch_quant_fp8_linear(x, weight, None, input_scale, weight_scale)
    got = scaled_mm_fp8_linear(x, weight, None, input_scale, weight_scale)
    assert (got - expected).norm() / expected.norm() < 1e-3


def test_fp8_checkpoint_greedy_tokens_equal_the_float_reference():
    import quant_checkpoints as qc

    reference = qc.reference_model("llama", "fp8").to("cuda")
    tokens = _hf_tokens(reference)
    checkpoint = qc.quantized_checkpoint("llama", "fp8")
    assert _engine_tokens(checkpoint, dtype="float32") == tokens  # auto: the decoded weights in float32
    # the FP8 GEMMs themselves (float32 output; equal on an H100 and an H200, 2026-11-26)
    assert _engine_tokens(checkpoint, dtype="float32", transforms={"fuse_fp8_linear": {"backend": "scaled_mm"}}) == tokens


def test_piecewise_prefill_graphs_give_hf_tokens():
    from helpers import family_checkpoint

    checkpoint = family_checkpoint("llama")
    tokens = _engine_tokens(checkpoint, dtype="float32", compile_backend="torch-cudagraph",
                            transforms={"compile_model": {"piecewise_enabled": True}})
    assert tokens == _hf_tokens(_hf(checkpoint, torch.float32))


@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_serving_neither_recompiles_nor_captures(backend):
    """Requests of every batch size and prompt length after the build: the number of compiled
    dynamo graphs and of captured CUDA graphs stays what the build left (the build warms up and
    captures every shape class), and decode steps replay the captured graphs."""
    import torch._dynamo.utils as dynamo_utils

    from autodeploy import LLM, SamplingParams
    from autodeploy.compile.cuda_graph import DecodeGraphs
    from helpers import family_checkpoint

    llm = LLM(family_checkpoint("llama"), device="cuda", dtype="bfloat16", max_seq_len=128, max_batch_size=8,
              compile_backend=backend, transforms={"compile_model": {"piecewise_enabled": True}})
    decode = llm.build.graph.runner  # CompiledGraph keeps its runner out of modules()
    assert isinstance(decode, DecodeGraphs)
    runners = {b: id(r) for b, r in decode._runners.items()}
    graphs_before = dynamo_utils.counters["stats"]["unique_graphs"]
    replays = []
    for batch, replay in list(decode._runners.items()):
        def counted(replay=replay, batch=batch):
            replays.append(batch)
            replay[0]()
        decode._runners[batch] = (counted, replay[1])
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 8, 5):
        prompts = [{"prompt_token_ids": torch.randint(1, 500, (int(l),), generator=gen).tolist()}
                   for l in torch.randint(2, 60, (n,), generator=gen)]
        llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs_before
    assert set(runners) == set(decode._runners) and len(replays) > 0
    print(f"{backend}: {len(replays)} decode steps replayed CUDA graphs (buckets {sorted(set(replays))}), "
          f"{graphs_before} dynamo graphs, none compiled while serving")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_auto_backend_gives_hf_tokens_for_moe_and_mla_models(family, caplog):
    """``compile_backend: auto`` on CUDA captures CUDA graphs, or, for a graph with an op that
    reads values back to the host (MoE routing counts, MLA metadata), falls back to torch-simple
    with a warning: either way the build works and gives HF's greedy tokens (float32)."""
    import logging

    from helpers import moe_family_checkpoint

    checkpoint = moe_family_checkpoint(family)
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        tokens = _engine_tokens(checkpoint, dtype="float32")
    fell_back = any("capturing CUDA graphs failed" in r.getMessage() for r in caplog.records)
    print(f"{family}: auto {'fell back to torch-simple' if fell_back else 'captured CUDA graphs'}")
    assert tokens == _hf_tokens(_hf(checkpoint, torch.float32))
