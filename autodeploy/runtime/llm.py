"""``LLM``: build the engine from a model source and generate, as users know it from vLLM.

    from autodeploy import LLM, SamplingParams
    llm = LLM("tiny-llama", max_seq_len=256)
    out = llm.generate(["The for statement"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)
"""

from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from ..config import load_deploy_config
from ..pipeline import BuildResult, build_graph
from ..utils.errors import ConfigError
from ..utils.logging import get_logger
from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import InvalidRequestError, SamplingParams

logger = get_logger(__name__)

Prompt = Union[str, Mapping[str, Any]]
Messages = List[Dict[str, str]]


class LLM:
    """A deployed model: the transformed graph, its KV cache, a tokenizer and an engine.

    ``config`` takes any ``DeployConfig`` setting (``dtype``, ``device``, ``max_seq_len``,
    ``max_batch_size``, ``max_num_tokens``, ``attn_backend``, ``compile_backend``,
    ``page_size``, ``transforms``, ...); ``yaml`` is one path or a list of YAML files applied
    first.
    """

    def __init__(self, model: Optional[str] = None, *, yaml: Union[str, Sequence[str], None] = None,
                 show_progress: bool = False, **config: Any):
        yaml_files = [yaml] if isinstance(yaml, str) else list(yaml or [])
        self.config = load_deploy_config(yaml_files, model=model, **config)
        self.build: BuildResult = build_graph(self.config, show_progress=show_progress)
        if self.build.cache is None or not self.build.cache.caches:
            raise ConfigError("the pipeline made no KV cache; keep insert_cached_attention and initialize_cache enabled")
        self.tokenizer = self.build.factory.tokenizer()
        self.generation_config = self.build.factory.generation_config()
        self.engine = Engine(
            self.build.graph,
            self.build.cache,
            tokenizer=self.tokenizer,
            eos_token_ids=self._eos_token_ids(),
            vocab_size=self.build.factory.vocab_size,
        )

    # ---- defaults ------------------------------------------------------------------------------
    def _eos_token_ids(self) -> List[int]:
        eos = self.generation_config.get("eos_token_id", getattr(self.tokenizer, "eos_token_id", None))
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the checkpoint's ``generation_config.json``."""
        gc = self.generation_config
        kwargs: Dict[str, Any] = {"max_tokens": int(gc.get("max_new_tokens") or 16)}
        if gc.get("do_sample"):
            kwargs.update(temperature=float(gc.get("temperature", 1.0)), top_k=int(gc.get("top_k") or 0),
                          top_p=float(gc.get("top_p", 1.0)))
        else:
            kwargs["temperature"] = 0.0
        return SamplingParams(**kwargs)

    # ---- prompts -------------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt, index: int) -> tuple:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer(prompt["prompt"])["input_ids"]
        raise InvalidRequestError(
            f"prompt {index}: expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
    ) -> List[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs come in prompt order.

        A prompt the engine cannot serve raises ``InvalidRequestError`` naming it, before any
        prompt of this call is queued.
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        staged = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            text, ids = self._tokenize(prompt, i)
            self._check(ids, params, i)
            staged.append((text, ids, params))
        request_ids = [self.engine.add_request(ids, params, prompt=text) for text, ids, params in staged]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generating")
        done: Dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        while wanted - set(done):
            outputs = self.engine.step()
            for out in outputs:
                if out.finished and out.request_id in wanted and out.request_id not in done:
                    done[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
            if not outputs and not self.engine.has_unfinished():
                break
        if progress is not None:
            progress.close()
        return [done[rid] for rid in request_ids]

    def _check(self, ids: List[int], params: SamplingParams, index: int) -> None:
        try:
            params.validate()
            if not ids:
                raise InvalidRequestError("the prompt is empty; give at least one token")
            if len(ids) >= self.engine.max_seq_len:
                raise InvalidRequestError(
                    f"the prompt has {len(ids)} tokens but max_seq_len is {self.engine.max_seq_len}; "
                    "shorten it or raise max_seq_len"
                )
            vocab = self.engine.vocab_size
            if vocab is not None and any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"prompt {index}: {exc}") from None

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield the request's output each time it grows, until it finishes."""
        text, ids = self._tokenize(prompt, 0)
        params = sampling_params or self.get_default_sampling_params()
        self._check(ids, params, 0)
        updates: List[RequestOutput] = []
        rid = self.engine.add_request(ids, params, prompt=text, on_update=updates.append)
        finished = False
        try:
            while not finished:
                if not self.engine.step() and not self.engine.has_unfinished():
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
        messages: Union[Messages, Sequence[Messages]],
        sampling_params: Optional[SamplingParams] = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> List[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        if not messages:
            raise InvalidRequestError("chat() needs at least one message")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for i, conv in enumerate(conversations):
            if not conv:
                raise InvalidRequestError(f"conversation {i} has no messages")
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise InvalidRequestError("this model's tokenizer has no chat template; use generate()")
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @property
    def summary(self) -> str:
        return self.build.summary
