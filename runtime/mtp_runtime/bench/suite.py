"""A whole benchmark: every concurrency level against one server, or the
baseline-vs-MTP comparison with two local servers measured in turns.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from .client import completion_payload, stream_completion
from .local_server import LocalServer
from .prompts import build_prompts
from .runner import LevelResult, LevelRun, find_model_name, run_level, summarise

log = logging.getLogger("mtp.bench")


def output_spread_error(spread: int, output_len: int) -> str | None:
    """The command-line refusal of an output spread that could leave a request no token (None: it is fine)."""
    if 0 <= spread < output_len:
        return None
    return f"--output-spread {spread} must lie in [0, --output-len {output_len})"


@dataclass
class BenchPlan:
    concurrency: list[int]
    input_len: int
    output_len: int
    requests_per_level: int  # 0: max(8, requests_per_client x concurrency)
    warmup_requests: int = 2
    seed: int = 0
    temperature: float = 0.0  # 0: greedy
    rounds: int = 2  # servers take turns this many times within each level
    # Each client's requests at a level (when requests_per_level is 0). With few, a level is mostly its
    # start (every client's first request at once) and its end (the last ones draining from a batch
    # nothing refills); with many, the steady state a long-running server sees dominates.
    requests_per_client: int = 4
    # Each request's output length is output_len + an offset drawn in [-output_spread, output_spread]
    # (seeded: request i asks every server for the same length). With every length equal, requests that
    # start together finish together on a server that gains one token a step, and their successors'
    # prompts prefill as one batch, cheaper per token than one at a time; a speculating server's
    # requests finish apart. Real traffic's lengths differ; a spread keeps the equal-length pattern out
    # of a comparison of speculative settings.
    output_spread: int = 0

    def __post_init__(self) -> None:
        if output_spread_error(self.output_spread, self.output_len):
            raise ValueError(f"output spread {self.output_spread} must lie in [0, output length {self.output_len}): "
                             f"every request must ask for at least one token")

    def output_lengths(self, n: int) -> list[int]:
        """The output length of each of n requests, in order (seeded by `seed`)."""
        if not self.output_spread:
            return [self.output_len] * n
        draw = random.Random(f"output-lengths-{self.seed}")
        return [self.output_len + draw.randint(-self.output_spread, self.output_spread) for _ in range(n)]

    def chunks(self, prompts: list[list[int]], concurrency: int) -> list[list[list[int]]]:
        """A level's prompts in `rounds` turns, each still able to keep `concurrency` requests busy."""
        turns = max(1, min(self.rounds, len(prompts) // concurrency))
        size = -(-len(prompts) // turns)
        return [prompts[i:i + size] for i in range(0, len(prompts), size)]

    def requests_for(self, concurrency: int) -> int:
        return self.requests_per_level or max(8, self.requests_per_client * concurrency)


async def _warm_up(base_url: str, model: str, prompt: list[int], plan: BenchPlan, api_key: str | None) -> None:
    # First requests pay one-off costs (allocator growth, lazy init); keep them out of level 1.
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=600.0) as client:
        for _ in range(plan.warmup_requests):
            payload = completion_payload(model, prompt, plan.output_len, plan.temperature, plan.seed)
            result = await stream_completion(client, base_url, payload, headers)
            if not result.ok:
                raise RuntimeError(f"warm-up request to {base_url} failed: {result.error}")


async def bench_servers(urls: dict[str, str], tokenizer, plan: BenchPlan,
                        api_key: str | None = None) -> dict[str, list[LevelResult]]:
    """Every level on every server, the servers taking turns within a level (the order flips
    each turn), so a machine that gets busier or quieter mid-run does not favour one of them."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        models = {label: await find_model_name(client, url, headers) for label, url in urls.items()}
    total = sum(plan.requests_for(c) for c in plan.concurrency)
    prompts = build_prompts(tokenizer, total + 1, plan.input_len, plan.seed)
    lengths = plan.output_lengths(total)
    for label, url in urls.items():
        await _warm_up(url, models[label], prompts[-1], plan, api_key)
    runs: dict[str, list[LevelResult]] = {label: [] for label in urls}
    offset, turn = 0, 0
    for concurrency in plan.concurrency:
        n = plan.requests_for(concurrency)
        measured: dict[str, LevelRun] = {}
        for chunk in plan.chunks(prompts[offset:offset + n], concurrency):
            order = list(urls) if turn % 2 == 0 else list(reversed(urls))
            for label in order:
                run = await run_level(urls[label], models[label], chunk, lengths[offset:offset + len(chunk)],
                                      concurrency, api_key, plan.temperature, seed_offset=offset)
                measured[label] = measured[label].plus(run) if label in measured else run
            offset, turn = offset + len(chunk), turn + 1
        for label in urls:
            level = summarise(concurrency, measured[label])
            log.info("%s concurrency %d: %.1f output tok/s, TPOT %.2f ms, acceptance %s", label, concurrency,
                     level.output_tokens_per_s, level.mean_tpot_ms, level.acceptance_rate)
            if level.failed:
                log.warning("%d of %d requests failed, first: %s", level.failed, level.requests, level.first_error)
            runs[label].append(level)
    return runs


def bench_local(model_dir: str, draft_dir: str, num_speculative_tokens: int, tokenizer, plan: BenchPlan,
                extra_serve_flags: list[str], startup_timeout_s: float = 900.0) -> dict[str, list[LevelResult]]:
    """A baseline (no draft) and an MTP server, both up, measured in turns on the same prompts."""
    baseline_flags = ["--model", model_dir, *extra_serve_flags]
    mtp_flags = ["--model", model_dir, "--draft_model", draft_dir,
                 "--num_speculative_tokens", str(num_speculative_tokens), *extra_serve_flags]
    log.info("starting the baseline server: mtp serve %s", " ".join(baseline_flags))
    with LocalServer(baseline_flags, startup_timeout_s) as baseline:
        log.info("starting the MTP server: mtp serve %s", " ".join(mtp_flags))
        with LocalServer(mtp_flags, startup_timeout_s) as mtp:
            return asyncio.run(bench_servers({"baseline": baseline.base_url, "mtp": mtp.base_url}, tokenizer, plan))
