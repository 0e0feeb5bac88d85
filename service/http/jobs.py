"""Score jobs over HTTP, shaped as OpenAI's batches: `POST /v1/jobs` (a file uploaded as multipart or as the
raw body, or an `input_path` the server may read), `GET /v1/jobs` (a page, newest first), `GET /v1/jobs/{id}`,
`POST /v1/jobs/{id}/cancel`, `DELETE /v1/jobs/{id}` and `GET /v1/jobs/{id}/output` (the scored file).

An upload streams to the jobs directory, counted against job_max_bytes as it comes (the edge middleware
leaves this route's body unbuffered); the desk (service.jobs.desk) checks and queues the job."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from python_multipart.multipart import MultipartParser, parse_options_header

from service.errors import ErrorKind, ServiceError
from service.http.routes import ERRORS
from service.http.schemas import Absent
from service.jobs.api import Job, JobOptions, Jobs

router = APIRouter(tags=["jobs"])  # protected by the API keys (app.PROTECTED_ROUTERS)
UPLOAD_ROUTE = "/v1/jobs"  # its body streams past the edge middleware's buffer (service.http.edge)
FIELD_BYTES = 4096  # a multipart form field other than the file
MEDIA = {"csv": "text/csv", "jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}


class JobOptionsBody(BaseModel):
    """`qtrel score`'s options; the server's model, precision and max_length stand for its own."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=64)] | Absent = Field(
        None, description="a served model's name (GET /v1/models); absent: the default model"
    )
    query_column: Annotated[str, Field(min_length=1, max_length=256)] = "query"
    title_column: Annotated[str, Field(min_length=1, max_length=256)] = "title"
    prefix: Annotated[str, Field(max_length=64)] = Field("", description="prefix of the score columns, e.g. pred_")
    skip_bad: bool = Field(False, description="write rows with a missing or empty query or title with empty scores")
    max_chunks: Annotated[int, Field(ge=1, le=64)] | Absent = Field(
        None, description="score a long title in at most this many windows; adds window columns"
    )
    chunk_overlap: Annotated[int, Field(ge=0, le=512)] | Absent = Field(
        None, description="with max_chunks: word pieces consecutive windows share (default: qtrel score's)"
    )
    truncation: Literal["only_second", "longest_first"] = "only_second"
    chunk_rows: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        20000, description="rows scored and written at a time: a restart resumes from the last one written"
    )

    @model_validator(mode="after")
    def _windows(self) -> JobOptionsBody:
        if self.chunk_overlap is not None and self.max_chunks is None:
            raise ValueError("chunk_overlap applies to windows: give max_chunks too")
        return self

    def options(self) -> JobOptions:
        return JobOptions(**self.model_dump(exclude={"input_path"}))


class JobPathBody(JobOptionsBody):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"input_path": "/data/nightly/pairs.parquet"}]}
    )
    input_path: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        description="a file inside one of the server's job_input_dirs"
    )


async def get_jobs(request: Request) -> Jobs:
    jobs = getattr(request.state, "jobs", None)
    if jobs is None:
        raise ServiceError(ErrorKind.NOT_FOUND, "score jobs are off on this server: set QTREL_JOBS_DIR to turn them on")
    return jobs


JobsDep = Annotated[Jobs, Depends(get_jobs)]


def owner_of(request: Request) -> str | None:
    """The API key's id where keys are set: each key sees its own jobs."""
    return getattr(request.state, "key_id", None)


def parse_options(fields: dict[str, Any], model: type[JobOptionsBody] = JobOptionsBody) -> JobOptionsBody:
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        msg = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}" for x in e.errors()[:10])
        raise ServiceError(ErrorKind.VALIDATION, msg) from None


class _Upload:
    """The file written as it streams in, refused beyond `limit` bytes."""

    def __init__(self, jobs: Jobs, filename: str):
        self.filename, self.limit = filename, jobs.max_bytes
        self.path = jobs.incoming(filename)
        self.f = self.path.open("wb")
        self.size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise ServiceError(ErrorKind.TOO_LARGE, f"the input is over {self.limit} bytes (job_max_bytes)")
        self.f.write(data)

    def close(self) -> None:
        self.f.close()

    def discard(self) -> None:
        self.f.close()
        self.path.unlink(missing_ok=True)


async def read_raw(request: Request, jobs: Jobs, filename: str) -> _Upload:
    up = _Upload(jobs, filename)
    try:
        async for data in request.stream():
            up.write(data)
    except BaseException:
        up.discard()
        raise
    finally:
        up.close()
    return up


