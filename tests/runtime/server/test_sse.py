from mtp_runtime.server.sse import SSE_DONE, parse_sse_lines, sse_event


def test_events_round_trip_and_stop_at_done():
    text = sse_event({"text": "a\nb", "n": 1}) + sse_event({"text": "é"}) + SSE_DONE + sse_event({"late": 1})
    assert "\n\n" in text and text.startswith("data: {")
    assert list(parse_sse_lines(text.splitlines())) == [{"text": "a\nb", "n": 1}, {"text": "é"}]
