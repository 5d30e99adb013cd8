"""Incremental detokenization with tokenizers' DecodeStream (text grows as tokens arrive)."""

from __future__ import annotations

from typing import Any, Optional

_PRIMING_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a stream of token ids into text; primed with the prompt tail so spacing comes out right."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend: Any = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.output_text = ""
        self.stream: Optional[DecodeStream] = None
        self.token_ids: list[int] = []
        if self.backend is not None:
            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in prompt_token_ids[-_PRIMING_TOKENS:]:
                self.stream.step(self.backend, token_id)

    def update(self, new_token_ids: list[int]) -> str:
        """Feed new tokens; return the text they added."""
        self.token_ids.extend(new_token_ids)
        if self.stream is None:  # slow tokenizers: decode everything again
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            delta, self.output_text = text[len(self.output_text) :], text
            return delta
        delta = "".join(
            piece for token_id in new_token_ids if (piece := self.stream.step(self.backend, token_id)) is not None
        )
        self.output_text += delta
        return delta
