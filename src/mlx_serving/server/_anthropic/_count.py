"""``count_tokens``: a Messages request's prompt tokens, as the serving renders and encodes them."""

from __future__ import annotations

from ...tokenization import Tokenizer
from .._errors import APIError
from ._request import Prompt

__all__ = ["count_tokens"]


def count_tokens(prompt: Prompt, tokenizer: Tokenizer | None) -> int:
    """Tokens of ``prompt`` rendered by the model's chat template (with its tools and thinking
    switch, and the assistant turn's opening), as a Messages request generates from. Blocking
    (~1 us per character): call off the event loop. Raises APIError 400 when ``tokenizer`` is None
    (param ``model``) or the messages cannot be rendered (param ``messages``)."""
    if tokenizer is None:
        raise APIError(400, f"the model {prompt.model!r:.200} has no tokenizer attached to this server: its tokens "
                            "cannot be counted", param="model")
    try:
        return len(tokenizer.encode_chat(prompt.messages, add_generation_prompt=True,
                                         enable_thinking=prompt.enable_thinking, tools=prompt.tools))
    except ValueError as exc:  # a template error or text the tokenizer refuses
        raise APIError(400, f"the messages cannot be rendered: {exc}", param="messages") from None
