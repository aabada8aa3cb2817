"""Why the model types that fail the coverage check fail, as far as we have found out.

The report prints the cause next to each failing type, so a failure is never just an error
line. Written by hand after reading each failure's log (``.cache/coverage/logs/<type>.<recipe>.log``);
a failing type without an entry is reported as not investigated yet. Keep an entry only while
the type fails: the report marks stale ones.
"""

from __future__ import annotations

from typing import Dict

_CHUNKED_SCAN = (
    "HF's chunked scan pads the sequence to a multiple of the chunk size and reshapes it into chunks; "
    "torch.export cannot keep the sequence dynamic through that, the fallback export bakes in the chunk count of "
    "the export example, and recompute_fallback's consistency check stops the build at the first other length. "
    "Recipe a passes only because its chunk ({chunk}) is longer than every sequence. Fix: canonical SSM / "
    "recurrent ops with state caches (issue 14)."
)

CAUSES: Dict[str, str] = {
    "xlstm": _CHUNKED_SCAN.format(chunk="64 tokens").replace("HF's chunked scan", "xLSTM's chunkwise mLSTM scan"),
    "blt": "the byte patcher chooses patch boundaries from the data (entropy thresholds): export cannot guard on "
           "the data-dependent patch count.",
    "cpmant": "its position bias lets a position see later tokens, so the static-length graph (the model does not "
              "export with a dynamic sequence) changes its answer with the padding; refused, not served wrong.",
    "deepseek_v4": "the model's attention code pins the sequence dimension to a single value during export "
                   "(min = max = 2), so no dynamic sequence dimension can be created.",
    "doge": "switches to a top-k dynamic mask once the sequence passes keep_window_size (8 at recipe a): the "
            "static-length graph cannot follow the branch; refused, not served wrong. At recipe b (window 4) both "
            "prompts are past the switch and it passes.",
    "qwen4_exp_text": "the sparse-attention indexer's token budget is data-dependent (u0 // 4 blocks): export "
                      "cannot guard on it.",
}


# What a type that passes in recompute mode needs to be served with caches (issue 14 gave the
# conv / SSM / delta-rule families state caches; these hold other kinds of state).
RECOMPUTE_NEEDS: Dict[str, str] = {
    "minimax": "lightning attention: linear attention with a fixed per-head decay (S = exp(-slope) S + k^T v, "
               "o = q S), computed in blocks by a Python loop over the sequence. Needs a canonical decayed "
               "linear-attention op with a [slots, h, dk, dv] state (the delta-rule step driver fits) and an "
               "export patch for MiniMaxLightningAttention.",
    "recurrent_gemma": "the RG-LRU recurrence (a gated diagonal linear recurrence over the LRU width) and a "
                       "temporal conv written as nn.Conv1d, not HF's causal_conv1d_fn. Needs an RG-LRU op with a "
                       "[slots, width] state, and an export patch for its recurrent block emitting that op and "
                       "torch_causal_conv1d.",
    "rwkv": "the WKV recurrence (per-channel exponential decay with a numerator, denominator and running-max "
            "state) and token shift (each layer mixes in the previous token). Needs a WKV op with "
            "[slots, 3, hidden] state and a token-shift state [slots, hidden] per block.",
    "xlstm": "the chunkwise mLSTM scan (matrix memory with exponential gates and a stabiliser). Needs an mLSTM op "
             "with C [slots, h, dk, dv], n [slots, h, dk] and m [slots, h] states; recipe b fails today because "
             "the export bakes in the chunk count.",
    "zaya": "Compressed Convolutional Attention: q/k pass through a depthwise then a grouped causal conv (window "
            "(cca_time0 - 1) + (cca_time1 - 1), written as nn.Conv1d) and half of each value head is the previous "
            "token's projection. Needs a grouped causal conv op (the conv-state cache fits) and a one-token shift "
            "state, with an export patch for ZayaCCAProjection.",
}


def cause_of(model_type: str) -> str:
    return CAUSES.get(model_type, "")


__all__ = ["CAUSES", "RECOMPUTE_NEEDS", "cause_of"]
