"""select_linear_backend with ``gemv_dtype: float32`` and ``auto``: one-row steps read a plain
float32 copy of each oneDNN-packed weight through autodeploy's GEMV kernel (exact: float32
throughout), other row counts the packed weight; ``auto`` keeps the copies only when a build-time
measurement on the model's weights finds the kernel faster and memory allows."""

import pytest
import torch

from autodeploy.ops import native
from autodeploy.ops.linear import exact_linears
from autodeploy.transform.library import _gemv_auto as gemv_auto
from helpers import assert_same_outputs, count_op, rel_rmse
from test_select_linear_backend import ONEDNN, FusedSwiglu, MixedDtypes, TwoLinears, _run

ad = torch.ops.autodeploy
aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not native.available(), reason="autodeploy's CPU kernels cannot be built here")


def _copies(gm):
    return {n: t for n, t in gm.named_buffers() if n.endswith("_gemv")}


def _assert_dual(gm, reference, expected_duals):
    assert count_op(gm, ad.dual_linear) == expected_duals and count_op(gm, aten.linear) == 0
    copies = _copies(gm)
    assert len(copies) == expected_duals and all(t.dtype == torch.float32 and not t.is_mkldnn for t in copies.values())
    with torch.no_grad():
        # several rows: oneDNN over the packed weights, as without the option
        assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(7, 32),)])
        for x in (torch.randn(1, 1, 32), torch.randn(1, 32)):  # one row: the kernel, float32
            out, ref = gm(x), reference(x)
            assert out.shape == ref.shape and rel_rmse(out, ref) < 1e-6
            with exact_linears():  # exact already: the consistency check takes the same path
                assert torch.equal(gm(x), out)


def test_float32_copies_serve_one_row_through_the_kernel():
    module = TwoLinears()
    reference, gm, record = _run(module, gemv_dtype="float32")
    assert record.status == "ok" and record.num_matches == 2
    _assert_dual(gm, reference, 2)
    # the one-row answer is the kernel's own (not torch's linear on the copy)
    x = torch.randn(1, 32)
    a = gm.a.weight_gemv
    h = torch.relu(native.gemv(x, a, gm.a.bias))
    with torch.no_grad():
        assert torch.equal(gm(x), native.gemv(h, gm.b.weight_gemv))
        with native.disabled():  # without the kernels: torch's linear on the plain copy
            torch.testing.assert_close(gm(x), reference(x), rtol=1e-5, atol=1e-6)


def test_float32_copies_split_the_fused_mlp():
    reference, gm, record = _run(FusedSwiglu(), gemv_dtype="float32")
    assert record.num_matches == 2 and count_op(gm, ad.torch_fused_swiglu_mlp) == 0
    assert count_op(gm, ad.torch_silu_and_mul) == 1
    _assert_dual(gm, reference, 2)


def test_auto_leaves_small_models_alone():
    """Below gemv_auto_min_mib (the default 64 MiB; these weights are 8 KiB) nothing is measured
    or copied: the graph is the plain oneDNN one."""
    reference, gm, record = _run(TwoLinears())
    assert record.num_matches == 2 and count_op(gm, ONEDNN) == 2 and count_op(gm, ad.dual_linear) == 0
    assert not _copies(gm)


@pytest.mark.parametrize("kernel_ms, onednn_ms, kept", [(1.0, 2.0, True), (2.0, 1.0, False), (1.0, 1.02, False)])
def test_auto_keeps_the_copies_only_when_measured_faster(monkeypatch, kernel_ms, onednn_ms, kept):
    monkeypatch.setattr(gemv_auto, "measure", lambda gm: (kernel_ms, onednn_ms))
    reference, gm, record = _run(TwoLinears(), gemv_auto_min_mib=0)
    assert record.num_matches == 2
    if kept:
        _assert_dual(gm, reference, 2)
    else:  # undone: one packed weight per linear, no copy left behind
        assert count_op(gm, ad.dual_linear) == 0 and count_op(gm, ONEDNN) == 2 and not _copies(gm)
        assert all(t.is_mkldnn for n, t in gm.named_buffers() if n in ("a.weight", "b.weight"))
        with torch.no_grad():
            assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(1, 32),)])


def test_auto_measures_on_the_models_weights():
    _, gm, _ = _run(TwoLinears(), gemv_dtype="float32")
    kernel_ms, onednn_ms = gemv_auto.measure(gm)
    assert 0 < kernel_ms < 1e3 and 0 < onednn_ms < 1e3


def test_auto_declines_a_copy_that_would_not_fit(monkeypatch):
    monkeypatch.setattr(gemv_auto, "free_memory_bytes", lambda device: 8 * 1024)  # 8 KiB free
    monkeypatch.setattr(gemv_auto, "measure", lambda gm: pytest.fail("measured although memory rules it out"))
    decision = gemv_auto.precheck(copy_bytes=4 * 1024, min_bytes=0)
    assert decision is not None and not decision.use and "free memory" in decision.reason
    _, gm, _ = _run(TwoLinears(), gemv_auto_min_mib=0)
    assert count_op(gm, ad.dual_linear) == 0 and not _copies(gm)


