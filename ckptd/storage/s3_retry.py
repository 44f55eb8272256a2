"""The S3 retry policy: what is retried, how long to wait, and how a failure reads.

Retried: throttling (503 SlowDown, 429, ``Throttling``), any other 5xx, S3's ``RequestTimeout``
(a 400), and transport failures — connection refused/reset/closed, a response cut off mid-body,
read and connect timeouts. Not retried: every other 4xx (missing key, access denied, bad request),
which would fail again.

The wait before retry ``n`` (1-based) is uniform in
``[0, min(max_delay_s, base_delay_s * 2**(n-1))]`` ("full jitter": clients that were throttled
together spread out instead of retrying in lockstep). Attempts are bounded by ``max_attempts``.
This is the only retry loop: botocore's own is switched off by :func:`client_config`, since two
nested loops multiply attempts and hide the real bound.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import aiohttp
import botocore.exceptions

if TYPE_CHECKING:
    from ckptd.storage.s3_transfer import S3Transfer

NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_RETRY_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
     "InternalError", "ServiceUnavailable", "XAmzContentSHA256Mismatch"}
)
_RETRY_EXCEPTIONS: tuple[type[BaseException], ...] = (
    botocore.exceptions.HTTPClientError,  # connection closed/reset, read timeout, streaming error
    botocore.exceptions.ConnectionError,  # endpoint connection / connect timeout
    botocore.exceptions.IncompleteReadError,
    aiohttp.ClientError,  # payload errors and disconnects raised outside botocore's wrappers
    ConnectionError,
    TimeoutError,
)
# What a request may raise because of the storage (the rest would be bugs, and propagate as is).
STORAGE_EXCEPTIONS: tuple[type[BaseException], ...] = (
    botocore.exceptions.BotoCoreError,
    botocore.exceptions.ClientError,
    aiohttp.ClientError,
    OSError,  # includes ConnectionError and TimeoutError
)


def client_config(config_kwargs: dict[str, Any] | None, transfer: S3Transfer) -> dict[str, Any]:
    """s3fs ``config_kwargs`` for ckptd: one retry loop (ours), a pool as wide as our fan-out.
    Everything else the user set (timeouts, addressing style...) passes through."""
    out = dict(config_kwargs or {})
    out["retries"] = {"total_max_attempts": 1}
    out["max_pool_connections"] = max(int(out.get("max_pool_connections", 0)), transfer.concurrency)
    return out


def retryable(e: BaseException) -> bool:
    if isinstance(e, botocore.exceptions.ClientError):
        s = status(e)
        return s >= 500 or s == 429 or code(e) in _RETRY_CODES
    return isinstance(e, _RETRY_EXCEPTIONS)


def delay_s(attempt: int, transfer: S3Transfer, rng: random.Random) -> float:
    """How long to wait after failed attempt ``attempt`` (1-based): exponential, full jitter."""
    return rng.uniform(0.0, min(transfer.max_delay_s, transfer.base_delay_s * 2 ** (attempt - 1)))


def code(e: BaseException | None) -> str:
    """S3's error code (``SlowDown``, ``NoSuchKey``...), or "" for a transport error."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def status(e: BaseException) -> int:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return 0
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def reason(e: BaseException) -> str:
    """One line for an error message: ``SlowDown (HTTP 503)`` or ``ExcType: text``."""
    if isinstance(e, botocore.exceptions.ClientError):
        return f"{code(e)} (HTTP {status(e)})"
    text = " ".join(str(e).split()) or "no detail"
    return f"{type(e).__name__}: {text}"[:300]
