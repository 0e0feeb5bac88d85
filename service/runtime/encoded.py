"""Pairs tokenised by a front process, as the engine core takes them: the token ids with the load
generation of the tokenizer that made them. Token ids cross the process boundary, not texts to tokenise
again; a reload between the front's tokenising and the core's scoring is caught by the generation."""

from __future__ import annotations

from dataclasses import dataclass

from model.tokenizer import EncodedPairs
from service.runtime.workers.backend import BackendError


@dataclass(frozen=True)
class Encoded:
    pairs: EncodedPairs
    generation: int  # the load generation of the model whose tokenizer encoded them

    def pick(self, rows: list[int]) -> EncodedPairs:
        p = self.pairs
        return self.pick_from(p.input_ids, p.token_type_ids, p.truncated, p.unknown, rows)

    @staticmethod
    def pick_from(ids: list, segs: list, cut: list, unk: list, rows: list[int]) -> EncodedPairs:
        """The rows' pairs (all of them when `rows` is every row in order: no copy)."""
        if len(rows) == len(ids):
            return EncodedPairs(ids, segs, cut, unk)
        return EncodedPairs(
            [ids[i] for i in rows],
            [segs[i] for i in rows],
            [cut[i] for i in rows],
            [unk[i] for i in rows] if unk else [],
        )


class Stale(BackendError):
    """The pairs were tokenised for a model generation that has since been reloaded: tokenise again."""

    def __init__(self, model: str, generation: int):
        super().__init__(f"model {model} was reloaded (generation {generation}): tokenise again")
        self.model = model
        self.generation = generation
