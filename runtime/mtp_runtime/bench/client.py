"""One streamed completion request, timed the way serving benchmarks time it.

TTFT: request sent -> first streamed token. TPOT: (end - first token) /
(output tokens - 1). Output tokens come from the server's `usage` (asked for
with stream_options.include_usage), falling back to the streamed chunk count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def completion_payload(model: str, prompt_ids: list[int], output_len: int, temperature: float = 0.0,
                       seed: int | None = None) -> dict:
    # ignore_eos: every request produces exactly output_len tokens on every server.
    payload = {"model": model, "prompt": prompt_ids, "max_tokens": output_len, "temperature": temperature,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        payload["seed"] = seed
    return payload


async def stream_completion(client: httpx.AsyncClient, base_url: str, payload: dict,
                            headers: dict[str, str]) -> RequestResult:
    started = time.perf_counter()
    first_token_at = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    return RequestResult(ok=False, error=str(event["error"])[:300])
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices") and event["choices"][0].get("text") is not None:
                    chunks += 1
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
    except httpx.HTTPError as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    finished = time.perf_counter()
    if first_token_at is None:
        return RequestResult(ok=False, error="the stream ended without a token")
    output_tokens = usage["completion_tokens"] if usage else chunks
    prompt_tokens = usage["prompt_tokens"] if usage else len(payload["prompt"])
    return RequestResult(ok=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                         ttft_s=first_token_at - started, latency_s=finished - started)
