"""Coverage checkpoints give random values to the parameters HF's init leaves all zero: ZAYA's key
scale ``temp`` (zero: every key is zero and attention uniform, so q and k never reach the logits)
and the like. Biases stay zero; every other tensor is exactly what the seeded init wrote."""

import torch
from safetensors.torch import load_file

from autodeploy.coverage.checkpoints import ZERO_PARAMETER_STD, ensure_checkpoint
from autodeploy.coverage.configs import tiny_config
from autodeploy.models.presets import write_random_checkpoint


def test_zero_initialised_parameters_get_values_and_nothing_else_changes(tmp_path):
    config = tiny_config("zaya", "a")
    write_random_checkpoint(config, str(tmp_path / "plain"), seed=0)  # the same seed as the sweep's
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    filled = load_file(ensure_checkpoint(config, str(tmp_path / "coverage")) + "/model.safetensors")
    temps = [k for k in plain if k.endswith("qk_norm.temp")]
    assert temps and all(not plain[k].any() for k in temps)
    for k in temps:
        assert filled[k].all() and 0.2 * ZERO_PARAMETER_STD < filled[k].std() < 5 * ZERO_PARAMETER_STD
    zero_biases = [k for k in plain if k.endswith("bias") and not plain[k].any()]
    assert zero_biases and all(not filled[k].any() for k in zero_biases)
    assert all(torch.equal(plain[k], filled[k]) for k in plain if k not in temps)
