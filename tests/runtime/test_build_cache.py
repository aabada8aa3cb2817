"""The build cache (autodeploy.build_cache): a hit loads the same model, any input change misses,
a corrupt entry is rebuilt with one warning, tied weights stay tied.

Every test uses its own cache root (AUTODEPLOY_CACHE under tmp_path) so that no state is shared
with other tests or the user's cache; the presets are linked in from the real cache root so they
are not written again.
"""

import json
import logging
import operator
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy.build_cache import key as cache_key
from autodeploy.build_cache import prune
from autodeploy.build_cache.graph_codec import Unserializable, decode_graph, decode_target, encode_graph
from autodeploy.build_cache.store import GRAPH_FILE, WEIGHTS_FILE, builds_dir
from autodeploy.build_cache.tensors import load_tensors, save_tensors
from autodeploy.cache.sequence_info import build_sequence_info
from autodeploy.config import load_deploy_config
from autodeploy.models.presets import preset_dir
from autodeploy.pipeline import build_graph, make_factory
from autodeploy.utils.paths import cache_root

SETTINGS = dict(max_seq_len=64, max_batch_size=2, max_num_tokens=64)


def _build(model: str = "tiny-llama", overrides=None, **settings):
    config = load_deploy_config([], overrides, model=model, build_cache=True, **{**SETTINGS, **settings})
    return build_graph(config, log_summary=False)


def _rebuilt_with_one_warning(build, caplog, says: str):
    """``build()`` after its entry was damaged: built anew, with one build-cache warning saying ``says``."""
    with caplog.at_level(logging.WARNING):
        rebuilt = build()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "build cache" in r.message]
    assert len(warnings) == 1 and says in warnings[0].message
    assert not rebuilt.from_cache
    return rebuilt


def _logits(result, tokens):
    info = build_sequence_info(tokens, [0] * len(tokens), [[i] for i in range(len(tokens))])
    with torch.no_grad():
        return result.graph(*result.cache.graph_args(info)).clone()


def _greedy(result, prompt, steps=4):
    """Greedy tokens through the paged KV cache: one prefill, then one-token decode steps."""
    out, tokens, pos = [], list(prompt), 0
    with torch.no_grad():
        for _ in range(steps):
            info = build_sequence_info([tokens], [pos], [[0]])
            logits = result.graph(*result.cache.graph_args(info))
            pos += len(tokens)
            tokens = [int(logits[0, -1].argmax())]
            out.append(tokens[0])
    return out


def _entries():
    return sorted(os.listdir(builds_dir())) if os.path.isdir(builds_dir()) else []


def _isolated_root(root) -> str:
    """A fresh cache root with the suite's presets linked in (materialised there once)."""
    for name in ("tiny-llama", "tiny-gemma"):
        preset_dir(name)
    root.mkdir()
    os.symlink(os.path.join(cache_root(), "presets"), root / "presets")
    return str(root)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """One cold build of tiny-llama in a module-wide cache root: its result and its entry."""
    root = _isolated_root(tmp_path_factory.mktemp("stored") / "adcache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTODEPLOY_CACHE", root)
        result = _build()
        assert not result.from_cache and len(_entries()) == 1
        return result, os.path.join(builds_dir(), _entries()[0])


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    root = _isolated_root(tmp_path / "adcache")
    monkeypatch.setenv("AUTODEPLOY_CACHE", root)
    return root


@pytest.fixture
def cold(stored, isolated_cache):
    """The stored build's result, and a copy of its entry in this test's own cache root."""
    result, entry = stored
    os.makedirs(builds_dir())
    shutil.copytree(entry, os.path.join(builds_dir(), os.path.basename(entry)))
    return result


