"""Hidden states through the API: ``LLM(..., transforms={"insert_cached_residual_add": {"layers": [0, -1]}})``
and ``SamplingParams(return_hidden_states=True)`` give each output ``[tokens, layers, hidden]``
equal to HF's decoder-layer outputs for the prompt and the generated tokens, also when prompts
are prefilled in chunks and sequences are preempted and recomputed; a request without the flag
gets none, and one with the flag on a build that captures nothing is refused naming the fix.
"""

import pytest
import torch

from autodeploy import LLM, InvalidRequestError, SamplingParams
from helpers import family_checkpoint, hf_model, rel_rmse

NEW = 6
PROMPT_LENGTHS = (30, 9, 17, 5)
# 8-token steps (prompts are chunked) and a pool too small for all four prompts at once: the
# engine preempts, and a recomputed sequence's hidden states must be replaced, not appended
SMALL = dict(max_seq_len=48, max_batch_size=4, max_num_tokens=8, page_size=4)
CAPTURE = {"insert_cached_residual_add": {"layers": [0, -1]}, "initialize_cache": {"num_pages": 16}}


@pytest.fixture(scope="module")
def llm():
    return LLM(family_checkpoint("llama"), transforms=CAPTURE, **SMALL)


def _prompts(vocab=512):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _hf_layer_outputs(ids):
    """HF's decoder-layer outputs ``[len(ids), layers, hidden]`` (forward hooks on each layer)."""
    hf = hf_model(family_checkpoint("llama"))
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            hf(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([outs[i][0] for i in range(len(outs))], dim=1)


def test_generate_returns_hf_hidden_states(llm):
    assert llm.hidden_state_layers == [0, 1]
    prompts = _prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, return_hidden_states=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == NEW
        hidden = out.hidden_states
        # every token the model ran: the prompt and all generated tokens but the last
        assert hidden.shape == (len(prompt) + NEW - 1, 2, 64) and hidden.device.type == "cpu"
        ref = _hf_layer_outputs(prompt + out.token_ids[:-1])
        assert rel_rmse(hidden, ref) < 1e-5, rel_rmse(hidden, ref)
    # greedy tokens are HF's own choice from the last layer's state (checked with the final norm and head)
    hf = hf_model(family_checkpoint("llama"))
    with torch.no_grad():
        logits = hf.lm_head(hf.model.norm(outs[1].hidden_states[len(prompts[1]) - 1:, 1]))
    assert logits.argmax(-1).tolist() == outs[1].token_ids


def test_without_the_flag_there_are_none(llm):
    assert llm.hidden_state_layers == [0, 1]  # captured, just not asked for
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert out.hidden_states is None and out.outputs[0].hidden_states is None


def test_a_build_that_captures_nothing_refuses_the_request():
    llm = LLM(family_checkpoint("llama"), max_seq_len=32, max_batch_size=2, max_num_tokens=16,
              transforms={"resize_kv_cache": {"enabled": False}})
    assert llm.hidden_state_layers == []
    with pytest.raises(InvalidRequestError, match=r"insert_cached_residual_add.*layers"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, return_hidden_states=True))
    assert not llm.engine.has_unfinished()
    with pytest.raises(InvalidRequestError, match="return_hidden_states must be True or False"):
        SamplingParams(return_hidden_states=1)
