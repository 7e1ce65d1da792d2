"""SentencePiece vocabularies (GGUF `tokenizer.ggml.model == "llama"`: Gemma, Llama 2),
tokenized as llama.cpp tokenizes them (src/llama-vocab.cpp).

Two steps, each llama.cpp's:

1. `SpecialTokens.split` (llama.cpp's tokenizer_st_partition): the texts of the special
   tokens (<start_of_turn>; in Gemma also "\\n" and runs of spaces) are cut out of the
   text first, each becoming its id.
2. `SentencePiece.encode` (llm_tokenizer_spm): each stretch between them has its spaces
   written as '▁' (U+2581) and is split into characters; the adjacent pair whose
   concatenation is a vocabulary token of the highest score is merged, again and again
   (ties: the leftmost pair), until no pair makes a token. A piece is then its token's
   id, or, a character the vocabulary lacks, the byte tokens <0xXX> of its UTF-8 bytes.
"""
from __future__ import annotations

from heapq import heappop, heappush

from ..errors import StrataError

NORMAL, BYTE = 1, 6  # llama.cpp token types: a piece of text; <0xXX>, one byte
SPACE = "\u2581"  # '▁': SentencePiece writes each space as this character
END = ""  # in the trie of special tokens: a token's text ends at this node


class SpecialTokens:
    """Where special tokens stand in a text, found as llama.cpp finds them: each special
    token, longest first, takes its occurrences, leftmost first, from the text that no
    longer one has taken."""

    def __init__(self, ids: dict[str, int]):  # special token text -> id
        self.ids = ids
        # A trie of their texts, char -> node: one walk from a position meets every special
        # token that starts there (Gemma has 6,414; trying each at every position is slow)
        self.trie: dict = {}
        for text in ids:
            node = self.trie
            for ch in text:
                node = node.setdefault(ch, {})
            node[END] = True

    # --8<-- [start:special_split]
    def split(self, text: str) -> list[str | int]:
        """The text cut at its special tokens: stretches of text and the tokens' ids, in order."""
        found = []  # (start, token text): every occurrence, overlapping ones too
        for start in range(len(text)):
            node, at = self.trie, start
            while at < len(text) and (node := node.get(text[at])) is not None:
                at += 1
                if END in node:
                    found.append((start, text[start:at]))
        # Longest first, then leftmost; an occurrence that overlaps one already taken stays
        # text. (Equal lengths go by id: llama.cpp's std::sort leaves their order open, and
        # it decides only where two special tokens of one length overlap in the text.)
        taken = bytearray(len(text))
        kept = []
        for start, token in sorted(found, key=lambda f: (-len(f[1]), self.ids[f[1]], f[0])):
            end = start + len(token)
            if taken.find(1, start, end) < 0:
                taken[start:end] = b"\x01" * len(token)
                kept.append((start, token))
        parts: list[str | int] = []
        at = 0
        for start, token in sorted(kept):
            if start > at:
                parts.append(text[at:start])
            parts.append(self.ids[token])
            at = start + len(token)
        if at < len(text):
            parts.append(text[at:])
        return parts
    # --8<-- [end:special_split]


class SentencePiece:
    """A stretch of text without special tokens -> ids, and a token id -> its bytes."""

    def __init__(self, tokens: list[str], vocab: dict[str, int], scores: list[float], types: list[int]):
        self.tokens, self.vocab, self.scores, self.types = tokens, vocab, scores, types
        self.byte_ids = [vocab.get(f"<0x{b:02X}>") for b in range(256)]  # (256,) byte -> its token, or None

    # --8<-- [start:spm_encode]
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, which holds no special token (SpecialTokens.split cut them out)."""
        if not text:
            return []
        pieces = list(text.replace(" ", SPACE))  # one piece per character; "" once merged into its left
        n = len(pieces)
        prev, after = list(range(-1, n - 1)), list(range(1, n)) + [-1]  # the neighbours still standing
        pairs: list[tuple] = []  # heap of (-score, left, right, length): best score first, then leftmost

        def offer(left: int, right: int):
            token = self.vocab.get(pieces[left] + pieces[right]) if left >= 0 and right >= 0 else None
            if token is not None:
                heappush(pairs, (-self.scores[token], left, right, len(pieces[left]) + len(pieces[right])))

        for i in range(1, n):
            offer(i - 1, i)
        while pairs:
            _, left, right, length = heappop(pairs)
            # offered before a merge changed either piece: that pair is gone
            if not pieces[left] or not pieces[right] or len(pieces[left]) + len(pieces[right]) != length:
                continue
            pieces[left], pieces[right] = pieces[left] + pieces[right], ""
            after[left] = after[right]
            if after[left] >= 0:
                prev[after[left]] = left
            offer(prev[left], left)
            offer(left, after[left])
        # a merge keeps the left place, so the pieces left standing are in the text's order
        return [i for piece in pieces if piece for i in self._piece_ids(piece)]
    # --8<-- [end:spm_encode]

    def _piece_ids(self, piece: str) -> list[int]:
        """A piece is its token, or the byte tokens of its UTF-8 bytes. (llama.cpp first looks
        for the piece among the merges it made, to split it back: every merge makes a
        vocabulary token, so a piece that is none is one character, never a merge.)"""
        token = self.vocab.get(piece)
        if token is not None:
            return [token]
        ids = [self.byte_ids[b] for b in piece.encode("utf-8")]
        if None in ids:
            raise StrataError(f"the vocabulary has neither {piece!r} nor byte tokens for it (<0x..>)")
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of a token that is not special: '▁' is a space, <0xXX> that byte; llama.cpp
        gives the other types (unused, undefined) no text."""
        kind = self.types[token_id]
        if kind == NORMAL:
            return self.tokens[token_id].replace(SPACE, " ").encode("utf-8")
        if kind == BYTE:
            return bytes([int(self.tokens[token_id][3:5], 16)])
        return b""
