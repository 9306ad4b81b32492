"""Byte-level BPE tokenizer built from a GGUF's `tokenizer.ggml.*` metadata with Hugging Face `tokenizers`.

`tokenizer.ggml.model = gpt2` (byte-level BPE: tokens, merges, token types) and
`tokenizer.ggml.pre` choosing the pre-tokenizer regexes as llama.cpp does (deepseek-v3,
deepseek-llm, deepseek-coder, glm4, kimi-k2, gpt-2 / gigachat; a file without the key gets
deepseek-v3). CONTROL tokens are added as special tokens and USER_DEFINED ones (R1's <think>)
as non-special added tokens: both matched whole in text, only the first skipped by
parse_special=False and by a decode that skips special tokens (llama.cpp's rules).

What ik_llama.cpp refuses (src/llama-vocab.cpp) is refused here too, naming the key, rather than
tokenizing some other way: a BPE vocabulary without `tokenizer.ggml.merges` (it would split every
prompt into single bytes and the model would see other text) and a pre-tokenizer name this module
has no regexes for (ik throws "unknown pre-tokenizer type" for names it does not know; GPT-2's
splitting in their place would cut words differently from the model's training). Merges that are
not "A B" strings of vocabulary tokens are refused by entry, before the `tokenizers` library sees
them (it raises its own exception, or panics, on them).
"""
from __future__ import annotations

import functools

from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ikjax.errors import ModelFileError, OptionError
from ikjax.gguf_io.writer import bytes_to_unicode

