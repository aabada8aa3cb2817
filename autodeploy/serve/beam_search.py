"""vLLM's ``use_beam_search`` on the server: the same search as ``LLM.beam_search``
(``runtime.beam_search``), driven from the request's handler. Each step runs every live beam as
a one-token engine request, all at once (batched with everyone else's), and waits for them; the
``n`` best hypotheses become the choices, best first."""

from typing import Union

from ..runtime.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from ..runtime.request_processor import CheckedPrompt
from ..runtime.sampling_params import InvalidRequestError
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .requests import final_output, gather_or_cancel, prepare_request
from .state import ServerState


def beam_params(req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int) -> BeamSearchParams:
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), "n" if "beam_width" in str(exc) else "max_tokens") from None


async def run_beam_search(state: ServerState, request_id: str, checked: CheckedPrompt, params: BeamSearchParams,
                          priority: int = 0) -> BeamSearchOutput:
    """The search of one prompt; its step requests share the prompt's cache salt and priority."""
    try:
        search = BeamSearch(checked, params, state.engine.eos_token_ids, state.max_seq_len)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), "max_tokens", exc.code) from None
    step = params.step_params()
    processor = state.engine.processor
    number = 0
    while not search.done:
        prepared = [prepare_request(processor, c, step, "prompt", priority) for c in search.requests()]
        outs = await gather_or_cancel(*[final_output(state, f"{request_id}-s{number}-b{j}", p)
                                        for j, p in enumerate(prepared)])
        search.advance([out.outputs[0].logprobs[0] for out in outs])  # type: ignore[index]
        number += 1
    return search.output(state.tokenizer)


def completion_tokens(output: BeamSearchOutput) -> int:
    return sum(len(s.token_ids) for s in output.sequences)


