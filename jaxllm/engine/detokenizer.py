"""Incremental detokenization with stop strings.

Text grows one token at a time through the tokenizers library's DecodeStream,
which holds back bytes until they form whole UTF-8 characters. Stop strings
are searched only in the newly added text (plus the tail that could begin a
stop string), and while the request runs the last `max(len(stop)) - 1`
characters are withheld from streamed output so a stop string is never shown
and then taken back.
"""

from __future__ import annotations

from typing import Any

from jaxllm.sampling_params import SamplingParams

# Prompt tokens given to the stream as context so the first output token is
# decoded with the right leading space / merge behaviour.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
            tokenizer, "_tokenizer", None)
        self.skip_special = params.skip_special_tokens
        self.stop = list(params.stop or ())
        self.consumed = 0  # of the last update's tokens (see update)
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = 0 if self.include_stop or not self.stop else max(map(len, self.stop)) - 1
        self.output_text = ""
        self._token_ids: list[int] = []
        self._emitted = 0  # characters already returned as deltas
        if self.backend is not None:
            self._stream = DecodeStream(ids=prompt_token_ids[-_CONTEXT_TOKENS:],
                                        skip_special_tokens=self.skip_special)
        else:
            self._stream = None

    def update(self, new_token_ids: list[int], stop_checked: bool = True) -> str | None:
        """Appends tokens; returns the stop string if one ended the text. `consumed` is
        then how many of `new_token_ids` it took, up to the one that ended it (a step
        may emit several: speculative decoding)."""
        self.consumed = len(new_token_ids)
        for i, tid in enumerate(new_token_ids):
            self._token_ids.append(tid)
            before = len(self.output_text)
            if self._stream is not None:
                piece = self._stream.step(self.backend, tid)
                if piece:
                    self.output_text += piece
            else:
                self.output_text = self.tokenizer.decode(
                    self._token_ids, skip_special_tokens=self.skip_special)
            if self.stop and stop_checked:
                hit = self._find_stop(before)
                if hit is not None:
                    self.consumed = i + 1
                    return hit
        return None

    def _find_stop(self, new_from: int) -> str | None:
        for s in self.stop:
            start = max(0, new_from - len(s) + 1)
            idx = self.output_text.find(s, start)
            if idx != -1:
                end = idx + len(s) if self.include_stop else idx
                self.output_text = self.output_text[:end]
                return s
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now: everything (or only what is new), minus the held-back tail."""
        length = len(self.output_text) if finished else max(
            len(self.output_text) - self.hold_back, 0)
        if not delta:
            return self.output_text[:length]
        start = min(self._emitted, length)
        self._emitted = max(self._emitted, length)
        return self.output_text[start:length]
