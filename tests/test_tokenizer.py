"""GGUF tokenizer (HF `tokenizers`) against an independent byte-level BPE written here, and tokenizer.json."""
from __future__ import annotations


import pytest
import regex

from conftest import fixtures_dir
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.gguf_io.writer import bytes_to_unicode  # GPT-2's standard byte map, not the code under test
from ikjax.tokenizer import PRE_REGEXES, GGUFTokenizer

TEXTS = [
    "Hello world!",
    "  leading and trailing spaces   ",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1e10",
    "ñandú café naïve Ελληνικά русский текст",
    "日本語のテキスト、漢字とカタカナ。中文也可以。",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f'{x=}')",
    "emoji 🙂👍🏽 and symbols ©®™ → ∑∫",
    "<｜begin▁of▁sentence｜>special<｜end▁of▁sentence｜> tokens",
    "line1\r\nline2\n\n\nline3",
    "",
    "a" * 50 + " " + "ab" * 20,
]


class ReferenceBPE:
    """Textbook byte-level BPE: split specials, regex pre-tokenize (isolated splits in sequence), merge by rank."""

    def __init__(self, tokens, merges, types, pre):
        self.vocab = {}
        for i, t in enumerate(tokens):
            self.vocab.setdefault(t, i)
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        self.special = sorted((tokens[i] for i, ty in enumerate(types) if ty in (3, 4)), key=len, reverse=True)
        # Kimi K2's pattern intersects classes ([...&&[^\p{Han}]]), which the regex module reads
        # only in its V1 mode (as Rust's regex, tiktoken's engine, does); the others as written
        self.regexes = [regex.compile(r, regex.V1 if "&&" in r else 0) for r in PRE_REGEXES[pre]]
        self.b2u = bytes_to_unicode()

    def _split(self, pieces, rx):
        out = []
        for p in pieces:
            pos = 0
            for m in rx.finditer(p):
                if m.start() > pos:
                    out.append(p[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(p):
                out.append(p[pos:])
        return out

    def _bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            best = min(((self.ranks.get((a, b), 1 << 60), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))))
            if best[0] == 1 << 60:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.vocab[p] for p in parts]

    def encode(self, text):
        ids = []
        chunks = [text]
        if self.special:
            chunks = regex.split("(" + "|".join(regex.escape(s) for s in self.special) + ")", text)
        for c in chunks:
            if c in self.special:
                ids.append(self.vocab[c])
                continue
            pieces = [c] if c else []
            for rx in self.regexes:
                pieces = self._split(pieces, rx)
            for p in pieces:
                ids += self._bpe("".join(self.b2u[b] for b in p.encode("utf-8")))
        return ids


@pytest.fixture(scope="module")
def fixture_file():
    return sorted(fixtures_dir().glob("*.gguf"))[0]


@pytest.mark.parametrize("pre", sorted(PRE_REGEXES))
def test_matches_reference_bpe(fixture_file, pre):
    md = dict(GGUFModelFile(fixture_file).metadata)
    assert md["tokenizer.ggml.pre"] == "deepseek-v3"
    md["tokenizer.ggml.pre"] = pre
    tok = GGUFTokenizer(md)
    ref = ReferenceBPE(md["tokenizer.ggml.tokens"].tolist(), md["tokenizer.ggml.merges"].tolist(),
                       list(md["tokenizer.ggml.token_type"]), tok.pre)
    for text in TEXTS:
        assert tok.encode(text, add_bos=False) == ref.encode(text), text


def test_parse_special_false_encodes_special_tokens_text_as_text(fixture_file):
    """parse_special=False (llama-server's /tokenize field): a special token's text in the input is
    byte-level BPE text like any other (the reference without its special-token split)."""
    md = dict(GGUFModelFile(fixture_file).metadata)
    tok = GGUFTokenizer(md)
    ref = ReferenceBPE(md["tokenizer.ggml.tokens"].tolist(), md["tokenizer.ggml.merges"].tolist(),
                       list(md["tokenizer.ggml.token_type"]), tok.pre)
    ref.special = []
    for text in TEXTS:
        assert tok.encode(text, add_bos=False, parse_special=False) == ref.encode(text), text
    text = tok.token_text(tok.bos_id) + "x"
    assert tok.encode(text, add_bos=False)[0] == tok.bos_id
    literal = tok.encode(text, add_bos=False, parse_special=False)
    assert tok.bos_id not in literal and tok.decode(literal) == text
    assert tok.encode(text, add_bos=False)[0] == tok.bos_id  # the default form is left as it was


