"""Incremental detokenisation for streaming, with stop strings.

Text is released only when it is final: a trailing replacement character (an incomplete UTF-8
sequence split across tokens) and any tail that could still grow into a stop string are held
back until the next tokens decide them. When a stop string appears, the text is cut before it.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.token_ids: list[int] = []
        self.sent = 0           # characters of the decoded text already released
        self.stopped = False    # a stop string was found

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens; returns the newly final text."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                self.stopped = True
                text = text[:at]
        if self.stopped:
            return self._release(text, len(text))
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                if text[end - k:end] == s[:k]:
                    end -= k
                    break
        return self._release(text, end)

    def flush(self) -> str:
        """At the end of the completion: everything not yet released (stop strings excluded)."""
        text = self.tokenizer.decode(self.token_ids)
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                text = text[:at]
        return self._release(text, len(text))

    def _release(self, text: str, end: int) -> str:
        end = max(end, self.sent)
        out = text[self.sent:end]
        self.sent = end
        return out
