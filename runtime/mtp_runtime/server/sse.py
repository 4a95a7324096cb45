"""Server-sent events in the framing OpenAI clients parse: `data: JSON` + blank line."""

from __future__ import annotations

import json

SSE_DONE = "data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


def sse_event(payload: dict) -> str:
    # Compact JSON never contains a raw newline, which would end the event early.
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def parse_sse_lines(lines):
    """Yield decoded payloads of `data:` lines until [DONE] (used by `mtp bench`)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