def test_hit_loads_the_same_model(cold, caplog):
    prompts = [[1, 5, 7, 9, 11, 3], [4, 2]]
    expected_logits, expected_tokens = _logits(cold, prompts), _greedy(cold, [3, 1, 4, 1, 5])
    with caplog.at_level(logging.INFO, logger="autodeploy.build_cache"):
        hit = _build()
    assert hit.from_cache
    assert any("loaded the built graph" in r.message for r in caplog.records)
    assert torch.equal(_logits(hit, prompts), expected_logits)
    assert torch.equal(_logits(hit, [[7]]), _logits(cold, [[7]]))  # a second shape
    assert _greedy(hit, [3, 1, 4, 1, 5]) == expected_tokens
    # the caches were allocated again, not shared with the first build
    first = next(iter(cold.cache.caches.values()))
    assert all(t.data_ptr() != first.data_ptr() for t in hit.cache.caches.values())
    assert hit.cache.num_pages == cold.cache.num_pages and hit.context.cache_mode == cold.context.cache_mode
    assert len(_entries()) == 1


def test_miss_on_a_config_setting(cold):
    again = _build(max_seq_len=32)
    assert not again.from_cache and len(_entries()) == 2
    assert _build(max_seq_len=32).from_cache


@pytest.mark.slow
@pytest.mark.parametrize("what", ["source", "torch"])
def test_miss_on_autodeploy_source_or_torch_version(cold, monkeypatch, what):
    if what == "source":
        monkeypatch.setattr(cache_key, "source_hash", lambda: "a different autodeploy")
    else:
        monkeypatch.setattr(cache_key, "torch_version", lambda: torch.__version__ + ".other")
    again = _build()
    assert not again.from_cache and len(_entries()) == 2
    assert torch.equal(_logits(again, [[1, 2, 3]]), _logits(cold, [[1, 2, 3]]))


def test_key_changes_with_every_input(isolated_cache, tmp_path, monkeypatch):
    """The key over a copy of the checkpoint: a changed weight file content, config.json, the
    autodeploy source hash, the torch version, a deploy-config setting and the rank each change it."""
    model_dir = tmp_path / "model"
    shutil.copytree(preset_dir("tiny-llama"), model_dir)
    config = load_deploy_config([], model=str(model_dir), build_cache=True, **SETTINGS)

    def key(cfg=config, rank=0):
        return cache_key.build_key(cache_key.key_inputs(cfg, make_factory(cfg), 1, rank))

    base = key()
    assert key() == base  # deterministic
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    stat = os.stat(weights)
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime: the content must decide
    changed = {"weights": key()}
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (model_dir / "config.json").write_text(json.dumps(cfg))
    changed["config.json"] = key()
    changed["deploy config"] = key(config.model_copy(update={"page_size": 32}))
    changed["rank"] = key(rank=1)
    monkeypatch.setattr(cache_key, "source_hash", lambda: "other")
    changed["source"] = key()
    monkeypatch.setattr(cache_key, "torch_version", lambda: "0.0")
    changed["torch"] = key()
    seen = [base]
    for what, k in changed.items():
        assert k not in seen, f"the key did not change with {what}"
        seen.append(k)


