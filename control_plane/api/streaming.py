"""Streamed text that never runs ahead of a stop string.

The engine cuts a request's text at the first stop string once it appears. A stream must not have sent any
of it: the streamer holds back the last (longest stop - 1) characters until the request ends, and the engine
loop never streams the tokens of the step that finished a request (they arrive with the final output). So the
concatenated deltas plus `finish(final_text)` equal the non-streamed text exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

from nanocp.models.tokenizer import StreamDecoder, Tokenizer


class TextStreamer:
    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = ()) -> None:
        self._decoder = StreamDecoder(tokenizer)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.emitted = ""
        self.failed = False  # the tokenizer failed on these tokens: nothing more is streamed

    def push(self, token_ids: Iterable[int]) -> str:
        """New tokens -> the text that is now safe to send (possibly ""). A tokenizer that fails on them stops the
        stream's text; the request's final output says why (finish_reason "error")."""
        if self.failed:
            return ""
        try:
            for token in token_ids:
                self._decoder.push(token)
        except Exception:  # tokenizer code (any type): the engine ends this request with the reason
            self.failed = True
            return ""
        safe = len(self._decoder.emitted) - self._holdback
        if safe <= len(self.emitted):
            return ""
        piece = self._decoder.emitted[len(self.emitted) : safe]
        self.emitted += piece
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (EOS dropped, cut at a stop string)."""
        rest = final_text[len(self.emitted) :] if final_text.startswith(self.emitted) else ""
        self.emitted += rest
        return rest
