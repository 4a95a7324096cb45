"""HTTP probes of local ranks: GET /health on every rank, /metrics on rank 0."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HealthProbe:
    ok: bool  # 200: loaded and the whole group connected
    status_code: int | None  # None: nothing answered
    body: dict[str, Any] | None
    error: str | None = None


def get(url: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) for 2xx-5xx answers; raises OSError when nothing answers, or when the answer
    breaks off (a rank that dies while it answers sends its headers and closes before the body)."""
    try:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
    except http.client.HTTPException as err:
        raise OSError(f"GET {url}: the answer broke off ({type(err).__name__})") from err


def probe_health(host: str, port: int, timeout: float = 2.0) -> HealthProbe:
    try:
        code, raw = get(f"http://{host}:{port}/health", timeout)
    except OSError as err:
        return HealthProbe(False, None, None, str(getattr(err, "reason", err)))
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = None
    return HealthProbe(code == 200, code, body if isinstance(body, dict) else None)


def scrape_metrics(host: str, port: int, timeout: float = 5.0) -> str | None:
    """Prometheus text of /metrics, or None when it cannot be read."""
    try:
        code, raw = get(f"http://{host}:{port}/metrics", timeout)
    except OSError:
        return None
    return raw.decode("utf-8", errors="replace") if code == 200 else None