def test_roundtrip_and_stream(fixture_file):
    tok = GGUFTokenizer.from_file(str(fixture_file))
    # the fixtures carry no tokenizer.ggml.add_bos_token: a BPE vocabulary gets no BOS, as ik's
    # llama-tokenize gives them (an outside probe found ikjax's ids one BOS longer on every text)
    assert not tok.add_bos
    for text in TEXTS:
        ids = tok.encode(text, add_bos=True)
        assert ids[0] == tok.bos_id and tok.encode(text) == ids[1:]
        assert tok.decode(ids[1:]) == text
        assert "".join(tok.stream(ids[1:], special=True)) == text
        # by default control tokens show nothing, as llama-cli without --special (and Engine.complete)
        shown = "".join(tok.stream(ids[1:]))
        d = tok.detokenizer()
        assert shown == "".join(d.feed(i) for i in ids[1:]) + d.finish()
        assert "｜begin▁of▁sentence｜" not in shown


def test_matches_tokenizer_json_if_present(fixture_file):
    d = fixtures_dir()
    found = sorted(set(d.glob("tokenizer.json")) | set(d.glob("*/tokenizer.json")))
    if not found:
        return  # the fixtures ship no tokenizer.json: the reference BPE above is the oracle
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(found[0]))
    tok = GGUFTokenizer.from_file(str(fixture_file))
    for text in TEXTS:
        assert tok.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False).ids, text
        ids = hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_all_fixtures_tokenize():
    for f in sorted(fixtures_dir().glob("*.gguf")):
        tok = GGUFTokenizer.from_file(str(f))
        assert tok.decode(tok.encode("x = 42 + y", add_bos=False)) == "x = 42 + y"


def test_add_bos_default_is_llama_cpp_s():
    """A BOS where the file's tokenizer.ggml.add_bos_token says; without the key, the vocabulary
    type's default in llama.cpp / ik: SPM ("llama") and WPM ("bert") add one, BPE ("gpt2", every
    deepseek2 file) none."""
    from ikjax.tokenizer import add_bos_default
    assert add_bos_default({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.add_bos_token": True})
    assert not add_bos_default({"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_bos_token": False})
    assert not add_bos_default({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-v3"})
    assert add_bos_default({"tokenizer.ggml.model": "llama"}) and add_bos_default({"tokenizer.ggml.model": "bert"})


def test_user_defined_tokens_are_not_special(fixture_file):
    """R1's <think> / </think> are USER_DEFINED (type 4) in its GGUF: matched in text before the BPE
    whatever parse_special says (llama.cpp skips only control tokens then), and kept by a decode
    that skips special ones: the oracle is Hugging Face tokenizers with them as non-special added
    tokens, as R1's tokenizer.json has them (they were special here: `logit_bias {"<think>": -100}`
    biased `<`, `th`, `ink`, `>`)."""
    from tokenizers import AddedToken

    from ikjax.server.openai import bias_by_id
    md = dict(GGUFModelFile(fixture_file).metadata)
    base_types = list(md["tokenizer.ggml.token_type"])
    toks = md["tokenizer.ggml.tokens"].tolist() + ["<think>", "</think>", "<｜User｜>"]
    md["tokenizer.ggml.tokens"] = toks
    md["tokenizer.ggml.token_type"] = base_types + [4, 4, 3]
    tok = GGUFTokenizer(md)
    think, end, user = len(toks) - 3, len(toks) - 2, len(toks) - 1
    oracle = GGUFTokenizer(dict(md, **{"tokenizer.ggml.token_type": base_types + [1, 1, 1]})).tokenizer
    oracle.add_tokens([AddedToken("<think>", special=False, normalized=False),
                       AddedToken("</think>", special=False, normalized=False)])
    oracle.add_special_tokens([AddedToken("<｜User｜>", special=True, normalized=False)])
    for text in ["<think>\nhi</think>ok", "<｜User｜>a<think>b", "x</think><think>", *TEXTS[:8]]:
        want = oracle.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_bos=False) == want, text
        oracle.encode_special_tokens = True
        literal = oracle.encode(text, add_special_tokens=False).ids
        oracle.encode_special_tokens = False
        assert tok.encode(text, add_bos=False, parse_special=False) == literal, text
        assert tok.decode(want, skip_special=True) == oracle.decode(want, skip_special_tokens=True), text
    ids = tok.encode("<think>\nhi</think>ok", add_bos=False)
    assert ids[0] == think and end in ids and tok.decode(ids, skip_special=True) == "<think>\nhi</think>ok"
    assert tok.encode("<｜User｜>", add_bos=False, parse_special=False) != [user]
    assert bias_by_id({"<think>": -100}, lambda text: tok.encode(text, False, False)) == {think: -100}
