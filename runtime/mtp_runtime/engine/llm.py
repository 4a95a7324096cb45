"""LLM: the offline API in the shape of vLLM's (`LLM(...).generate(prompts, params)`)."""

from __future__ import annotations

from typing import Sequence

from mtp_runtime.engine.config import EngineConfig
from mtp_runtime.engine.llm_engine import LLMEngine, RequestOutput
from mtp_runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, draft_model: str | None = None, num_speculative_tokens: int = 0,
                 **engine_options):
        unknown = sorted(set(engine_options) - set(EngineConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(f"LLM: unknown engine option(s) {unknown}; known: "
                            f"{sorted(set(EngineConfig.__dataclass_fields__) - {'model'})}")
        self.engine = LLMEngine(EngineConfig(model=str(model), draft_model=draft_model,
                                             num_speculative_tokens=num_speculative_tokens, **engine_options))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order. A prompt is text or token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"LLM.generate: {len(params)} sampling_params for {len(prompts)} prompts; "
                                 f"give one, or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"generate-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: drop the prompts already queued
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        finished: dict[str, RequestOutput] = {}
        self.engine.closed_batch = True  # no request arrives until these are done
        try:
            while len(finished) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        finally:
            self.engine.closed_batch = False
        return [finished[i] for i in ids]
