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
    **{t: _CHUNKED_SCAN.format(chunk="256 tokens") for t in
       ("bamba", "falcon_h1", "granitemoehybrid", "mamba2", "zamba2")},
    "nemotron_h": _CHUNKED_SCAN.format(chunk="256 tokens") + " Recipe a fails earlier: its MoE router counts "
                  "tokens per expert with torch.histc on integer ids, which has no CPU kernel in the exported graph.",
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
    "hy_v4": "its output depends on the sequence length beyond causality (a 1-token prompt differs from the "
             "static-length graph); refused by recompute_fallback's eager check, not served wrong.",
    "inkling2_text": "save_pretrained writes the checkpoint under its original names (model.llm.layers.N.mlp.experts."
                     "w13_weight / w2_weight) and the loader does not apply transformers' reverse key mapping to the "
                     "model's names (model.layers.N.mlp.experts.gate_up_proj).",
    "qwen4_exp_text": "the sparse-attention indexer's token budget is data-dependent (u0 // 4 blocks): export "
                      "cannot guard on it.",
}


def cause_of(model_type: str) -> str:
    return CAUSES.get(model_type, "")


__all__ = ["CAUSES", "cause_of"]
