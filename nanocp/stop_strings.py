"""Stop strings, checked after every generated token without decoding the whole output each time.

The check runs once per token, so a match that was not there before must overlap the text the newest token added
or changed (a token can complete a multi-byte character, turning up to 3 replacement characters into one). Only
a window of the latest tokens is decoded; it agrees with the whole text except in its first few characters (a
character split at its start, a stripped leading space), so when its last `region` characters hold no stop string
there is none. Otherwise, or when the window is too short to tell (tokens that decode to nothing), the whole
output is decoded and searched as before. Decoding the whole output per token made a request with stop strings
cost O(n^2) on the driver (about 0.2 ms per token at 1,000 tokens with the byte tokenizer);
tests/test_serving_stop_strings.py compares this with the whole-text search on random outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanocp.models.tokenizer import Tokenizer

WINDOW_SLACK_TOKENS = 16  # decoded before the region: room for a split character or a stripped space at the start
REGION_SLACK_CHARS = 4  # characters the newest token may change before its own text (a completed UTF-8 character)
BOUNDARY_CHARS = 8  # characters at the window's start that may differ from the whole text


def stop_string_end(tokenizer: Tokenizer, output: Sequence[int], stops: Sequence[str]) -> int | None:
    """Where the output's text is cut for the earliest stop string in it, or None; for an output whose text without
    its last token held no stop string."""
    stops = [s for s in stops if s]
    if not stops or not output:
        return None
    region = max(map(len, stops)) + len(tokenizer.decode(output[-1:])) + REGION_SLACK_CHARS
    window = 4 * region + WINDOW_SLACK_TOKENS  # a character is at most 4 byte tokens
    if len(output) > window:
        tail = tokenizer.decode(output[-window:])
        if len(tail) >= region + BOUNDARY_CHARS and not any(s in tail[-region:] for s in stops):
            return None
    text = tokenizer.decode(output)
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None
