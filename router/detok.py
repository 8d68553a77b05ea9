"""Incremental detokenisation for streaming, with stop strings.

Text is released only when it is final: text that ends in an incomplete UTF-8 sequence (a
replacement character, the sequence split across tokens) and any tail that could still grow into
a stop string are held back until the next tokens decide them. When a stop string appears, the
text is cut before it.

Each push costs what its new tokens cost, not what the whole completion does: only the tokens
since the last complete text are decoded, with the chunk before them as context (the difference
of the two decodes is the new text; context keeps tokenizers that drop a leading space at the
start of a decode right). Stop strings are searched only where a new match can start. The
released text equals the tokenizer's decode of all tokens (tests/router/test_detok.py).
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.token_ids: list[int] = []
        self.text = ""          # decode of token_ids[:_read]
        self._context = 0       # token_ids[_context:_read]: the last decoded chunk, context for the next
        self._read = 0
        self._scanned = 0       # text before this holds no start of a stop string
        self._longest = max((len(s) for s in stop), default=0)
        self.sent = 0           # characters of the text already released
        self.stopped = False    # a stop string was found

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens; returns the newly final text."""
        self.token_ids.extend(token_ids)
        text = self._cut(self._visible(final=False))
        if self.stopped:
            return self._release(text, len(text))
        end = len(text)
        while end > self.sent and text[end - 1] == _REPLACEMENT:
            end -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                if text[end - k:end] == s[:k]:
                    end -= k
                    break
        return self._release(text, end)

    def flush(self) -> str:
        """At the end of the completion: everything not yet released (stop strings excluded)."""
        text = self._cut(self._visible(final=True))
        return self._release(text, len(text))

    def _visible(self, final: bool) -> str:
        """The decode of every token so far: the committed text, plus the new tokens' text. That
        is committed (the next decode starts after it) unless it ends in an incomplete
        character and more tokens may come: then it is decoded again with them."""
        ids = self.token_ids
        if self._read == len(ids) or self.stopped:
            return self.text
        before = self.tokenizer.decode(ids[self._context:self._read]) if self._read > self._context else ""
        after = self.tokenizer.decode(ids[self._context:])
        if not after.startswith(before):   # the chunk decodes otherwise with more tokens after it
            self.text, self._scanned = self.tokenizer.decode(ids), 0
        elif final or not after.endswith(_REPLACEMENT):
            self.text += after[len(before):]
        else:
            return self.text + after[len(before):]
        self._context, self._read = self._read, len(ids)
        return self.text

    def _cut(self, text: str) -> str:
        """`text` cut before its first stop string (then `stopped`), searched only where a stop
        string can start that earlier searches could not have seen whole."""
        if not self.stop or self.stopped:
            return text
        start = max(0, self._scanned - self._longest + 1)
        hits = [at for at in (text.find(s, start) for s in self.stop) if at != -1]
        self._scanned = len(text.rstrip(_REPLACEMENT))   # an incomplete last character may still change
        if hits:
            self.stopped = True
            self.text = text = text[: min(hits)]
        return text

    def _release(self, text: str, end: int) -> str:
        end = max(end, self.sent)
        out = text[self.sent:end]
        self.sent = end
        return out
