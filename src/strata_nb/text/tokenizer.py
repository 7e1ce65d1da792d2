"""Text <-> token ids, built from the GGUF file alone.

The vocabulary, merges and token types live in the GGUF metadata (`tokenizer.ggml.*`). Two
kinds: byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM), whose BPE is the
`tokenizers` library's, and SentencePiece ("llama": Gemma), tokenized as llama.cpp does it
(text/sentencepiece.py). The chat template is the file's own Jinja
(`tokenizer.chat_template`), rendered the way transformers renders it.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from functools import lru_cache

from ..errors import StrataError
from .sentencepiece import SentencePiece, SpecialTokens

UNKNOWN = 2  # llama.cpp token types: <unk>
CONTROL = 3  # special tokens such as <|im_start|>
USER_DEFINED = 4
STRETCHES = 256  # the most recent stretches between special tokens whose ids are kept


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each of the 256 bytes is shown as one printable char."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


# GGUF's `tokenizer.ggml.pre` names the pre-tokenizer llama.cpp applies before BPE.
def _pre_tokenizer(pre: str):
    from tokenizers import pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "gpt-2", "gpt2", "default"):
        if pre == "gpt-2" or pre == "gpt2" or pre == "default":
            return byte_level
        # these split every digit on its own before the GPT-2 regex
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    raise StrataError(f"unsupported tokenizer pre-tokenizer {pre!r} (strata-nb knows smollm, starcoder, gpt-2)")


class Tokenizer:
    """Byte-level BPE or SentencePiece from GGUF metadata, plus the chat template and a
    streaming decoder."""

    # --8<-- [start:tokenizer_init]
    def __init__(self, gguf_model):
        md = gguf_model.metadata
        kind = md("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise StrataError(f"unsupported tokenizer model {kind!r}: strata-nb reads byte-level BPE ('gpt2') "
                              "and SentencePiece ('llama')")
        self.tokens: list[str] = list(md("tokenizer.ggml.tokens"))
        types = md("tokenizer.ggml.token_type") or [1] * len(self.tokens)
        vocab = self._vocab = {t: i for i, t in enumerate(self.tokens)}
        self.eos_id = int(md("tokenizer.ggml.eos_token_id", 0))
        self.bos_id = md("tokenizer.ggml.bos_token_id")
        self.add_bos = bool(md("tokenizer.ggml.add_bos_token", False))  # the caller prepends bos_id; encode never does
        # generation stops at EOS and at the end-of-turn marker of chat models
        self.stop_ids = {self.eos_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>")
                                         if t in vocab}
        self.chat_template = md("tokenizer.chat_template")
        self._stretches: OrderedDict[str, list[int]] = OrderedDict()  # text between special tokens -> ids
        self._spm = None
        if kind == "llama":
            self._init_sentencepiece(md, types)
        else:
            self._init_bpe(md, types)

    def _init_sentencepiece(self, md, types):
        # the special tokens llama.cpp cuts out of the text first (<unk> too) and decodes as their own text
        self.special_ids = {i for i, t in enumerate(types) if t in (UNKNOWN, CONTROL, USER_DEFINED)}
        self._spm_specials = SpecialTokens({self.tokens[i]: i for i in self.special_ids})
        scores = md("tokenizer.ggml.scores") or [0.0] * len(self.tokens)
        self._spm = SentencePiece(self.tokens, self._vocab, scores, types)
        # llama.cpp puts a space before the text, and after each special token, unless told not to
        self.add_space_prefix = bool(md("tokenizer.ggml.add_space_prefix", True))

    def _init_bpe(self, md, types):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

        merges = [tuple(m.split(" ", 1)) for m in md("tokenizer.ggml.merges") or []]
        vocab = self._vocab
        self._hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        self._hf.pre_tokenizer = _pre_tokenizer(md("tokenizer.ggml.pre", "gpt2"))
        self._hf.decoder = decoders.ByteLevel()
        self.special_ids = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
        self._hf.add_special_tokens(
            [AddedToken(self.tokens[i], special=True, normalized=False) for i in sorted(self.special_ids)])
        self._bytes = _byte_decoder()
        # The text between special tokens, split on them (longest first at a position, as
        # the BPE library matches them); each stretch's ids are kept in _stretches
        by_length = sorted((self.tokens[i] for i in self.special_ids), key=len, reverse=True)
        self._specials = re.compile("(" + "|".join(map(re.escape, by_length)) + ")") if by_length else None
    # --8<-- [end:tokenizer_init]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    # --8<-- [start:encode]
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text such as <|im_start|> becomes its id. Never a
        BOS: the caller prepends `bos_id` when `add_bos` is set."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate: bytes that were not UTF-8, decoded leniently
            raise StrataError(f"the text is not valid Unicode: {text[err.start]!r} at index {err.start} "
                              "(bytes that were not UTF-8?)") from None
        if self._spm is not None:
            return self._encode_sentencepiece(text)
        if self._specials is None:
            return self._hf.encode(text, add_special_tokens=False).ids
        # A special token ends the text before it: the BPE library splits on them first
        # and encodes each stretch between them alone. So a conversation's turns, each a
        # stretch, keep their ids from request to request; only new ones are encoded (a
        # follow-up turn's 4,000-token history is a dictionary lookup, not a re-encode).
        ids: list[int] = []
        for i, part in enumerate(self._specials.split(text)):
            if i % 2:  # the split keeps each special token, at the odd places
                ids.append(self._vocab[part])
            elif part:
                ids += self._stretch(part)
        return ids

    def _encode_sentencepiece(self, text: str) -> list[int]:
        """llama.cpp's order: special tokens cut out first (longest first), then each stretch
        alone, a space put before it when it starts the text or follows a special token
        (if the vocabulary asks for that: add_space_prefix)."""
        ids: list[int] = []
        after_special = True
        for part in self._spm_specials.split(text):
            if isinstance(part, int):
                ids.append(part)
                after_special = True
            else:
                ids += self._stretch(" " + part if self.add_space_prefix and after_special else part)
                after_special = False
        return ids

    def _stretch(self, text: str) -> list[int]:
        """The ids of text without special tokens, from the cache of recent stretches."""
        ids = self._stretches.get(text)
        if ids is None:
            ids = self._stretches[text] = (self._spm.encode(text) if self._spm is not None
                                           else self._hf.encode(text, add_special_tokens=False).ids)
            if len(self._stretches) > STRETCHES:
                self._stretches.popitem(last=False)
        else:
            self._stretches.move_to_end(text)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a special token stands for its own text)."""
        t = self.tokens[token_id]
        if token_id in self.special_ids:
            return t.encode("utf-8")
        if self._spm is not None:
            return self._spm.token_bytes(token_id)
        return bytes(self._bytes[c] for c in t)
    # --8<-- [end:encode]

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    # --8<-- [start:render_chat]
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered with the file's own template."""
        if not self.chat_template:
            raise StrataError("this model has no chat template; use --raw")
        return _template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.tokens[self.bos_id] if self.bos_id is not None else "",
            eos_token=self.tokens[self.eos_id])
    # --8<-- [end:render_chat]


@lru_cache(maxsize=4)
def _template(source: str):
    """A chat template compiled once: compiling costs a millisecond, more than rendering a
    long conversation with it."""
    return _jinja_env().from_string(source)


@lru_cache(maxsize=1)
def _jinja_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise StrataError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


# --8<-- [start:stream_decoder]
class StreamDecoder:
    """Turns token ids into text pieces as they come, never splitting a UTF-8 character.

    A token can end in the middle of a multi-byte character (emoji are often 2-4 tokens),
    so bytes wait in `pending` until they form complete characters.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pending = b""

    def push(self, token_id: int) -> str:
        self.pending += self.tokenizer.token_bytes(token_id)
        text, self.pending = _split_complete_utf8(self.pending)
        return text

    def flush(self) -> str:
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


def _split_complete_utf8(buf: bytes) -> tuple[str, bytes]:
    """Decode the longest prefix of `buf` that does not end inside a character."""
    cut = len(buf)
    # a character is at most 4 bytes: look back at most 3 bytes for an unfinished lead byte
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        if need > back:
            cut = len(buf) - back
        break
    return buf[:cut].decode("utf-8", errors="replace"), buf[cut:]
# --8<-- [end:stream_decoder]
