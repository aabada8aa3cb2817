"""The engine: prepared requests in, one forward per step, tokens out.

A step is four calls: the scheduler picks the batch, the model runner runs it through the
compiled graph, the sampler picks each due sequence's next token, and postprocessing appends
it, detokenizes incrementally, applies the stop conditions and frees finished sequences' pages.
Requests arrive already checked (``RequestProcessor.prepare``); the engine does not check them
again.
"""

import itertools
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Literal, Optional

import torch

from ..cache.interface import CachedSequenceInterface
from ..cache.limits import snapshot_capacity
from ..utils.logging import get_logger
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .guided.guide import Guides
from .logits_processors import process_logits
from .model_runner import ModelRunner, StepLogits
from .outputs import CompletionOutput, RequestOutput
from .page_pool import PagePool
from .request_processor import PreparedRequest, TokenizerHandle
from .sampler import prompt_token_logprobs, sample, token_logprobs
from .sampling_params import InvalidRequestError
from .scheduler import ScheduledStep, Scheduler
from .sequence import Sequence
from .state_snapshots import StateSnapshots

if TYPE_CHECKING:
    from .step_broadcast import StepSender

logger = get_logger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time_s: float = 0.0  # steps that had prefill tokens
    decode_time_s: float = 0.0  # steps with only decode tokens
    generated_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_time_s if self.prefill_time_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time_s if self.decode_time_s else 0.0

    def account(self, step: ScheduledStep, elapsed: float, sampled: int) -> None:
        decode = len(step.decode)
        prefill = step.num_tokens - decode
        self.steps += 1
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.generated_tokens += sampled
        if prefill:
            self.prefill_time_s += elapsed
        else:
            self.decode_time_s += elapsed


@dataclass
class _Request:
    request_id: str
    prepared: PreparedRequest
    sequences: List[Sequence]
    on_update: Optional[Callable[[RequestOutput], None]] = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def snapshot(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prepared.prompt,
            prompt_token_ids=list(self.prepared.prompt_token_ids),
            outputs=[
                CompletionOutput(s.index, s.text, s.output_token_ids, s.finish_reason,
                                 list(s.logprobs) if s.logprobs is not None else None,
                                 s.hidden_states_so_far(), s.stop_reason)
                for s in self.sequences
            ],
            finished=self.finished,
            prompt_logprobs=_copy(self.sequences[0].prompt_logprobs),
            prompt_ranks=_copy(self.sequences[0].prompt_ranks),
        )


def _copy(entries: Optional[List[Any]]) -> Optional[List[Any]]:
    return list(entries) if entries is not None else None


def _snapshot_store(cache: CachedSequenceInterface, setting: Optional[int], max_batch_size: int, sends_steps: bool,
                    chunked_prefill: bool) -> Optional[StateSnapshots]:
    """The snapshot store of a state-cache model's prefix caching, or None (with one log line
    saying why) where prefix caching is off for it. ``sends_steps``: rank 0 of a tensor-parallel
    group, whose copies the other ranks make too."""
    state = cache.state_names
    names = f"{len(state)} state caches (" + ", ".join(state[:3]) + (", ...)" if len(state) > 3 else ")")
    why = None
    if not chunked_prefill:
        why = "a state is copied at a page boundary only where a prefill chunk ends there (chunked prefill is off)"
    elif setting == 0:
        why = "prefix_state_snapshots is 0"
    if why is not None:
        logger.info("prefix caching is off for this model with %s: %s", names, why)
        return None
    capacity = snapshot_capacity(setting, max_batch_size)
    store = StateSnapshots(cache, capacity, record=sends_steps)  # the other ranks repeat its copies
    logger.info("prefix caching for a model with %s: up to %d copies of a sequence's states at page boundaries "
                "(prefix_state_snapshots), %.1f MiB", names, capacity, store.nbytes / 2**20)
    return store


