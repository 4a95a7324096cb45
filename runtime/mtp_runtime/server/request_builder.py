"""From a validated OpenAI request to (prompt token ids, SamplingParams).

Length checks happen here, before the engine sees anything, so a prompt
longer than the context or a max_tokens that cannot fit is a 400 that names
the field instead of a request that fails half-way. A text prompt too long
to fit whatever its tokens (prompt_bound) is refused before it is tokenised,
a token-id list by its length before its ids are checked. The methods that
tokenise are blocking: the server runs them in a worker thread.
"""

from __future__ import annotations

from mtp_runtime.sampling_params import SamplingParams

from .chat_template import ChatTemplate, ChatTemplateError
from .openai_protocol import APIError, ChatCompletionRequest, SamplingFields
from .prompt_bound import cannot_fit, max_bytes_per_token


class RequestBuilder:
    def __init__(self, tokenizer, chat_template: ChatTemplate | None, max_model_len: int, vocab_size: int) -> None:
        # tokenizer: a `tokenizers.Tokenizer` (encode(text, add_special_tokens=...).ids).
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.bytes_per_token = max_bytes_per_token(tokenizer)

    def _no_room(self, prompt_param: str, prompt_len: int) -> APIError:
        return APIError(400, f"{prompt_param}: {prompt_len} tokens leave no room in the model's context of "
                             f"{self.max_model_len} tokens; shorten it", param=prompt_param,
                        code="context_length_exceeded")

    def check_text_fits(self, text: str, prompt_param: str) -> None:
        """Refuse, without tokenising, a text that has too many tokens whatever they are."""
        fewest = cannot_fit(len(text), self.max_model_len, self.bytes_per_token)
        if fewest is not None:
            raise APIError(400, f"{prompt_param}: {len(text)} characters are at least {fewest} tokens (one token "
                                f"of this model covers at most {self.bytes_per_token} bytes), which leave no room in "
                                f"the model's context of {self.max_model_len} tokens; shorten it",
                           param=prompt_param, code="context_length_exceeded")

    def completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if len(prompt) >= self.max_model_len:
                raise self._no_room("prompt", len(prompt))
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"prompt: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                               param="prompt", code="invalid_token_id")
            return list(prompt)
        self.check_text_fits(prompt, "prompt")
        # Completions get the tokenizer's own special tokens (BOS), as Hugging Face and vLLM do.
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        text = self.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt)
        self.check_text_fits(text, "messages")
        # The template already wrote BOS and role markers; adding them again would double them.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def sampling_params(self, req: SamplingFields, prompt_len: int, max_tokens: int | None,
                        prompt_param: str) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise self._no_room(prompt_param, prompt_len)
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise APIError(400, f"max_tokens: {max_tokens} is out of range: the prompt has {prompt_len} tokens, "
                                f"so at most {room} fit in the context of {self.max_model_len}",
                           param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  max_tokens=max_tokens, stop=req.stop_list(), seed=req.seed,
                                  ignore_eos=req.ignore_eos)
        except ValueError as exc:  # SamplingParams names the field: "SamplingParams.top_k=..."
            field = str(exc).split("=")[0].removeprefix("SamplingParams.")
            raise APIError(400, f"{field}: {exc}", param=field) from None
