"""insert_cached_delta_rule (cache_init): torch_delta_rule (DeltaNet: no decay gate) ->
torch_cached_delta_rule with an fp32 ``[slots, h, dk, dv]`` state per sequence.

No transformers model in 5.23 uses the ungated rule, so the model is a toy LM written on the
canonical op (two delta-rule layers, GQA-style 2 q/k heads for 4 value heads): the match count,
the op swap, numerics of the cached graph against the uncached one (two shapes, chunked prefill,
decodes beside another sequence, a reused slot), and a near miss (the gated op is not taken).
"""

import torch
from torch import nn

from autodeploy.export.exporter import export_causal_lm
from helpers import count_op
from state_cache_checks import apply_cache_transforms, run_all, state_handlers

ad = torch.ops.autodeploy
VOCAB, HIDDEN, HK, H, DK, DV = 64, 32, 2, 4, 8, 8


class DeltaLM(nn.Module):
    def __init__(self, layers: int = 2, gated: bool = False):
        super().__init__()
        self.gated = gated
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qk = nn.ModuleList(nn.Linear(HIDDEN, 2 * HK * DK) for _ in range(layers))
        self.vb = nn.ModuleList(nn.Linear(HIDDEN, H * DV + 2 * H) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(H * DV, HIDDEN) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        for qk, vb, out in zip(self.qk, self.vb, self.out):
            q, k = qk(x).view(b, s, 2, HK, DK).unbind(2)
            v, beta, g = vb(x).split([H * DV, H, H], dim=-1)
            v = v.view(b, s, H, DV)
            if self.gated:
                o = ad.torch_gated_delta_rule(q, k, v, -nn.functional.softplus(g), beta.sigmoid(), None, True)
            else:
                o = ad.torch_delta_rule(q, k, v, beta.sigmoid(), None, True)
            x = x + out(o.reshape(b, s, H * DV))
        return self.head(x)


def _exported(gated: bool = False):
    torch.manual_seed(0)
    return export_causal_lm(DeltaLM(gated=gated).eval(), max_batch_size=4, max_seq_len=32)


def test_every_delta_rule_gets_an_fp32_state_and_the_graph_stays_exact():
    gm = _exported()
    assert count_op(gm, ad.torch_delta_rule) == 2
    c = apply_cache_transforms(gm, ["insert_cached_delta_rule"], VOCAB)
    record = c.context.history[-1]
    assert record.key == "insert_cached_delta_rule" and record.status == "ok" and record.num_matches == 2
    assert count_op(c.graph, ad.torch_delta_rule) == 0 and count_op(c.graph, ad.torch_cached_delta_rule) == 2
    handlers = state_handlers(c.cache, "delta_state")
    assert list(handlers) == ["delta_state_0", "delta_state_1"]
    assert all(h.shape == (H, DK, DV) and h.dtype == torch.float32 for h in handlers.values())
    run_all(c)


def test_the_gated_rule_is_not_taken():
    """Near miss: torch_gated_delta_rule is insert_cached_gated_delta_rule's."""
    gm = _exported(gated=True)
    c = apply_cache_transforms(gm, ["insert_cached_delta_rule", "insert_cached_gated_delta_rule"], VOCAB)
    first, second = c.context.history[-2:]
    assert first.key == "insert_cached_delta_rule" and first.status == "skipped" and first.num_matches == 0
    assert second.key == "insert_cached_gated_delta_rule" and second.num_matches == 2
    assert count_op(c.graph, ad.torch_cached_delta_rule) == 0
    assert count_op(c.graph, ad.torch_cached_gated_delta_rule) == 2
    run_all(c)  # and the gated toy is exact through the other transform