class Engine:
    """Continuous batching over a cached graph (see ``autodeploy.cache``)."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        cache: CachedSequenceInterface,
        *,
        tokenizer: Optional[TokenizerHandle] = None,
        eos_token_ids: Iterable[int] = (),
        chunked_prefill: bool = True,
        step_sender: Optional["StepSender"] = None,
        num_pages: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        prefix_caching: bool = False,
        state_snapshots: Optional[int] = None,
        scheduling_policy: Literal["fcfs", "priority"] = "fcfs",
    ):
        """``step_sender``: rank 0 of a tensor-parallel group sends every step to the other ranks.
        ``num_pages`` / ``max_batch_size``: schedule within fewer pages or sequences than this
        rank's cache holds (every rank's cache must hold what rank 0 schedules).
        ``prefix_caching``: sequences start from the cached pages of a prompt prefix seen before
        (``PagePool``). ``state_snapshots``: for a model with per-sequence state caches, how many
        copies of a state at a page boundary are kept for it (``snapshot_capacity``; 0 turns
        prefix caching off for such a model). ``scheduling_policy``: ``Scheduler``'s ``policy``."""
        self.cache = cache
        self.tokenizer = tokenizer
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.max_seq_len = cache.max_seq_len
        self.snapshots: Optional[StateSnapshots] = None
        if prefix_caching and cache.state_names:
            self.snapshots = _snapshot_store(cache, state_snapshots, max_batch_size or cache.max_batch_size,
                                             step_sender is not None, chunked_prefill)
            prefix_caching = self.snapshots is not None
        self.runner = ModelRunner(model, cache, step_sender, self.snapshots)
        self.pool = PagePool(num_pages if num_pages is not None else cache.allocatable_pages, cache.page_size,
                             prefix_caching=prefix_caching,
                             tail_pages=True, whole_tails=self.snapshots is not None)  # a state cannot rewind
        self.scheduler = Scheduler(
            self.pool, max_batch_size=max_batch_size or cache.max_batch_size, max_num_tokens=cache.max_num_tokens,
            chunked_prefill=chunked_prefill, snapshots=self.snapshots, policy=scheduling_policy,
        )
        self.requests: Dict[str, _Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._rng = random.Random()
        self._guides: Optional[Guides] = None  # made for the first guided request (needs the tokenizer)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request: PreparedRequest,
        *,
        request_id: Optional[str] = None,
        on_update: Optional[Callable[[RequestOutput], None]] = None,
    ) -> str:
        """Queue a prepared request. ``on_update`` gets the request's output whenever it grows
        (streaming); ``step`` returns outputs only when requests finish."""
        if not isinstance(request, PreparedRequest):
            raise TypeError("add_request takes a PreparedRequest (RequestProcessor.prepare makes one)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        if request.priority and self.scheduler.policy != "priority":
            raise InvalidRequestError(f"priority {request.priority}: this engine serves requests in arrival order; "
                                      "start it with scheduling_policy='priority' (serve --scheduling_policy priority)")
        params = request.params
        tokenizer = self.tokenizer.tokenizer if self.tokenizer is not None else None
        guides = self._guides_for(tokenizer) if params.guided is not None else None
        sequences = []
        for i in range(params.n):
            gen = None
            if not params.greedy:
                seed = (params.seed * 1000003 + i) % 2**63 if params.seed is not None else self._rng.getrandbits(63)
                gen = torch.Generator().manual_seed(seed)
            seq = Sequence(request_id, i, request.prompt_token_ids, params, next(self._arrivals), gen,
                           logprobs=[] if params.logprobs is not None else None,
                           # the prompt is scored once per request, by its first sequence
                           prompt_logprobs=[None] if params.prompt_logprobs is not None and i == 0 else None,
                           prompt_ranks=[None] if params.prompt_logprobs is not None and i == 0 else None,
                           hidden_states=[] if params.return_hidden_states else None,
                           cache_salt=request.cache_salt, priority=request.priority)
            if tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                         skip_special_tokens=params.skip_special_tokens)
            if guides is not None:
                seq.guide = guides.start(params.guided)  # type: ignore[arg-type]
            sequences.append(seq)
        self.requests[request_id] = _Request(request_id, request, sequences, on_update)
        for seq in sequences:
            self.scheduler.add(seq)
        return request_id

    def _guides_for(self, tokenizer: Any) -> Guides:
        if tokenizer is None:
            raise InvalidRequestError("guided decoding needs the model's tokenizer (to know each token's text), "
                                      "and this engine has none")
        if self._guides is None:
            self._guides = Guides(tokenizer)
        return self._guides

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (pages freed, recomputed later) since the engine was built."""
        return self.scheduler.num_preemptions

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the admitted sequences' tokens read from cached pages (prefix caching)."""
        queried = self.scheduler.prefix_query_tokens
        return self.scheduler.prefix_hit_tokens / queried if queried else 0.0

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages (e.g. its client went away)."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.sequences:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self._emit(req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """Run one forward; returns the outputs of the requests that finished in it."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        start = time.perf_counter()
        due = scheduled.due
        logits = self.runner.run(scheduled)
        self.scheduler.mark_computed(scheduled)
        self._score_prompts(logits)
        tokens: List[Optional[int]] = []
        if due:
            processed = process_logits(logits.next_token, due, self.eos_token_ids)
            tokens = list(sample(processed, [s.params for s in due], [s.generator for s in due]))
            if processed is not logits.next_token:  # a row its constraints left without a token samples none
                for i in torch.isneginf(processed).all(dim=-1).nonzero()[:, 0].tolist():
                    tokens[i] = None
        finished = self._postprocess(due, tokens, logits.next_token)
        self.stats.account(scheduled, time.perf_counter() - start, len(due))
        return finished

    @staticmethod
    def _score_prompts(logits: StepLogits) -> None:
        """Prompt log-probabilities from the rows of the sequences scoring their prompt: the
        logits at position ``p`` score prompt token ``p + 1``. A preempted sequence computing its
        prompt again keeps the entries it has."""
        for seq, start, rows in logits.prompt:
            first = len(seq.prompt_logprobs) - 1  # type: ignore[arg-type]  # the first position not scored
            if first < start:
                raise RuntimeError(f"prompt scoring skipped positions {first}..{start - 1} of request {seq.request_id}")
            stop = min(start + rows.shape[0], seq.num_prompt_tokens - 1)  # the last prompt token scores nothing
            if first >= stop:
                continue
            targets = seq.prompt_token_ids[first + 1 : stop + 1]
            entries, ranks = prompt_token_logprobs(rows[first - start : stop - start], targets,
                                                   seq.params.prompt_logprobs or 0)
            seq.prompt_logprobs.extend(entries)  # type: ignore[union-attr]
            seq.prompt_ranks.extend(ranks)  # type: ignore[union-attr]

    def _postprocess(self, due: List[Sequence], tokens: List[Optional[int]],
                     logits: torch.Tensor) -> List[RequestOutput]:
        """Append each due sequence's token. ``None``: its parameters left no token possible (e.g.
        ``allowed_token_ids`` all banned by ``min_tokens`` or bad words): it ends, "abort", rather
        than take a token they forbid."""
        changed: Dict[str, _Request] = {}
        for i, (seq, token) in enumerate(zip(due, tokens)):
            scoring_only = seq.params.max_tokens == 0  # the prompt is done, nothing is generated
            if scoring_only or token is None:
                if not scoring_only:
                    logger.warning("request %s: its sampling parameters leave no token that may come next after %d "
                                   "tokens; it ends there (finish_reason 'abort')", seq.request_id,
                                   seq.num_output_tokens)
                seq.finish_reason = "length" if scoring_only else "abort"
                self.scheduler.finish(seq)
                changed[seq.request_id] = self.requests[seq.request_id]
                continue
            if seq.logprobs is not None:
                seq.logprobs.append(dict(token_logprobs(logits[i], token, seq.params.logprobs or 0)))
            self._append_token(seq, token)
            changed[seq.request_id] = self.requests[seq.request_id]
        return [out for out in (self._emit(req) for req in changed.values()) if out is not None and out.finished]

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.append_token(token)
        params = seq.params
        detok = seq.detokenizer
        ends_on_eos = not params.ignore_eos and token in self.eos_token_ids
        # the EOS or stop_token_ids token that ends the output is not part of its text (vLLM's
        # rule: counted in token_ids, its text only with include_stop_str_in_output)
        silent = (ends_on_eos or token in params.stop_token_ids) and not params.include_stop_str_in_output
        new_chars = len(detok.add(token)) if detok is not None and not silent else 0
        reason = None
        if seq.guide is not None and seq.guide.failed:  # its constraint could not go on (logged)
            reason = "abort"
        elif token in params.stop_token_ids or ends_on_eos:
            reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None
        elif seq.guide is not None and seq.guide.advance(token):
            # the constrained output is done (nothing can follow it), or the constraint failed
            reason = "abort" if seq.guide.failed else "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_seq_len:
            reason = "length"
        if detok is not None and params.stop_strings and seq.num_output_tokens >= params.min_tokens:
            if reason is not None:  # text held back for the next token comes out now: check it too
                new_chars += len(detok.flush())
            match = StopStringMatcher.for_params(params).find_match(detok.text, new_chars)
            if match is not None:
                seq.cut_text = detok.text[:match[1] if params.include_stop_str_in_output else match[0]]
                reason, seq.stop_reason = "stop", detok.text[match[0]:match[1]]
        if reason is None:
            return
        if detok is not None:
            detok.flush()
        seq.finish_reason = reason
        self.scheduler.finish(seq)

    def _emit(self, req: _Request) -> Optional[RequestOutput]:
        """Tell the request's listener; a finished request leaves the engine. Snapshots (copies
        of the outputs so far) are made only for a listener or a finished request."""
        if req.on_update is None and not req.finished:
            return None
        out = req.snapshot()
        if req.on_update is not None:
            req.on_update(out)
        if req.finished:
            self.requests.pop(req.request_id, None)
        return out

    # ---- convenience ---------------------------------------------------------------------------
    def run_until_done(self, request_ids: Optional[Iterable[str]] = None) -> Dict[str, RequestOutput]:
        """Step until the given requests (default: all) finish; returns their final outputs."""
        wanted = set(request_ids) if request_ids is not None else set(self.requests)
        final: Dict[str, RequestOutput] = {}
        for rid in list(wanted):  # requests may be finished (e.g. aborted) before stepping
            req = self.requests.get(rid)
            if req is not None and req.finished:
                out = self._emit(req)
                if out is not None:
                    final[rid] = out
        while wanted - set(final):
            outputs = self.step()
            if not outputs and not self.has_unfinished():
                break
            for out in outputs:
                if out.request_id in wanted:
                    final[out.request_id] = out
        return final

