"""Incremental detokenisation that never emits a broken UTF-8 character.

Follows the prefix/read-offset scheme of Hugging Face TGI and vLLM (``detokenize_incrementally``): decode a short window
of recent tokens twice, with and without the new ones, and emit the difference; when the text ends in U+FFFD (a
multi-byte character split across tokens) hold it back until the next token completes it.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_ids: the prompt's token ids (their tail gives the first output token its leading-space context).
    """

    _CONTEXT = 5  # tokens of left context used so that SentencePiece-style leading spaces decode correctly

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-self._CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""
