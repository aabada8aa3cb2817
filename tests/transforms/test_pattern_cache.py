"""The on-disk cache of traced search patterns (``transform.pattern_matcher``).

A warm cache must give exactly what tracing gives: the same registered entries, the same
matches and the same rewritten graph, without tracing anything. A damaged entry is retraced,
and ``AUTODEPLOY_PATTERN_CACHE=0`` writes nothing.
"""

import os

import pytest
import torch

from autodeploy.transform import pattern_matcher
from autodeploy.transform.library import match_rmsnorm_pattern, match_rope_pattern
from helpers import apply_transform, count_op, export_gm
from test_match_rmsnorm_pattern import TwoNorms
from test_match_rope_pattern import LlamaRope, bnsd

ad = torch.ops.autodeploy


def _fresh_pattern_sets(monkeypatch):
    """Forget the process's registered sets so the next apply registers (and loads) again."""
    monkeypatch.setattr(match_rmsnorm_pattern, "_PATTERNS", None)
    monkeypatch.setattr(match_rope_pattern, "_PATTERNS", None)


def _apply_both():
    """RMSNorm (replacement patterns) and RoPE (handler patterns whose ``cat`` takes a list)."""
    norm, norm_rec = apply_transform("match_rmsnorm_pattern", export_gm(TwoNorms().eval(), torch.randn(2, 5, 32)))
    rope, rope_rec = apply_transform("match_rope_pattern", export_gm(LlamaRope(), *bnsd(2, 6)))
    entries = {name: sum(len(v) for v in getter()._pass.patterns.values())
               for name, getter in (("norm", match_rmsnorm_pattern.rmsnorm_patterns),
                                    ("rope", match_rope_pattern.rope_patterns))}
    return {"norm": (norm_rec.num_matches, norm.code, count_op(norm, ad.torch_rmsnorm)),
            "rope": (rope_rec.num_matches, rope.code, count_op(rope, ad.torch_rope_with_explicit_cos_sin)),
            "entries": entries}


def _entries(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTODEPLOY_CACHE", str(tmp_path))
    monkeypatch.delenv("AUTODEPLOY_PATTERN_CACHE", raising=False)
    return str(tmp_path / "patterns")


def test_warm_cache_gives_what_tracing_gives_without_tracing(cache_dir, monkeypatch):
    _fresh_pattern_sets(monkeypatch)
    cold = _apply_both()
    assert cold["norm"][0] == 2 and cold["norm"][2] == 2
    assert cold["rope"][0] == 1 and cold["rope"][2] == 1
    files = _entries(cache_dir)
    assert len(files) >= 6  # every traced variant of both sets

    _fresh_pattern_sets(monkeypatch)

    def no_tracing(*args, **kwargs):
        raise AssertionError("a cached pattern was traced again")

    from torch._inductor import pattern_matcher as inductor_pattern_matcher

    monkeypatch.setattr(inductor_pattern_matcher, "gen_pattern", no_tracing)
    warm = _apply_both()
    assert warm == cold
    assert _entries(cache_dir) == files


@pytest.mark.slow  # ~9 s: traces every pattern again (suite time)
def test_damaged_entries_are_retraced(cache_dir, monkeypatch):
    _fresh_pattern_sets(monkeypatch)
    cold = _apply_both()
    assert cold["norm"][0] == 2 and cold["rope"][0] == 1  # the comparison below compares real matches
    for name in _entries(cache_dir):
        with open(os.path.join(cache_dir, name), "w") as f:
            f.write("output = CallFunction(aten.add.Tensor, *)\n")  # not even Python
    _fresh_pattern_sets(monkeypatch)
    assert _apply_both() == cold
    # ...and the retraced patterns were written back in a form that loads
    for name in _entries(cache_dir):
        assert pattern_matcher._load_pattern(os.path.join(cache_dir, name)) is not None


def test_cache_can_be_switched_off(cache_dir, monkeypatch):
    monkeypatch.setenv("AUTODEPLOY_PATTERN_CACHE", "0")
    assert pattern_matcher.pattern_cache_dir() is None
    _fresh_pattern_sets(monkeypatch)
    result = _apply_both()
    assert _entries(cache_dir) == []
    assert result["norm"][0] == 2 and result["rope"][0] == 1  # the patterns still work, just uncached


def test_tracing_says_when_it_starts_and_how_long_it_took(cache_dir, monkeypatch, caplog):
    """Tracing a cold set takes seconds: one line before, one with the count and time after;
    a warm cache says nothing (nothing slow happens)."""
    import logging
    import re

    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)

    def pattern_lines():
        with caplog.at_level(logging.INFO, logger="autodeploy"):
            caplog.clear()
            _fresh_pattern_sets(monkeypatch)
            _apply_both()
        records = {id(r): r for r in caplog.records}.values()  # after an in-process CLI run, each is seen twice
        return [r.getMessage() for r in records if r.getMessage().startswith("pattern set")]

    cold = pattern_lines()
    sets = [line.split(":")[0].split()[-1] for line in cold]
    assert sets == ["match_rmsnorm_pattern"] * 2 + ["match_rope_pattern"] * 2, cold
    assert "tracing the patterns not in the pattern cache yet" in cold[0]
    assert re.search(r"traced \d+ of \d+ patterns in \d+\.\d s \(kept in .*patterns for later builds\)", cold[1])
    assert pattern_lines() == []


def test_key_depends_on_function_and_inputs():
    fn_a, fn_b = match_rope_pattern._explicit, match_rope_pattern._interleaved
    x = torch.randn(2, 3, 8)
    key = pattern_matcher._pattern_key("s", fn_a, [x], [True])
    assert key == pattern_matcher._pattern_key("s", fn_a, [torch.randn(2, 3, 8)], [True])  # values do not matter
    assert key != pattern_matcher._pattern_key("s", fn_b, [x], [True])
    assert key != pattern_matcher._pattern_key("s", fn_a, [x.to(torch.bfloat16)], [True])
    assert key != pattern_matcher._pattern_key("s", fn_a, [torch.randn(2, 3, 4)], [True])
    assert key != pattern_matcher._pattern_key("s", fn_a, [x], [False])