# llama.cpp llama-vocab.cpp regexes per pre-tokenizer (DeepSeek's own tokenizer.json have the same)
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_DEEPSEEK_LLM = [
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝ\u2124\u2126\u2128\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
]
_DEEPSEEK_CODER = [
    "[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
]
# GLM-4 (llama.cpp's "glm4"/"chatglm-bpe", its CHATGLM4 type): the Llama-3 pattern, contractions
# spelled case by case as llama.cpp writes them (what tokenizer.json says with (?i:...))
_GLM4 = [
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# Kimi K2 / Moonlight ("kimi-k2"): Moonshot's tiktoken pattern (tokenization_kimi.py), which
# llama.cpp quotes above its hand-written splitter: Han runs alone, words split at case changes
# as o200k does ("getUserName" -> get|User|Name). llama.cpp's splitter takes a whole run of
# non-Han letters as one word there; this follows the model's own tokenizer (the reference).
# `tokenizers`' regex engine (Oniguruma) takes the class intersections (&&) as written.
_KIMI_K2 = [
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
PRE_REGEXES: dict[str, list[str]] = {"deepseek-v3": _DEEPSEEK_V3, "deepseek-llm": _DEEPSEEK_LLM,
                                     "deepseek-coder": _DEEPSEEK_CODER, "glm4": _GLM4, "chatglm-bpe": _GLM4,
                                     "kimi-k2": _KIMI_K2}
# pre-tokenizers done by `tokenizers`' own GPT-2 ByteLevel regex (ik's LLAMA_VOCAB_PRE_TYPE_GPT2
# regex; GigaChat's "gigachat" is one of the names llama.cpp maps to it)
GPT2_PRES = ("gpt-2", "gpt2", "gigachat")
KNOWN_PRES = (*PRE_REGEXES, *GPT2_PRES)
DEFAULT_PRE = "deepseek-v3"

_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def add_bos_default(metadata) -> bool:
    """Whether text gets a BOS first, as ik_llama.cpp / llama.cpp decide it: the file's
    `tokenizer.ggml.add_bos_token` where it has one (DeepSeek's files from the converters carry
    true), else the vocabulary type's default: SPM ("llama") and WPM ("bert") add one, BPE ("gpt2":
    every deepseek2 file) none. A file without the key got a BOS here once, for DeepSeek's
    pre-tokenizers, and so other ids than ik's for the same text (RESULTS §23s)."""
    if "tokenizer.ggml.add_bos_token" in metadata:
        return bool(metadata["tokenizer.ggml.add_bos_token"])
    return str(metadata.get("tokenizer.ggml.model", "")) in ("llama", "bert")


def build_hf_tokenizer(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None = None,
                       pre: str = "deepseek-v3"):
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for this vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = _merge_pairs(merges, vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre not in KNOWN_PRES:
        raise ModelFileError(f"tokenizer.ggml.pre: unknown pre-tokenizer {pre!r} "
                             f"(ikjax knows {', '.join(KNOWN_PRES)})")
    regexes = PRE_REGEXES.get(pre)
    if regexes is None:  # GPT-2's own splitting
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    if token_types is not None:
        # control tokens (BOS, EOS, <｜User｜>) are special; user-defined ones (R1's <think>) are
        # matched in text first but are not special, as llama.cpp's tokenizer and R1's
        # tokenizer.json have them: still one token with parse_special off (llama-server's
        # /tokenize, logit_bias by text) and kept by a decode that skips the special ones
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, ty in enumerate(token_types) if int(ty) == _CONTROL]
        if special:
            tok.add_special_tokens(special)
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, ty in enumerate(token_types) if int(ty) == _USER_DEFINED]
        if user:
            tok.add_tokens(user)
    return tok


def _merge_pairs(merges: Sequence[Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """`"A B"` merge strings -> (A, B) pairs, each entry checked: a string holding a space (split at
    the first space after the first character, as ik does), A, B and AB all vocabulary tokens."""
    pairs = []
    for i, m in enumerate(merges):
        if not isinstance(m, str):
            raise ModelFileError(f"tokenizer.ggml.merges: entry {i} is {type(m).__name__} {m!r}, "
                                 f"expected a string \"A B\"")
        cut = m.find(" ", 1)
        if cut < 0:
            raise ModelFileError(f"tokenizer.ggml.merges: entry {i} {m!r} is not two tokens \"A B\"")
        a, b = m[:cut], m[cut + 1:]
        for t in (a, b, a + b):
            if t not in vocab:
                raise ModelFileError(f"tokenizer.ggml.merges: entry {i} {m!r} names {t!r}, "
                                     f"which is not in the vocabulary (tokenizer.ggml.tokens)")
        pairs.append((a, b))
    return pairs


class GGUFTokenizer:
    """encode(text) -> ids (with BOS as the file asks), decode(ids) -> text, stream(ids) -> text pieces."""

    def __init__(self, metadata: dict[str, Any], source: str = "GGUF"):
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError(f"{source}: no tokenizer in the file (tokenizer.ggml.model missing)")
        if str(model) != "gpt2":
            raise ModelFileError(f"{source}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' only)")
        if metadata.get("tokenizer.ggml.tokens") is None:
            raise ModelFileError(f"{source}: no tokenizer vocabulary in the file (tokenizer.ggml.tokens missing)")
        if metadata.get("tokenizer.ggml.merges") is None:
            # ik: "cannot find tokenizer merges in model file"; without them every word is split
            # into bytes and the model reads other tokens than it was trained on
            raise ModelFileError(f"{source}: no BPE merges in the file (tokenizer.ggml.merges missing)")
        tokens = _as_list(metadata.get("tokenizer.ggml.tokens"))
        merges = _as_list(metadata.get("tokenizer.ggml.merges"))
        types = metadata.get("tokenizer.ggml.token_type")
        self.pre = str(metadata.get("tokenizer.ggml.pre", DEFAULT_PRE))
        try:
            self.tokenizer = build_hf_tokenizer(tokens, merges, None if types is None else list(types), self.pre)
        except ModelFileError as e:
            raise ModelFileError(f"{source}: {e}") from None
        self.bos_id = _token_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens), source)
        self.eos_id = _token_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens), source)
        self.add_bos = add_bos_default(metadata) and self.bos_id is not None
        self.n_vocab = len(tokens)
        self.tokens = tokens
        self.token_types = [_NORMAL] * len(tokens) if types is None else [int(t) for t in _as_list(types)]
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_file(cls, path: str) -> "GGUFTokenizer":
        from ikjax.gguf_io.reader import GGUFModelFile
        return cls(GGUFModelFile(path).metadata, source=str(path))

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """`parse_special` False: a special token's text in `text` ("<｜User｜>") is encoded as the
        text it is, not as that token (llama-server's /tokenize `parse_special`, llama_tokenize's
        flag of that name)."""
        check_text(text)
        for name, v in (("add_bos", add_bos), ("parse_special", parse_special)):  # ("no" was read as true)
            if v is not None and not isinstance(v, (bool, np.bool_)):
                raise OptionError(f"{name}: expected True or False, got {v!r}"[:300])
        tok = self.tokenizer if parse_special else self._literal()
        # the batch call of one text: the same ids, with the GIL released while the library works
        # (`encode` holds it: a server's event loop stood still for the 20 s an 8 MB prompt took)
        batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        ids = batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its string in the vocabulary, a
        byte-level token's string a character per byte): a text longer than this times a context
        cannot fit it, known before tokenizing it (a server answers an 8 MB prompt at once)."""
        return max((len(t) for t in self.tokens if isinstance(t, str)), default=1) or 1

    def _literal(self):
        """A copy of the tokenizer that encodes special tokens' text as text (made on first use)."""
        lit = getattr(self, "_literal_tok", None)
        if lit is None:
            from tokenizers import Tokenizer
            lit = Tokenizer.from_str(self.tokenizer.to_str())
            lit.encode_special_tokens = True
            self._literal_tok = lit
        return lit

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of token ids; an id outside the vocabulary (or not an integer) is an OptionError
        naming it (an OverflowError or TypeError from the tokenizer library before, and an id
        past the vocabulary decoded to nothing)."""
        if isinstance(ids, (str, bytes)):
            raise OptionError(f"token ids: expected integers, got {type(ids).__name__}")
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < len(self.tokens):
                raise OptionError(f"token ids: {t!r} at index {i} is not a token id in [0, {len(self.tokens)})")
            out.append(int(t))
        return self.tokenizer.decode(out, skip_special_tokens=skip_special)

    def token_text(self, token_id: int | None) -> str:
        """The vocabulary string of a token as the chat template writes it (bos_token, eos_token):
        "" for None."""
        return "" if token_id is None else self.tokens[int(token_id)]

    def piece(self, token_id: int, special: bool = False) -> bytes:
        """The bytes a generated token stands for, as llama.cpp's token_to_piece gives them: a
        normal token's byte-level characters mapped back to bytes, a user-defined token's text
        as is, a control token (BOS, EOS, ...) nothing unless `special`, an unused one nothing.
        Bytes, not text: a character may be split over several tokens (`Detokenizer` joins them)."""
        key = int(token_id) * 2 + bool(special)
        got = self._pieces.get(key)
        if got is None:
            tok = self.tokens[int(token_id)]
            ty = self.token_types[int(token_id)] if int(token_id) < len(self.token_types) else _NORMAL
            if ty == _CONTROL:
                got = tok.encode("utf-8") if special else b""
            elif ty == _USER_DEFINED:
                got = tok.encode("utf-8")
            elif ty == _UNUSED:
                got = b""
            else:
                got = b"".join(bytes([_BYTE_OF[ch]]) if ch in _BYTE_OF else ch.encode("utf-8") for ch in tok)
            self._pieces[key] = got
        return got

    def detokenizer(self, special: bool = False, keep: frozenset[int] = frozenset()) -> "Detokenizer":
        """An incremental decoder of generated ids into text (see `Detokenizer`); `keep`: control
        tokens whose text is shown all the same (`ids_of`)."""
        return Detokenizer(self, special, keep)

    def ids_of(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of the vocabulary entries spelled exactly as one of `texts` (tool-call markers:
        the converter makes DeepSeek's and Kimi's control tokens, whose text a generated answer must
        still show for its calls to be parsed, as llama-server's preserved tokens)."""
        if self.__dict__.get("_index") is None:
            self._index = {t: i for i, t in enumerate(self.tokens)}
        return frozenset(self._index[t] for t in texts if t in self._index)

    def stream(self, ids: Iterable[int], special: bool = False) -> Iterator[str]:
        """Text pieces as ids arrive (the `Detokenizer`'s: a character split over tokens waits for
        its last byte; control tokens show nothing unless `special`, as llama-cli without
        --special, and as `Engine.complete` gives the text)."""
        d = self.detokenizer(special)
        for i in ids:
            piece = d.feed(int(i))
            if piece:
                yield piece
        tail = d.finish()
        if tail:
            yield tail


