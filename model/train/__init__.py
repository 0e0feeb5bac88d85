"""The training wing: the training loop, negatives, evaluation and its metrics and reports,
calibration, the lexical baseline and the attention-head experiments, with their commands (`cli`)."""
