"""Random batches in the trainer's format (inputs, targets, segment_ids, positions, loss_mask)."""

import numpy as np


def random_batch(rows: int, seq: int, *, seed: int = 0, vocab: int = 259, padded_tails: bool = False) -> dict:
    """Random tokens packed as 1-3 documents a row, a tenth of the tokens left out of the loss; with
    `padded_tails`, the last half of the rows ends in a quarter row of padding (segment 0, masked),
    so a mean over the batch's tokens and one over the loss mask's count differ."""
    rng = np.random.default_rng(seed)
    segments = np.sort(rng.integers(1, 4, size=(rows, seq)), axis=1).astype(np.int32)
    if padded_tails:
        segments[rows // 2:, seq - seq // 4:] = 0
    return {"inputs": rng.integers(0, vocab, size=(rows, seq), dtype=np.int32),
            "targets": rng.integers(0, vocab, size=(rows, seq), dtype=np.int32),
            "segment_ids": segments,
            "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
            "loss_mask": ((rng.random((rows, seq)) > 0.1) & (segments > 0)).astype(np.float32)}
