"""Prefix caching: a sequence starts from the cached pages of a prefix computed before.

The pool's rules by hand (match, sharing, eviction order, ids never reused, tail pages); the
scheduler under a random workload of shared prefixes and of requests going on from where an
earlier one ended (its tail page copied) with a small pool, checking with a simulated cache that
every position a step reads holds that position's token (so no page is ever read with another
prefix's contents, written while shared, or leaked), and with a simulated state cache that every
sequence resumes from the state of its own prefix; and the engine on the real tiny-llama preset
and tiny real checkpoints (Llama, Mamba2) against HF's greedy tokens.
"""

import random

import pytest
import torch

from autodeploy import LLM, InvalidRequestError, SamplingParams
from autodeploy.cache.interface import CachedSequenceInterface
from autodeploy.cache.resources import StateHandler
from autodeploy.runtime.page_pool import PagePool
from autodeploy.runtime.sampling_params import SamplingParams as Params
from autodeploy.runtime.scheduler import Scheduler
from autodeploy.runtime.sequence import Sequence
from autodeploy.runtime.state_snapshots import StateSnapshots
from helpers import coverage_checkpoint, hf_greedy_tokens

PS = 4  # tokens per page in the pool tests


def _computed(pool, tokens, pages, ids, salt=None):
    """A sequence that computed all of ``tokens`` into ``pages`` registers its full pages."""
    pool.register(tokens, pages, len(tokens), ids, salt)
    return ids


# ---- the pool --------------------------------------------------------------------------------
def test_match_takes_whole_cached_pages_and_leaves_a_token_to_compute():
    pool = PagePool(8, PS, prefix_caching=True)
    tokens = list(range(10))  # pages [0-3] [4-7] and two tokens of a third
    pages = pool.allocate(3)
    ids = _computed(pool, tokens, pages, [])
    assert len(ids) == 2  # full pages only
    assert pool.match(tokens + [99])[0] == pages[:2]
    assert pool.match(tokens[:9])[0] == pages[:2]
    assert pool.match(tokens[:8])[0] == pages[:1]  # 8 tokens: the second page would leave none to compute
    assert pool.match(tokens[:5] + [42, 6, 7, 8])[0] == pages[:1]  # differs inside the second page
    assert pool.match([42] + tokens[1:])[0] == []


def test_a_cache_salt_shares_pages_only_with_the_same_salt():
    """vLLM's ``cache_salt``: pages registered under a salt match only requests with that salt
    (no salt is its own group), at every depth."""
    pool = PagePool(16, PS, prefix_caching=True)
    tokens = list(range(10))
    held = {}
    for salt in (None, "tenant-a"):
        assert pool.match(tokens + [99], salt)[0] == []  # nothing under this salt yet
        held[salt] = pool.allocate(3)
        _computed(pool, tokens, held[salt], [], salt)
    for salt in (None, "tenant-a"):
        assert pool.match(tokens + [99], salt)[0] == held[salt][:2]
    assert held[None][:2] != held["tenant-a"][:2]
    assert pool.match(tokens + [99], "tenant-b")[0] == []


def test_shared_pages_are_freed_when_the_last_holder_lets_go_and_stay_cached():
    pool = PagePool(4, PS, prefix_caching=True)
    tokens = list(range(9))
    pages = pool.allocate(3)
    ids = _computed(pool, tokens, pages, [])
    shared, shared_ids = pool.match(tokens)
    assert shared == pages[:2] and shared_ids == ids
    assert pool.num_free == 1
    pool.free(pages)  # the first holder: its third page (no entry) is free again, the shared two held
    assert pool.num_free == 2 and pool.num_cached == 0
    pool.free(shared)
    assert pool.num_free == 4 and pool.num_cached == 2  # free to take, still matchable
    again, _ = pool.match(tokens)
    assert again == pages[:2] and pool.num_cached == 0
    pool.free(again)


def test_cached_pages_are_reused_tail_first_after_the_never_used_ones():
    pool = PagePool(4, PS, prefix_caching=True)
    tokens = list(range(13))
    pages = pool.allocate(4)
    _computed(pool, tokens, pages, [])  # three full pages with entries
    pool.free(pages)
    assert pool.num_free == 4 and pool.num_cached == 3
    (fresh,) = pool.allocate(1)
    assert fresh == pages[3]  # the page without an entry goes first
    (taken,) = pool.allocate(1)
    assert taken == pages[2]  # then the tail of the cached prefix
    assert pool.match(tokens)[0] == pages[:2]


