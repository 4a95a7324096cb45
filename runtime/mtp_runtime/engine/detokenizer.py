"""Incremental detokenisation: a growing output's text, extended by decoding only its newest tokens.

Decoding a request's whole output again at every streamed step costs time
that grows with the output (quadratic over a request). `IncrementalText`
keeps the text decoded so far and, for new tokens, decodes a window that
starts at the tokens of the previous update: the text of the window minus
the text of its already-read part is the new text. Decoding the window's
context along with the new tokens keeps decoders that treat a sequence's
first token specially (a leading space dropped, for instance) from changing
the new text, and a window that ends inside a multi-byte character (its
text ends with U+FFFD) is held back until the character is complete or the
request finishes.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text of a token list that only grows (a request's output), kept up to date cheaply."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.text = ""
        self._prefix = 0  # the window starts here: the tokens of the last update that added text
        self._read = 0  # tokens up to here are in self.text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip)

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Bring the text up to `token_ids` (the whole output so far; it extends the last one) and
        return the text added. Not `final`: a trailing incomplete character waits for the next
        tokens. `final`: everything is decoded, an incomplete character as U+FFFD."""
        if len(token_ids) < self._read:
            raise ValueError(f"IncrementalText: the output shrank from {self._read} to {len(token_ids)} tokens")
        if len(token_ids) == self._read:
            return ""
        window = token_ids[self._prefix:]
        read_text = self._decode(token_ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window_text = self._decode(window)
        if not final and (len(window_text) <= len(read_text) or window_text.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or only part of a character: wait for more tokens
        added = window_text[len(read_text):]
        self.text += added
        self._prefix, self._read = self._read, len(token_ids)
        return added
