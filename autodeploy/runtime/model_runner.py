"""The model runner: one scheduled step through the compiled graph.

It owns everything between the scheduler's decision and the sampler: the step's inputs (the
flattened tokens and the ``SequenceInfo`` metadata of ``autodeploy.cache``), the graph call,
and which rows of the output are next-token logits. The graph returns either one row per token
or, when ``gather_logits_before_lm_head`` ran (``cache.gathered_logits``), one row per
sequence (its last token); the runner hides that difference. When the build captures hidden
states (``cache.captured_layers``, filled by the graph into per-step token buffers), it also
hands each sequence that asked for them (``SamplingParams.return_hidden_states``) its rows of
this step, before the next step overwrites them.
"""

from typing import Callable, List

import torch

from ..cache.interface import CachedSequenceInterface
from ..cache.sequence_info import SequenceInfo, build_sequence_info
from .scheduler import ScheduledStep
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: Callable[..., torch.Tensor], cache: CachedSequenceInterface):
        self.model = model
        self.cache = cache

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> torch.Tensor:
        """Next-token logits ``[len(step.due), vocab]`` of the sequences ``step.due`` (those whose
        scheduled tokens complete them), in that order; an empty tensor when none is due."""
        batch = step.sequences
        info = build_sequence_info(
            [s.token_ids[s.num_computed : s.num_computed + n] for s, n in batch],
            [s.num_computed for s, _ in batch],
            [s.pages for s, _ in batch],
            device=self.cache.device,
            slots=[s.slot for s, _ in batch],
        )
        logits = self.model(*self.cache.graph_args(info))[0]
        self._hand_out_hidden_states([s for s, _ in batch], info)
        rows = step.due_rows
        if len(rows) == len(batch):
            # every sequence is due: one row each, either already (gathered) or at its last token
            return logits if self.cache.gathered_logits else logits.index_select(
                0, info.last_token_indices().to(logits.device))
        index = torch.tensor(rows, dtype=torch.long) if self.cache.gathered_logits else info.last_token_indices()[rows]
        return logits.index_select(0, index.to(logits.device))

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