def test_an_evicted_page_does_not_make_its_cached_child_match_behind_other_tokens():
    """Entries name the previous page's entry by an id that is never reused: after the first page
    of a prefix is evicted and refilled with other tokens, the old second page (still cached, its
    keys and values computed after the old first page) is not matched behind the new one."""
    pool = PagePool(4, PS, prefix_caching=True)
    a = list(range(9))
    p0, p1, p2 = pool.allocate(3)
    _computed(pool, a, [p0, p1, p2], [])
    pool.free([p0])
    pool.free([p1])  # reuse order of the cached pages: p0, then p1
    pool.free([p2])  # no entry: back on the free list
    fresh = pool.allocate(2)  # the never-used page and p2
    assert sorted(fresh) == sorted([p2, 3])
    (evicted,) = pool.allocate(1)
    assert evicted == p0 and pool.num_cached == 1  # p1 is still cached
    b = [100, 101, 102, 103] + a[4:8] + [7]  # another first page, then a's second page's tokens
    _computed(pool, b, [p0, p2, 3], [])
    matched, _ = pool.match(b)
    assert matched == [p0, p2] and p1 not in matched
    assert pool.match(a)[0] == []  # a's first page is gone: nothing of a matches
    pool.free(matched)
    pool.free([p0, p2, 3])
    assert pool.num_free == 4


def test_pages_computed_side_by_side_keep_one_entry():
    pool = PagePool(6, PS, prefix_caching=True)
    tokens = list(range(9))
    first, second = pool.allocate(3), pool.allocate(3)
    ids_first = _computed(pool, tokens, first, [])
    ids_second = _computed(pool, tokens, second, [])
    assert ids_first == ids_second  # the second sequence's pages take the first's ids
    pool.free(first)
    pool.free(second)
    assert pool.num_cached == 2 and pool.num_free == 6
    assert pool.match(tokens)[0] == first[:2]


def _ended(pool, tokens, num_computed, salt=None):
    """A sequence that computed ``num_computed`` of ``tokens`` and ends: its tail page is kept."""
    pages = pool.allocate(pool.pages_for(len(tokens)))
    ids = []
    pool.register(tokens, pages, num_computed, ids, salt)
    pool.keep_tail(tokens, pages, num_computed, ids, salt)
    pool.free(pages)
    return pages, ids


def test_a_tail_page_is_matched_by_a_sequence_going_on_from_it():
    pool = PagePool(16, PS, prefix_caching=True, tail_pages=True)
    tokens = list(range(11))  # pages [0-3] [4-7], and [8 9 10] computed in the third
    pages, _ = _ended(pool, tokens + [99], 11)  # its last token (99) was sampled, not computed
    assert pool.num_free == 16 and pool.num_cached == 2
    follow = tokens + [99, 5]
    held, ids = pool.match(follow)
    assert held == pages[:2] and pool.match_tail(follow, ids) == (pages[2], 3)
    assert pool.num_free == 13 and pool.num_tail_hits == 1  # the tail page is held until it is copied
    pool.free(held + [pages[2]])
    assert pool.num_free == 16
    assert pool.match_tail(tokens[:10] + [7, 7], ids) == (pages[2], 2)  # the tokens before the two part
    pool.free([pages[2]])
    assert pool.match_tail(tokens, ids) == (pages[2], 2)  # the same tokens again: all but the last one
    pool.free([pages[2]])
    assert pool.match_tail(tokens[:8] + [7, 7], ids) is None  # no first token in common
    assert pool.match_tail(tokens[:9] + [7, 7], ids) is None  # one: not worth a page copy (MIN_TAIL_TOKENS)
    _ended(pool, tokens[:9] + [42, 42], 9)  # a tail that a kept one starts with ([8]): not kept again
    other, _ = _ended(pool, tokens[:8] + [50, 51, 52], 11)  # another tail after the same pages
    assert pool.match_tail(tokens[:8] + [50, 51, 0, 1], ids) == (other[2], 2)  # the one sharing the most
    pool.free([other[2]])
    assert pool.num_free == 16 and pool.num_tail_hits == 4 and len(pool._tails[ids[-1]]) == 2