class Detokenizer:
    """Generated ids -> text, one token at a time: `feed(id)` returns the text that token completes
    ("" while a multi-byte UTF-8 character is still incomplete: its bytes wait for the next token),
    `finish()` the rest (an incomplete character at the very end becomes U+FFFD, as does any byte
    sequence that is not UTF-8). The text of all the deltas is the pieces' bytes decoded at once.
    O(1) a token, whatever the length of the answer."""

    def __init__(self, tokenizer: GGUFTokenizer, special: bool = False, keep: frozenset[int] = frozenset()):
        import codecs
        self._tok = tokenizer
        self._special = special
        self._keep = keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.piece(token_id, self._special or token_id in self._keep))

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)


# GPT-2's byte-level alphabet reversed: printable character -> the byte it stands for
_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def check_text(text: Any, what: str = "text") -> None:
    """Text the tokenizer can take: a str that is valid Unicode. Bytes that are not UTF-8 on the
    command line (`-p $'\\xff'`) reach Python as lone surrogates ('\\udcff', PEP 383), which the
    `tokenizers` library refuses with "TextInputSequence must be str"; named here instead."""
    if not isinstance(text, str):
        raise OptionError(f"{what}: expected a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what_is = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate U+{ch:04X}"
        raise OptionError(f"{what}: not valid UTF-8 ({what_is} at character {e.start})") from None


def _token_id(metadata: dict[str, Any], key: str, n_vocab: int, source: str) -> int | None:
    """A special token id from the file: an integer inside the vocabulary, named by its key if not
    (rather than "token id out of range" once the user has typed a prompt)."""
    v = metadata.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ModelFileError(f"{source}: {key}: expected an integer, got {type(v).__name__}")
    if not 0 <= int(v) < n_vocab:
        raise ModelFileError(f"{source}: {key} {int(v)} is outside the vocabulary of {n_vocab} tokens")
    return int(v)


def _as_list(x: Any) -> list:
    if x is None:
        return []
    if hasattr(x, "tolist"):
        return x.tolist()
    return list(x)