def test_float32_copies_leave_other_dtypes_alone():
    """Near miss: a bfloat16 linear gets no copy (oneDNN packs it where the CPU has native bf16,
    torch's linear stays elsewhere); the float32 one beside it does."""
    reference, gm, record = _run(MixedDtypes(), gemv_dtype="float32")
    assert count_op(gm, ad.dual_linear) == 1 and count_op(gm, aten.linear) + count_op(gm, ONEDNN) == 1
    assert set(_copies(gm)) == {"a.weight_gemv"}
    with torch.no_grad():
        for x in (torch.randn(1, 32), torch.randn(3, 4, 32)):
            torch.testing.assert_close(gm(x), reference(x), rtol=1e-2, atol=1e-2)


def test_llama_through_llm_gives_hfs_greedy_tokens_with_the_kernel_at_batch_one():
    """The whole pipeline with float32 copies (forced: the tiny model is below auto's size):
    one-row decode steps run the kernel and the greedy tokens are HF eager's."""
    from autodeploy import LLM, SamplingParams
    from helpers import family_checkpoint, hf_model

    checkpoint = family_checkpoint("llama")
    llm = LLM(checkpoint, max_seq_len=64, max_batch_size=2, max_num_tokens=64,
              transforms={"select_linear_backend": {"gemv_dtype": "float32"}})
    assert count_op(llm.build.graph_module, ad.dual_linear) > 0
    prompt = [3, 17, 29, 41, 5]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=10, temperature=0.0,
                                                                      ignore_eos=True))[0]
    hf = hf_model(checkpoint)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
    assert out.outputs[0].token_ids == expected.tolist()


def test_copies_sit_in_one_huge_page_mapping_and_tied_weights_are_not_copied():
    from autodeploy.utils.hugepages import HUGE_PAGE, huge_page_copies

    tensors = [torch.randn(5, 7), torch.randn(3).half(), torch.randn(64, 33)]
    copies = huge_page_copies(tensors)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and b.is_contiguous() for a, b in zip(tensors, copies))
    assert copies[0].data_ptr() % HUGE_PAGE == 0 and all(c.data_ptr() % 4096 == 0 for c in copies)
    del tensors
    assert copies[2].sum().isfinite()  # the mapping lives as long as a copy does

    _, gm, _ = _run(TwoLinears(), gemv_dtype="float32")
    starts = sorted(t.data_ptr() for t in _copies(gm).values())
    assert starts[0] % HUGE_PAGE == 0 and starts[1] - starts[0] < HUGE_PAGE  # one mapping, side by side

    class TiedHead(torch.nn.Module):  # the head reads the embedding table: it stays unpacked
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 32)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.emb.weight) + self.emb(torch.zeros(1, dtype=torch.long)).sum()

    reference, gm, _ = _run(TiedHead(), gemv_dtype="float32")
    (copy,) = _copies(gm).values()
    assert copy.data_ptr() == gm.emb.weight.data_ptr()  # the "copy" is the shared table itself
    with torch.no_grad():
        for x in (torch.randn(1, 32), torch.randn(3, 4, 32)):
            torch.testing.assert_close(gm(x), reference(x), rtol=1e-5, atol=1e-5)


def _file_mappings(directory: str):
    """The address ranges this process maps from files under ``directory`` (Linux)."""
    import os

    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]).startswith(os.path.realpath(directory)):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
@pytest.mark.parametrize("gemv_dtype", ["float32", None])
def test_no_weight_is_left_in_the_checkpoints_mapping(gemv_dtype):
    """Loaded weights are views of the memory-mapped safetensors files; after packing, every
    tensor the graph keeps has its own memory (a view would keep the whole mapping resident),
    the GEMV copies included, which go straight to the huge-page arena."""
    from autodeploy.transform.interface import Stage
    from helpers import build, family_checkpoint

    checkpoint = family_checkpoint("llama")
    overrides = {"select_linear_backend": {"backend": "onednn", "gemv_dtype": gemv_dtype}}
    gm = build(checkpoint, up_to=Stage.POST_LOAD_FUSION, overrides=overrides).graph
    tensors = [t for t in list(gm.parameters()) + list(gm.buffers()) if not t.is_mkldnn]
    assert count_op(gm, ad.dual_linear if gemv_dtype else torch.ops.mkldnn._linear_pointwise) > 0
    assert len(_copies(gm)) == (count_op(gm, ad.dual_linear) if gemv_dtype else 0)
    ranges = _file_mappings(checkpoint)
    inside = [t.shape for t in tensors if any(lo <= t.data_ptr() < hi for lo, hi in ranges)]
    assert inside == []