def test_a_first_page_tail_is_shared_only_under_its_salt():
    pool = PagePool(8, PS, prefix_caching=True, tail_pages=True)
    _ended(pool, [1, 2, 3], 3, "a")
    assert pool.match_tail([1, 2, 3, 4], [], "b") is None and pool.match_tail([1, 2, 3, 4], []) is None
    assert pool.match_tail([1, 2, 3, 4], [], "a")[1] == 3


def test_whole_tails_serve_only_all_their_tokens_and_only_with_a_kept_state():
    """State-cache models: a tail serves a sequence going on with every one of its tokens, and
    only while the caller says a copy of the state after them is kept (``usable``)."""
    pool = PagePool(16, PS, prefix_caching=True, tail_pages=True, whole_tails=True)
    tokens = list(range(11))  # pages [0-3] [4-7], and [8 9 10] computed in the third
    pages = pool.allocate(3)
    ids = []
    pool.register(tokens + [99], pages, 11, ids)
    tail = pool.keep_tail(tokens + [99], pages, 11, ids)
    assert tail is not None and tail not in ids
    pool.free(pages)
    kept = {tail}
    assert pool.match_tail(tokens + [99, 5], ids, usable=kept.__contains__) == (pages[2], 3)
    assert pool.tail_id(pages[2]) == tail
    pool.free([pages[2]])
    assert pool.match_tail(tokens + [99, 5], ids, usable=set().__contains__) is None  # its state is gone
    assert pool.match_tail(tokens + [99, 5], ids) is None  # nobody says it is kept
    assert pool.match_tail(tokens[:10] + [7, 7], ids, usable=kept.__contains__) is None  # 2 of its 3 tokens
    assert pool.match_tail(tokens, ids, usable=kept.__contains__) is None  # the last one would be computed
    # the same tokens ending again name the same tail (its state is the same); a shorter run is its own
    again = pool.allocate(3)
    pool.register(tokens + [99], again, 11, [])
    assert pool.keep_tail(tokens + [99], again, 11, list(ids)) == tail
    shorter = pool.keep_tail(tokens[:10], again, 10, list(ids))
    assert shorter not in (None, tail)
    pool.free(again)
    kept.add(shorter)
    assert pool.match_tail(tokens[:10] + [7, 7], ids, usable=kept.__contains__) == (again[2], 2)
    pool.free([again[2]])
    assert pool.num_free == 16 and pool.num_tail_hits == 2


def test_tail_pages_are_handed_out_before_cached_whole_pages():
    pool = PagePool(4, PS, prefix_caching=True, tail_pages=True)
    tokens = list(range(6))  # one whole page and a tail of 2
    pages, ids = _ended(pool, tokens, 6)
    assert pool.allocate(2) == [2, 3]  # the never-used pages first
    assert pool.allocate(1) == [pages[1]]  # then the tail page (its entry goes), not the whole one
    assert pool.match_tail(tokens + [7], ids) is None and pool.match(tokens + [7])[0] == pages[:1]
    assert not PagePool(8, PS, prefix_caching=False, tail_pages=True).tail_pages


