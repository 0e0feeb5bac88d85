"""How bulk scoring groups pairs into forward passes, torch-free: length-sorted batches under a padded-token
budget (`length_batches`), and on cpu a budget small enough for every worker (`batch_budget`). `bulk_batches`
is `RelevanceModel.encoded_logits`' plan, so that a scoring server's jobs (service.jobs) forward `qtrel
score`'s very batches and write its very bytes (a float sum depends, by a last bit, on the batch it ran in)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Past a few workers the Python between kernels (one at a time under the GIL) would bind; measured at 2
MAX_WORKERS = 4
# Batches per worker when a call holds few (batch_budget), and the smallest batch that runs at full speed
# (AMD EPYC Zen 3, float32, 2 workers: per pair as fast at 1,024-4,096 tokens as at 8,192, within noise)
BATCHES_PER_WORKER, MIN_BATCH_TOKENS = 4, 1024


def length_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int = 256) -> Iterable[list[int]]:
    """Indices grouped by length so that longest x count stays within the token budget."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batch: list[int] = []
    for i in order:  # ascending: the newest item is the batch's longest
        if batch and (lengths[i] * (len(batch) + 1) > max_batch_tokens or len(batch) >= max_batch_size):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def batch_budget(tokens: int, max_batch_tokens: int) -> int:
    """Padded tokens per cpu batch for a call of `tokens` in all: small enough that MAX_WORKERS workers get
    BATCHES_PER_WORKER each (one big batch keeps one worker busy while the others wait), down to
    MIN_BATCH_TOKENS. It depends on the pairs only, not on the workers, so that a file scored with any
    number of workers gets the very same batches (and, one thread per worker, the bits one thread gives)."""
    return min(max_batch_tokens, max(MIN_BATCH_TOKENS, tokens // (BATCHES_PER_WORKER * MAX_WORKERS)))


def bulk_batches(lengths: Sequence[int], max_batch_tokens: int, cpu: bool) -> list[list[int]]:
    """The length-sorted batches `encoded_logits` forwards: on cpu, small enough for every worker; on cuda
    bounded by the token budget alone (the cpu's 256-pair cap starved the GPU of work)."""
    if cpu:
        return list(length_batches(lengths, batch_budget(sum(lengths), max_batch_tokens)))
    return list(length_batches(lengths, max_batch_tokens, max_batch_tokens))
