"""`mtp serve`: the OpenAI-compatible HTTP server each pod runs."""