# ---- the scheduler, simulated ------------------------------------------------------------------
class SimulatedCache:
    """What each page slot holds: the keys/values a step wrote there, named by what they depend
    on (the position and every token up to it)."""

    def __init__(self, num_pages, page_size):
        self.page_size = page_size
        self.slots = [[None] * page_size for _ in range(num_pages)]

    def write(self, seq, start, count):
        for pos in range(start, start + count):
            self.slots[seq.pages[pos // self.page_size]][pos % self.page_size] = tuple(seq.token_ids[:pos + 1])

    def check_reads(self, seq, upto):
        for pos in range(upto):
            held = self.slots[seq.pages[pos // self.page_size]][pos % self.page_size]
            assert held == tuple(seq.token_ids[:pos + 1]), f"{seq.request_id} reads {held} at position {pos}"


class SimulatedState:
    """A real state cache whose slot records the tokens its sequence ran through (row 0 the
    count, then the tokens), as an SSM state summarises them: a step reads the slot (it must hold
    exactly the sequence's computed tokens) and appends the step's tokens."""

    def __init__(self, max_batch_size, page_size, width=64):
        self.cache = CachedSequenceInterface(page_size=page_size, max_batch_size=max_batch_size, max_seq_len=width - 1,
                                             max_num_tokens=24)
        self.cache.add_cache("state", StateHandler((width,), torch.int64))
        self.cache.allocate(self.cache.min_pages)

    def run(self, seq, n):
        row = self.cache.caches["state"][seq.slot]
        if seq.num_computed == 0:  # use_initial_state False: starts from zeros
            row.zero_()
        count = int(row[0])
        assert row[1:count + 1].tolist() == seq.token_ids[:seq.num_computed], \
            f"{seq.request_id} resumes from another state at {seq.num_computed}"
        row[count + 1:count + 1 + n] = torch.tensor(seq.token_ids[seq.num_computed:seq.num_computed + n])
        row[0] = count + n


def _run_workload(seed, num_pages, prefix_caching=True, steps_limit=3000, snapshots=None, tail_pages=True):
    rng = random.Random(seed)
    page_size = 4
    pool = PagePool(num_pages, page_size, prefix_caching=prefix_caching, tail_pages=tail_pages,
                    whole_tails=snapshots is not None)
    state = SimulatedState(4, page_size) if snapshots is not None else None
    store = StateSnapshots(state.cache, snapshots) if state is not None else None
    sched = Scheduler(pool, max_batch_size=4, max_num_tokens=24, snapshots=store)
    cache = SimulatedCache(num_pages, page_size)
    heads = [[rng.randrange(50) for _ in range(rng.choice([5, 8, 13]))] for _ in range(3)]
    heads.append([50, 51, 52, 53] + heads[0][4:])  # another first page, then the same pages as heads[0]
    arrival = 0
    for i in range(24):
        prompt = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(0, 7))]
        for choice in range(rng.choice([1, 1, 2, 3])):  # requests with n > 1: choices of one prompt
            sched.add(Sequence(f"r{i}", choice, prompt, Params(max_tokens=rng.randrange(1, 9), temperature=0), arrival))
            arrival += 1
    steps = 0
    while sched.has_work():
        steps += 1
        assert steps < steps_limit
        step = sched.schedule()
        writing = {}
        for seq, n in step.sequences:
            first_page, last_page = seq.num_computed // page_size, (seq.num_computed + n - 1) // page_size
            for page in seq.pages[first_page:last_page + 1]:
                writing.setdefault(page, []).append(seq.request_id)
        holders = {}
        for seq in sched.running:
            for page in seq.pages:
                holders.setdefault(page, set()).add(seq.request_id)
        for page, writers in writing.items():
            assert len(writers) == 1 and holders[page] == set(writers), f"page {page} written while shared"
        for src, dst in step.page_copies:  # what the model runner does first
            assert sum(dst in s.pages for s in sched.running) == 1  # a page of the copying sequence's own
            cache.slots[dst] = list(cache.slots[src])
        for seq, n in step.sequences:
            cache.write(seq, seq.num_computed, n)
        for seq, n in step.sequences:
            cache.check_reads(seq, seq.num_computed + n)
            if state is not None:
                state.run(seq, n)
        sched.mark_computed(step)
        for seq, n in step.sequences:
            if seq.remaining == 0:
                # what it generates and what follows it depend on it alone, not on the schedule
                own = random.Random(f"{seed}-{seq.request_id}-{seq.index}-{seq.num_tokens}")
                seq.append_token(own.randrange(50))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.finish_reason = "length"
                    sched.finish(seq)
                    # the next turn: all it had, and maybe more (as a beam search's next step), within the pool
                    follow = seq.token_ids + [own.randrange(50) for _ in range(own.randrange(0, 4))]
                    max_tokens = own.randrange(1, 5)
                    if own.random() < 0.5 and len(follow) + max_tokens <= 28:
                        sched.add(Sequence(f"{seq.request_id}.{seq.index}", 0, follow,
                                           Params(max_tokens=max_tokens, temperature=0), arrival))
                        arrival += 1
    assert pool.num_free == num_pages
    return sched


@pytest.mark.parametrize("seed", range(6))
def test_random_shared_prefixes_read_only_their_own_tokens(seed):
    roomy = _run_workload(seed, num_pages=128)  # room for tail pages to wait for their next turn
    assert roomy.prefix_hit_tokens > _run_workload(seed, num_pages=128, tail_pages=False).prefix_hit_tokens > 0
    assert roomy.pool.num_tail_hits > 0
    tight = _run_workload(seed, num_pages=8)  # eviction and preemption
    assert tight.num_preemptions > 0 or tight.prefix_hit_tokens > 0


@pytest.mark.parametrize("seed", range(6))
def test_state_models_resume_only_from_a_copy_of_the_state_after_their_prefix(seed):
    """With state caches a sequence resumes only after a page whose state was copied, and its
    slot then holds exactly the state of its own prefix (``SimulatedState`` checks every step)."""
    roomy = _run_workload(seed, num_pages=64, snapshots=8)
    assert roomy.prefix_hit_tokens > 0 and roomy.snapshots.num_restored > 0
    assert roomy.prefix_hit_tokens <= _run_workload(seed, num_pages=64).prefix_hit_tokens
    # with spare copies, next turns resume from whole tails (the state after all their tokens,
    # copied when the turn ended); 8 copies are all taken by page copies, so no tail is kept there
    spare = _run_workload(seed, num_pages=128, snapshots=64)
    assert spare.pool.num_tail_hits > 0
    assert spare.prefix_hit_tokens > _run_workload(seed, num_pages=128, snapshots=64, tail_pages=False).prefix_hit_tokens
    assert roomy.pool.num_tail_hits == 0
    one = _run_workload(seed, num_pages=8, snapshots=1)  # eviction of pages, of copies and preemption
    assert one.snapshots.num_saved > 0 and len(one.snapshots) == 1


def test_snapshots_are_kept_by_entry_id_and_the_least_recent_goes_first():
    state = SimulatedState(2, 4)
    slots = state.cache.caches["state"]
    store = StateSnapshots(state.cache, 2)
    assert store.nbytes == 2 * 64 * 8 and store.deepest([3, 4]) == 0
    for entry, value in ((10, 1), (11, 2)):
        slots[0].fill_(value)
        store.save(entry, 0)
    assert store.deepest([10, 11, 12]) == 2 and store.deepest([10, 12]) == 1
    store.restore(10, 1)  # 10 is now the most recently used
    assert slots[1].eq(1).all()
    slots[0].fill_(3)
    store.save(12, 0)  # full: 11 goes
    assert 11 not in store and 10 in store and 12 in store
    store.save(10, 2)  # already kept: not copied again
    store.restore(10, 0)
    assert slots[0].eq(1).all() and store.num_saved == 3 and store.num_restored == 2


def test_tail_copies_take_spare_rows_only():
    """A copy at the end of a sequence never pushes out a page-boundary copy, and goes first."""
    state = SimulatedState(1, 4)
    store = StateSnapshots(state.cache, 3)
    store.save(10, 0)
    store.save(20, 0, tail=True)  # a spare row
    store.save(11, 0)
    store.save(21, 0, tail=True)  # full: the least recently used tail copy makes room
    assert 20 not in store and {10, 11, 21} <= set(store.entry_ids())
    store.save(12, 0)  # a page copy replaces the tail copy first, though 10 is older
    assert 21 not in store and set(store.entry_ids()) == {10, 11, 12}
    store.save(22, 0, tail=True)  # no tail copy to replace: left out
    assert 22 not in store and set(store.entry_ids()) == {10, 11, 12} and store.num_saved == 5
    store.save(13, 0)  # with no tail copies, the least recently used copy goes
    assert set(store.entry_ids()) == {11, 12, 13}
    # an end copy wanted at a page boundary later (a prompt parted there) is kept like a page copy
    store = StateSnapshots(state.cache, 2)
    store.save(30, 0, tail=True)
    store.save(31, 0)
    store.save(30, 0)
    store.save(32, 0)  # no tail copy left: the least recently used, 31, goes
    assert set(store.entry_ids()) == {30, 32}


def test_without_prefix_caching_nothing_is_matched():
    sched = _run_workload(0, num_pages=64, prefix_caching=False)
    assert sched.prefix_hit_tokens == 0 and sched.prefix_query_tokens == 0


# ---- the engine --------------------------------------------------------------------------------
SYSTEM = "You are a helpful assistant. Answer in one short sentence, and never use lists. "
QUESTIONS = ["What is a class?", "Why are exceptions raised?", "What does the for statement do?"]


@pytest.fixture(scope="module")
def engines():
    base = dict(max_seq_len=128, max_batch_size=4, max_num_tokens=64, page_size=4)
    return LLM("tiny-llama", **base), LLM("tiny-llama", **base, enable_prefix_caching=False)


def _greedy(new_tokens=12, **kw):
    return SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, **kw)


def test_requests_sharing_a_system_prompt_give_the_tokens_computed_without_it(engines):
    cached, plain = engines
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = [o.token_ids for o in plain.generate(prompts, _greedy())]
    eng = cached.engine
    hits_before = eng.scheduler.prefix_hit_tokens
    first = cached.generate(prompts[:1], _greedy())[0].token_ids  # computes and caches the prefix
    rest = [o.token_ids for o in cached.generate(prompts[1:], _greedy())]
    assert [first] + rest == expected
    system_pages = len(cached.tokenizer(SYSTEM)["input_ids"]) // 4
    # the later two each start from at least the system prompt's whole pages
    assert eng.scheduler.prefix_hit_tokens - hits_before >= 2 * (system_pages - 1) * 4
    assert plain.engine.scheduler.prefix_hit_tokens == 0
    # the same prompt again: everything but its last page's tokens comes from the cache
    again = cached.generate(prompts[:1], _greedy())[0].token_ids
    assert again == expected[0]
    assert 0 < cached.engine.prefix_cache_hit_rate < 1


@pytest.mark.parametrize("cut, extra", [(0, 0), (0, 3), (2, 2)])
def test_a_request_going_on_from_an_ended_one_starts_from_a_copy_of_its_tail_page(engines, cut, extra):
    """A beam search's next step (the whole history), the next turn (``extra`` more tokens) or a
    request that parts from the ended one inside its last page (``cut`` of its tokens dropped):
    every token the two share and the ended one computed comes from the cache, its partly filled
    last page copied; tokens and log-probabilities equal the engine without prefix caching."""
    cached, plain = engines
    prompt = SYSTEM + f"(turn {cut} {extra}) " + QUESTIONS[0]  # a prompt no other test sends
    num_prompt = len(cached.tokenizer(prompt)["input_ids"])
    # the ended one's computed tokens fill 3 of its last page's 4 (so that 2 dropped part inside it)
    n = next(k for k in (9, 10, 11, 12) if (num_prompt + k - 1) % 4 == 3)
    first = cached.generate([prompt], _greedy(n))[0]
    kept = first.token_ids[:len(first.token_ids) - cut]
    follow = {"prompt_token_ids": first.prompt_token_ids + kept + list(range(100, 100 + extra))}
    pool, sched = cached.engine.pool, cached.engine.scheduler
    tails, hits = pool.num_tail_hits, sched.prefix_hit_tokens
    (ours,) = cached.generate([follow], _greedy(8, logprobs=1))
    (ref,) = plain.generate([follow], _greedy(8, logprobs=1))
    assert pool.num_tail_hits == tails + 1
    assert sched.prefix_hit_tokens - hits == num_prompt + min(len(kept), n - 1)  # shared and computed
    assert ours.token_ids == ref.token_ids
    for a, b in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("num_pages", [40, 26])
def test_conversations_in_a_small_pool_give_the_tokens_computed_without_prefix_caching(engines, num_pages):
    """Turns that go on from earlier answers, sent in batches to a pool of few pages of 4 tokens:
    with 40 pages tail pages are matched, with 26 the tails are handed out again first and
    decoding sequences preempted and recomputed. Every answer equals the engine without prefix
    caching."""
    _, plain = engines
    small = LLM("tiny-llama", max_seq_len=96, max_batch_size=4, max_num_tokens=64, page_size=4,
                transforms={"initialize_cache": {"num_pages": num_pages}})
    rng = random.Random(0)
    histories = [small.tokenizer(SYSTEM + q)["input_ids"] for q in QUESTIONS] + [[1, 5, 9, 13, 17]]
    for _ in range(3):
        prompts = [{"prompt_token_ids": h} for h in histories]
        params = _greedy(rng.randint(3, 9))
        ours, ref = small.generate(prompts, params), plain.generate(prompts, params)
        assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
        # the next turn: the answer so far (sometimes cut inside its last page) and a few new tokens
        histories = [h + o.token_ids[:len(o.token_ids) - rng.randint(0, 2)] + [rng.randrange(3, 500)
                                                                               for _ in range(rng.randint(0, 3))]
                     for h, o in zip(histories, ours)]
    if num_pages == 40:
        assert small.engine.pool.num_tail_hits > 0
    else:
        assert small.engine.num_preemptions > 0


def test_a_one_token_rest_after_cached_pages_runs_beside_new_prompts(engines):
    """A prompt cached up to its last token computes a one-token chunk after the start, which the
    cached graph reads as a decode: it goes after the other prefills of its step (before the fix
    such a step failed: "prefill sequences must come before decode sequences")."""
    cached, plain = engines
    base = [(7 * i) % 500 + 3 for i in range(12)]  # three pages
    cached.generate([{"prompt_token_ids": base + [11]}], _greedy(2))  # caches the three pages
    prompts = [{"prompt_token_ids": base + [12]}, {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 2, 1, 9]}]
    hits = cached.engine.scheduler.prefix_hit_tokens
    got = [o.token_ids for o in cached.generate(prompts, _greedy())]
    assert cached.engine.scheduler.prefix_hit_tokens - hits == 12
    assert got == [o.token_ids for o in plain.generate(prompts, _greedy())]


