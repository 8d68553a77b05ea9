"""The incremental detokenizer (router/detok.py) against the whole-text one it replaced: every push
releases exactly the same text, with the demo pair's real tokenizer (byte-level BPE: tokens that
split UTF-8 characters), random token sequences, random chunks and stop strings that occur."""

from __future__ import annotations

import random

import pytest

from router.detok import Detokenizer


class WholeText:
    """The reference: decodes every token on every push (what router/detok.py did before, except
    that it cut at the stop strings one after another, in their order: with two overlapping stop
    strings it could cut at the later one). The text is cut at the earliest stop string."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, stop
        self.token_ids, self.sent, self.stopped = [], 0, False

    def _cut(self, text):
        hits = [at for at in (text.find(s) for s in self.stop) if at != -1]
        return text[: min(hits)] if hits else text

    def push(self, token_ids):
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        if self._cut(text) != text or self.stopped:
            self.stopped = True
            text = self._cut(text)
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

    def flush(self):
        return self._release(self._cut(self.tokenizer.decode(self.token_ids)), None)

    def _release(self, text, end):
        end = max(len(text) if end is None else end, self.sent)
        out = text[self.sent:end]
        self.sent = end
        return out


@pytest.fixture(scope="module")
def tokenizer():
    from spectandem.checkpoint import load_tokenizer
    from spectandem.demo import demo_paths

    return load_tokenizer(demo_paths("none")[0])


def _sequences(tokenizer, rng):
    texts = ["héllo wörld € 日本語のテキスト, and then some ASCII.", "emoji 🙂🙃 mixed with “quotes” — dashes",
             "plain words only here, nothing special at all"]
    seqs = [tokenizer.encode(t).ids for t in texts]
    vocab = tokenizer.get_vocab_size()
    seqs += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(40)]   # invalid UTF-8 too
    return seqs


def _run(detok, seq, rng, stopping):
    """Pushes `seq` in random chunks (until a stop, as the router does), then flushes."""
    outs, i = [], 0
    while i < len(seq):
        n = rng.randrange(1, 6)
        outs.append(detok.push(seq[i: i + n]))
        outs.append(detok.stopped)
        i += n
        if stopping and detok.stopped:
            break
    outs.append(detok.flush())
    return outs


def test_every_push_releases_what_the_whole_text_decode_does(tokenizer):
    rng = random.Random(5)
    for seq in _sequences(tokenizer, rng):
        state = rng.getstate()
        got = _run(Detokenizer(tokenizer), seq, rng, False)
        rng.setstate(state)
        want = _run(WholeText(tokenizer), seq, rng, False)
        assert got == want, seq
        assert "".join(x for x in got if isinstance(x, str)) == tokenizer.decode(seq)


def test_stop_strings_cut_at_the_same_push_and_character(tokenizer):
    rng = random.Random(11)
    checked_hits = 0
    for seq in _sequences(tokenizer, rng):
        full = tokenizer.decode(seq)
        stops = []
        for _ in range(rng.randrange(1, 3)):   # substrings of the text, so that they occur
            a = rng.randrange(len(full))
            stops.append(full[a: a + rng.randrange(1, 5)])
        stops.append("never-in-the-text")
        state = rng.getstate()
        got = _run(Detokenizer(tokenizer, tuple(stops)), seq, rng, True)
        rng.setstate(state)
        want = _run(WholeText(tokenizer, tuple(stops)), seq, rng, True)
        assert got == want, (seq, stops)
        checked_hits += any(x is True for x in want)
    assert checked_hits > 20   # most cases do stop: the stop path is what is compared


def test_a_different_release_is_caught(tokenizer):
    """Negative control: a detokenizer that decodes each push's tokens alone (no context chunk,
    not waiting for the rest of a character split across tokens) differs from the reference."""

    class NoWait(Detokenizer):
        def _visible(self, final):
            self._context = self._read
            return super()._visible(True)

    seq = tokenizer.encode("héllo wörld € 日本語").ids
    assert _run(NoWait(tokenizer), seq, random.Random(1), False) != _run(WholeText(tokenizer), seq,
                                                                          random.Random(1), False)


class Counting:
    """A tokenizer that counts the tokens it decodes."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.inner.decode(ids)


def test_a_push_decodes_only_its_tokens_and_the_chunk_before(tokenizer):
    counting = Counting(tokenizer)
    d = Detokenizer(counting, ("zzzz",))
    seq = tokenizer.encode("a long plain completion " * 40).ids
    for i in range(0, len(seq), 2):
        d.push(seq[i: i + 2])
    d.flush()
    assert counting.decoded <= 4 * len(seq)          # the whole-text decoder: about len(seq)^2 / 4
    assert d.text == tokenizer.decode(seq)
