"""``host_lists``: a step's metadata as Python lists, one device-to-host copy on an accelerator."""

import pytest
import torch

from autodeploy.ops.host_reads import host_lists, read_once


def _metadata(device: str):
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.tensor([2, 7, 1], **i32), torch.tensor([3, 4, 1], **i32), torch.tensor([0, 5, 9], **i32),
            torch.tensor([True, False, True], device=device))


def test_cpu_lists_keep_values_and_types():
    batch_info, seq_len, input_pos, carry = _metadata("cpu")
    info, lengths, starts, flags = host_lists(batch_info, seq_len, input_pos, carry)
    assert (info, lengths, starts, flags) == ([2, 7, 1], [3, 4, 1], [0, 5, 9], [True, False, True])
    assert all(type(f) is bool for f in flags)


def test_one_copy_path_splits_back_into_the_same_lists():
    """The accelerator path (one concatenated read), run on CPU tensors: each tensor's values in
    order, bools as bools, an empty tensor as an empty list."""
    tensors = (*_metadata("cpu"), torch.zeros(0, dtype=torch.int32))
    got = read_once(tensors)
    assert got == [t.tolist() for t in tensors]
    assert all(type(f) is bool for f in got[3]) and all(type(v) is int for v in got[0])


def test_rejects_non_vector_metadata():
    with pytest.raises(ValueError, match="1-d metadata"):
        host_lists(torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reads_once_and_equals_tolist():
    tensors = _metadata("cuda")
    expected = [t.tolist() for t in tensors]
    got = host_lists(*tensors)
    assert got == expected
    assert all(type(f) is bool for f in got[-1])