def test_requests_share_cached_prefixes_only_under_the_same_cache_salt(engines):
    cached, plain = engines
    prompt = SYSTEM + QUESTIONS[1] + " (salted)"
    expected = plain.generate([prompt], _greedy())[0].token_ids
    sched = cached.engine.scheduler
    cached.generate([prompt], _greedy())  # cached without a salt
    for salt, shares in (("tenant-a", False), ("tenant-a", True), ("tenant-b", False)):
        before = sched.prefix_hit_tokens
        out = cached.generate([{"prompt": prompt, "cache_salt": salt}], _greedy())[0]
        assert out.token_ids == expected
        assert (sched.prefix_hit_tokens > before) == shares, salt
    with pytest.raises(InvalidRequestError, match="cache_salt must be a non-empty string"):
        cached.generate([{"prompt": prompt, "cache_salt": ""}], _greedy())


def test_prompt_logprobs_and_n_with_a_cached_prefix(engines):
    cached, plain = engines
    prompt = SYSTEM + QUESTIONS[0]
    cached.generate([prompt], _greedy())  # the prefix is cached now
    params = _greedy(6, prompt_logprobs=1, n=2)
    got, want = cached.generate([prompt], params)[0], plain.generate([prompt], params)[0]
    # prompt logprobs need every prompt position: that sequence computes them all
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(got.prompt_token_ids)
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