async def read_multipart(request: Request, jobs: Jobs, content_type: bytes) -> tuple[_Upload | None, dict[str, str]]:
    """A multipart form with one file part (`file`) and option fields, the file streamed to disk."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ServiceError(ErrorKind.BAD_REQUEST, "multipart body without a boundary")
    fields: dict[str, str] = {}
    part: dict[str, Any] = {}
    files: list[_Upload] = []

    def header_field(d: bytes, s: int, e: int) -> None:
        part["field"] = part.get("field", b"") + d[s:e]

    def header_value(d: bytes, s: int, e: int) -> None:
        part["value"] = part.get("value", b"") + d[s:e]

    def header_end() -> None:
        part.setdefault("headers", {})[part.pop("field", b"").lower()] = part.pop("value", b"")

    def headers_done() -> None:
        _, disp = parse_options_header(part.get("headers", {}).get(b"content-disposition", b""))
        part["name"] = disp.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in disp:
            if part["name"] != "file":
                raise ServiceError(ErrorKind.VALIDATION, f"a file in part {part['name']!r}: send the input as `file`")
            if files:
                raise ServiceError(ErrorKind.VALIDATION, "one file per job")
            files.append(_Upload(jobs, disp[b"filename"].decode("utf-8", "replace") or "input"))
            part["file"] = files[-1]

    def data(d: bytes, s: int, e: int) -> None:
        if (up := part.get("file")) is not None:
            up.write(d[s:e])
        else:
            part["data"] = part.get("data", b"") + d[s:e]
            if len(part["data"]) > FIELD_BYTES:
                raise ServiceError(ErrorKind.TOO_LARGE, f"form field {part['name']!r} is over {FIELD_BYTES} bytes")

    def part_end() -> None:
        if part.get("file") is None:
            fields[part["name"]] = part.get("data", b"").decode("utf-8", "replace")
        part.clear()

    callbacks = {
        "on_part_begin": part.clear,
        "on_header_field": header_field,
        "on_header_value": header_value,
        "on_header_end": header_end,
        "on_headers_finished": headers_done,
        "on_part_data": data,
        "on_part_end": part_end,
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]  # its callbacks are loosely typed
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except BaseException as e:
        for up in files:
            up.discard()
        if isinstance(e, ServiceError | asyncio.CancelledError) or not isinstance(e, Exception):
            raise
        raise ServiceError(ErrorKind.BAD_REQUEST, f"malformed multipart body: {e}") from None  # python-multipart's
    finally:
        for up in files:
            up.close()
    return (files[0] if files else None), fields


@router.post(UPLOAD_ROUTE, responses={c: ERRORS.get(c, ERRORS[422]) for c in (400, 401, 403, 404, 413, 422, 429, 507)})
async def create_job(request: Request, jobs: JobsDep, filename: Annotated[str | Absent, Query()] = None):
    """Queue a score job. Send the file as multipart (`file`, with the options as form fields), as the raw body
    (`?filename=pairs.csv` names its format, the options as query parameters), or name a file the server may
    read: JSON `{"input_path": ..., options}`. Refused with nothing queued: a file too large or too long, an
    unknown format or model, missing columns, bad rows (unless skip_bad), a path outside job_input_dirs, too
    many jobs, a disk too full."""
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    owner = owner_of(request)
    if media == "application/json":
        body = await request.body()
        try:
            fields = json.loads(body or b"null")
        except ValueError as e:
            raise ServiceError(ErrorKind.BAD_REQUEST, f"body is not valid JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ServiceError(ErrorKind.VALIDATION, "the body must be a JSON object with input_path")
        p = parse_options(fields, JobPathBody)
        assert isinstance(p, JobPathBody)
        job = await jobs.submit(Path(p.input_path), p.input_path, p.options(), owner, uploaded=False)
        return JSONResponse(job.public())
    if media == "multipart/form-data":
        up, fields = await read_multipart(request, jobs, ctype.encode("latin-1"))
        if up is None or "file" in fields:
            if up is not None:
                up.discard()
            raise ServiceError(ErrorKind.VALIDATION, "the form has no file: send it as the part `file`")
    else:
        if not filename:
            raise ServiceError(
                ErrorKind.VALIDATION,
                "name the file: ?filename=pairs.csv (.csv, .jsonl, .parquet) with a raw body, or send it as "
                "multipart/form-data, or send JSON with input_path",
            )
        fields = {k: v for k, v in request.query_params.items() if k != "filename"}
        up = await read_raw(request, jobs, filename)
    try:
        options = parse_options(fields).options()
    except ServiceError:
        up.path.unlink(missing_ok=True)
        raise
    job = await jobs.submit(up.path, up.filename, options, owner, uploaded=True)
    return JSONResponse(job.public())


@router.get("/v1/jobs", responses={401: ERRORS[401], 404: ERRORS[404]})
async def list_jobs(
    request: Request,
    jobs: JobsDep,
    after: Annotated[str | Absent, Query(description="the last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
):
    """Jobs, newest first, a page at a time (OpenAI's list: data, first_id, last_id, has_more)."""
    page, more = jobs.list(owner_of(request), after, limit)
    data = [j.public() for j in page]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


@router.get("/v1/jobs/{job_id}", responses={401: ERRORS[401], 404: ERRORS[404]})
async def get_job(job_id: str, request: Request, jobs: JobsDep):
    """The job: its status, progress (rows done, pairs/s, seconds left), counts, error, output."""
    return JSONResponse(jobs.get(job_id, owner_of(request)).public())


@router.post("/v1/jobs/{job_id}/cancel", responses={c: ERRORS.get(c, ERRORS[422]) for c in (401, 404, 409)})
async def cancel_job(job_id: str, request: Request, jobs: JobsDep):
    """Cancel a queued or running job (running: `cancelling` until its slices in flight end); 409 once it ended."""
    return JSONResponse((await jobs.cancel(job_id, owner_of(request))).public())


@router.delete("/v1/jobs/{job_id}", responses={c: ERRORS.get(c, ERRORS[422]) for c in (401, 404, 409)})
async def delete_job(job_id: str, request: Request, jobs: JobsDep):
    """Delete a finished job and its files; 409 while it is queued or running (cancel it first)."""
    job: Job = await jobs.delete(job_id, owner_of(request))
    return JSONResponse({"id": job.id, "object": "job.deleted", "deleted": True})


@router.get("/v1/jobs/{job_id}/output", responses={c: ERRORS.get(c, ERRORS[422]) for c in (401, 404, 409)})
async def job_output(job_id: str, request: Request, jobs: JobsDep):
    """The scored file, byte for byte what `qtrel score` writes for the same input, model and precision."""
    job = jobs.get(job_id, owner_of(request))
    path = jobs.output(job_id, owner_of(request))
    return FileResponse(path, media_type=MEDIA[job.format], filename=f"{job.id}.{job.format}")
