"""A whole benchmark: every concurrency level against one server, or the
baseline-vs-MTP comparison with two local servers started one after the other.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from .client import completion_payload, stream_completion
from .local_server import LocalServer
from .prompts import build_prompts
from .runner import LevelResult, find_model_name, run_level

log = logging.getLogger("mtp.bench")


@dataclass
class BenchPlan:
    concurrency: list[int]
    input_len: int
    output_len: int
    requests_per_level: int  # 0: max(8, 4 x concurrency)
    warmup_requests: int = 2
    seed: int = 0

    def requests_for(self, concurrency: int) -> int:
        return self.requests_per_level or max(8, 4 * concurrency)


async def _warm_up(base_url: str, model: str, prompt: list[int], plan: BenchPlan, api_key: str | None) -> None:
    # First requests pay one-off costs (allocator growth, lazy init); keep them out of level 1.
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=600.0) as client:
        for _ in range(plan.warmup_requests):
            result = await stream_completion(client, base_url, completion_payload(model, prompt, plan.output_len),
                                             headers)
            if not result.ok:
                raise RuntimeError(f"warm-up request to {base_url} failed: {result.error}")


async def bench_server(base_url: str, tokenizer, plan: BenchPlan, api_key: str | None = None,
                       model: str | None = None) -> list[LevelResult]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if model is None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            model = await find_model_name(client, base_url, headers)
    total = sum(plan.requests_for(c) for c in plan.concurrency)
    prompts = build_prompts(tokenizer, total + 1, plan.input_len, plan.seed)
    await _warm_up(base_url, model, prompts[-1], plan, api_key)
    results, offset = [], 0
    for concurrency in plan.concurrency:
        n = plan.requests_for(concurrency)
        level = await run_level(base_url, model, prompts[offset:offset + n], plan.output_len, concurrency, api_key)
        offset += n
        log.info("%s concurrency %d: %.1f output tok/s, TPOT %.2f ms, acceptance %s", base_url, concurrency,
                 level.output_tokens_per_s, level.mean_tpot_ms, level.acceptance_rate)
        if level.failed:
            log.warning("%d of %d requests failed, first: %s", level.failed, level.requests, level.first_error)
        results.append(level)
    return results


def bench_local(model_dir: str, draft_dir: str, num_speculative_tokens: int, tokenizer, plan: BenchPlan,
                extra_serve_flags: list[str]) -> dict[str, list[LevelResult]]:
    """Baseline (no draft) then MTP, same prompts, servers never running at the same time."""
    servers = {
        "baseline": ["--model", model_dir, *extra_serve_flags],
        "mtp": ["--model", model_dir, "--draft_model", draft_dir,
                "--num_speculative_tokens", str(num_speculative_tokens), *extra_serve_flags],
    }
    runs = {}
    for label, flags in servers.items():
        log.info("starting the %s server: mtp serve %s", label, " ".join(flags))
        with LocalServer(flags) as server:
            runs[label] = asyncio.run(bench_server(server.base_url, tokenizer, plan))
    return runs
