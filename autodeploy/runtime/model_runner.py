"""The model runner: one scheduled step through the compiled graph.

It owns everything between the scheduler's decision and the sampler: the step's inputs (the
flattened tokens and the ``SequenceInfo`` metadata of ``autodeploy.cache``), the graph call,
and which rows of the output are next-token logits. The step's ``logits_index`` names the rows
whose logits are needed (each sequence's last token, every token of a sequence scoring its
prompt); the graph returns either those rows, when ``gather_logits_before_lm_head`` ran
(``cache.gathered_logits``), or one row per token; the runner hides that difference. When the
build captures hidden states (``cache.captured_layers``, filled by the graph into per-step
token buffers), it also hands each sequence that asked for them
(``SamplingParams.return_hidden_states``) its rows of this step, before the next step
overwrites them.

Under tensor parallelism the runner of rank 0 is given a ``StepSender``
(``autodeploy.runtime.step_broadcast``): each step's ``SequenceInfo`` goes to the other
ranks, which run their shard of the graph with it (``autodeploy.runtime.follower``), while
rank 0 runs its own; with the step go the state copies rank 0's ``StateSnapshots`` made since
the last one, which the other ranks make on their shards first.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch

from ..cache.interface import CachedSequenceInterface
from ..cache.sequence_info import SequenceInfo, build_sequence_info
from .scheduler import ScheduledStep
from .sequence import Sequence
from .state_snapshots import PAGE, Copy

if TYPE_CHECKING:
    from .state_snapshots import StateSnapshots
    from .step_broadcast import StepSender


@dataclass
class StepLogits:
    """What one step's forward produced for the sampler and the prompt scorer."""

    next_token: torch.Tensor  # [len(step.due), vocab]: the next-token logits of the due sequences
    # (sequence, position of its first new token, [new tokens, vocab]): every new token's logits,
    # for the sequences scoring their prompt (``Sequence.scores_prompt``)
    prompt: List[Tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: Callable[..., torch.Tensor], cache: CachedSequenceInterface,
                 sender: Optional["StepSender"] = None, snapshots: Optional["StateSnapshots"] = None):
        self.model = model
        self.cache = cache
        self.sender = sender  # rank 0 of several: every step goes to the other ranks too
        self.snapshots = snapshots  # with a sender: its copies go with the next step

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> StepLogits:
        """The step's logits: next-token rows of ``step.due`` in that order (an empty tensor when
        none is due), and all rows of the sequences scoring their prompt."""
        if step.page_copies:  # tail pages (``PagePool.match_tail``), before anything reads them
            self.cache.copy_pages(*zip(*step.page_copies))
        batch = step.sequences
        scoring = [s.scores_prompt for s, _ in batch]
        info = build_sequence_info(
            [s.token_ids[s.num_computed : s.num_computed + n] for s, n in batch],
            [s.num_computed for s, _ in batch],
            [s.pages for s, _ in batch],
            device=self.cache.device,
            slots=[s.slot for s, _ in batch],
            all_logits=scoring if any(scoring) else None,
        )
        if self.sender is None:
            logits = self.model(*self.cache.graph_args(info))[0]
        else:
            copies = list(self.snapshots.take_copies()) if self.snapshots is not None else []
            copies += [Copy(PAGE, src, dst) for src, dst in step.page_copies]  # every rank copies its own shard
            with self.sender.step(info, copies):
                logits = self.model(*self.cache.graph_args(info))[0]
        self._hand_out_hidden_states([s for s, _ in batch], info)
        if not self.cache.gathered_logits:  # every token's row: keep those logits_index names
            logits = logits.index_select(0, info.logits_index.to(device=logits.device, dtype=torch.long))
        rows = step.due_rows
        if not any(scoring) and len(rows) == len(batch):
            return StepLogits(logits)  # one row per sequence, every sequence due: the decode hot path
        # row of each sequence's last token in ``logits``, and the scoring sequences' rows
        last, prompt, row = [], [], 0
        for (seq, n), scores in zip(batch, scoring):
            count = n if scores else 1
            if scores:
                prompt.append((seq, seq.num_computed, logits[row : row + count]))
            row += count
            last.append(row - 1)
        index = torch.tensor([last[i] for i in rows], dtype=torch.long, device=logits.device)
        return StepLogits(logits.index_select(0, index), prompt)
    def _hand_out_hidden_states(self, sequences: List[Sequence], info: SequenceInfo) -> None:
        """Each asking sequence's rows of the capture buffers, ``[new tokens, layers, hidden]`` on the
        CPU, recorded at the positions they were computed for (before ``mark_computed``)."""
        wanted = [i for i, s in enumerate(sequences) if s.hidden_states is not None]
        if not wanted or not self.cache.captured_layers:
            return
        buffers = [self.cache.caches[name] for name in self.cache.captured_layers.values()]
        cu = info.cu_seqlen.tolist()
        for i in wanted:
            rows = torch.stack([b[cu[i]:cu[i + 1]] for b in buffers], dim=1).cpu()
            sequences[i].add_hidden_states(sequences[i].num_computed, rows)