@pytest.mark.slow
def test_miss_on_weight_file_content(isolated_cache, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(preset_dir("tiny-llama"), model_dir)
    first = _build(str(model_dir))
    assert not first.from_cache
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    again = _build(str(model_dir))
    assert not again.from_cache and len(_entries()) == 2
    assert not torch.equal(_logits(again, [[1, 2, 3]]), _logits(first, [[1, 2, 3]]))


@pytest.mark.parametrize("damage", ["truncate_weights", pytest.param("garble_graph", marks=pytest.mark.slow),
                                    pytest.param("missing_weights", marks=pytest.mark.slow)])
def test_corrupt_entry_is_rebuilt_with_one_warning(cold, caplog, damage):
    entry = os.path.join(builds_dir(), _entries()[0])
    if damage == "truncate_weights":
        path = os.path.join(entry, WEIGHTS_FILE)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif damage == "garble_graph":
        path = os.path.join(entry, GRAPH_FILE)
        record = json.loads(open(path).read())
        call = next(n for n in record["graph"] if n["op"] == "call_function")
        call["target"] = "torch.ops.aten.no_such_op.default"
        with open(path, "w") as f:
            f.write(json.dumps(record)[:-100])  # and cut short: not even JSON
    else:
        os.remove(os.path.join(entry, WEIGHTS_FILE))
    rebuilt = _rebuilt_with_one_warning(_build, caplog, "unusable")
    assert torch.equal(_logits(rebuilt, [[1, 5, 7, 9]]), _logits(cold, [[1, 5, 7, 9]]))
    assert _build().from_cache  # the rebuilt entry replaced the broken one


def test_a_graph_whose_generated_kernels_are_gone_is_rebuilt(isolated_cache, caplog):
    """A stored graph calls element-wise kernels generated into the kernel cache (here the norms'
    chains of a Llama whose norm patterns are off); with that cache cleaned the entry cannot run:
    it is rebuilt, kernels compiled again, with one warning, and the next build hits."""
    fused = {"transforms": {"match_rmsnorm_pattern": {"enabled": False}, "match_swiglu_pattern": {"enabled": False},
                            "mlir_elementwise_fusion": {"min_ops": 2}}}

    def build():
        return _build(overrides=fused)

    first = build()
    calls = [n for n in first.graph_module.graph.nodes if n.target is torch.ops.autodeploy.cpu_fused_elementwise.default]
    assert calls and all(n.args[1].startswith(os.path.join(isolated_cache, "kernels")) for n in calls)
    shutil.rmtree(os.path.join(isolated_cache, "kernels"))
    rebuilt = _rebuilt_with_one_warning(build, caplog, "generated kernel")
    assert torch.equal(_logits(rebuilt, [[1, 5, 7, 9]]), _logits(first, [[1, 5, 7, 9]]))
    assert build().from_cache


@pytest.mark.slow
def test_garbled_op_name_is_rebuilt(cold, caplog):
    """Valid JSON naming an operator that does not exist: the graph fails to rebuild."""
    path = os.path.join(builds_dir(), _entries()[0], GRAPH_FILE)
    record = json.loads(open(path).read())
    call = next(n for n in record["graph"] if n["op"] == "call_function")
    call["target"] = "torch.ops.aten.no_such_op.default"
    with open(path, "w") as f:
        json.dump(record, f)
    _rebuilt_with_one_warning(_build, caplog, "unusable")


def _embedding_and_head(result):
    """The tensors the token embedding (of ``input_ids``) and the LM head (the op producing the
    output) read."""
    gm = result.graph_module

    def value(node):
        owner, _, leaf = node.target.rpartition(".")
        return getattr(gm.get_submodule(owner) if owner else gm, leaf)

    embedding = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default
                     and getattr(n.args[1], "name", None) == "input_ids")
    head = list(gm.graph.nodes)[-1].args[0]
    head = head[0] if isinstance(head, (list, tuple)) else head
    weight = next(a for a in head.args if isinstance(a, torch.fx.Node) and a.op == "get_attr")
    return value(embedding.args[0]), value(weight)


def test_tied_weights_stay_tied(isolated_cache):
    cold = _build("tiny-gemma")
    hit = _build("tiny-gemma")
    assert not cold.from_cache and hit.from_cache
    embed, head = _embedding_and_head(cold)
    assert embed.data_ptr() == head.data_ptr()  # the preset's head is tied in the built graph
    embed, head = _embedding_and_head(hit)
    assert embed.data_ptr() == head.data_ptr() and embed.shape == head.shape
    assert torch.equal(_logits(hit, [[1, 2, 3, 4]]), _logits(cold, [[1, 2, 3, 4]]))
    assert _greedy(hit, [5, 6, 7]) == _greedy(cold, [5, 6, 7])


