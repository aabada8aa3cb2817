"""Per-sequence state slots (issue 14's cache interface): the step metadata carries each
sequence's slot and whether it continues from its stored state; state caches are sized per slot,
not per page, and follow the batch size."""

import pytest
import torch

from autodeploy.cache.interface import CachedSequenceInterface
from autodeploy.cache.resources import PagedKVHandler, StateHandler
from autodeploy.cache.sequence_info import METADATA_NAMES, build_sequence_info


def _cache(max_batch_size=4):
    cache = CachedSequenceInterface(page_size=4, max_batch_size=max_batch_size, max_seq_len=16, max_num_tokens=32)
    cache.add_cache("k_cache_0", PagedKVHandler(2, 8, torch.float32))
    cache.add_cache("ssm_state_0", StateHandler((3, 5, 7), torch.float32))
    cache.add_cache("conv_state_0", StateHandler((6, 3), torch.bfloat16))
    return cache


def test_metadata_has_slots_and_initial_state_flags():
    info = build_sequence_info([[1, 2, 3], [4, 5], [6]], [0, 5, 9], [[0], [1, 2], [3, 4, 5]], slots=[2, 0, 3])
    assert METADATA_NAMES[-3:] == ("slot_idx", "use_initial_state", "logits_index")
    assert info.slot_idx.tolist() == [2, 0, 3] and info.slot_idx.dtype == torch.int32
    # a first chunk starts from zeros; a later chunk and a decode continue
    assert info.use_initial_state.tolist() == [False, True, True]
    assert list(info.as_inputs())[-3:] == ["slot_idx", "use_initial_state", "logits_index"]
    with pytest.raises(ValueError, match="2 state slots for 3 sequences"):
        build_sequence_info([[1], [2], [3]], [0, 0, 0], [[0], [1], [2]], slots=[0, 1])


def test_state_caches_are_per_slot_not_per_page():
    cache = _cache()
    assert cache.paged_names == ["k_cache_0"] and cache.state_names == ["ssm_state_0", "conv_state_0"]
    assert cache.bytes_per_page() == 4 * 2 * 8 * 4  # only the paged cache
    cache.allocate(10)
    assert cache.caches["k_cache_0"].shape == (10, 4, 2, 8)
    assert cache.caches["ssm_state_0"].shape == (5, 3, 5, 7)  # max_batch_size + 1 slots
    assert cache.caches["conv_state_0"].dtype == torch.bfloat16
    assert cache.num_slots == 5 and cache.spare_slot == 4
    assert cache.state_bytes() == 5 * (3 * 5 * 7 * 4 + 6 * 3 * 2)
    assert cache.paged_bytes() == 10 * 4 * 2 * 8 * 4
    assert cache.cache_bytes() == cache.paged_bytes() + cache.state_bytes()
    # graph inputs: metadata by name, caches in registration order
    assert cache.input_names[-3:] == ["k_cache_0", "ssm_state_0", "conv_state_0"]
    assert cache.input_index("slot_idx") == 2 + METADATA_NAMES.index("slot_idx")


def test_state_caches_follow_the_batch_size_chosen_after_allocation():
    cache = _cache(max_batch_size=4)
    cache.allocate(10)
    pages = cache.caches["k_cache_0"]
    cache.max_batch_size = 9
    assert cache.caches["ssm_state_0"].shape[0] == 10 and cache.caches["conv_state_0"].shape[0] == 10
    assert cache.caches["k_cache_0"] is pages  # the page pool is not touched


@pytest.mark.parametrize("snapshots", [None, 0, 3, 16])
def test_batch_for_states_is_the_largest_batch_whose_slots_spare_and_copies_fit(snapshots):
    from autodeploy.cache.limits import batch_for_states, snapshot_capacity

    def needed(batch):
        return batch + 1 + snapshot_capacity(snapshots, batch)

    for num_states in range(1, 80):
        batch = batch_for_states(num_states, snapshots)
        if needed(1) > num_states:
            assert batch == 1  # nothing fits: one sequence at least (the pool's own checks decide)
            continue
        assert needed(batch) <= num_states < needed(batch + 1), num_states
