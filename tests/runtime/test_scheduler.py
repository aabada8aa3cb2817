"""Scheduler + PagePool + Sequence driven by hand (no model): the engine's loop is simulated."""

import random

import pytest

from autodeploy.runtime.page_pool import PagePool
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.scheduler import Scheduler
from autodeploy.runtime.sequence import Sequence


def make_seq(arrival, prompt_len, max_tokens, priority=0):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Sequence(f"r{arrival}", 0, list(range(1, prompt_len + 1)), params, arrival, priority=priority)


def pages_for(num_tokens, page_size):
    return -(-num_tokens // page_size)


class Driver:
    """Runs the scheduler like the engine does, checking its invariants at every step."""

    def __init__(self, *, num_pages, page_size, max_batch_size, max_num_tokens, chunked_prefill=True, policy="fcfs"):
        self.pool = PagePool(num_pages, page_size)
        self.sched = Scheduler(self.pool, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                               chunked_prefill=chunked_prefill, policy=policy)
        self.steps = []  # per step: list of (seq, n, kind, pages held when scheduled)
        self.preempted = []  # per step: the sequences preempted in it, youngest first
        self.finished = []

    def add(self, seq):
        self.sched.add(seq)

    def step(self):
        sched, pool = self.sched, self.pool
        running_before = list(sched.running)
        preemptions_before = sched.num_preemptions
        step = sched.schedule()
        assert step is not None, "work is left but nothing was scheduled"

        # ---- invariants of the schedule ----
        assert step.num_tokens <= sched.max_num_tokens
        assert len(step.sequences) <= sched.max_batch_size
        assert len(sched.running) <= sched.max_batch_size
        assert all(not s.is_decode for s, _ in step.prefill)
        assert all(s.is_decode for s in step.decode)
        order = [s for s, _ in step.sequences]
        assert order == [s for s, _ in step.prefill] + step.decode  # prefill first, then decode
        # the graph's layout: what it reads as a decode (one token after the start) comes last
        as_decode = [n == 1 and s.num_computed > 0 for s, n in step.sequences]
        assert as_decode == sorted(as_decode), as_decode
        assert len(set(map(id, order))) == len(order)  # no sequence twice
        for seq, n in step.sequences:
            assert seq in sched.running
            assert 1 <= n <= seq.remaining
            assert len(seq.pages) == pages_for(seq.num_computed + n, pool.page_size)
        scheduled = {id(s) for s in order}
        for seq in sched.running:
            if id(seq) not in scheduled:
                assert len(seq.pages) == pages_for(seq.num_computed, pool.page_size)
        for seq in sched.waiting:
            assert seq.pages == []
        held = [p for s in sched.running for p in s.pages]
        assert len(held) == len(set(held))  # no page given twice
        # state slots: one per running sequence, distinct, never the spare (max_batch_size)
        slots = [s.slot for s in sched.running]
        assert all(slot is not None and 0 <= slot < sched.max_batch_size for slot in slots), slots
        assert len(set(slots)) == len(slots)
        assert all(s.slot is None for s in sched.waiting)
        assert len(slots) + len(sched.free_slots) == sched.max_batch_size
        assert len(held) + pool.num_free == pool.num_pages

        # ---- preemption: the youngest (priority policy: least urgent, then youngest) running
        # sequences, freed and queued at the front ----
        victims = [s for s in running_before if s not in sched.running]
        assert sched.num_preemptions - preemptions_before == len(victims)
        if victims:
            urgency = (lambda s: (s.priority, s.arrival)) if sched.policy == "priority" else (lambda s: s.arrival)
            youngest = sorted(running_before, key=urgency, reverse=True)[: len(victims)]
            assert {id(s) for s in victims} == {id(s) for s in youngest}
            assert {id(s) for s in list(sched.waiting)[: len(victims)]} == {id(s) for s in victims}
            for s in victims:
                assert s.num_computed == 0 and s.pages == [] and id(s) not in scheduled
        self.preempted.append(victims)

        # ---- the engine's part: compute, sample, finish ----
        record = []
        for seq, n in step.sequences:
            record.append((seq, n, "decode" if seq in step.decode else "prefill", len(seq.pages)))
            seq.num_computed += n
            if seq.remaining == 0:
                seq.append_token(7)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish_reason = "length"
                    sched.finish(seq)
                    assert seq.pages == [] and seq.slot is None
                    self.finished.append(seq)
        self.steps.append(record)
        return step

    def run(self, max_steps=1000):
        while self.sched.has_work():
            assert len(self.steps) < max_steps, "the scheduler does not make progress"
            self.step()
        assert self.pool.num_free == self.pool.num_pages  # no page leaked
        assert sorted(self.sched.free_slots) == list(range(self.sched.max_batch_size))  # no slot leaked
        assert not self.sched.running and not self.sched.waiting


def test_single_sequence_prefill_then_decode_pages_track_tokens():
    d = Driver(num_pages=8, page_size=4, max_batch_size=2, max_num_tokens=32)
    seq = make_seq(0, prompt_len=6, max_tokens=5)
    d.add(seq)
    step = d.step()
    assert [(s, n) for s, n in step.prefill] == [(seq, 6)] and step.decode == []
    assert len(seq.pages) == 2 and seq.output_token_ids == [7]
    sizes = []
    while d.sched.has_work():
        step = d.step()
        assert step.prefill == [] and step.decode == [seq]
        sizes.append(d.steps[-1][0][3])
    # decode steps put tokens 7..10 into the cache: 7, 8 -> 2 pages, 9, 10 -> 3 pages
    assert sizes == [2, 2, 3, 3]
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 5
    assert d.pool.num_free == 8


def test_decodes_come_after_prefills_in_a_mixed_step():
    d = Driver(num_pages=32, page_size=4, max_batch_size=4, max_num_tokens=64)
    a = make_seq(0, 5, 10)
    d.add(a)
    d.step()  # a prefilled
    b = make_seq(1, 9, 10)
    d.add(b)
    step = d.step()
    assert [s for s, _ in step.sequences] == [b, a]
    assert step.prefill == [(b, 9)] and step.decode == [a]
    d.run()


def test_token_budget_and_batch_size_are_never_exceeded():
    rng = random.Random(0)
    d = Driver(num_pages=200, page_size=4, max_batch_size=3, max_num_tokens=10)
    for i in range(12):
        d.add(make_seq(i, rng.randint(1, 25), rng.randint(1, 8)))
    max_running = 0
    while d.sched.has_work():
        decoders = [s for s in d.sched.running if s.is_decode]
        step = d.step()
        max_running = max(max_running, len(d.sched.running))
        # with pages to spare, every decoding sequence runs each step (decode has priority)
        if len(decoders) <= d.sched.max_num_tokens:
            assert {id(s) for s in step.decode} == {id(s) for s in decoders}
    d.run()
    assert max_running == 3
    assert len(d.finished) == 12
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in d.finished)
    assert d.sched.num_preemptions == 0
    assert max(sum(r[1] for r in rec) for rec in d.steps) == 10  # the budget is actually reached


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    d = Driver(num_pages=32, page_size=4, max_batch_size=4, max_num_tokens=8)
    a = make_seq(0, 20, 2)
    b = make_seq(1, 6, 2)
    d.add(a)
    d.add(b)
    s1 = d.step()
    assert s1.prefill == [(a, 8)] and len(a.pages) == 2 and a.output_token_ids == []
    s2 = d.step()
    assert s2.prefill == [(a, 8)] and len(a.pages) == 4 and a.output_token_ids == []
    s3 = d.step()
    # a's last 4 tokens, then b's first chunk takes what is left of the budget
    assert s3.prefill == [(a, 4), (b, 4)]
    assert len(a.pages) == 5 and a.output_token_ids == [7]
    assert len(b.pages) == 1 and b.output_token_ids == []
    s4 = d.step()
    # a decodes (scheduled first for the budget, placed last), b's prefill continues
    assert s4.prefill == [(b, 2)] and s4.decode == [a]
    d.run()
    assert a.finished and b.finished


