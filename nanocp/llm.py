"""Offline, vLLM-style API over the engine:

from nanocp import LLM, SamplingParams
llm = LLM(model="tiny", decode_instances=4, policy="nanocp", backend="threads")
outs = llm.generate(["hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0.0))
outs = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=32))

A text prompt is tokenized as the server tokenizes /v1/completions (`encode_prompt`: BOS as the checkpoint's
tokenizer_config.json says), a conversation as it tokenizes /v1/chat/completions (the checkpoint's chat template,
`encode_chat`), so the same prompt gives the same greedy tokens offline and served.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from .data_plane.sampling import SamplingParams
from .engine import Engine, EngineConfig, RequestOutput
from .models import encode_chat, encode_prompt
from .models.chat_template import ChatTemplate


class LLM:
    def __init__(self, model: str = "tiny", **kwargs) -> None:
        self.engine = Engine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self.chat_template = ChatTemplate.for_tokenizer(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        return_logits: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        rids = []
        for prompt, p in zip(prompts, params):
            ids = encode_prompt(self.tokenizer, prompt)
            rid = f"gen-{next(self._ids)}"
            self.engine.add_request(rid, ids, p, keep_logits=return_logits)
            rids.append(rid)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(rids), disable=not use_tqdm, desc="generate") as bar, self.engine.driving():
            while len(finished) < len(rids):
                for out in self.engine.step():
                    finished[out.request_id] = out
                    bar.update(1)
        for rid in rids:
            self.engine.release(rid)
        return [finished[rid] for rid in rids]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        return_logits: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation ([{"role": ..., "content": ...}, ...]) or a list of them, each rendered with the
        checkpoint's chat template; outputs in conversation order. A template that refuses a conversation raises
        ChatRenderError."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            encode_chat(self.tokenizer, self.chat_template.render(list(c), add_generation_prompt))
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, return_logits=return_logits, use_tqdm=use_tqdm)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