def test_choices_of_one_request_compute_the_prompt_once(engines):
    cached, plain = engines
    prompt = "Three answers, each its own: " + QUESTIONS[2] + " Explain the loop and its else clause."  # cached by no other test
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3, ignore_eos=True)
    before = cached.engine.scheduler.prefix_hit_tokens
    got = cached.generate([prompt], params)[0]
    want = plain.generate([prompt], params)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    shared = (len(got.prompt_token_ids) - 1) // 4 * 4
    # the second and third choice waited for the first one's prompt pages and read them
    assert cached.engine.scheduler.prefix_hit_tokens - before == 2 * shared


@pytest.mark.parametrize("model", ["mamba2", "lfm2"])
def test_a_state_models_next_turn_resumes_from_the_last_ones_final_state(model):
    """Mamba2 (state caches only) and LFM2 (a short convolution beside attention): a turn going on
    from everything the last one computed starts from its whole tail (its last page copied, the
    state after its last computed token restored): every one of those tokens is a hit, and the
    tokens and logprobs equal the engine's without prefix caching. A turn that goes on from fewer
    of them cannot rewind the copied state: it computes again from the last page with a copy (here
    none) and leaves one there, where the next such turn resumes."""
    path, vocab = coverage_checkpoint(model)
    base = dict(dtype="float32", max_seq_len=64, max_batch_size=4, page_size=4, max_num_tokens=64)
    cached, plain = LLM(path, **base), LLM(path, **base, prefix_state_snapshots=0)
    rng = random.Random(1)
    first = [rng.randrange(3, vocab) for _ in range(21)]
    params = _greedy(6, logprobs=2)
    turn = cached.generate([{"prompt_token_ids": first}], params)[0]
    computed = first + list(turn.token_ids[:-1])  # 26: six whole pages and a tail of 2
    sched, store = cached.engine.scheduler, cached.engine.snapshots
    cases = [(first + list(turn.token_ids) + [7, 8, 9], len(computed), 1),  # the next turn
             (computed[:-1] + [11, 12], 0, 0),  # parts inside the tail: no copy at its last page yet
             (computed[:-1] + [13, 14], 24, 0)]  # the copy the last one left where they parted
    for prompt, hits, tail_hits in cases:
        before, tails_before = sched.prefix_hit_tokens, cached.engine.pool.num_tail_hits
        got = cached.generate([{"prompt_token_ids": prompt}], params)[0]
        want = plain.generate([{"prompt_token_ids": prompt}], params)[0]
        assert got.token_ids == want.token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
        assert sched.prefix_hit_tokens - before == hits
        assert cached.engine.pool.num_tail_hits - tails_before == tail_hits
    assert store.num_restored == 2