def test_without_chunked_prefill_prompts_are_not_split():
    d = Driver(num_pages=32, page_size=4, max_batch_size=4, max_num_tokens=10, chunked_prefill=False)
    a, b = make_seq(0, 6, 2), make_seq(1, 6, 2)
    d.add(a)
    d.add(b)
    s1 = d.step()
    assert s1.prefill == [(a, 6)]  # b does not fit in the 4 tokens left and waits whole
    s2 = d.step()
    assert s2.prefill == [(b, 6)] and s2.decode == [a]
    d.run()


def test_preemption_takes_the_youngest_and_everything_finishes():
    page_size, max_tokens = 4, 16
    # the pool holds one full 32-token sequence; three sequences want 24 tokens (6 pages) each
    d = Driver(num_pages=8, page_size=page_size, max_batch_size=4, max_num_tokens=64)
    seqs = [make_seq(i, 8, max_tokens) for i in range(3)]
    for s in seqs:
        d.add(s)
    oldest = seqs[0]
    last_progress = -1
    while d.sched.has_work():
        d.step()
        assert oldest not in d.preempted[-1]
        if not oldest.finished:
            # the oldest sequence gets a new token every step
            assert oldest.num_computed > last_progress
            last_progress = oldest.num_computed
    d.run()
    assert d.sched.num_preemptions > 0
    assert sum(len(v) for v in d.preempted) == d.sched.num_preemptions
    assert all(s.finished and len(s.output_token_ids) == max_tokens for s in seqs)
    # the oldest finished first: it was never held back
    assert d.finished[0] is oldest
    assert d.pool.num_free == d.pool.num_pages


