"""One request as the event loop sees it: a scheduler Request whose tokens arrive as text deltas.

The scheduler calls back on its own thread; `Job` hands each event to the event loop
(`call_soon_threadsafe`) and turns token ids into text there: incremental UTF-8-safe
detokenization, stop strings held back until they can no longer match (and cut off, never
sent, when they do), the model's end-of-generation tokens never shown. A matched stop string
cancels the request at the scheduler at once (its slot is freed at the next step boundary).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ikjax.runtime.scheduler import STOP_CANCELLED, STOP_STRING, Request, Scheduler
from ikjax.runtime.text import StopStrings
from ikjax.server.openai import ApiError, GenParams


class Job:
    def __init__(self, scheduler: Scheduler, tokenizer, ids: list[int], params: GenParams, *, on_first=None,
                 keep: frozenset[int] = frozenset()):
        self.loop = asyncio.get_running_loop()
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.params = params
        self.events: asyncio.Queue = asyncio.Queue()
        self.t_arrival = time.perf_counter()
        self._on_first = on_first
        self._keep = keep  # control tokens shown as text (a tool call's markers)
        self.req: Request = scheduler.make_request(
            ids, params.max_tokens, on_event=self._from_scheduler, cache_prompt=params.cache_prompt,
            ignore_eos=params.ignore_eos, slot=params.id_slot, **params.sampling())
        self.new_ids: list[int] = []  # the ids whose text the last delta carried (/completion's `tokens`)
        self.finish_reason: str | None = None  # "eos", "stop" (a stop string), "max_tokens", "context"
        self.stopping_word = ""
        self.n_generated = 0  # tokens up to the end (a stop string's included, the ones after it not)
        self.token_ids: list[int] = []
        self.done = False
        # where each token's text starts in the decoded answer before stop strings cut it, and how
        # much text was given out: tokens that start past the cut are the stop string's (`in_answer`)
        self.tail = ""  # text held back at the end, for the last event of a stream of one event per token
        self._text_at: list[int] = []
        self._text_len = 0
        self._given = 0

    def in_answer(self, i: int) -> bool:
        """Whether generated token i is part of the answer: after a stop string, the tokens whose
        text starts where the answer was cut are the stop string's and are left out of the
        log-probabilities (llama-server drops them; OpenAI's logprobs follow the returned text)."""
        if self.finish_reason != "stop" or i >= len(self._text_at):
            return True
        return self._text_at[i] < self._given

    def _from_scheduler(self, kind: str, value) -> None:  # the scheduler's thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def start(self) -> "Job":
        self.scheduler.submit(self.req)  # QueueFullError: the app answers 503
        return self

    def cancel(self, reason: str = STOP_CANCELLED) -> None:
        if not self.done:
            self.done = True
            self.scheduler.cancel(self.req, reason)

    async def text(self) -> str:
        """The whole answer's text (a request that is not streamed)."""
        return "".join([p async for p in self.pieces()])

    async def pieces(self, every_token: bool = False) -> AsyncIterator[str]:
        """Text deltas until the request ends; then `finish_reason` is set. `every_token`: one
        piece per generated token, "" when its text is held back (an incomplete UTF-8 character,
        a possible stop string), so a client that asked for token ids gets each id as it is made:
        random-id prompts (bench/serve_load.py) make byte tokens whose text waits, and a stream
        seemed to stall for 4 tokens when it was only the text that waited (RESULTS §23b)."""
        detok = self.tokenizer.detokenizer(keep=self._keep)
        stops = StopStrings(self.params.stop)
        hidden = self.req.stop_ids  # EOS and the stop ids: ends of generation, not text
        while True:
            kind, value = await self.events.get()
            if kind == "token":
                if self.n_generated == 0 and self._on_first is not None:
                    self._on_first(time.perf_counter() - self.t_arrival)
                self.n_generated += 1
                self.token_ids.append(value)
                self.new_ids.append(value)
                self._text_at.append(self._text_len)
                if value in hidden:
                    continue
                raw = detok.feed(value)
                self._text_len += len(raw)
                text, stopped = stops.feed(raw)
                self._given += len(text)
                if stopped:  # before the last delta: its log-probabilities leave the stop string's tokens out
                    self.finish_reason, self.stopping_word = "stop", stops.matched
                if text or (every_token and not stopped):
                    yield text
                    self.new_ids = []
                if stopped:
                    self.cancel(STOP_STRING)
                    return
            elif kind == "done":
                self.done = True
                if value == STOP_CANCELLED:  # cancelled from here (a stop string) or at shutdown
                    raise ApiError(503, "the request was cancelled (server shutting down)")
                text, stopped = stops.feed(detok.finish())
                text += stops.flush()
                self._given += len(text)
                if text and every_token:  # an event per token: what was held back goes in the last event
                    self.tail = text
                elif text:
                    yield text
                if stopped:
                    self.finish_reason, self.stopping_word = "stop", stops.matched
                else:
                    self.finish_reason = value
                return
            else:  # "error": the step failed
                self.done = True
                raise ApiError(500, f"generation failed: {value}")