def test_matches_hf_greedy_on_a_real_checkpoint():
    path, vocab = coverage_checkpoint("llama")
    llm = LLM(path, dtype="float32", max_seq_len=128, max_batch_size=4, page_size=4)
    rng = random.Random(0)
    head = [rng.randrange(3, vocab) for _ in range(21)]
    prompts = [head + [rng.randrange(3, vocab) for _ in range(k)] for k in (1, 3, 6)]
    outs = [llm.generate([{"prompt_token_ids": p}], _greedy(8))[0].token_ids for p in prompts]  # one by one
    assert llm.engine.scheduler.prefix_hit_tokens >= 2 * 20
    assert outs == hf_greedy_tokens(path, prompts, 8)


def test_state_models_resume_from_state_snapshots_with_hf_tokens():
    """Mamba2 (a state cache per layer, no attention): the second prompt sharing a head computes it
    again and leaves a copy of the state where they part; later ones start from it. Tokens equal
    HF's greedy ones, and the choices of an ``n > 1`` request start from the prompt's last page
    with the tokens the engine without prefix caching samples."""
    path, vocab = coverage_checkpoint("mamba2")
    base = dict(dtype="float32", max_seq_len=64, max_batch_size=4, page_size=4, max_num_tokens=64)
    llm = LLM(path, **base)
    assert llm.engine.pool.prefix_caching and llm.engine.snapshots.capacity == 4  # min(16, max_batch_size)
    rng = random.Random(0)
    head = [rng.randrange(3, vocab) for _ in range(22)]
    prompts = [head + [rng.randrange(3, vocab) for _ in range(k)] for k in (1, 3, 6, 2)]
    outs = [llm.generate([{"prompt_token_ids": p}], _greedy(6))[0].token_ids for p in prompts]  # one by one
    sched, store = llm.engine.scheduler, llm.engine.snapshots
    # copies: where the prompts part, and each sequence's final state (28 computed tokens: after its
    # last page; 30, 33, 29: under its whole tail, in spare rows)
    assert (sched.prefix_hit_tokens, store.num_saved, store.num_restored) == (2 * 20, 1 + 4, 2)
    assert outs == hf_greedy_tokens(path, prompts, 6)

    plain = LLM(path, **base, prefix_state_snapshots=0)
    assert not plain.engine.pool.prefix_caching and plain.engine.snapshots is None
    prompt = [5 + i % 11 for i in range(14)]
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, n=3, ignore_eos=True)
    before = sched.prefix_hit_tokens
    got = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    want = plain.generate([{"prompt_token_ids": prompt}], params)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert sched.prefix_hit_tokens - before == 2 * 12  # two choices from the copy after 3 whole pages
