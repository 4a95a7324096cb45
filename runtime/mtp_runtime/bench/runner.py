"""One benchmark level: N requests at a fixed concurrency against one server."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass

import httpx

from .client import RequestResult, completion_payload, stream_completion
from .server_metrics import SpecCounters, scrape_spec_counters


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    output_tokens: int
    prompt_tokens: int
    acceptance_rate: float | None  # server-side accepted / drafted over this level
    mean_accepted_per_step: float | None
    accepted_per_position: dict[int, float]  # per verify step
    first_error: str = ""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class LevelRun:
    """Raw measurements of one batch of requests at one concurrency; runs of a level add up."""

    results: list[RequestResult]
    duration_s: float
    spec: SpecCounters

    def plus(self, other: "LevelRun") -> "LevelRun":
        return LevelRun(self.results + other.results, self.duration_s + other.duration_s,
                        self.spec.plus(other.spec))


async def find_model_name(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_level(base_url: str, model: str, prompts: list[list[int]], output_len: int | list[int],
                    concurrency: int, api_key: str | None = None, temperature: float = 0.0, timeout_s: float = 600.0,
                    seed_offset: int = 0) -> LevelRun:
    """The prompts through `concurrency` clients; output_len: every request's, or one per prompt."""
    lengths = [output_len] * len(prompts) if isinstance(output_len, int) else list(output_len)
    if len(lengths) != len(prompts):
        raise ValueError(f"run_level: {len(lengths)} output lengths for {len(prompts)} prompts")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        before = await scrape_spec_counters(client, base_url)
        queue = [(index, prompt, length) for index, (prompt, length)
                 in enumerate(zip(prompts, lengths), start=seed_offset)]
        results: list[RequestResult] = []

        async def worker() -> None:
            while queue:
                index, prompt, length = queue.pop()
                seed = index if temperature > 0 else None  # the same draws on every server
                results.append(await stream_completion(
                    client, base_url, completion_payload(model, prompt, length, temperature, seed), headers))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - started
        spec = (await scrape_spec_counters(client, base_url)).minus(before)
    return LevelRun(results, duration, spec)


def summarise(concurrency: int, run: LevelRun) -> LevelResult:
    results, duration, spec = run.results, run.duration_s, run.spec
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    steps = spec.steps if spec.found else 0
    return LevelResult(
        concurrency=concurrency, requests=len(results), failed=len(failed), duration_s=duration,
        mean_ttft_ms=1000 * statistics.fmean(r.ttft_s for r in ok) if ok else float("nan"),
        mean_tpot_ms=1000 * statistics.fmean(tpots) if tpots else float("nan"),
        output_tokens_per_s=out_tokens / duration if duration > 0 else 0.0,
        total_tokens_per_s=(out_tokens + prompt_tokens) / duration if duration > 0 else 0.0,
        output_tokens=out_tokens, prompt_tokens=prompt_tokens,
        acceptance_rate=spec.acceptance_rate,
        mean_accepted_per_step=spec.accepted / steps if steps else None,
        accepted_per_position=spec.per_position_rate() if steps else {},
        first_error=failed[0].error if failed else "",
    )
