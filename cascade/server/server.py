"""The state behind the HTTP routes: one cascade, its scheduler and its metrics. It validates requests, tokenizes
prompts and chat conversations, sets each choice's token budget and submits the choices to the scheduler."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import uuid

from jinja2 import TemplateError

from cascade.api import Cascade, out_of_vocabulary
from cascade.server.errors import APIError, bad_request
from cascade.server.metrics import Metrics
from cascade.server.protocol import ChatCompletionRequest, SamplingFields
from cascade.server.responses import failure
from cascade.server.scheduler import EngineUnavailable, Events, Job, QueueFull, Scheduler
from cascade.server.worker import EngineThread


class Server:
    """The state behind the routes: one cascade, its scheduler and its metrics."""

    def __init__(
        self, cascade: Cascade, *, api_key: str | None, max_waiting: int, worker: EngineThread | None = None,
        step_timeout_s: float = 120.0, max_new_tokens: int | None = None,
    ):
        self.cascade = cascade
        self.api_key = api_key
        self.max_new_tokens = max_new_tokens  # per choice: the most a request may ask, and what one that asks none gets
        self.max_context = cascade.max_context
        self.vocab_size = cascade.vocab_size
        tokenizer = cascade.tokenizer
        # Message contents are tokenized with special-token parsing off, which a fast tokenizer does by flipping a
        # setting of its shared Rust backend for the call: other threads encoding meanwhile would see it (a request
        # tokenized otherwise than alone, or "Already borrowed"). So that flip happens on a private copy, one
        # request at a time, and the shared tokenizer is never mutated.
        self._verbatim = copy.deepcopy(tokenizer)
        self._verbatim_lock = threading.Lock()
        # Strings the tokenizer turns into its added tokens (end of text, turn markers, ...).
        self._markers = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        self.metrics = Metrics(cascade.stage_names, gauges=cascade.cache_gauges(), emulation=cascade.emulation_report)
        cascade.observer = self.metrics
        self.scheduler = Scheduler(
            cascade, self.metrics, max_waiting=max_waiting, worker=worker, step_timeout_s=step_timeout_s
        )
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.cascade.served_model_name

    # ---- validation -------------------------------------------------------------------------------------------

    def check_model(self, body: SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404, f"The model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            return self.cascade.encode(prompt)
        problem = out_of_vocabulary(prompt, self.vocab_size, "prompt token ids")
        if problem:
            raise bad_request(problem, "prompt")
        return list(prompt)

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template's text, tokenized; message contents are text whatever they contain: a user who writes
        ``<|im_end|>`` or the end-of-text marker into a message gets those characters, not the control tokens (so
        no forged turns, no early end). Only the template's own markers are control tokens."""
        tokenizer = self.cascade.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request(f"the model {self.model_name!r} has no chat template; use /v1/completions", "messages")
        contents = [m.text() for m in body.messages]
        roles = [m.role for m in body.messages]
        if not any(marker in content for content in contents for marker in self._markers):
            text = self._render(roles, contents)
            return tokenizer.encode(text, add_special_tokens=False)  # the template already has what it needs
        # Render with a placeholder for each content, tokenize the template's text with its markers and each content
        # with special-token parsing off.
        placeholders = [f"\ue000cascade-content-{uuid.uuid4().hex}\ue000" for _ in contents]
        text = self._render(roles, placeholders)
        if any(text.count(p) != 1 for p in placeholders):
            raise bad_request(
                "a message contains a special-token string and this model's chat template does not carry message "
                "contents verbatim, so it cannot be sent as text", "messages",
            )
        ids: list[int] = []
        for placeholder, content in zip(placeholders, contents):
            before, text = text.split(placeholder)
            ids += tokenizer.encode(before, add_special_tokens=False)
            with self._verbatim_lock:
                ids += self._verbatim(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids + tokenizer.encode(text, add_special_tokens=False)

    def _render(self, roles: list[str], contents: list[str]) -> str:
        """The chat template's text; a template that refuses the conversation (``raise_exception``, e.g. roles
        that do not alternate) refuses the request, with its own words."""
        messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
        try:
            return self.cascade.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:
            raise bad_request(f"the model's chat template refused these messages: {e}", "messages") from None

    def token_budget(self, prompt_ids: list[int], max_tokens: int | None, param: str, min_tokens: int = 0) -> int:
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens, but the prompt has "
                f"{len(prompt_ids)} tokens, which leaves no room for a completion",
                "prompt" if param == "max_tokens" else "messages",
            )
        cap = self.max_new_tokens
        if max_tokens is not None and cap is not None and max_tokens > cap:
            raise bad_request(f"{param} is {max_tokens}; this server generates at most {cap} tokens per choice", param)
        default = room if cap is None else min(room, cap)
        if min_tokens > (default if max_tokens is None else max_tokens):
            raise bad_request(
                f"min_tokens ({min_tokens}) exceeds the tokens this request may generate "
                f"({default if max_tokens is None else max_tokens})", "min_tokens",
            )
        if max_tokens is None:
            return default
        if max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and {param} is {max_tokens}, so at most {room} can be generated",
                param,
            )
        return max_tokens

    # ---- running ----------------------------------------------------------------------------------------------

    def submit(self, body: SamplingFields, prompts: list[list[int]], budgets: list[int]) -> tuple[list[Job], Events]:
        problem = out_of_vocabulary(body.stop_token_ids or (), self.vocab_size, "stop_token_ids")
        if problem:
            raise bad_request(problem, "stop_token_ids")
        capacity = self.scheduler.max_waiting + self.cascade.max_running
        if len(prompts) * body.n > capacity:  # can never be admitted: not a 503 to retry
            raise bad_request(
                f"{len(prompts)} prompt(s) x n={body.n} is {len(prompts) * body.n} generations; this server holds at "
                f"most {capacity} at once (--max-running plus --max-waiting)", "n",
            )
        loop = asyncio.get_running_loop()
        events = Events()
        jobs = []
        for p, (ids, budget) in enumerate(zip(prompts, budgets)):
            for c in range(body.n):
                index = p * body.n + c
                jobs.append(Job(index, ids, body.engine_options(budget, c), loop, events, counts_prompt=c == 0))
        try:
            self.scheduler.submit(jobs)
        except QueueFull as e:
            raise APIError(503, f"{e}; retry later", type="server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineUnavailable as e:
            raise failure(e) from None
        return jobs, events