def test_tensor_store_keeps_aliasing_views_and_packed_weights(tmp_path):
    """Names of one tensor, a non-contiguous view and a slice of one storage come back as views of
    one storage with their strides; a oneDNN-packed weight is packed again (from the plain copy
    that holds its values, not stored twice)."""
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    plain = torch.randn(16, 8)
    tensors = {
        "a.weight": (torch.nn.Parameter(base, requires_grad=False), True),
        "b.weight": (base, False),  # the same memory under a second name
        "a.t": (base.t(), False),  # non-contiguous
        "a.rows": (base[2:4], False),  # an offset view
        "w_gemv": (plain, False),
        "w": (torch.ops.mkldnn._reorder_linear_weight(plain), False),
    }
    path = str(tmp_path / "w.safetensors")
    manifest = save_tensors(tensors, path)
    assert manifest["w"]["pack_from"] == "w_gemv"
    loaded = load_tensors(path, manifest)
    assert isinstance(loaded["a.weight"], torch.nn.Parameter) and not isinstance(loaded["b.weight"], torch.nn.Parameter)
    ptr = loaded["a.weight"].untyped_storage().data_ptr()
    assert all(loaded[n].untyped_storage().data_ptr() == ptr for n in ("b.weight", "a.t", "a.rows"))
    assert loaded["a.t"].stride() == base.t().stride() and torch.equal(loaded["a.t"], base.t())
    assert torch.equal(loaded["a.rows"], base[2:4]) and loaded["a.rows"].storage_offset() - loaded[
        "a.weight"].storage_offset() == 16
    loaded["b.weight"][0, 0] = -1.0  # one memory
    assert loaded["a.weight"][0, 0] == -1.0
    assert loaded["w"].is_mkldnn and torch.equal(loaded["w"].to_dense(), plain)
    x = torch.randn(3, 8)
    assert torch.equal(torch.ops.mkldnn._linear_pointwise(x, loaded["w"], None, "none", [], ""),
                       torch.ops.mkldnn._linear_pointwise(x, tensors["w"][0], None, "none", [], ""))
    # stored once: the four names of `base` share one span and the packed weight has no bytes of its own
    assert os.path.getsize(path) < 3 * 4096 + 4096


def test_graph_that_is_not_data_is_refused():
    """A call of an arbitrary Python function or a call_module node cannot be stored as data; an
    ordinary aten graph round-trips with its targets and arguments."""
    def custom(x):
        return x + 1

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.add.Tensor, (x, 2.5), {"alpha": 2})
    z = g.call_function(operator.getitem, ((y, y), 0))
    g.output((z, [y], {"k": torch.float16}))
    back = decode_graph(encode_graph(g))
    assert [(n.op, n.target, str(n.args), str(n.kwargs)) for n in back.nodes] == [
        (n.op, n.target, str(n.args), str(n.kwargs)) for n in g.nodes]
    g.call_function(custom, (x,))
    with pytest.raises(Unserializable, match="custom"):
        encode_graph(g)
    m = torch.fx.Graph()
    m.call_module("sub", (m.placeholder("x"),))
    with pytest.raises(Unserializable, match="call_module"):
        encode_graph(m)
    with pytest.raises(ValueError):
        decode_target("os.system")


def test_prune_removes_least_recently_used(tmp_path, monkeypatch):
    parent = tmp_path / "builds"
    for i, name in enumerate(["old", "mid", "new"]):
        (parent / name).mkdir(parents=True)
        (parent / name / WEIGHTS_FILE).write_bytes(b"\0" * (1 << 20))
        os.utime(parent / name, (1000 + i, 1000 + i))
    monkeypatch.setenv("AUTODEPLOY_BUILD_CACHE_MAX_GB", str(2.5 / 1024))  # room for two entries
    assert prune(str(parent), keep=str(parent / "old")) == 1
    assert sorted(os.listdir(parent)) == ["new", "old"]  # "mid" was the least recent one not kept
