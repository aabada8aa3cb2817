"""``LLM``: a model source in, a running engine out, with vLLM's generate/chat/stream API.

    from autodeploy import LLM, SamplingParams
    llm = LLM("tiny-llama", max_seq_len=256)
    out = llm.generate(["The for statement"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)

It wires the three layers together and adds nothing of its own: the configuration
(``autodeploy.config``), the build (``autodeploy.pipeline``: factory, export, transforms) and
the runtime (``autodeploy.runtime``: request processor and engine).

At ``world_size`` above 1 every process of the group builds an ``LLM`` (its shard); rank 0 then
drives: it alone has the engine (scheduler, sampler, tokenizer) and sends every step to the
others, which run it in ``follow()`` until rank 0's ``shutdown()``::

    initialize()                          # torchrun's environment, or autodeploy's launcher
    llm = LLM(model, world_size=2)
    if llm.is_driver:
        print(llm.generate(["Hello"])[0].outputs[0].text)
        llm.shutdown()                    # the other ranks leave follow()
    else:
        llm.follow()
"""

import atexit
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from .config import load_deploy_config
from .config.chat_template import read_chat_template
from .pipeline import BuildResult, build_graph
from .runtime.engine import Engine
from .runtime.outputs import RequestOutput
from .runtime.request_processor import Message, Prompt, RequestProcessor, TokenizerHandle
from .runtime.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from .runtime.sampling_params import InvalidRequestError, SamplingParams
from .utils.errors import ConfigError
from .utils.logging import get_logger

if TYPE_CHECKING:
    from .runtime.step_broadcast import StepSender

logger = get_logger(__name__)


