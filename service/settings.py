"""Service settings: one frozen object; every field comes from `QTREL_<FIELD>` or the CLI."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.levels import CHUNK_OVERLAP, MAX_BATCH_TOKENS
from service.keys import KeyRing, split_keys

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a served model's name, as requests and labels take it


@dataclass(frozen=True)
class ModelEntry:
    """One `NAME=PATH` of the configuration; `name` None: a bare path, named by its checkpoint."""

    name: str | None
    path: str | None  # None: the built-in default


def parse_entry(text: str) -> ModelEntry:
    """`NAME=PATH` or a bare path / builtin: name. A bare path keeps today's naming (the checkpoint's)."""
    name, sep, path = text.strip().partition("=")
    if sep and NAME.fullmatch(name):
        if not path.strip():
            raise ValueError(f"model {name!r} has no path: give NAME=PATH")
        return ModelEntry(name, path.strip())
    return ModelEntry(None, text.strip() or None)


def parse_models(text: str) -> list[ModelEntry]:
    """`a=builtin:default,b=/models/v3` (QTREL_MODELS); names must be distinct."""
    entries = [parse_entry(part) for part in text.split(",") if part.strip()]
    names = [e.name for e in entries]
    if len(entries) > 1 and None in names:
        raise ValueError("with several models each needs a name: NAME=PATH")
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be distinct: {', '.join(str(n) for n in names)}")
    return entries


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QTREL_", frozen=True, extra="ignore")

    # --- model ---
    model: str | None = Field(
        None,
        description="checkpoint directory, or builtin:default / builtin:pruned "
        "(shipped in the package); empty = the built-in default model",
    )
    models: str = Field(
        "",
        description="several models, NAME=PATH comma-separated (PATH as for model); the first is the default "
        "and each gets an equal share of the cores. Empty: the one model of `model`",
    )
    reload: Literal["auto", "beside", "in_place"] = Field(
        "auto",
        description="how a reload (SIGHUP, POST /admin/models/{name}/reload) swaps a model: beside (load the new "
        "copy next to the old, switch at once), in_place (drain the old first: requests wait, a bounded pause), "
        "auto = beside when a second copy fits in the memory available",
    )
    shadow: str = Field(
        "",
        description="NAME=PATH of a candidate model that scores a sample of the default model's live pairs "
        "again, off the request path, for the shadow metrics; empty = none",
    )
    shadow_rate: float = Field(0.1, ge=0, le=1, description="share of live pairs the shadow model scores")
    shadow_queue_pairs: int = Field(
        1024, ge=1, description="shadow pairs waiting at most; beyond, new ones are dropped (and counted)"
    )
    device: str = Field("auto", description="cpu, cuda, cuda:N, or auto (cuda when available)")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = Field(
        "auto",
        description="precision; auto = bfloat16 on CPUs with bfloat16 instructions (unless ONEDNN_MAX_CPU_ISA caps "
        "oneDNN below them), else float32; float16 on cuda",
    )
    max_length: int = Field(128, ge=8, le=512, description="tokens per pair, special tokens included")
    threads: int = Field(0, ge=0, description="torch intra-op threads per model process; 0 = auto")
    replicas: int = Field(
        0,
        ge=0,
        description="model processes serving batches side by side (process "
        "worker); 0 = auto: on cpu, cores / threads, on cuda 1",
    )
    warmup: bool = Field(True, description="run warm-up forwards before reporting ready")
    worker: Literal["process", "thread"] = Field(
        "process",
        description="where the model runs: a child process (no GIL shared with the HTTP server; "
        "restarted if it dies) or a thread of the server process",
    )
    process_start: Literal["template", "spawn"] = Field(
        "template",
        description="how model processes start on cpu (process worker): template = forked by a fork server "
        "that holds torch and this model loaded and warmed up once, shared by every model process; spawn = "
        "each a new interpreter that loads and warms its own (more memory; docs/benchmarks.md)",
    )
    inference: Literal["auto", "torch", "openvino"] = Field(
        "auto",
        description="what runs the forward pass on cpu: torch (oneDNN linears, unpadded batches), openvino "
        "(the optional extra qtrel[openvino]; padded batches compiled by OpenVINO), or auto = each model process "
        "times both on two realistic batches at start-up (about a second) and serves with OpenVINO only where it "
        "is at least 1.1x faster. Head masks "
        "(explanations) always run on torch; without OpenVINO, or where it fails to load, torch. /info shows "
        "the choice and why (model.inference, model.inference_reason)",
    )
    attention: Literal["auto", "fused", "torch"] = Field(
        "auto",
        description="the attention kernel of the torch forward on cpu: fused (one C call a layer over every pair's "
        "rows, where pip built it), torch (torch's kernels, per group of similar-length pairs), or auto = each "
        "model times both on a served batch at start-up (about 0.1 s) and the fused one serves where it is at "
        "least 1.03x faster. /info shows the choice and why (model.attention, model.attention_reason)",
    )

    batch_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a model process that holds one batch (or job) "
        "longer than this is killed and replaced, and the batch retried once "
        "(process worker)",
    )

    # --- HTTP ---
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    log_level: str = "info"
    log_json: bool = Field(True, description="one JSON object per log line")
    log_texts: bool = Field(
        False,
        description="write query and title texts to the logs, for debugging (search queries can be personal): "
        "each scoring request's texts at debug level, a refused request's values. Off: no log line holds a "
        "request's texts, exception messages included",
    )

    http_workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="front processes serving HTTP on the one port (validation, keys, tokenisation, response "
        "shaping), all feeding one engine core (this process: the queues, the cache, admission, the model "
        "processes). 1 = one process does it all; auto = 1 on a CPU with fewer than 8 cores, else one per 8 "
        "cores (at most 4), and half the cores (at most 8) on cuda. /info shows the choice (fronts)",
    )
    http_socket: Literal["reuseport", "shared"] = Field(
        "reuseport",
        description="how several fronts share the port: reuseport = a socket each (SO_REUSEPORT), the kernel "
        "spreading new connections evenly over the fronts; shared = one listening socket they all accept from "
        "(a front that dies leaves the connections waiting on it to the others, but one front may take most of "
        "a burst of new connections: measured 2:1 against reuseport's 1.05:1, docs/fronts-bench.md)",
    )

    fast_lane: bool = Field(
        True,
        description="hand a plainly valid scoring request (JSON body, no odd header) straight to its route, past "
        "FastAPI's per-request machinery: ~0.2 ms of CPU less a request, the same answers and errors "
        "(service.http.fast). Off, or with tracing on: every request goes the whole FastAPI way",
    )

    # --- batching ---
    max_batch_tokens: int = Field(MAX_BATCH_TOKENS, ge=64, description="padded tokens per forward (longest x pairs)")
    max_batch_size: int = Field(128, ge=1, description="pairs per forward")
    max_wait_ms: float = Field(2.0, ge=0, description="how long a batch may wait to fill")
    max_batch_ms: float = Field(
        50.0,
        ge=0,
        description="while a request bigger than about this much of one model process's work (at the model's "
        "measured rate) is queued, a batch holds this much work at most, so that a big request (or one whose client "
        "has gone) holds a process this long at most before small requests get their turn; small requests alone "
        "fill a batch whole up to max_batch_tokens. 0: batches bounded by max_batch_tokens only",
    )

    # --- the pair-score cache ---
    cache_mb: int = Field(
        64,
        ge=0,
        description="MiB of memory for the pair-score cache (~530 bytes a pair of Home Depot texts: 64 MiB holds "
        "~120k pairs), shared by every scoring route; 0 turns it off. A request bypasses it with "
        "Cache-Control: no-cache",
    )

    # --- long documents ---
    chunk_overlap: int = Field(
        CHUNK_OVERLAP,
        ge=0,
        le=512,
        description="tokens that consecutive windows of a long document share, where a request asks for "
        "windows (max_chunks on /score and /rerank, max_chunks_per_doc on /v1 and /v2/rerank) and names no "
        "chunk_overlap; at most half a window is used",
    )

    # --- admission and limits ---
    max_queue_pairs: int = Field(8192, ge=1, description="pairs accepted but not finished; beyond: 429")
    max_queue_tokens: int = Field(524288, ge=64, description="tokens accepted but not finished; beyond: 429")
    max_queue_wait_ms: float = Field(
        1000.0,
        ge=0,
        description="refuse (429, with a Retry-After from the rate) work whose queue ahead would take longer "
        "than this at the model's measured rate, on any CPU or GPU; until the rate is measured, only "
        "max_queue_pairs and max_queue_tokens bound the queue. 0: off",
    )
    max_pairs_per_request: int = Field(2048, ge=1, description="beyond: 413")
    max_text_chars: int = Field(2000, ge=1, description="characters per query or title; beyond: 413")
    unknown_share_warn: float = Field(
        0.3, ge=0, le=1, description="scoring routes warn of pairs whose share of unknown tokens is over this"
    )
    unknown_share_refuse: float | None = Field(
        None, ge=0, le=1, description="refuse (422) pairs whose share of unknown tokens is over this; none: serve all"
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="request body size; beyond: 413")
    request_timeout_ms: int = Field(30000, ge=1, description="default deadline; X-Request-Timeout-Ms overrides")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight work may take")

    # --- authentication ---
    api_keys: SecretStr = Field(
        SecretStr(""),
        description="comma-separated API keys; when any key is set "
        "(here or in api_keys_file), the scoring, explanation and /info routes need "
        "Authorization: Bearer <key>. Never logged, never shown in /info",
    )
    api_keys_file: Path | None = Field(
        None,
        description="a file of API keys, one a line (blank lines and # "
        "comments ignored), read at start and again when it changes (or on SIGHUP); for Kubernetes Secrets",
    )
    admin_keys: SecretStr = Field(
        SecretStr(""),
        description="comma-separated keys for the admin routes (POST /admin/models/{name}/reload); none set: "
        "the API keys (and with no key at all the admin routes are open, as every route is)",
    )
    admin_keys_file: Path | None = Field(None, description="a file of admin keys, one a line, as api_keys_file")
    _admin_keyring: KeyRing = PrivateAttr()
    protect_metrics: bool = Field(False, description="/metrics also needs an API key (when keys are set)")
    _keyring: KeyRing = PrivateAttr()

    # --- score jobs (/v1/jobs) ---
    jobs_dir: Path | None = Field(
        None,
        description="directory that holds score jobs, their inputs and outputs (a volume in Docker and Kubernetes); "
        "a restart resumes every unfinished job from its last written chunk. Unset: the /v1/jobs routes are off",
    )
    job_input_dirs: str = Field(
        "",
        description="comma-separated directories whose files a job may name as its input (`input_path`) instead "
        "of uploading one; empty: uploads only",
    )
    job_max_bytes: int = Field(1 << 30, ge=1, description="an input file's size; beyond: 413")
    job_max_rows: int = Field(10_000_000, ge=1, description="an input file's rows; beyond: 413")
    job_max_jobs: int = Field(16, ge=1, description="jobs queued or running at once; beyond: 429")
    job_min_free_bytes: int = Field(
        1 << 30,
        ge=0,
        description="free bytes the jobs directory keeps: a job whose input and output would leave less is refused "
        "(507), and a running one that meets a full disk fails with the reason",
    )
    job_processes: Literal["auto", "idle", "shared"] = Field(
        "auto",
        description="where score jobs' batches run: idle = model processes of their own, as many as the live ones, "
        "at the OS's idle priority (SCHED_IDLE; nice 19 where there is none), started while a job runs: live work "
        "takes a CPU from them at once; shared = the live model processes, while no live batch holds them (a live "
        "request may wait behind a job batch). auto = idle with the process worker on cpu, unless a CPU quota is "
        "below the cores the server sees (idle work spends the quota too)",
    )
    job_keep_s: float = Field(
        7 * 86400.0,
        ge=0,
        description="seconds a finished job (its files too) is kept before it is deleted; 0: kept until deleted",
    )

    # --- explanations ---
    explain_per_minute: int = Field(60, ge=0, description="/explain calls per minute (0 disables the route)")

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.max_batch_tokens < self.max_length:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must hold one pair of max_length ({self.max_length})"
            )
        if self.max_pairs_per_request > self.max_queue_pairs:
            raise ValueError(
                "max_pairs_per_request must not exceed max_queue_pairs: such a request could never be admitted"
            )
        self._keyring = KeyRing(split_keys(self.api_keys.get_secret_value(), ","), self.api_keys_file)
        self._admin_keyring = KeyRing(split_keys(self.admin_keys.get_secret_value(), ","), self.admin_keys_file)
        if self.model and self.models:
            raise ValueError("set model (QTREL_MODEL) or models (QTREL_MODELS), not both: which to serve is unclear")
        if self.models or self.shadow:
            names = [e.name for e in parse_models(self.models)]  # ValueError: a clear settings error
            if self.shadow and parse_entry(self.shadow).name in (None, *names):
                raise ValueError("shadow needs its own name: NAME=PATH, not one of the served models")
        return self

    @property
    def job_input_roots(self) -> list[Path]:
        """The directories of job_input_dirs, resolved: a job's input_path must lie under one of them."""
        return [Path(d.strip()).resolve() for d in self.job_input_dirs.split(",") if d.strip()]

    @property
    def keyring(self) -> KeyRing:
        """The API keys in force, re-read from api_keys_file when it changes (`keyring.reload()` on SIGHUP):
        the one part of the settings that changes while the server runs."""
        return self._keyring

    @property
    def keys(self) -> tuple[str, ...]:
        """Every API key in force, from api_keys and api_keys_file; empty: no authentication."""
        return self._keyring.keys

    @property
    def admin_keyring(self) -> KeyRing:
        """The admin keys; empty: the admin routes take the API keys (`keyring`)."""
        return self._admin_keyring if self._admin_keyring.keys else self._keyring

    def public(self) -> dict:
        """The effective settings as /info shows them: API keys redacted (their count only)."""
        out = self.model_dump(mode="json")
        n = len(self.keys)
        out["api_keys"] = f"<{n} redacted>" if n else ""
        n = len(self._admin_keyring.keys)
        out["admin_keys"] = f"<{n} redacted>" if n else ""
        return out
