"""Forms each step's batch within the token budget, the batch size and the page pool.

Every step: running sequences that decode get one token each, oldest first; then prefills
(continuing chunks first, then waiting requests in arrival order) take what is left of the
``max_num_tokens`` budget, split into chunks when they do not fit. When a decoding sequence
needs a page and none is free, the youngest running sequence is preempted: its pages are freed
and it waits, at the front of the queue, to be recomputed (prompt and generated tokens) later.
No request is dropped: one sequence always fits because the pool holds at least a full
``max_seq_len`` sequence.

With prefix caching (``PagePool.prefix_caching``) a sequence being admitted first takes the
cached pages that hold the start of its tokens (``PagePool.match``), then a copy of a tail page
that holds some of the next ones (``PagePool.match_tail``; the step that admits it lists the
copy in ``ScheduledStep.page_copies``, which the model runner makes before the forward, and lets
the tail page go after it), and computes only the rest, as a chunked prefill continues; the
pages each step fills are given entries after it ran (``mark_computed``). A preempted sequence
matches again when it is readmitted: its own pages, released tail first, are usually still
cached. The other choices of an ``n > 1`` request wait
while the first one computes the prompt's whole pages, then start from them.

Scheduling policy (vLLM's ``scheduling_policy``): ``"fcfs"`` orders everything by arrival as
above; ``"priority"`` orders by (``Sequence.priority``, arrival), lower values first: decodes and
prefill chunks, the waiting queue's admissions, and the preemption victim (the last in that
order, so the least urgent, youngest sequence is recomputed). A new sequence never preempts in
either policy: an urgent request waits for room, then goes before every less urgent one.

Each running sequence also holds a state slot (``Sequence.slot``, ``0..max_batch_size-1``) for
the per-sequence state caches (SSM, convolution, delta rule): taken when it starts running,
given back when it finishes, is aborted or is preempted. A preempted sequence recomputes from an
empty state (its first step has ``use_initial_state`` False), so whatever its old slot holds by
then does not matter.

Prefix caching for a model with state caches (``StateSnapshots``): a sequence resumes only
after a matched page whose state was copied, so its match is cut back to the deepest such page
(the rest of the matched pages are let go and computed again into its own). Copies are taken at
the end of a step, so the scheduler ends a prefill chunk at the page boundary where one is
wanted (``Sequence.snapshot_at``): where the match went deeper than any copy (two prompts were
seen to part there) and, for an ``n > 1`` request, at the prompt's last whole page (where the
other choices start). Without chunked prefill no chunk is cut and no copy is taken. A sequence
that ends (or is preempted) leaves a copy of its final state: under its whole tail's id when its
last page is partly filled (``PagePool`` whole tails: a sequence that goes on with all those
tokens, a conversation's next turn, resumes there, the tail page copied and the state restored),
else under its last page's entry id.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Deque, List, Literal, Optional, Set, Tuple

from ..utils.logging import get_logger
from .page_pool import PagePool
from .sequence import Sequence

if TYPE_CHECKING:
    from .state_snapshots import StateSnapshots

logger = get_logger(__name__)


@dataclass
class ScheduledStep:
    prefill: List[Tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    decode: List[Sequence] = field(default_factory=list)
    # (source, destination) pages whose contents are copied before the step runs (tail pages)
    page_copies: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def sequences(self) -> List[Tuple[Sequence, int]]:
        """Prefill first, then decode: the order the cached graph expects."""
        return self.prefill + [(s, 1) for s in self.decode]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)

    @property
    def due_rows(self) -> List[int]:
        """Positions in ``sequences`` of the sequences this step completes (all their tokens in
        the cache afterwards): each gets its next token. Read before ``Scheduler.mark_computed``."""
        return [i for i, (s, n) in enumerate(self.sequences) if s.remaining == n]

    @property
    def due(self) -> List[Sequence]:
        """The sequences of ``due_rows``, in that order."""
        batch = self.sequences
        return [batch[i][0] for i in self.due_rows]


class Scheduler:
    def __init__(self, pool: PagePool, *, max_batch_size: int, max_num_tokens: int, chunked_prefill: bool = True,
                 snapshots: Optional["StateSnapshots"] = None, policy: Literal["fcfs", "priority"] = "fcfs"):
        """``snapshots``: the state copies of a model with state caches (prefix caching only);
        ``policy``: the order sequences are served in (module docstring)."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self.pool = pool
        self.snapshots = snapshots
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []  # in arrival order
        self.num_preemptions = 0
        # prefix caching: tokens of the sequences admitted that could match, and of those the
        # tokens read from cached pages instead of computed
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.free_slots: List[int] = list(range(max_batch_size))[::-1]  # pop() hands out the lowest

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _order(self, seq: Sequence) -> Tuple[int, int]:
        """Serving order: lower first (the policy's key)."""
        return (seq.priority if self.policy == "priority" else 0, seq.arrival)

    def _admission_order(self) -> List[Sequence]:
        """The waiting queue in the order it is admitted: as queued for fcfs (preempted sequences
        at its front), by priority then arrival for the priority policy."""
        if self.policy == "priority":
            return sorted(self.waiting, key=self._order)
        return list(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def mark_computed(self, step: ScheduledStep) -> None:
        """The step ran: its tokens are in the cache."""
        for seq, n in step.sequences:
            if seq.tail_copy is not None:  # copied before the step ran: the tail page is let go
                self.pool.free([seq.tail_copy[0]])
                seq.tail_copy = None
            seq.num_computed += n
            if self.pool.prefix_caching:
                self.pool.register(seq.token_ids, seq.pages, seq.num_computed, seq.prefix_ids, seq.cache_salt)
            if seq.snapshot_at is not None and seq.num_computed >= seq.snapshot_at:
                if seq.num_computed == seq.snapshot_at and self.snapshots is not None:
                    self.snapshots.save(seq.prefix_ids[-1], seq.slot)  # type: ignore[arg-type]
                seq.snapshot_at = None

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._keep_tail(seq)
        self._release_pages(seq)
        self._release_slot(seq)

    def _keep_tail(self, seq: Sequence) -> None:
        """An ending or preempted sequence's partly filled last page keeps a tail entry; with
        state snapshots its state (all it computed) is copied under the tail's id, or under its
        last page's entry when it ends on a page boundary."""
        if seq.tail_copy is not None:  # admitted with a copy that never ran: nothing computed to keep
            return
        tail = self.pool.keep_tail(seq.token_ids, seq.pages, seq.num_computed, seq.prefix_ids, seq.cache_salt)
        if self.snapshots is None or seq.slot is None or seq.num_computed == 0:
            return
        # an end-of-sequence copy (spare rows only: most sequences are never continued)
        if tail is not None:
            self.snapshots.save(tail, seq.slot, tail=True)
        elif seq.num_computed == len(seq.prefix_ids) * self.pool.page_size:
            self.snapshots.save(seq.prefix_ids[-1], seq.slot, tail=True)

    def _release_pages(self, seq: Sequence) -> None:
        if seq.tail_copy is not None:  # admitted with a copy that never ran
            self.pool.free([seq.tail_copy[0]])
            seq.tail_copy = None
        self.pool.free(seq.pages)
        seq.pages = []
        seq.prefix_ids = []
        seq.snapshot_at = None  # a boundary of the pages it held
        seq.resume_from = None

    def _sibling_computing_prompt(self, seq: Sequence) -> bool:
        """Whether another running sequence of ``seq``'s request (``n > 1``) has yet to compute the
        prompt pages ``seq`` could match: ``seq`` then waits for them rather than computing the
        same prompt beside it."""
        shared_end = (seq.num_prompt_tokens - 1) // self.pool.page_size * self.pool.page_size
        return shared_end > 0 and any(s.request_id == seq.request_id and s is not seq and s.num_computed < shared_end
                                      for s in self.running)

    def _match(self, seq: Sequence) -> None:
        """Start ``seq`` from the cached pages holding the start of its tokens; with state
        snapshots only up to the deepest page with a copy, and mark where a copy is wanted."""
        pages, ids = self.pool.match(seq.token_ids, seq.cache_salt)
        seq.snapshot_at = None
        # a tail page and a page to copy it into (two free pages: the tail may be one of them); with
        # state snapshots a whole tail with a copy of the state after it (then every matched page serves)
        snapshots = self.snapshots
        usable = snapshots.__contains__ if snapshots is not None else None
        tail = self.pool.match_tail(seq.token_ids, ids, seq.cache_salt, usable) if self.pool.num_free >= 2 else None
        if snapshots is not None and tail is None:
            keep = snapshots.deepest(ids)
            self.pool.free(pages[keep:])
            page_size = self.pool.page_size
            if self.chunked_prefill:
                wanted = len(pages) * page_size  # prompts parted here, deeper than any copy
                if seq.params.n > 1:  # the other choices start at the prompt's last whole page
                    wanted = max(wanted, (seq.num_prompt_tokens - 1) // page_size * page_size)
                seq.snapshot_at = wanted if wanted > keep * page_size else None
            pages, ids = pages[:keep], ids[:keep]
        seq.pages, seq.prefix_ids = pages, ids
        seq.num_computed = len(pages) * self.pool.page_size
        seq.resume_from = ids[-1] if ids else None
        if tail is not None:
            seq.tail_copy = (tail[0], self.pool.allocate(1)[0])
            seq.pages.append(seq.tail_copy[1])
            seq.num_computed += tail[1]
            seq.resume_from = self.pool.tail_id(tail[0])

    def _unmatch(self, seq: Sequence) -> None:
        """A sequence that matched cached pages but is not admitted this step lets them go (it
        waits holding nothing, and matches again when admitted)."""
        self._release_pages(seq)
        seq.num_computed = 0

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def _preempt(self, seq: Sequence) -> None:
        # info, not warning: preemption is the designed answer to a full pool, but a deployment
        # that sees it often wants a larger pool (the count is also a server metric)
        logger.info("KV pool full: preempted request %s (choice %d, %d tokens computed, %d pages freed); "
                    "it will be recomputed", seq.request_id, seq.index, seq.num_computed, len(seq.pages))
        self.running.remove(seq)
        self._keep_tail(seq)
        self._release_pages(seq)
        self._release_slot(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` the pages to hold ``num_tokens`` tokens, if the pool has them."""
        need = self.pool.pages_for(num_tokens) - len(seq.pages)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.pages += self.pool.allocate(need)
        return True

    def _reserve(self, seq: Sequence, num_tokens: int, step: ScheduledStep, preempted: Set[int],
                 may_preempt_self: bool) -> bool:
        """Pages for ``seq`` up to ``num_tokens``, preempting the youngest running sequence while
        they do not fit. If the youngest is ``seq`` itself it is preempted only when
        ``may_preempt_self`` (a decode that cannot grow); if the youngest is already in this
        step, ``seq`` waits a step instead. Returns whether ``seq`` got its pages."""
        while not self._grow(seq, num_tokens):
            youngest = max(self.running, key=self._order)  # the least urgent, youngest
            if youngest is seq:
                if may_preempt_self:
                    self._preempt(seq)
                    preempted.add(id(seq))
                return False
            if any(s is youngest for s, _ in step.sequences):
                return False
            self._preempt(youngest)
            preempted.add(id(youngest))
        return True

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledStep]:
        step = ScheduledStep()
        budget = self.max_num_tokens
        preempted: Set[int] = set()
        # 1. decodes, oldest first: one token each
        for seq in sorted(self.running, key=self._order):
            if budget < 1 or id(seq) in preempted or not seq.is_decode:
                continue
            if self._reserve(seq, seq.num_computed + 1, step, preempted, may_preempt_self=True):
                step.decode.append(seq)
                budget -= 1
        # 2. prefills: running sequences' next chunks (oldest first), then admissions (FIFO)
        continuing = sorted((s for s in self.running if not s.is_decode), key=self._order)
        for seq in continuing + self._admission_order():
            if budget < 1:
                break
            if id(seq) in preempted:
                continue
            admitting = seq not in self.running
            if admitting and len(self.running) >= self.max_batch_size:
                break
            if admitting and self.pool.prefix_caching and seq.may_share_prefix:
                if self._sibling_computing_prompt(seq):
                    continue  # another choice of its request computes the prompt: matched once it has
                self._match(seq)
            n = seq.remaining
            if seq.snapshot_at is not None and seq.snapshot_at > seq.num_computed:
                n = min(n, seq.snapshot_at - seq.num_computed)  # the chunk ends where a state copy is wanted
            if n > budget:
                if not self.chunked_prefill:
                    if admitting:
                        self._unmatch(seq)
                    break
                n = budget
            if admitting:
                # a new sequence never preempts: it takes what is free, or waits
                if not self._grow(seq, seq.num_computed + n):
                    fits = (len(seq.pages) + self.pool.num_free) * self.pool.page_size - seq.num_computed
                    if not self.chunked_prefill or fits < 1 or not self._grow(seq, seq.num_computed + fits):
                        self._unmatch(seq)
                        break
                    n = fits
                if self.pool.prefix_caching and seq.may_share_prefix:
                    self.prefix_query_tokens += seq.num_tokens
                    self.prefix_hit_tokens += seq.num_computed
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.slot = self.free_slots.pop()  # running < max_batch_size: one is free
                if self.snapshots is not None and seq.resume_from is not None:
                    self.snapshots.restore(seq.resume_from, seq.slot)  # resume from the copied state
            else:
                fits = (len(seq.pages) + self.pool.num_free) * self.pool.page_size - seq.num_computed
                if self.chunked_prefill and 1 <= fits < n:
                    n = fits  # make progress with what is free before preempting anyone
                if not self._reserve(seq, seq.num_computed + n, step, preempted, may_preempt_self=False):
                    continue
            step.prefill.append((seq, n))
            if admitting and seq.tail_copy is not None:
                step.page_copies.append(seq.tail_copy)
            budget -= n
        # a one-token chunk after the start (the rest of a prompt whose other tokens came from cached
        # pages, or of a chunked one) is a decode to the cached graph, whose batch must list every
        # longer or first chunk before any decode: such chunks go last among the prefills
        step.prefill.sort(key=lambda item: item[1] == 1 and item[0].num_computed > 0)
        if not step.prefill and not step.decode:
            if self.has_work():
                raise RuntimeError(
                    f"scheduler made no progress with {len(self.running)} running and {len(self.waiting)} waiting "
                    f"sequences and {self.pool.num_free}/{self.pool.num_pages} free pages"
                )
            return None
        return step