class LLM:
    """A deployed model: the transformed graph, its caches, a request processor and an engine.

    ``config`` takes any ``DeployConfig`` setting (``dtype``, ``device``, ``max_seq_len``,
    ``max_batch_size``, ``max_num_tokens``, ``attn_backend``, ``compile_backend``, ``quantization``,
    ``kv_cache_dtype``, ``page_size``, ``skip_tokenizer_init``, ``transforms``, ...); ``yaml`` is one
    path or a list of YAML files applied first. ``registry="NAME"`` deploys a model-registry entry
    (``autodeploy models`` lists them): its model, world size and YAML fragments come first, under
    ``yaml`` and every keyword (``model`` too, which then replaces the entry's model); a registry
    name passed as ``model`` is not looked up. ``show_progress`` draws a progress bar over the
    transforms; ``log_summary=False`` keeps the transform table out of the log (``llm.summary`` has
    it either way).
    """

    def __init__(self, model: Optional[str] = None, *, yaml: Union[str, Sequence[str], None] = None,
                 show_progress: bool = False, log_summary: bool = True, **config: Any):
        yaml_files = [yaml] if isinstance(yaml, str) else list(yaml or [])
        self.config = load_deploy_config(yaml_files, model=model, **config)
        self.build: BuildResult = build_graph(self.config, show_progress=show_progress, log_summary=log_summary)
        cache = self.build.cache
        if cache is None or not cache.caches:
            raise ConfigError("the pipeline made no KV cache; keep insert_cached_attention and initialize_cache enabled")
        factory = self.build.factory
        self.tokenizer_handle = TokenizerHandle(self._load_tokenizer, skip=self.config.skip_tokenizer_init)
        self.generation_config = factory.generation_config()
        self.processor = RequestProcessor(self.tokenizer_handle, max_seq_len=cache.max_seq_len,
                                          vocab_size=factory.vocab_size, hidden_state_layers=self.hidden_state_layers)
        wanted = (self.config.transforms.get("insert_cached_residual_add") or {}).get("layers")
        if wanted and not self.hidden_state_layers:
            logger.warning("insert_cached_residual_add.layers is set but no hidden states are captured (cache mode "
                           "%s%s); requests with return_hidden_states will be refused", self.build.context.cache_mode,
                           f": {self.build.context.recompute_reason}" if self.build.context.recompute_reason else "")
        self.rank = self.build.context.rank
        self._sender: Optional["StepSender"] = None  # rank 0 of several: sends every step to the others
        self._engine: Optional[Engine] = None
        self._agreed_sequences = cache.max_batch_size  # above world size 1: what every rank holds
        if self.config.world_size == 1:
            self._engine = Engine(self.build.graph, cache, tokenizer=self.tokenizer_handle,
                                  eos_token_ids=self._eos_token_ids(),
                                  prefix_caching=self.config.enable_prefix_caching,
                                  state_snapshots=self.config.prefix_state_snapshots,
                                  scheduling_policy=self.config.scheduling_policy)
            return
        from .runtime.step_broadcast import StepSender, agree_on_capacity

        pages, sequences = agree_on_capacity(cache)  # every rank, in the same order
        self._agreed_sequences = sequences
        if self.rank == 0:
            self._sender = StepSender(cache.device)
            # a script that forgets shutdown() still lets the other ranks go when it ends
            atexit.register(StepSender.stop, self._sender)
            self._engine = Engine(self.build.graph, cache, tokenizer=self.tokenizer_handle,
                                  eos_token_ids=self._eos_token_ids(), step_sender=self._sender,
                                  num_pages=pages, max_batch_size=sequences,
                                  prefix_caching=self.config.enable_prefix_caching,
                                  state_snapshots=self.config.prefix_state_snapshots,
                                  scheduling_policy=self.config.scheduling_policy)

    def _load_tokenizer(self) -> Any:
        """The checkpoint's tokenizer, with ``chat_template`` in place of its own template if set."""
        tokenizer = self.build.factory.tokenizer()
        if self.config.chat_template is not None:
            try:
                tokenizer.chat_template = read_chat_template(self.config.chat_template)
            except ValueError as exc:  # (checked with the config; the file went away since)
                raise ConfigError(f"chat_template: {exc}") from None
        return tokenizer

    # ---- tensor parallelism --------------------------------------------------------------------
    @property
    def is_driver(self) -> bool:
        """Whether this process runs the engine: always at world size 1, rank 0 above."""
        return self._engine is not None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise ConfigError(f"rank {self.rank} of {self.config.world_size} has no engine: rank 0 schedules and "
                              "samples for every rank; call llm.follow() on the other ranks and generate on rank 0 "
                              "(llm.is_driver)")
        return self._engine

    @property
    def rank_failure(self) -> Optional[str]:
        """Why the tensor-parallel group failed (a rank died, hung or failed a step), or None."""
        return self._sender.failure if self._sender is not None else None

    def on_rank_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from any thread) when the group fails (rank 0 of several)."""
        if self._sender is not None:
            self._sender.on_failure.append(callback)

    def report_rank_failure(self, reason: str) -> None:
        """Record that the group failed for ``reason`` (e.g. a launcher saw a rank exit): later
        steps raise ``RankFailure`` with it and ``on_rank_failure`` callbacks hear it."""
        if self._sender is not None:
            self._sender.fail(reason)

    def follow(self) -> int:
        """Ranks other than 0: run the steps rank 0 sends until its ``shutdown()``; returns how many
        ran. Raises ``RankFailure`` when rank 0 is gone or hung for longer than the group's timeout."""
        if self.is_driver:
            raise ConfigError("follow() is for the ranks other than 0; this process runs the engine (llm.is_driver)")
        from .runtime.follower import follow
        from .cache.limits import snapshot_capacity
        from .runtime.state_snapshots import StateReplica

        cache = self.build.cache
        # rank 0 keeps state snapshots for prefix caching (Engine): this rank repeats its copies
        capacity = snapshot_capacity(self.config.prefix_state_snapshots, self._agreed_sequences)
        replica = (StateReplica(cache, capacity) if self.config.enable_prefix_caching and cache.state_names
                   and capacity > 0 else None)
        return follow(self.build.graph, cache, replica)

    def shutdown(self) -> None:
        """Rank 0 of several: tell the other ranks to leave ``follow()`` (once; a no-op elsewhere).
        Not after a failure, when the others leave on their own error."""
        if self._sender is not None:
            self._sender.stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def hidden_state_layers(self) -> List[int]:
        """The decoder layers whose hidden states requests can get
        (``SamplingParams(return_hidden_states=True)``), in the order of the outputs' layer axis;
        set with ``transforms={"insert_cached_residual_add": {"layers": [...]}}``."""
        return list(self.build.cache.captured_layers) if self.build.cache is not None else []

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (loaded on first use), or ``None`` when there is none."""
        return self.tokenizer_handle.tokenizer

    # ---- defaults ------------------------------------------------------------------------------
    def _eos_token_ids(self) -> List[int]:
        """From generation_config.json, else the model's config, else the tokenizer (if any)."""
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            eos = getattr(self.build.factory.config, "eos_token_id", None)
        if eos is None and self.tokenizer_handle.available:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the checkpoint's ``generation_config.json``, as HF's ``generate``
        reads them: the repetition penalty whether or not it samples, the sampling settings only
        with ``do_sample``."""
        gc = self.generation_config
        kwargs: Dict[str, Any] = {"max_tokens": int(gc.get("max_new_tokens") or 16),
                                  "repetition_penalty": float(gc.get("repetition_penalty") or 1.0)}
        if gc.get("do_sample"):
            kwargs.update(temperature=float(gc.get("temperature", 1.0)), top_k=int(gc.get("top_k") or 0),
                          top_p=float(gc.get("top_p", 1.0)), min_p=float(gc.get("min_p") or 0.0))
        else:
            kwargs["temperature"] = 0.0
        return SamplingParams(**kwargs)

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
        priority: Optional[Sequence[int]] = None,
    ) -> List[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs come in prompt order.

        A prompt the engine cannot serve raises ``InvalidRequestError`` naming it, before any
        prompt of this call is queued. ``priority`` (vLLM's): one integer per prompt, lower served
        first; needs ``scheduling_policy='priority'``.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        if priority is not None:
            priority = list(priority)
            if len(priority) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(priority)} priorities")
            if any(priority) and self.config.scheduling_policy != "priority":
                raise InvalidRequestError("priority: this engine serves requests in arrival order; build it with "
                                          "scheduling_policy='priority'")
        requests = self.processor.prepare_all(prompts, params_list, priority)
        request_ids = [self.engine.add_request(r) for r in requests]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generating")
        done: Dict[str, RequestOutput] = {}
        while len(done) < len(request_ids):
            outputs = self.engine.step()
            for out in outputs:
                done[out.request_id] = out
            if progress is not None and outputs:
                progress.update(len(outputs))
            if not outputs and not self.engine.has_unfinished():
                break
        if progress is not None:
            progress.close()
        return [done[rid] for rid in request_ids]

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield the request's output (all of it so far) each time it grows, until it finishes."""
        request = self.processor.prepare(prompt, sampling_params or self.get_default_sampling_params())
        updates: List[RequestOutput] = []
        rid = self.engine.add_request(request, on_update=updates.append)
        finished = False
        try:
            while not finished:
                self.engine.step()
                if not updates and not self.engine.has_unfinished():
                    break
                while updates:
                    out = updates.pop(0)
                    finished = finished or out.finished
                    yield out
        finally:
            if not finished:
                self.engine.abort(rid)

    def chat(
        self,
        messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        chat_template: Optional[str] = None,
    ) -> List[RequestOutput]:
        """Apply the chat template (the tokenizer's, or the ``chat_template`` setting) to one
        conversation or a list of them. ``tools``: function definitions (OpenAI's ``{"type":
        "function", "function": {"name", "description", "parameters"}}``) the template shows the
        model; the calls it writes are in the text (the server's ``--tool-call-parser`` finds them;
        ``SamplingParams.guided`` can force them). ``continue_final_message`` (with
        ``add_generation_prompt=False``): the model continues the last, assistant, message.
        ``chat_template_kwargs``: more template variables (e.g. Qwen 3's ``enable_thinking``).
        ``chat_template``: a Jinja template for these conversations instead of the deployment's."""
        if not messages:
            raise InvalidRequestError("chat() needs at least one message")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(self.processor.chat_prompt(  # type: ignore[arg-type]
                    conversation, add_generation_prompt, tools=tools, continue_final_message=continue_final_message,
                    template_kwargs=chat_template_kwargs, chat_template=chat_template))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"conversation {i}: {exc}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Union[Prompt, Sequence[Prompt]], params: BeamSearchParams,
                    use_tqdm: bool = False) -> List[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``; the search is HF's ``generate(num_beams=...)``,
        ``runtime.beam_search``): each prompt's ``params.beam_width`` best hypotheses, best first.
        Every step runs each live beam as a one-token request; prefix caching shares their history."""
        prompts = _as_prompt_list(prompts)
        searches: List[BeamSearch] = []
        eos = sorted(self._eos_token_ids())
        for i, prompt in enumerate(prompts):
            try:
                searches.append(BeamSearch(self.processor.check(prompt), params, eos, self.processor.max_seq_len))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt {i}: {exc}", code=exc.code) from None
        step = params.step_params()
        if not self.engine.pool.prefix_caching:
            logger.warning("beam search without prefix caching computes every beam's whole history again at each "
                           "step (%d steps at most); build with enable_prefix_caching=True (the default) to share it",
                           params.max_tokens)
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=params.max_tokens, desc="beam search")
        while not all(s.done for s in searches):
            live = [s for s in searches if not s.done]
            outs = iter(self.generate([beam for s in live for beam in s.requests()], step))
            for s in live:
                s.advance([next(outs).outputs[0].logprobs[0] for _ in s.beams])  # type: ignore[index]
            if progress is not None:
                progress.update(1)
        if progress is not None:
            progress.close()
        return [s.output(self.tokenizer) for s in searches]

    @property
    def summary(self) -> str:
        return self.build.summary


def _as_prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> List[Prompt]:
    """One prompt (text or a mapping) or a list of prompts (each text, a mapping or a list of
    token ids). A flat list of ints is a list of prompts, each of which is then invalid: one
    token-id prompt is ``[[1, 2, 3]]`` or ``{"prompt_token_ids": [1, 2, 3]}``."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    return list(prompts)
