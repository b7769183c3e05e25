"""The checkpoint's chat template for the server (models/chat_template.py) with a refused conversation as a 400."""

from __future__ import annotations

from nanocp.models.chat_template import ChatRenderError, ChatTemplateError
from nanocp.models.chat_template import ChatTemplate as _ModelChatTemplate

from .errors import bad_request

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplate(_ModelChatTemplate):
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages [{"role", "content"}] -> prompt text; a template that rejects the conversation -> 400."""
        try:
            return super().render(messages, add_generation_prompt)
        except ChatRenderError as e:
            raise bad_request(str(e), "invalid_messages", "messages") from e
