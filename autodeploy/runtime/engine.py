"""The engine: requests in, one forward per step, tokens out.

Each ``step()`` asks the scheduler for a batch, builds the step's ``SequenceInfo``, runs the
compiled graph once over all its tokens, samples the next token of every sequence whose new
tokens are all in the cache, applies stop conditions and frees finished sequences' pages.
"""

import itertools
import random
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence as Seq

import torch

from ..cache.interface import CachedSequenceInterface
from ..cache.sequence_info import build_sequence_info
from ..utils.logging import get_logger
from .outputs import CompletionOutput, RequestOutput
from .page_pool import PagePool
from .sampler import sample, token_logprobs
from .sampling_params import InvalidRequestError, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

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


@dataclass
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    params: SamplingParams
    sequences: List[Sequence]
    on_update: Optional[Callable[[RequestOutput], None]] = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def snapshot(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[
                CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason,
                                 list(s.logprobs) if s.logprobs is not None else None)
                for s in self.sequences
            ],
            finished=self.finished,
        )


class Engine:
    """Continuous batching over a cached graph (see ``autodeploy.cache``)."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        cache: CachedSequenceInterface,
        *,
        tokenizer: object = None,
        eos_token_ids: Iterable[int] = (),
        vocab_size: Optional[int] = None,
        chunked_prefill: bool = True,
    ):
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.max_seq_len = cache.max_seq_len
        self.pool = PagePool(cache.allocatable_pages, cache.page_size)
        self.scheduler = Scheduler(
            self.pool, max_batch_size=cache.max_batch_size, max_num_tokens=cache.max_num_tokens,
            chunked_prefill=chunked_prefill,
        )
        self.requests: Dict[str, _Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._rng = random.Random()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Seq[int],
        params: Optional[SamplingParams] = None,
        *,
        prompt: Optional[str] = None,
        request_id: Optional[str] = None,
        on_update: Optional[Callable[[RequestOutput], None]] = None,
    ) -> str:
        """Queue a request; a request the engine cannot serve raises ``InvalidRequestError``
        and changes nothing, so other requests keep going."""
        params = params or SamplingParams()
        tokens = self.validate_request(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        sequences = []
        for i in range(params.n):
            gen = None
            if not params.greedy:
                seed = (params.seed * 1000003 + i) % 2**63 if params.seed is not None else self._rng.getrandbits(63)
                gen = torch.Generator().manual_seed(seed)
            sequences.append(Sequence(request_id, i, tokens, params, next(self._arrivals), gen,
                                      logprobs=[] if params.logprobs is not None else None))
        self.requests[request_id] = _Request(request_id, prompt, tokens, params, sequences, on_update)
        for seq in sequences:
            self.scheduler.add(seq)
        return request_id

    def validate_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> List[int]:
        """The prompt as a list of ints, or ``InvalidRequestError`` saying why it cannot be served."""
        params.validate()
        try:
            tokens = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise InvalidRequestError("prompt token ids must be integers") from None
        if not tokens:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        if len(tokens) >= self.max_seq_len:
            raise InvalidRequestError(
                f"the prompt has {len(tokens)} tokens but max_seq_len is {self.max_seq_len} "
                "(prompt and generated tokens together); shorten it or raise max_seq_len"
            )
        if self.vocab_size is not None and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        return tokens

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

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
    @torch.inference_mode()
    def step(self) -> List[RequestOutput]:
        """Run one forward; returns the requests that changed (finished ones are dropped)."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        start = time.perf_counter()
        batch = scheduled.sequences
        info = build_sequence_info(
            [s.all_token_ids[s.num_computed : s.num_computed + n] for s, n in batch],
            [s.num_computed for s, _ in batch],
            [s.pages for s, _ in batch],
            device=self.cache.device,
        )
        logits = self.model(*self.cache.graph_args(info))
        rows, to_sample = [], []
        for i, (seq, n) in enumerate(batch):
            seq.num_computed += n
            if seq.remaining == 0:
                rows.append(i)
                to_sample.append(seq)
        if to_sample:
            if self.cache.gathered_logits and len(rows) == len(batch):  # one row per sequence already
                next_logits = logits[0]
            else:
                last = torch.tensor(rows, dtype=torch.long) if self.cache.gathered_logits else \
                    info.last_token_indices()[rows]
                next_logits = logits[0].index_select(0, last.to(logits.device))
            tokens = sample(next_logits, [s.params for s in to_sample], [s.generator for s in to_sample])
            for row, seq, token in zip(next_logits, to_sample, tokens):
                if seq.logprobs is not None:
                    seq.logprobs.append(dict(token_logprobs(row, token, seq.params.logprobs or 0)))
                self._append_token(seq, token)
        elapsed = time.perf_counter() - start
        self._account(scheduled.num_tokens - len(scheduled.decode), len(scheduled.decode), elapsed, len(to_sample))
        changed: Dict[str, _Request] = {}
        for seq in to_sample:
            changed[seq.request_id] = self.requests[seq.request_id]
        outputs = []
        for req in changed.values():
            outputs.append(self._emit(req))
        return outputs

    def _account(self, prefill_tokens: int, decode_tokens: int, elapsed: float, sampled: int) -> None:
        st = self.stats
        st.steps += 1
        st.prefill_tokens += prefill_tokens
        st.decode_tokens += decode_tokens
        st.generated_tokens += sampled
        if prefill_tokens:
            st.prefill_time_s += elapsed
        else:
            st.decode_time_s += elapsed

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        params = seq.params
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif params.stop_strings and self.tokenizer is not None:
            hits = [seq.text.find(s) for s in params.stop_strings if s in seq.text]
            if hits:
                seq.text = seq.text[: min(hits)]
                reason = "stop"
        if reason is None and (len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_seq_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _emit(self, req: _Request) -> RequestOutput:
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
        # requests may already be finished (e.g. aborted) before stepping
        for rid in list(wanted):
            req = self.requests.get(rid)
            if req is not None and req.finished:
                final[rid] = self._emit(req)
        while wanted - set(final):
            outputs = self.step()
            if not outputs and not self.has_unfinished():
                break
            for out in outputs:
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return final

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free
