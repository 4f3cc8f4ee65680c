"""Request bodies of the OpenAI-compatible routes, validated strictly (a wrong type is an error, not a guess).

Every field is either honoured or rejected: fields the OpenAI API has but Cascade does not implement (``echo``,
``best_of``, ``suffix``, ``response_format``, tools, ``logit_bias``) are a 400 naming them when set to anything but
their neutral value, and an unknown field is a 400 too (a client that misspells a parameter, or relies on one this
server lacks, is told so rather than silently served something else).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from cascade.penalties import MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY

MAX_N = 16  # choices per request; each is a full generation


MAX_PROMPT_ITEMS = 1 << 20  # token ids or prompts in one request, checked before the items are validated


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    """Send a last chunk with the request's ``usage`` (and no choices) before ``data: [DONE]``."""
    continuous_usage_stats: bool = False
    """An extension (as in vLLM), with ``include_usage``: every chunk also carries the request's ``usage`` so far
    (its completion tokens committed up to that chunk, over all its choices), so a client can tell when each token
    arrived even where one chunk carries several (a speculative step commits several tokens at once)."""

    @model_validator(mode="after")
    def _continuous_needs_usage(self):
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("stream_options.continuous_usage_stats needs stream_options.include_usage")
        return self


def _check_text(value, field: str) -> None:
    """Strings must be valid Unicode: JSON can carry a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer
    can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{field} contains a lone UTF-16 surrogate ({value[e.start]!r} at character {e.start}), which is not "
                "valid Unicode text"
            ) from None
    elif isinstance(value, list):
        for item in value:
            _check_text(item, field)


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    """The served model name; omitted means the one model this server serves."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    """0 decodes greedily (exactly the target's greedy output)."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    """-1 or 0 disables top-k (vLLM uses -1, Hugging Face 0)."""
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    """Makes a sampled request reproducible — the same text under any load or batch (shared-noise verification);
    choice i of n uses seed + i, so seed + n − 1 must stay below 2**64."""
    stop: StrictStr | list[StrictStr] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    return_token_ids: StrictBool = False
    """An extension (as in vLLM): also return the prompt's and each choice's token ids."""
    ignore_eos: StrictBool = False
    """An extension (as in vLLM, sent by load generators): the target's end-of-sequence token does not end the
    completion, which runs to ``max_tokens`` (or a stop string)."""
    min_tokens: Annotated[int, Field(ge=0)] = 0
    """An extension (as in vLLM): the target's end-of-sequence token is not generated before this many tokens
    (stop strings still apply)."""
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=64)] | None = None
    """An extension (as in vLLM): generation ends after any of these token ids (kept in the output)."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """An extension (as in vLLM): tokens less likely than ``min_p`` times the most likely one are not sampled."""
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] = 1.0
    """An extension (as in vLLM): the target's logit of every token in the prompt or output so far is divided by it
    (multiplied, if negative); 1 is none. At least 0.01: a smaller one makes logits infinite."""
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    """Subtracted from the target's logit of every token the output has so far."""
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    """Subtracted from the target's logit of every token per time the output has it so far."""
    # Accepted by OpenAI, not implemented here: only their neutral values are allowed.
    response_format: Any = None
    tool_choice: Any = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ValueError("response_format is not supported: the output is the target model's text, unconstrained")
        if self.tool_choice is not None and self.tool_choice != "none":
            raise ValueError("tool_choice is not supported (no tools are)")
        for name in ("prompt", "messages", "stop"):
            value = getattr(self, name, None)
            _check_text([m.text() for m in value] if name == "messages" and value else value, name)
        if self.seed is not None and self.seed + self.n > 2**64:
            raise ValueError(f"seed + n - 1 must be below 2**64 (choice i uses seed + i), got seed {self.seed}, n {self.n}")
        return self

    def engine_options(self, max_tokens: int, choice: int) -> dict:
        return dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids or (),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.logprob_alternatives,
            user=self.user,
        )

    @property
    def logprob_alternatives(self) -> int | None:
        """None: no log-probabilities; k: each token's, with its k most likely alternatives."""
        raise NotImplementedError


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    """A string, a list of token ids, or a batch of either (each gets ``n`` choices)."""
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    """OpenAI's default is 16; ``null`` means all the room the context window leaves."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """Each token's log-probability under the target model, with this many most likely alternatives (0: none)."""
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One clear error for a prompt of the wrong shape, before pydantic tries every branch of the union on every
        item (a megabyte list of floats built millions of errors and took seconds)."""
        if isinstance(value, list):
            if len(value) > MAX_PROMPT_ITEMS:
                raise ValueError(f"prompt has {len(value)} items; at most {MAX_PROMPT_ITEMS}")
            kinds = {type(x) for x in value}
            if kinds and not (kinds <= {int} or kinds <= {str} or kinds <= {list}):
                raise ValueError("prompt must be a string, a list of token ids (integers), or a list of strings or "
                                 f"of token id lists; got a list of {', '.join(sorted(k.__name__ for k in kinds))}")
        return value

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if isinstance(p[0], int):
            return [p]
        if any(len(x) == 0 for x in p):
            raise ValueError("prompt must not contain an empty prompt")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None
    # What an assistant message returned by an OpenAI-style API carries back into the next turn: allowed when empty
    refusal: Any = None
    tool_calls: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None

    @model_validator(mode="after")
    def _no_tool_calls(self):
        for name in ("refusal", "tool_calls", "function_call", "audio", "annotations"):
            if getattr(self, name):
                raise ValueError(f"messages: {name} is not supported")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Deprecated by OpenAI in favour of ``max_completion_tokens``; either works, ``null`` means all the room
    the context window leaves."""
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list | None = None
    logprobs: StrictBool = False
    """Each token's log-probability under the target model."""
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """With ``logprobs``: this many most likely alternatives at each position."""

    @model_validator(mode="after")
    def _chat_only(self):
        if self.tools:
            raise ValueError("tools are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
