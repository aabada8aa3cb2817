"""insert_cached_cca_conv (cache_init): torch_cca_conv (ZAYA's CCA q/k convolutions, from the
``zaya_cca`` export patch) -> torch_cached_cca_conv with a ``[slots, c, K]`` input window per sequence.

On a real tiny ZAYA checkpoint (the coverage sweep's config: CCA attention and a MoE with a skip
expert; its key scale set and its conv weights scaled up, so that q/k matter): the match count, the op swap, the delayed values on their one-token conv window, the
paged KV cache beside them, numerics of the cached graph against the uncached one (two shapes,
chunked prefill, decodes beside another sequence, a reused slot), and a near miss (RWKV: width-2
causal convs and a recurrence, but no CCA conv).
"""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy.transform.interface import Stage
from helpers import build, count_op, coverage_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy


# HF initialises ZayaQKNorm's key scale ``temp`` to zeros: every key is then zero and attention
# uniform, so on the coverage checkpoint q and k -- and the convolutions that make them -- do not
# reach the logits at all (a graph without the conv cache passed this test). Here the key scale is
# set and the convolutions (std 0.02 from HF's init) are scaled up so that they matter.
KEY_SCALE, CONV_SCALE = 2.0, 10.0


def _strengthened(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name.endswith("qk_norm.temp"):
        return torch.full_like(tensor, KEY_SCALE)
    return tensor * CONV_SCALE if ".conv_qk_" in name else tensor


@pytest.fixture(scope="module")
def zaya(tmp_path_factory):
    path, vocab = coverage_checkpoint("zaya")
    scaled = tmp_path_factory.mktemp("zaya-strong-conv")
    for name in os.listdir(path):
        if name != "model.safetensors":
            shutil.copy(os.path.join(path, name), scaled / name)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert any(k.endswith("qk_norm.temp") for k in tensors)
    tensors = {k: _strengthened(k, v) for k, v in tensors.items()}
    save_file(tensors, str(scaled / "model.safetensors"), metadata={"format": "pt"})
    return build_cached(str(scaled), vocab)


def test_every_cca_layer_gets_its_window_and_keeps_its_kv_cache(zaya):
    c = zaya
    nodes = [n for n in c.uncached.graph.nodes if n.op == "call_function"
             and getattr(n.target, "overloadpacket", None) is ad.torch_cca_conv]
    layers = c.context.factory.config.num_hidden_layers  # type: ignore[union-attr]
    assert len(nodes) == layers > 0
    record = next(r for r in c.context.history if r.key == "insert_cached_cca_conv")
    assert record.status == "ok" and record.num_matches == layers
    assert count_op(c.graph, ad.torch_cca_conv) == 0 and count_op(c.graph, ad.torch_cached_cca_conv) == layers
    handlers = state_handlers(c.cache, "cca_conv_state")
    assert list(handlers) == [f"cca_conv_state_{i}" for i in range(layers)]
    for node, h in zip(nodes, handlers.values()):
        x, dw, g = (node.args[i].meta["val"] for i in (0, 1, 3))
        assert h.shape == (x.shape[-1], dw.shape[-1] - 1 + g.shape[-1] - 1)
    assert count_op(c.graph, ad.torch_cached_causal_conv1d) == layers  # each layer's delayed value half
    assert c.cache.paged_names


def test_cached_graph_equals_the_uncached_graph(zaya):
    run_all(zaya)


def test_a_graph_without_cca_convs_is_left_alone():
    path, _ = coverage_checkpoint("rwkv")
    res = build(path, up_to=Stage.CACHE_INIT, **LIMITS)
    record = next(r for r in res.context.history if r.key == "insert_cached_cca_conv")
    assert record.status == "skipped" and record.num_matches == 0
    assert not [n for n in res.cache.handlers if n.startswith("cca_conv_state")]
    assert [n for n in res.cache.handlers if n.startswith("conv_state")]  # its token shifts were cached
