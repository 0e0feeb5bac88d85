"""The models shipped inside the package, named `builtin:<name>`: the rule every command and the server
use to turn a `--model` value into a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODELS = ("default", "pruned", "zh")  # under model/<name>


def builtin_dir(name: str = "default") -> Path:
    """model/default, model/pruned (the default with 60% of its attention heads removed and fine-tuned
    again, docs/heads.md), or model/zh (multilingual-e5-small fine-tuned on QQ Browser's Chinese query-title
    pairs, docs/model-card-zh.md)."""
    return Path(__file__).resolve().parent / name


def resolve_model(spec: str | None) -> Path:
    """A checkpoint directory, `builtin:<name>`, or nothing for the built-in default."""
    if spec and not spec.startswith("builtin:"):
        return Path(spec)
    name = (spec or "builtin:default").removeprefix("builtin:")
    if name not in BUILTIN_MODELS:
        raise FileNotFoundError(f"no built-in model {name!r}; the package ships {', '.join(BUILTIN_MODELS)}")
    d = builtin_dir(name)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"the built-in model {name!r} is missing at {d}")
    return d
