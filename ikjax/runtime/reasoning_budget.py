"""A reasoning budget (ik_llama.cpp's `--reasoning-budget N`, a chat request's
`thinking_budget_tokens`): at most N tokens inside a `<think>` block, then the end of the block is
forced — an optional message and the closing tag, token by token — and the answer goes on.

Why a state machine over token ids and not over text: it runs beside the sampler, one token at a
time, in the scheduler's thread; the tags are matched as the token sequences they encode to. The
rules are ik's (common/reasoning-budget.cpp): counting starts at the opening tag (the prompt's own
included: R1's generation prompt opens the block), a natural closing tag ends it, the budget runs
out on a token that completes its UTF-8 character (or waits for the one that does), the forced
tokens replace whatever the sampler would draw, and a later opening tag gets a fresh budget.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = "idle", "counting", "waiting_utf8", "forcing", "done"


class _Matcher:
    """Whether a token sequence has just been completed, fed one id at a time."""

    def __init__(self, ids: Sequence[int]):
        self.ids, self.pos = list(ids), 0

    def advance(self, tok: int) -> bool:
        if not self.ids:
            return False
        if tok == self.ids[self.pos]:
            self.pos += 1
            if self.pos == len(self.ids):
                self.pos = 0
                return True
            return False
        self.pos = 1 if tok == self.ids[0] else 0
        return False


class ReasoningBudget:
    """One request's budget: `accept` every token of the prompt's tail and of the answer, `forced`
    the id the next token must be (None: the sampler's), `free_steps` how many tokens may come
    from the sampler before it could force one (the scheduler's device loop stays within it)."""

    def __init__(self, budget: int, start: Sequence[int], end: Sequence[int], forced: Sequence[int],
                 piece: Callable[[int], bytes] | None = None):
        """`piece`: a token's bytes (the tokenizer's), read only where the budget runs out, to wait
        for a whole character (None: every token taken as whole)."""
        if budget < 0:
            raise ValueError("a reasoning budget is >= 0 (-1 means none: make no ReasoningBudget)")
        self.budget, self.remaining = budget, budget
        self._start, self._end, self.forced_ids = _Matcher(start), _Matcher(end), list(forced)
        self.state, self._pos = IDLE, 0
        self._piece = piece

    def _open(self) -> None:
        self.state, self.remaining = COUNTING, self.budget
        self._end.pos = 0
        if self.remaining <= 0:
            self.state, self._pos = FORCING, 0

    def _complete(self, tok: int, complete: bool | None) -> bool:
        if complete is not None:
            return complete
        return self._piece is None or utf8_complete(self._piece(tok))

    def accept(self, tok: int, complete: bool | None = None, prompt: bool = False) -> None:
        """The token that came (`complete`: its text ends a UTF-8 character, None: as `piece` says,
        asked only where it matters; `prompt`: one of the
        prompt's, which count against the budget as ik's prefill tokens do but are never taken for
        a forced one: R1's `<think>\n` with a budget of 0 forced nothing, its newline taken for the
        first forced token)."""
        if self.state == FORCING and prompt:
            return
        if self.state in (IDLE, DONE):
            if self._start.advance(tok):
                self._open()
        elif self.state in (COUNTING, WAITING_UTF8):
            if self._end.advance(tok):
                self.state = DONE
            elif self.state == WAITING_UTF8:
                if self._complete(tok, complete):
                    self.state, self._pos = FORCING, 0
            else:
                self.remaining -= 1
                if self.remaining <= 0:
                    self.state, self._pos = (FORCING, 0) if self._complete(tok, complete) else (WAITING_UTF8, 0)
                    self._end.pos = 0
        elif self.state == FORCING:
            self._pos += 1
            if self._pos >= len(self.forced_ids):
                self.state = DONE

    def forced(self) -> int | None:
        if self.state == FORCING and self._pos < len(self.forced_ids):
            return self.forced_ids[self._pos]
        return None

    def free_steps(self) -> int | None:
        """Tokens the sampler may give before one could be forced (None: no limit)."""
        if self.state in (FORCING, WAITING_UTF8):
            return 0
        if self.state == COUNTING:
            return self.remaining
        if not self._start.ids:
            return None
        # idle or done: the opening tag's tokens still to come, then the budget (its tokens are not forced)
        return len(self._start.ids) - self._start.pos + self.budget


def utf8_complete(piece: bytes) -> bool:
    """Whether a token's bytes end on a whole UTF-8 character (a token may carry half of one)."""
    for back in range(1, min(4, len(piece)) + 1):
        b = piece[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
        return back >= need
    return not piece  # only continuation bytes: their lead came in an earlier token
