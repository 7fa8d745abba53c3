"""OpenAI Batch API wire types: /v1/files and /v1/batches objects, the create request, and the
lines of the input, output and error files.

Shapes follow the openai SDK's `types/file_object.py`, `types/batch.py` (with
`batch_request_counts.py`, `batch_error.py`, `batch_usage.py`) field for field; the SDK parses them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from compat import protocol as p

COMPLETION_WINDOWS_S = {"24h": 24 * 3600}  # OpenAI accepts only 24h

MIN_EXPIRES_AFTER_S, MAX_EXPIRES_AFTER_S = 3600, 30 * 24 * 3600  # OpenAI's bounds: 1 hour to 30 days
ExpiresAfterSeconds = Annotated[int, Meta(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)]
MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)]
ObjectId = Annotated[str, Meta(min_length=1, max_length=128)]


# --------------------------------------------------------------------------- requests
class ExpiresAfter(Struct, forbid_unknown_fields=True, kw_only=True):
    """When a file expires: `seconds` after its creation (the only anchor OpenAI has)."""

    anchor: Literal["created_at"]
    seconds: ExpiresAfterSeconds


class CreateBatchRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    input_file_id: ObjectId
    endpoint: str  # an endpoint kind's route (server/endpoints.py), checked with a message that lists them
    completion_window: str
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None  # of the output and error files


class InputLine(Struct, forbid_unknown_fields=True, kw_only=True):
    """One line of a batch input file: {"custom_id", "method", "url", "body"}."""

    custom_id: Annotated[str, Meta(min_length=1, max_length=512)]
    method: Literal["POST"]
    url: str
    body: msgspec.Raw  # decoded later by the endpoint's own request decoder


CREATE_BATCH_DECODER = msgspec.json.Decoder(CreateBatchRequest)
INPUT_LINE_DECODER = msgspec.json.Decoder(InputLine)


# --------------------------------------------------------------------------- objects
class _Object(Struct, kw_only=True):
    pass


class FileObject(_Object, kw_only=True):
    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"  # deprecated by OpenAI, still required by the SDK type
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(_Object, kw_only=True):
    id: str
    object: str = "file"
    deleted: bool = True


class RequestCounts(_Object, kw_only=True):
    total: int
    completed: int
    failed: int


class BatchError(_Object, kw_only=True):
    code: str | None
    message: str | None
    param: str | None = None
    line: int | None = None


class BatchErrors(_Object, kw_only=True):
    object: str = "list"
    data: list[BatchError]


# the Batch API reports usage as the Responses API does
InputTokensDetails, OutputTokensDetails, BatchUsage = p.InputTokensDetails, p.OutputTokensDetails, p.ResponseUsage


class Batch(_Object, kw_only=True):
    id: str
    object: str = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None


class ObjectList(_Object, kw_only=True):
    """A cursor page (files, batches, a response's input_items): the SDK asks for the next one with
    after=<last id> while has_more."""

    object: str = "list"
    data: list[Any]
    first_id: str | None
    last_id: str | None
    has_more: bool


# --------------------------------------------------------------------------- output and error lines
class LineResponse(_Object, kw_only=True):
    status_code: int
    request_id: str
    body: Any  # the endpoint's response object, or {"error": {...}}


class LineError(_Object, kw_only=True):
    code: str
    message: str


class OutputLine(_Object, kw_only=True):
    """A line of the output file (response set) or the error file (response with a 4xx/5xx body, or
    error set when the line never became a request)."""

    id: str
    custom_id: str | None
    response: LineResponse | None
    error: LineError | None


ENCODER = msgspec.json.Encoder()
