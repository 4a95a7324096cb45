"""A few greedy completions through rank 0's OpenAI API (the `--requests` smoke test)."""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass

from mtp_operator.constants import ENV_API_KEY

SMOKE_PROMPTS = ("def main(", "import os\n", "class Config:", "for i in range(")


@dataclass(frozen=True)
class Completion:
    prompt: str
    text: str
    completion_tokens: int


def auth_headers(environ=os.environ) -> dict[str, str]:
    """The ranks inherit `mtp up`'s environment, so they require its MTP_API_KEY (spec.apiKeySecret's stand-in)."""
    key = environ.get(ENV_API_KEY)
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(endpoint: str, timeout: float = 10.0) -> str:
    request = urllib.request.Request(f"{endpoint}/v1/models", headers=auth_headers())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)["data"][0]["id"]


def complete(endpoint: str, model: str, prompt: str, max_tokens: int = 32, timeout: float = 120.0) -> Completion:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{endpoint}/v1/completions", data=body, headers={"Content-Type": "application/json", **auth_headers()}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.load(response)
    return Completion(prompt, answer["choices"][0]["text"], answer["usage"]["completion_tokens"])


def smoke_requests(endpoint: str, count: int, max_tokens: int = 32) -> list[Completion]:
    model = served_model(endpoint)
    return [complete(endpoint, model, SMOKE_PROMPTS[i % len(SMOKE_PROMPTS)], max_tokens) for i in range(count)]
