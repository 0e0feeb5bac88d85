"""The options of a training run (`qtrel train`'s, generated from `TrainArgs`, so each default lives here
only), without torch: building the command line does not load the network."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.levels import DEFAULT_LEVELS

# Metrics that select the best checkpoint, and whether higher is better.
SELECT = {
    "qwk": True,
    "accuracy": True,
    "macro_f1": True,
    "ndcg@10": True,
    "rmse_level": False,
    "rmse_relevance": False,
    "loss": False,
}


# Help for the options of `qtrel train`, which are generated from TrainArgs (so defaults live here only).
HELP = {
    "epochs": "passes over the judged pairs (fractions allowed)",
    "eval_every": "steps between dev evaluations (0: once per epoch)",
    "select": f"dev metric that picks the best checkpoint: {', '.join(SELECT)}",
    "save_every": "steps between resume snapshots",
    "max_steps": "stop after this many steps (0: no limit)",
    "threads": "torch threads (0: torch's default)",
    "negatives": "sampled unrelated pairs per judged pair, fresh each epoch, labelled with the lowest level",
    "dev_negatives": "negatives per dev pair for the dev report (0: none)",
    "mse_weight": "weight of the squared error of the expected level beside cross-entropy",
    "mse_target": "level: the ordinal term pulls E[level] to the level; relevance: to the raters' mean relevance",
    "patience": "stop after this many dev evaluations without improvement (0: never)",
    "hard_negatives": "share of the negatives drawn hard: a word shared with the query, its head term missing",
    "foreign_negatives": "share of the negatives drawn foreign: catalogue titles in vocabulary words no title uses",
    "autocast": "none, or bfloat16: the forward under bfloat16 autocast (fast on AVX512-BF16/AMX CPUs only)",
    "not_candidate": "1: a sixth class, 'not a candidate', learns the negatives and grades level 1 (merged at scoring)",
    "teacher": "CSV/JSONL of per-pair teacher targets: query, title, relevance and/or p_<level> (model.train.teacher)",
    "teacher_weight": "the teacher's share of a matched pair's targets (cross-entropy, ordinal term); not negatives'",
    "keep_evals": "1: keep the checkpoint of every dev evaluation in <out>/step-N/ (for averaging, choosing)",
}


@dataclass
class TrainArgs:
    train_file: str
    base: str  # encoder checkpoint (new head) or a qtrel checkpoint (continue)
    output_dir: str
    dev_file: str | None = None
    labels: list[str] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    label_column: str = "level"
    label_map: dict[str, str] | None = None
    epochs: float = 3.0
    batch_size: int = 32
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.06
    max_grad_norm: float = 1.0
    max_length: int = 128
    seed: int = 42
    eval_every: int = 0  # steps between dev evaluations; 0 = once per epoch
    select: str = "qwk"
    save_every: int = 200  # steps between resume snapshots
    max_steps: int = 0  # stop early after this many steps (0 = no limit); for smoke runs
    device: str = "cpu"
    threads: int = 0  # torch threads; 0 = torch's default
    progress: bool = True
    negatives: float = 0.0  # sampled unrelated pairs per judged pair, fresh each epoch (level 1)
    mse_weight: float = 0.0  # weight of the squared error of the expected level beside cross-entropy
    mse_target: str = "level"  # "relevance": the ordinal term's target is the raters' mean (model.train.loop)
    label_smoothing: float = 0.0
    patience: int = 0  # stop after this many dev evaluations without a better checkpoint (0 = never)
    dev_negatives: float = 1.0  # negatives per dev pair for the dev report (0 = none)
    hard_negatives: float = 0.0  # share of the negatives that are hard (model.train.negatives)
    foreign_negatives: float = 0.0  # share of the negatives that are foreign (model.train.negatives)
    autocast: str = "none"  # "bfloat16": the forward under bfloat16 autocast
    keep_evals: int = 0  # 1: a checkpoint per dev evaluation in <out>/step-N/
    teacher: str = ""  # per-pair teacher targets (model.train.teacher); "" = none
    teacher_weight: float = 0.5  # the teacher's share of a matched pair's targets
    not_candidate: int = 0  # 1: negatives train an extra class merged into the lowest level (model.config)
