"""Request bodies in, checked parameters out; errors as OpenAI-style JSON.

Every field the endpoints read is checked here, by name, before anything reaches the scheduler:
a bad request is one `ApiError` (status 400 and a one-line message naming the field), which the
app turns into `{"error": {"message", "type", "code"}}` — llama-server's shape, which is OpenAI's
with the status as `code`. Unknown fields are ignored, as both servers do (clients send their own).

Field names and defaults are llama-server's: `n_predict` (/completion) and `max_tokens` /
`max_completion_tokens` (OpenAI) with -1 or absent = until the slot's context is full;
`temperature top_k top_p min_p seed` default to the server's `--temp --top-k --top-p --min-p -s`.
"""
from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ikjax.chat_template import ROLES, ChatTemplateError, text_of_parts
from ikjax.errors import IkjaxError
from ikjax.runtime.sampling import check_top_logprobs

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               431: "invalid_request_error",
               500: "server_error", 501: "not_supported_error",
               503: "unavailable_error"}


class ApiError(Exception):
    """An HTTP error answered as JSON: status, one-line message, OpenAI's error type."""

    def __init__(self, status: int, message: str, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": self.type}}


def bad(message: str) -> ApiError:
    return ApiError(400, message)


# repeat_penalty's range: llama.cpp takes any float, but past these the penalized logits overflow
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY = 1e-6, 1e6


@dataclass
class Defaults:
    """The server's sampling defaults (its --temp --top-k --top-p --min-p -s -n flags,
    --reasoning-budget / --reasoning-budget-message for chat answers, and --keep)."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    n_predict: int = -1
    reasoning_budget: int = -1  # -1: none
    reasoning_budget_message: str = ""
    n_keep: int = 0  # --keep: a request's n_keep when it gives none


@dataclass
class GenParams:
    max_tokens: int | None  # None: until the slot's context is full
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_prompt: bool = True
    ignore_eos: bool = False
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalize_nl: bool = False  # llama-server's: the penalties count the newline token too
    return_tokens: bool = False
    timings_per_token: bool = False  # llama-server's: every streamed event carries `timings` so far
    top_logprobs: int | None = None  # log-probabilities of each token and this many alternatives; None: none
    logit_bias: Any = None  # as the request gave it: checked against the vocabulary by Scheduler.make_request
    id_slot: int | None = None  # llama-server's id_slot: run on this slot (check_slot); None: the scheduler's choice
    reasoning_budget: int = -1  # tokens inside a <think> block before its end is forced (-1: none)
    reasoning_budget_message: str = ""
    n_keep: int = 0  # the context shift's: prompt tokens kept when a slot is full (-1: all of them)
    n_discard: int = 0  # ... and tokens dropped a shift (0: half of those after n_keep)

    def sampling(self) -> dict:
        """The scheduler's sampling keywords (Scheduler.make_request), the context shift's with them."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    seed=self.seed, repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                    frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                    penalize_nl=self.penalize_nl, top_logprobs=self.top_logprobs, logit_bias=self.logit_bias,
                    reasoning_budget=self.reasoning_budget, reasoning_budget_message=self.reasoning_budget_message,
                    n_keep=self.n_keep, n_discard=self.n_discard)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def json_type(v: Any) -> str:
    """A decoded JSON value's type as JSON names it (a client sent JSON, not Python's NoneType)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def json_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad(f"request body: expected a JSON object, got {json_type(body)}")
    return body


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _get(body: dict, name: str, check, what: str, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise bad(f"{name}: expected {what}, got {v!r}"[:300])
    return v


def logprobs_field(body: dict, endpoint: str) -> int | None:
    """How many alternatives to report beside each token's log-probability, None for none, as each
    endpoint asks: chat `logprobs` (true/false) with `top_logprobs` (0-20); completions `logprobs`
    (an integer, 0-5 in OpenAI's API, up to 20 here); /completion `n_probs` (0 = none)."""
    if endpoint in ("chat", "completions") and body.get("logprobs") is None and body.get("n_probs") not in (None, 0):
        # llama-server's own field on the OpenAI endpoints: its alternatives as the endpoint's logprobs
        return check_top_logprobs(body.get("n_probs"), "n_probs")
    if endpoint == "chat":
        on = _get(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
        k = check_top_logprobs(body.get("top_logprobs"), "top_logprobs")
        if k is not None and not on:
            raise bad("top_logprobs: needs logprobs: true")
        return (k or 0) if on else None
    if endpoint == "completions":
        return check_top_logprobs(body.get("logprobs"), "logprobs")
    return check_top_logprobs(body.get("n_probs"), "n_probs") or None


# llama-server's samplers and limits this server does not run, each with a test of whether a value
# asks for it and the value that turns it off, as ik_llama.cpp reads them (common/sampling.h: typical_p
# and tfs_z off at 1 and above, top_n_sigma at 0 and below, dynatemp_range at 0 and below, the adaptive
# target below 0): a request asking for one is refused (a 400 naming it), never answered as if it had not
# asked; one at an off value (what ik's own web UI sends with every request) is fine
_NOT_RUN = {
    "mirostat": (lambda v: v != 0, "0"),
    "typical_p": (lambda v: v < 1, "1"),
    "tfs_z": (lambda v: v < 1, "1"),  # (ik's tail-free sampling)
    "dry_multiplier": (lambda v: v != 0, "0"),
    "xtc_probability": (lambda v: v > 0, "0"),
    "top_n_sigma": (lambda v: v > 0, "0"),
    "dynatemp_range": (lambda v: v > 0, "0"),
    "adaptive_target": (lambda v: v >= 0, "-1"),  # (ik's adaptive-p sampler)
    "min_keep": (lambda v: v > 1, "0"),  # (ik keeps max(1, min_keep): 1 is off too)
    # (llama.cpp's time limits: off at 0 and below, -1 its default; the prompt's is not run there either)
    "t_max_predict_ms": (lambda v: v > 0, "-1"),
    "t_max_prompt_ms": (lambda v: v > 0, "-1"),
    "n_indent": (lambda v: v != 0, "0"),
}
# other servers' fields (vLLM's, llama-server's) that ask for what is not done here, each with a
# test of whether the request asks for it: refused as _NOT_RUN's, never ignored
_NOT_DONE = {
    "min_tokens": (lambda v: v not in (None, 0), "a minimum length is not enforced here"),
    "stop_token_ids": (lambda v: v not in (None, []), "give stop strings (`stop`) instead"),
    "include_stop_str_in_output": (lambda v: v not in (None, False), "the stop string is never included here"),
    "prompt_logprobs": (lambda v: v is not None, "the prompt's log-probabilities are not returned here"),
    "guided_json": (lambda v: v is not None, "grammar-constrained sampling is not supported here"),
    "guided_regex": (lambda v: v is not None, "grammar-constrained sampling is not supported here"),
    "guided_choice": (lambda v: v is not None, "grammar-constrained sampling is not supported here"),
    "guided_grammar": (lambda v: v is not None, "grammar-constrained sampling is not supported here"),
    "post_sampling_probs": (lambda v: v not in (None, False), "probabilities are the model's, before sampling"),
    # vLLM's and OpenAI's other fields that would change the answer (a probe found them ignored)
    "structured_outputs": (lambda v: v is not None, "grammar-constrained sampling is not supported here"),
    "allowed_token_ids": (lambda v: v not in (None, []), "the vocabulary is not restricted here (logit_bias -100 "
                                                         "bans a token)"),
    "bad_words": (lambda v: v not in (None, []), "words are not banned here (logit_bias -100 bans a token)"),
    "truncate_prompt_tokens": (lambda v: v is not None, "prompts are never cut here (one too long for a slot is a "
                                                        "400)"),
    "use_beam_search": (lambda v: v not in (None, False), "beam search is not run here"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "beam search is not run here"),
    "skip_special_tokens": (lambda v: v is False, "special tokens are always left out of the text here"),
    "functions": (lambda v: v is not None, "OpenAI's deprecated functions: give `tools`"),
    "function_call": (lambda v: v is not None, "OpenAI's deprecated function_call: give `tool_choice`"),
    "lora": (lambda v: v not in (None, []), "LoRA adapters are not supported here"),
    "response_fields": (lambda v: v is not None, "the response's fields are not selectable here"),
    "modalities": (lambda v: v not in (None, ["text"]), "this model answers in text only"),
    "audio": (lambda v: v is not None, "this model answers in text only"),
    "best_of": (lambda v: v not in (None, 1), "one answer is made a prompt (best_of 1)"),
    # llama-server's multimodal fields on /completion (chat's image parts are refused by messages_field)
    "image_data": (lambda v: v not in (None, []), "this model reads text only"),
    "multimodal_data": (lambda v: v not in (None, []), "this model reads text only"),
    # ik_llama.cpp's server's own fields that change the answer
    "banned_strings": (lambda v: v not in (None, []), "strings are not banned here (logit_bias -100 bans a token)"),
    "banned_regex": (lambda v: v not in (None, []), "strings are not banned here"),
    "banned_regex_case_insensitive": (lambda v: v not in (None, []), "strings are not banned here"),
    "penalty_prompt": (lambda v: v is not None, "the penalties read the prompt and the answer here"),
    "system_prompt": (lambda v: v not in (None, ""), "no server-wide system prompt here: put it in the prompt or "
                                                      "messages"),
}
_ORDER = ("top_k", "top_p", "min_p", "temperature")  # the order this server applies its filters in
# sampler names as ik_llama.cpp's server reads them (common/sampling.cpp: its names, their other spellings,
# one letter each in the string form) and mainline llama.cpp's: the ones run here, and the ones not run
# here (their settings are checked as _NOT_RUN's: named in `samplers` at their off values, they change nothing)
_SAMPLER_NAMES = {"top_k": "top_k", "top-k": "top_k", "k": "top_k", "top_p": "top_p", "top-p": "top_p",
                  "nucleus": "top_p", "p": "top_p", "min_p": "min_p", "min-p": "min_p", "m": "min_p",
                  "temperature": "temperature", "temp": "temperature", "t": "temperature",
                  "penalties": "penalties", "e": "penalties"}
_SAMPLERS_NOT_RUN = {"dry": "dry", "d": "dry", "typical_p": "typical_p", "typical-p": "typical_p", "typical": "typical_p",
                     "typ_p": "typical_p", "typ": "typical_p", "y": "typical_p", "tfs_z": "tfs_z", "tfs-z": "tfs_z",
                     "tfs": "tfs_z", "f": "tfs_z", "xtc": "xtc", "x": "xtc", "top_n_sigma": "top_n_sigma",
                     "top-n-sigma": "top_n_sigma", "n": "top_n_sigma", "adaptive_p": "adaptive_p",
                     "adaptive-p": "adaptive_p", "w": "adaptive_p", "infill": "infill", "i": "infill",
                     "s": "top_n_sigma", "dist": "dist"}  # (mainline's "s" is top_n_sigma; ik's is the final draw)


def _check_not_run(body: dict) -> list[str] | None:
    """Refuse the samplers and limits that are not run here (`_NOT_RUN`, `_NOT_DONE`) at a value
    that asks for them, and a `samplers` order other than this server's (top_k, top_p, min_p,
    temperature; penalties, where named, first). Returns the samplers `samplers` names that run here
    (None: not given): the others of those four are off for this request, as in llama-server's chain.
    The penalties always run (ik_llama.cpp applies them before its chain, named or not)."""
    for name, (asks, why) in _NOT_DONE.items():
        if asks(body.get(name)):
            raise bad(f"{name}: not supported ({why}); leave it out")
    for name, (on, off) in _NOT_RUN.items():
        v = body.get(name)
        if v is None:
            continue
        if not _is_num(v):
            raise bad(f"{name}: expected a number, got {v!r}"[:300])
        if name == "xtc_probability" and _is_num(body.get("xtc_threshold")) and body["xtc_threshold"] > 0.5:
            continue  # (XTC is off at a threshold above 0.5, whatever its probability)
        if on(v):
            raise bad(f"{name}: this sampler / limit is not supported here; leave it out or at {off} (off)")
    order = body.get("samplers")
    if order is None:
        return None
    if isinstance(order, str) and ";" in order:  # names joined by ";" (llama-cli's --samplers form)
        given = [x.strip().lower() for x in order.split(";") if x.strip()]
    elif isinstance(order, str):  # the short form: one letter a sampler, "kpmt" (ik's web UI: "kdypmxntw")
        given = list(order)
    elif isinstance(order, list) and all(isinstance(x, str) for x in order):
        given = [x.lower() for x in order]
    else:
        raise bad(f"samplers: expected a list of sampler names, got {order!r}"[:300])
    unknown = [x for x in given if x not in _SAMPLER_NAMES and x not in _SAMPLERS_NOT_RUN]
    if unknown:
        raise bad(f"samplers: {', '.join(map(str, unknown))} unknown (this server runs penalties, top_k, top_p, "
                  f"min_p, temperature)"[:300])
    names = list(dict.fromkeys(_SAMPLER_NAMES[x] for x in given if x in _SAMPLER_NAMES))  # ("kkt": top_k once)
    kept = [x for x in names if x in _ORDER]
    if kept != [x for x in _ORDER if x in kept] or ("penalties" in names and names.index("penalties") != 0):
        raise bad(f"samplers: this server applies penalties, top_k, top_p, min_p, temperature in that order; "
                  f"got {', '.join(given)}"[:300])
    return names


_ID = re.compile(r"\s*-?[0-9]+\s*")  # a token id as text: ASCII digits only ("²".isdigit() is true)
MAX_BIAS_TEXT = 65536  # characters of logit_bias text in one request


def _bias_items(bias) -> list[tuple[Any, Any, bool]] | None:
    """(key, bias, whether the key is text) of each `logit_bias` entry, as ik_llama.cpp's server reads
    them: in the object form a key that is not an integer is text, in the list form a pair's first
    element that is a string (there even "42" is text). None for another shape (refused later)."""
    if isinstance(bias, dict):
        return [(k, v, isinstance(k, str) and not _ID.fullmatch(k)) for k, v in bias.items()]
    if isinstance(bias, list) and all(isinstance(p, list) and len(p) == 2 for p in bias):
        return [(k, v, isinstance(k, str)) for k, v in bias]
    return None


def bias_has_text(bias) -> bool:
    """Whether `logit_bias` names tokens by text anywhere (`bias_by_id` then tokenizes it)."""
    return any(text for _, _, text in _bias_items(bias) or ())


def bias_by_id(bias, encode: Callable[[str], list[int]]):
    """`logit_bias` with its text keys (`_bias_items`) tokenized (no special tokens), each of the
    text's tokens getting the bias. Returns the bias with ids only, as {id: bias} (checked against
    the vocabulary by Scheduler.make_request; a later entry wins, as in ik); another shape as given.
    At most MAX_BIAS_TEXT characters of text (a 32 MiB body of keys held the server ~40 s)."""
    items = _bias_items(bias)
    if items is None:
        return bias
    if sum(len(k) for k, _, text in items if text) > MAX_BIAS_TEXT:
        raise bad(f"logit_bias: more than {MAX_BIAS_TEXT} characters of text")
    out: dict = {}
    for k, v, text in items:
        if not text:
            out[str(k).strip() if isinstance(k, str) else k] = v
            continue
        try:
            ids = encode(k)
        except IkjaxError as e:  # (a lone surrogate: not UTF-8)
            raise bad(f"logit_bias: {k[:40]!r}: {e}"[:300]) from None
        for t in ids:
            out[t] = v
    return out


def text_offsets(pieces: list[bytes], start: int = 0) -> list[int]:
    """/v1/completions' logprobs.text_offset: where each token's text starts, in characters of the
    answer's text (`start`: the characters before the first). A token that ends inside a UTF-8
    character (byte-level vocabularies split them) adds that character only with the token that
    completes it, as the answer's text does; counting each piece decoded alone overran the text."""
    chars = codecs.getincrementaldecoder("utf-8")("replace")
    out = []
    for b in pieces:
        out.append(start)
        start += len(chars.decode(b))
    return out


def check_slot(body: dict, n_slots: int) -> int | None:
    """llama-server's `id_slot`: -1 (any: the scheduler picks the slot whose cache shares most of
    the prompt) or a slot that exists, which the request then runs on (waiting for it if it is
    busy: what pins a client's prompt cache to its slot); a 400 otherwise. Returns the slot, or
    None for any."""
    v = body.get("id_slot")
    if v is not None and (not _is_int(v) or not -1 <= v < n_slots):
        raise bad(f"id_slot: expected -1 or a slot 0..{n_slots - 1}, got {v!r}"[:300])
    return None if v is None or v == -1 else v


def check_completions_only(body: dict) -> None:
    """/v1/completions' fields this server does not do, refused as llama-server refuses them
    ("Unsupported param"): `suffix` (fill-in-the-middle); `best_of` other than 1 on every endpoint
    (`_NOT_DONE`)."""
    if body.get("suffix") not in (None, ""):
        raise bad("suffix: not supported here (no fill-in-the-middle); leave it out")


def gen_params(body: dict, d: Defaults, *, max_names: tuple[str, ...], endpoint: str = "completion") -> GenParams:
    """The generation fields of any of the three generate endpoints (`endpoint`: chat,
    completions or completion, which say how log-probabilities are asked for)."""
    n = None
    for name in max_names:  # the first one given wins
        if body.get(name) is not None:
            n = _get(body, name, _is_int, "an integer (-1 = until the context is full)", None)
            if n < -1:
                raise bad(f"{name}: expected an integer >= -1 (-1 = until the context is full), got {n}")
            if n == 0 and name != "n_predict":  # (OpenAI's 400; llama-server's n_predict 0 evaluates the prompt)
                raise bad(f"{name}: expected at least 1 (or -1 = until the context is full), got 0")
            break
    if n is None:
        n = d.n_predict
    temperature = float(_get(body, "temperature", lambda v: _is_num(v) and math.isfinite(v),
                             "a number (0 or below: greedy)", d.temperature))
    temperature = max(temperature, 0.0)  # (llama-server: a temperature <= 0 samples greedily)
    top_k = _get(body, "top_k", _is_int, "an integer (<= 0 = off)", d.top_k)
    top_p = float(_get(body, "top_p", lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]", d.top_p))
    min_p = float(_get(body, "min_p", lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]", d.min_p))
    seed = _get(body, "seed", _is_int, "an integer (-1 = random)", d.seed)
    if seed < -1:  # ik reads the seed as a uint32: only -1 (0xFFFFFFFF) draws one, -2 is 4294967294
        seed &= 0xFFFFFFFF
    if seed == 0xFFFFFFFF:
        seed = -1
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad(f"stop: expected a string or a list of strings, got {stop!r}"[:300])
    if len(stop) > 16:
        raise bad(f"stop: at most 16 stop strings, got {len(stop)}")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if body.get("stream_options") is not None and not stream:  # (OpenAI's 400)
        raise bad("stream_options: only with stream true")
    include_usage = _get(opts, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    cache_prompt = _get(body, "cache_prompt", lambda v: isinstance(v, bool), "true or false", True)
    ignore_eos = _get(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False)
    # bounded: a logit divided or multiplied by 1e308 (or 1e-320) is not finite (a 500 before)
    lo, hi = MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY
    pname = "repeat_penalty"
    if body.get("repetition_penalty") is not None:  # vLLM's name, over every token of the context
        if body.get("repeat_penalty") is not None:
            raise bad("repetition_penalty and repeat_penalty: give one of them")
        pname = "repetition_penalty"
    repeat_penalty = float(_get(body, pname, lambda v: _is_num(v) and lo <= v <= hi,
                                f"a number in [{lo:g}, {hi:g}] (1 = off)", 1.0))
    last_n = "repeat_last_n" if body.get("repeat_last_n") is not None else "penalty_last_n"  # (mainline's name)
    repeat_last_n = _get(body, last_n, lambda v: _is_int(v) and v >= -1,
                         "an integer >= -1 (0 = off, -1 = the context)", -1 if pname == "repetition_penalty" else 64)
    # checked with the other penalties by sampling.check_penalty (Scheduler.make_request; a 400)
    # (null, as OpenAI's clients send for "not given": the default)
    frequency_penalty = _or(body.get("frequency_penalty"), 0.0)
    presence_penalty = _or(body.get("presence_penalty"), 0.0)
    penalize_nl = _get(body, "penalize_nl", lambda v: isinstance(v, bool), "true or false", False)
    budget = reasoning_budget_field(body, d, endpoint)
    # the context shift's (serve --context-shift: a slot that is full keeps n_keep prompt tokens and drops
    # n_discard of the rest; without it a prompt that does not fit is a 400, as before)
    n_keep = _get(body, "n_keep", lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1: the whole prompt)",
                  d.n_keep)
    n_discard = _get(body, "n_discard", lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: half)", 0)
    return_tokens = _get(body, "return_tokens", lambda v: isinstance(v, bool), "true or false", False)
    timings_per_token = _get(body, "timings_per_token", lambda v: isinstance(v, bool), "true or false", False)
    _get(body, "user", lambda v: isinstance(v, str), "a string", None)  # (OpenAI's and vLLM's 400; not used here)
    count = _get(body, "n", _is_int, "an integer", 1)
    if count != 1:
        raise bad(f"n: only one choice per request is supported, got {count}")
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is not None and kind != "text":  # refused, not ignored: an answer would not keep to the format
        raise bad(f"response_format: {kind!r} is not supported (no grammar-constrained sampling here); "
                  f"only {{\"type\": \"text\"}}")
    for name in ("grammar", "json_schema"):  # llama-server's constraints: refused like response_format (a
        # json_schema of {} too: llama-server makes it a grammar for any JSON value)
        if body.get(name) not in (None, ""):
            raise bad(f"{name}: grammar-constrained sampling is not supported here; leave {name} out")
    kept = _check_not_run(body)
    if kept is not None:  # llama-server's chain: a sampler left out of `samplers` does not run
        top_k = top_k if "top_k" in kept else 0
        top_p = top_p if "top_p" in kept else 1.0
        min_p = min_p if "min_p" in kept else 0.0
        if "temperature" not in kept and temperature > 0:  # the distribution as it is (greedy stays greedy)
            temperature = 1.0
    # after the chain's filter: a top_p of 0 left out of `samplers` does not run, so it must not set top_k
    if top_p == 0.0:  # "only the most likely token": what top_p -> 0 means, without an empty set
        top_p, top_k = 1.0, 1
    return GenParams(max_tokens=None if n == -1 else n, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                     min_p=min_p, seed=None if seed < 0 else seed, stop=[s for s in stop if s], stream=stream,
                     include_usage=include_usage, cache_prompt=cache_prompt, ignore_eos=ignore_eos,
                     repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
                     presence_penalty=presence_penalty, penalize_nl=penalize_nl, return_tokens=return_tokens,
                     timings_per_token=timings_per_token,
                     top_logprobs=logprobs_field(body, endpoint), logit_bias=body.get("logit_bias"),
                     reasoning_budget=budget, reasoning_budget_message=d.reasoning_budget_message, n_keep=n_keep,
                     n_discard=n_discard)


def reasoning_budget_field(body: dict, d: Defaults, endpoint: str) -> int:
    """ik's reasoning budget of a request: on chat, the server's --reasoning-budget, else the
    request's `thinking_budget_tokens` (or `reasoning_budget_tokens`); -1 none. The other endpoints
    have no template that says where reasoning starts: a budget asked there is a 400, not ignored."""
    names = [n for n in ("thinking_budget_tokens", "reasoning_budget_tokens") if body.get(n) is not None]
    for n in names:
        v = body[n]
        if not _is_int(v) or v < -1:
            raise bad(f"{n}: expected an integer >= -1 (-1 = no budget), got {v!r}"[:300])
    asked = [body[n] for n in names if body[n] != -1]
    if endpoint != "chat":
        if asked:
            raise bad(f"{names[0]}: a reasoning budget is for chat requests (/v1/chat/completions), whose "
                      f"template opens the reasoning; leave it out here")
        return -1
    if len(set(asked)) > 1:
        raise bad("thinking_budget_tokens and reasoning_budget_tokens: give one of them")
    return d.reasoning_budget if d.reasoning_budget >= 0 or not asked else asked[0]


def prompt_field(body: dict, name: str = "prompt") -> str | list:
    """A prompt: text, or token ids; a list holding one of them (OpenAI's batch form) is that one;
    or llama-server's mixed form, ids and texts in one list ([12, 34, "text", 56])."""
    p = body.get(name)
    if p is None:
        raise bad(f"{name}: missing")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise bad(f"{name}: one prompt here (got {len(p)})")
    if isinstance(p, list) and p and all(_is_int(t) or isinstance(t, str) for t in p):
        return p  # mixed: the server tokenizes the texts (Server._prompt_ids)
    raise bad(f"{name}: expected a string or a non-empty list of token ids"
              + (", got an empty list" if p == [] else f", got {json_type(p)}"))


MAX_PROMPTS = 16  # prompts in one request (each a job of its own, as ik_llama.cpp's tasks)


def prompts_field(body: dict) -> list:
    """The prompts of a completion request: one (`prompt_field`), or several, as llama-server and
    OpenAI take them: a list of two or more texts or id lists (a list holding any id is one prompt,
    llama-server's mixed form). Each is checked as `prompt_field` checks one."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        if len(p) > MAX_PROMPTS:
            raise bad(f"prompt: at most {MAX_PROMPTS} prompts a request, got {len(p)}")
        return [prompt_field({f"prompt[{i}]": t}, f"prompt[{i}]") for i, t in enumerate(p)]
    return [prompt_field(body)]


def messages_field(body: dict) -> list[dict]:
    """Chat messages: role and content, content as text or a list of text parts."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages: expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]: expected an object with role and content, got {json_type(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role: expected a string, got {role!r}")
        if role == "function":
            raise bad(f"messages[{i}].role: 'function' (OpenAI's deprecated form) is not supported; send a tool's "
                      f"result as role 'tool'")
        if role not in ROLES:  # a template drops a role it does not know: the message would vanish unseen
            raise bad(f"messages[{i}].role: expected one of {', '.join(ROLES)}, got {role!r}"[:300])
        content = m.get("content")
        if isinstance(content, list):
            try:
                content = text_of_parts(content, i)  # as llama-server joins a text-only model's parts
            except ChatTemplateError as e:
                raise bad(str(e)) from None
        elif content is None:  # kept None beside tool_calls: R1's template tells a call turn by it
            if role != "assistant":  # OpenAI's 400 (llama-server: "Missing 'content'"); an assistant
                # turn may be all calls, or empty
                raise bad(f"messages[{i}]: a {role} message needs content (a string or text parts)")
            content = None if m.get("tool_calls") else ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content: expected a string or a list of text parts, got "
                      f"{type(content).__name__}")
        msg = dict(m, role=role, content=content)
        out.append(msg)
    return out


def tokens_field(body: dict, name: str = "tokens") -> list[int]:
    toks = body.get(name)
    if not isinstance(toks, list) or not all(_is_int(t) for t in toks):
        raise bad(f"{name}: expected a list of token ids")
    return toks


def text_field(body: dict, name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str):
        raise bad(f"{name}: expected a string, got {type(v).__name__ if v is not None else 'nothing'}")
    return v


def bool_field(body: dict, name: str, default: bool) -> bool:
    return _get(body, name, lambda v: isinstance(v, bool), "true or false", default)


FINISH = {"eos": "stop", "stop": "stop", "max_tokens": "length", "context": "length"}


def usage(prompt_n: int, completion_n: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_n, "completion_tokens": completion_n, "total_tokens": prompt_n + completion_n,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- OpenAI's Responses API (POST /v1/responses), served through the chat endpoint's machinery ------------

_RESPONSES_REFUSED = {
    "previous_response_id": "responses are not stored here; send the conversation as `input`",
    "background": "no background responses here",
    "prompt": "no stored prompts here",
    "conversation": "conversations are not stored here; send them as `input`",
    "top_logprobs": "no log-probabilities on this endpoint here; the chat endpoint gives them",
}


def responses_to_chat(body: dict) -> dict:
    """A Responses API request as the chat request it means (ik_llama.cpp's conversion, the rules read
    from its server: `instructions` a system message first; `input` a user message, or a list of items:
    messages of input_text parts (user / system / developer), assistant messages of output_text parts,
    function_call and function_call_output items as a call turn and a tool message; reasoning items of
    earlier answers dropped, as DeepSeek's templates drop earlier reasoning). `max_output_tokens` is
    max_tokens, function tools are chat tools; the sampling fields go as they are."""
    for name, why in _RESPONSES_REFUSED.items():
        if body.get(name) not in (None, False, ""):
            raise bad(f"{name}: not supported ({why})")
    if "input" not in body:
        raise bad("input: required (a string, or a list of input items)")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "max_output_tokens", "tools",
                                                         "tool_choice", "text", "reasoning", "store", "include",
                                                         "metadata", "truncation", "service_tier", "top_logprobs")}
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad(f"instructions: expected a string, got {json_type(instructions)}")
        messages.append({"role": "system", "content": instructions})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            messages += _response_item(item, i, messages)
    else:
        raise bad("input: expected a string or a non-empty list of input items")
    if not any(m["role"] != "system" for m in messages):
        raise bad("input: no message to answer (only instructions / system messages)")
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        n = body["max_output_tokens"]
        if not _is_int(n) or n < 1:
            raise bad(f"max_output_tokens: expected an integer >= 1, got {n!r}"[:300])
        chat["max_tokens"] = n
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise bad("text: expected an object")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("text.format: only {\"type\": \"text\"} (no grammar-constrained sampling here)")
    if body.get("tools") is not None:
        chat["tools"] = _response_tools(body["tools"])
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad("metadata: expected an object")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat


def _text_parts(content, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content: expected a string or a list of parts, got {json_type(content)}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{where}.content[{j}]: {kind} is not supported (a text-only model)")
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{j}]: expected a part of type {' or '.join(kinds)} with text")
        out.append(part["text"])
    return "".join(out)


def _response_item(item, i: int, messages: list[dict]) -> list[dict]:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad(f"{where}: expected an object, got {json_type(item)}")
    kind, role = item.get("type"), item.get("role")
    if kind in (None, "message") and role in ("user", "system", "developer"):
        return [{"role": role, "content": _text_parts(item.get("content"), where, ("input_text", "text"))}]
    if kind in (None, "message") and role == "assistant":
        return [{"role": "assistant", "content": _text_parts(item.get("content"), where,
                                                              ("output_text", "input_text", "text"))}]
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise bad(f"{where}.{name}: expected a string")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
            messages[-1]["tool_calls"].append(call)  # (several calls of one turn: one assistant message)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad(f"{where}.call_id: expected a string")
        return [{"role": "tool", "tool_call_id": item["call_id"],
                 "content": _text_parts(item.get("output"), where, ("input_text", "output_text", "text"))}]
    if kind == "reasoning":
        return []
    raise bad(f"{where}: expected a message (role user, system, developer or assistant), a function_call or a "
              f"function_call_output item, got type {kind!r}, role {role!r}"[:300])


def _response_tools(tools) -> list[dict]:
    """The function tools (Responses' flat form) as chat tools; built-in tools (web_search, custom, ...)
    left out, as ik's server leaves them (coding agents send them with every request)."""
    if not isinstance(tools, list):
        raise bad("tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad(f"tools[{i}]: expected an object, got {json_type(t)}")
        if t.get("type") != "function":
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"tools[{i}].name: a function tool needs a name ({{type: function, name, parameters}})")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise bad(f"tools[{i}].parameters: expected a JSON schema object")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def response_usage(prompt_n: int, completion_n: int, cached: int, reasoning_n: int = 0) -> dict:
    """The Responses API's usage object (`reasoning_n`: the output's reasoning tokens)."""
    return {"input_tokens": prompt_n, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion_n, "output_tokens_details": {"reasoning_tokens": min(reasoning_n, completion_n)},
            "total_tokens": prompt_n + completion_n}
