"""vLLM's ``use_beam_search`` on the server: the same search as ``LLM.beam_search``
(``runtime.beam_search``), driven from the request's handler. Each step runs every live beam as
a one-token engine request, all at once (batched with everyone else's), and waits for them; the
``n`` best hypotheses become the choices, best first."""

from typing import List, Union

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
    prompt_ids = checked.prompt_token_ids
    if len(prompt_ids) + params.max_tokens - 1 >= state.max_seq_len:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and beam search's max_tokens is "
                            f"{params.max_tokens}: more than max_seq_len {state.max_seq_len}", "max_tokens",
                       "context_length_exceeded")
    search = BeamSearch(prompt_ids, params, state.engine.eos_token_ids)
    step = params.step_params()
    processor = state.engine.processor
    number = 0
    while not search.done:
        beams: List[CheckedPrompt] = [CheckedPrompt(None, ids, checked.cache_salt) for ids in search.requests()]
        prepared = [prepare_request(processor, c, step, "prompt", priority) for c in beams]
        outs = await gather_or_cancel(*[final_output(state, f"{request_id}-s{number}-b{j}", p)
                                        for j, p in enumerate(prepared)])
        search.advance([out.outputs[0].logprobs[0] for out in outs])  # type: ignore[index]
        number += 1
    tokenizer = state.tokenizer
    return search.output(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def completion_tokens(output: BeamSearchOutput) -> int:
    return sum(len(s.token_ids) for s in output.sequences)