def test_preempted_sequence_recomputes_prompt_and_generated_tokens():
    d = Driver(num_pages=8, page_size=4, max_batch_size=4, max_num_tokens=64)
    a, b = make_seq(0, 12, 20), make_seq(1, 12, 20)  # 31 tokens each: cannot both fit in 8 pages
    d.add(a)
    d.add(b)
    while not any(d.preempted):
        d.step()
    victims = [v for vs in d.preempted for v in vs]
    assert victims == [b]
    generated = len(b.output_token_ids)
    assert generated >= 1 and b.num_computed == 0 and b.pages == []
    assert list(d.sched.waiting) == [b]
    # until b samples its next token it is prefilled again (possibly in chunks, possibly
    # preempted again): the chunks since its last preemption cover the prompt and every token
    # it had generated, and none of its steps is a decode
    start = len(d.steps)
    while len(b.output_token_ids) == generated:
        d.step()
    last = max(i for i, vs in enumerate(d.preempted) if b in vs)
    since = [(r[1], r[2]) for rec in d.steps[last + 1:] for r in rec if r[0] is b]
    assert all(kind == "prefill" for _, kind in since)
    assert sum(n for n, _ in since) == 12 + len(b.output_token_ids) - 1
    assert all(r[2] == "prefill" for rec in d.steps[start:] for r in rec if r[0] is b)
    d.run()
    assert a.finished and b.finished
    assert d.sched.num_preemptions >= 1


def test_prefill_waits_when_the_pool_is_full_and_resumes_later():
    # one running sequence holds most pages; a new prompt gets a partial chunk, then waits
    d = Driver(num_pages=8, page_size=4, max_batch_size=4, max_num_tokens=64)
    a = make_seq(0, 20, 4)  # 5 pages, grows to 6 while decoding
    d.add(a)
    d.step()
    b = make_seq(1, 16, 2)
    d.add(b)
    d.run()
    assert a.finished and b.finished


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_with_a_tight_pool(seed, policy):
    rng = random.Random(seed)
    page_size, max_seq_len = 4, 32
    d = Driver(num_pages=pages_for(max_seq_len, page_size) + 2, page_size=page_size, max_batch_size=4,
               max_num_tokens=12, policy=policy)
    seqs = []
    pending = []
    for i in range(10):
        prompt = rng.randint(1, 20)
        seqs.append(make_seq(i, prompt, rng.randint(1, max_seq_len - prompt),
                             priority=rng.randint(-2, 2) if policy == "priority" else 0))
        pending.append(rng.randint(0, 20))  # arrival step
    step_no = 0
    while d.sched.has_work() or any(p >= step_no for p in pending):
        for s, at in zip(seqs, pending):
            if at == step_no:
                d.add(s)
        if d.sched.has_work():
            d.step()
        step_no += 1
        assert step_no < 2000
    d.run()
    assert all(s.finished and len(s.output_token_ids) == s.params.max_tokens for s in seqs)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_priority_policy_admits_the_most_urgent_first(policy):
    """One sequence at a time: fcfs serves the earlier one; priority the lower value."""
    d = Driver(num_pages=8, page_size=4, max_batch_size=1, max_num_tokens=64, policy=policy)
    late_urgent, early = make_seq(1, 8, 4, priority=-1), make_seq(0, 8, 4, priority=3)
    d.add(early)
    d.add(late_urgent)
    d.run()
    assert d.finished == ([early, late_urgent] if policy == "fcfs" else [late_urgent, early])


def test_the_priority_policy_preempts_the_least_urgent_even_when_older():
    d = Driver(num_pages=8, page_size=4, max_batch_size=4, max_num_tokens=64, policy="priority")
    a, b = make_seq(0, 12, 20, priority=9), make_seq(1, 12, 20, priority=0)  # cannot both fit in 8 pages
    d.add(a)
    d.add(b)
    while not any(d.preempted):
        d.step()
    assert [v for vs in d.preempted for v in vs] == [a]
    d.run()
    assert d.finished[0] is b and a.finished


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="'fcfs' or 'priority'"):
        Scheduler(PagePool(8, 4), max_batch_size=1, max_num_tokens=8, policy="lifo")


def test_finish_releases_a_waiting_or_running_sequence():
    d = Driver(num_pages=8, page_size=4, max_batch_size=4, max_num_tokens=64)
    a, b = make_seq(0, 10, 5), make_seq(1, 10, 5)
    d.add(a)
    d.step()
    d.add(b)
    assert a.pages and not b.pages
    d.sched.finish(a)  # running
    d.sched.finish(b)  # waiting
    assert not d.sched.has_work()
    assert d.pool.num_free == 8 and a.pages == []
    assert d.sched.schedule() is None
