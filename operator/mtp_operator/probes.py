"""HTTP probes of runtime pods: per-rank GET /health, rank 0's metrics page.

Plain blocking urllib with short timeouts: the handlers run in kopf's thread
pool, and a slow rank must cost at most `timeout` seconds, never a hang.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthResult:
    healthy: bool
    detail: str  # "200", "503: {...}", "connection refused", ...


def _url(host: str, port: int, path: str) -> str:
    if ":" in host and not host.startswith("["):  # IPv6 pod IP
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def probe_health(host: str, port: int, path: str, timeout: float) -> HealthResult:
    try:
        with urllib.request.urlopen(_url(host, port, path), timeout=timeout) as response:
            return HealthResult(response.status == 200, str(response.status))
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read(200).decode(errors="replace").strip()
        except http.client.HTTPException:  # the rank closed the connection before its body (dying)
            body = ""
        return HealthResult(False, f"{exc.code}: {body}" if body else str(exc.code))
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        return HealthResult(False, str(reason) or type(exc).__name__)


def fetch_metrics(host: str, port: int, path: str, timeout: float) -> str:
    """The metrics page text; raises OSError (with the URL) when rank 0 cannot be read."""
    url = _url(host, port, path)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # an answer that broke off too
        raise OSError(f"GET {url}: {getattr(exc, 'reason', exc) or type(exc).__name__}") from None
