"""Why the model types that fail the coverage check fail, as far as we have found out.

The report prints the cause next to each failing type, so a failure is never just an error
line. Written by hand after reading each failure's log (``.cache/coverage/logs/<type>.<recipe>.log``);
a failing type without an entry is reported as not investigated yet. Keep an entry only while
the type fails: the report marks stale ones.
"""

from __future__ import annotations

from typing import Dict

CAUSES: Dict[str, str] = {
    "blt": "the byte patcher chooses patch boundaries from the data (entropy thresholds): export cannot guard on "
           "the data-dependent patch count.",
}


# What a type that passes in recompute mode needs to be served with caches (issue 14 gave the
# conv / SSM / delta-rule families state caches; these hold other kinds of state).
RECOMPUTE_NEEDS: Dict[str, str] = {
    "qwen4_exp_text": "QSA sparse attention: each indexed-attention layer attends only to the tokens its indexer "
                      "selects (the best indexer_budget // C blocks of C tokens, plus the query's incomplete block), "
                      "exported as torch_qsa_indexer (hf_qsa) and an explicit mask on torch_attention. Needs a cached "
                      "QSA indexer with a paged cache of the raw index keys (one head_dim vector a token, like "
                      "torch_cached_dsa_indexer) and a cached attention taking the selected token indices; with PLE "
                      "layers also an n-gram token-context state and a dilated-conv state. The GatedDeltaNet layers "
                      "already export as torch_gated_delta_rule / torch_causal_conv1d and the MoE as torch_moe.",
}


def cause_of(model_type: str) -> str:
    return CAUSES.get(model_type, "")


__all__ = ["CAUSES", "RECOMPUTE_NEEDS", "cause_of"]
