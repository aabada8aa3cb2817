"""The ``rwkv`` export patch: a tiny RWKV-4 exported with it carries one ``torch_wkv`` per block and a
width-2 ``torch_causal_conv1d`` per token shift, with a dynamic sequence (one token included), and
its logits equal HF eager's, which rescales its weights in place at its first call
(``rescale_every=1`` here, so every block but the first is rescaled; the export divides the
outputs by the same powers of two). Calls with a state run HF's code; everything is restored
after the export."""

import copy

import pytest
import torch
from torch.export import Dim
from transformers import RwkvConfig, RwkvForCausalLM
from transformers.models.rwkv import modeling_rwkv as hf

from autodeploy.export import apply_export_patches, export_patches
from autodeploy.export.hf_rwkv import is_token_shift

ad = torch.ops.autodeploy
LAYERS, VOCAB = 4, 64


def _patched(model: torch.nn.Module):
    """Only this patch, so the test sees nothing else change."""
    return apply_export_patches(model, {**{p.name: False for p in export_patches()}, "rwkv": True})


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    config = RwkvConfig(vocab_size=VOCAB, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
                        num_hidden_layers=LAYERS, context_length=128, rescale_every=1)
    model = RwkvForCausalLM(config).eval()
    # the exported program shares its module's parameters, which HF's eager call divides in place
    exporting = copy.deepcopy(model)
    original_wkv = hf.rwkv_linear_attention
    with _patched(exporting):
        assert hf.rwkv_linear_attention is not original_wkv and exporting.rwkv.layers_are_rescaled
        ep = torch.export.export(_Logits(exporting), (torch.randint(0, VOCAB, (1, 9)),),
                                 dynamic_shapes=({1: Dim("seq", min=1, max=128)},), strict=False)
    assert hf.rwkv_linear_attention is original_wkv and not exporting.rwkv.layers_are_rescaled
    assert all("forward" not in vars(b.attention.output) for b in exporting.rwkv.blocks)
    torch.testing.assert_close(exporting.rwkv.blocks[3].attention.output.weight,
                               model.rwkv.blocks[3].attention.output.weight, rtol=0, atol=0)  # not divided
    return model, ep


def test_every_block_exports_its_wkv_and_two_token_shifts(exported):
    _, ep = exported
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_wkv.default) == LAYERS
    assert targets.count(ad.torch_causal_conv1d.default) == 2 * LAYERS


@pytest.mark.parametrize("s", [9, 1, 40])
def test_exported_logits_equal_hf_eager_which_rescales(exported, s):
    model, ep = exported
    ids = torch.randint(0, VOCAB, (1, s))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        out = ep.module()(ids)
    assert model.rwkv.layers_are_rescaled  # HF's eager call did rescale
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_call_with_a_state_runs_hf():
    from autodeploy.export.hf_rwkv import _wkv_fn

    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "hf"

    wrapped = _wkv_fn(original)
    k = torch.randn(1, 3, 4)
    assert wrapped(torch.zeros(4), torch.zeros(4), k, k, state=[k[:, 0]] * 3) == "hf"
    assert wrapped(torch.zeros(4), torch.zeros(4), k, k, return_state=True) == "hf"
    assert len(calls) == 2
    out, state = wrapped(torch.zeros(4), torch.zeros(4), k, k)
    assert state is None and torch.equal(out, ad.torch_wkv(torch.zeros(4), torch.zeros(4), k, k))


def test_only_rwkv_token_shifts_match():
    assert is_token_shift(torch.nn.ZeroPad2d((0, 0, 1, -1)))
    assert not is_token_shift(torch.nn.ZeroPad2d((0, 0, 1, 0)))
    assert not is_token_shift(torch.nn.ConstantPad2d((0, 0, 1, -1), 0.0))


def test_llm_on_a_rescaled_rwkv_gives_hf_greedy_tokens(tmp_path):
    """End to end on a real checkpoint with 8 blocks rescaled in 4 groups (rescale_every=2): the
    engine serves it on state caches and its greedy tokens equal HF's. (Before the rwkv patch
    such a model did not build: its static-length export mixed the halving with unscaled weights.)"""
    from autodeploy import LLM, SamplingParams
    from autodeploy.models.presets import write_random_checkpoint

    write_random_checkpoint(dict(model_type="rwkv", vocab_size=512, hidden_size=64, attention_hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=8, context_length=256, rescale_every=2),
                            str(tmp_path), seed=0)
    prompt = torch.randint(8, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    reference = RwkvForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    llm = LLM(str(tmp_path), max_seq_len=64, max_batch_size=2)
    assert llm.build.context.cache_mode == "state"
    out = llm.generate([{"prompt_token_ids": prompt[0].tolist()}],
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert list(out.token_ids) == expected
