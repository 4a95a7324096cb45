"""The server's own spec-decode counters, read from its Prometheus /metrics.

Acceptance is taken from what the server counted (deltas over a benchmark
level), never estimated by the client. Our names and vLLM's are both read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# (draft counter, accepted counter, per-position counter) by engine, Prometheus family names.
COUNTER_NAMES = (
    ("mtp_spec_decode_draft_tokens", "mtp_spec_decode_accepted_tokens",
     "mtp_spec_decode_accepted_tokens_per_position", "mtp_spec_decode_steps"),
    ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
     "vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:spec_decode_num_drafts"),
)


@dataclass
class SpecCounters:
    found: bool = False
    draft: float = 0.0
    accepted: float = 0.0
    steps: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        return SpecCounters(
            found=self.found, draft=self.draft - before.draft, accepted=self.accepted - before.accepted,
            steps=self.steps - before.steps,
            per_position={p: v - before.per_position.get(p, 0.0) for p, v in self.per_position.items()},
        )

    def plus(self, other: "SpecCounters") -> "SpecCounters":
        positions = set(self.per_position) | set(other.per_position)
        return SpecCounters(
            found=self.found or other.found, draft=self.draft + other.draft,
            accepted=self.accepted + other.accepted, steps=self.steps + other.steps,
            per_position={p: self.per_position.get(p, 0.0) + other.per_position.get(p, 0.0) for p in positions},
        )

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft if self.found and self.draft > 0 else None

    def per_position_rate(self) -> dict[int, float]:
        """Accepted at position p per verify step (= per drafted token at p)."""
        if not self.steps:
            return {}
        return {p: v / self.steps for p, v in sorted(self.per_position.items())}


def parse_spec_counters(text: str) -> SpecCounters:
    # Index by sample name: the parser files `name_total` samples of names with a
    # colon (vLLM's) under a family of their own, so families are not reliable.
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    for draft_name, accepted_name, per_pos_name, steps_name in COUNTER_NAMES:
        if f"{draft_name}_total" not in samples:
            continue
        total = lambda name: sum(s.value for s in samples.get(f"{name}_total", []))  # noqa: E731
        counters = SpecCounters(found=True, draft=total(draft_name), accepted=total(accepted_name),
                                steps=total(steps_name))
        for sample in samples.get(f"{per_pos_name}_total", []):
            if "position" in sample.labels:
                position = int(sample.labels["position"])
                counters.per_position[position] = counters.per_position.get(position, 0.0) + sample.value
        return counters
    return SpecCounters(found=False)


async def scrape_spec_counters(client: httpx.AsyncClient, base_url: str) -> SpecCounters:
    try:
        response = await client.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return SpecCounters(found=False)
    if response.status_code != 200:
        return SpecCounters(found=False)
    return parse_spec_counters(response.text)
