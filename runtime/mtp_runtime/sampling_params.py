"""SamplingParams: how one request is decoded (the shape of vLLM's offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = -1  # -1 or 0 = whole vocabulary
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               "temperature", self.temperature, "a number >= 0 (0 means greedy)")
        self.temperature = float(self.temperature)
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               "top_p", self.top_p, "a number in (0, 1]")
        self.top_p = float(self.top_p)
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
               "top_k", self.top_k, "-1 or 0 (whole vocabulary) or a positive integer")
        if self.top_k == 0:
            self.top_k = -1
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "an integer >= 1")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a list of non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check(self.seed is None or _is_int(self.seed),
               "seed", self.seed, "an integer or None")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {expected}")
