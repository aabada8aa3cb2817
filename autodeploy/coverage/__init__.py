"""Architecture coverage: does every causal-LM model type of the installed transformers go
through the whole default pipeline and generate exactly what HF eager generates?

``configs`` enumerates the model types and builds a tiny random config for each,
``checkpoints`` writes it as a real checkpoint, ``reference`` computes HF eager's answer,
``check`` runs one model end to end (in a child process during a sweep), ``sweep`` runs many in
a subprocess pool with a time limit each, and ``report`` writes the markdown table and JSON.
``autodeploy coverage`` is the command line.
"""

from .check import CheckResult, run_check
from .configs import causal_lm_model_types, classify, tiny_config
from .sweep import run_sweep, select_model_types

__all__ = ["CheckResult", "run_check", "classify", "causal_lm_model_types", "tiny_config", "run_sweep",
           "select_model_types"]
