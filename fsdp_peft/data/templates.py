"""What the model sees: prompts and chats rendered as text, cut into pieces that are trained or not.

A prompt is rendered with the tokenizer's chat template (a user turn and the generation prompt) or used
raw; a chat is rendered whole and cut at its assistant turns, which are the pieces trained on.
"""

from __future__ import annotations

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.formats import BadRow, Example
from fsdp_peft.settings.config import RecipeArguments


def _chat_template(tokenizer) -> None:
    if not tokenizer.chat_template:
        raise ConfigError("use_chat_template: the tokenizer has no chat template; set use_chat_template: false")


def render_prompt(tokenizer, prompt: str, use_chat_template: bool) -> str:
    """The text the model sees before its answer: the chat template's user turn, or the raw prompt."""
    if not use_chat_template:
        return prompt
    _chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def render_example_prompt(tokenizer, example: Example, use_chat_template: bool) -> str:
    """The generation prompt of a held-out example: its conversation so far, or its prompt."""
    if example.messages is None:
        return render_prompt(tokenizer, example.prompt, use_chat_template)
    _chat_template(tokenizer)
    return tokenizer.apply_chat_template(example.messages, tokenize=False, add_generation_prompt=True)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja's raise_exception and template bugs
        raise BadRow("chat template error", f"the chat template refused the conversation ({error})") from None


def chat_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered chat cut into (text, is_assistant_turn) pieces.

    An assistant turn is what rendering the conversation through it adds to rendering the conversation
    before it with the generation prompt (for most templates: the content and the end-of-turn token).
    A template that rewrites earlier turns as later ones are added is refused: its answer positions
    cannot be found.
    """
    full = _render(tokenizer, messages)
    segments, done = [], ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], add_generation_prompt=True)
        through = _render(tokenizer, messages[: index + 1])
        if not (before.startswith(done) and through.startswith(before) and full.startswith(through)):
            raise ConfigError(
                "data: the tokenizer's chat template renders earlier turns differently once later turns are added, "
                "so the assistant tokens cannot be located; use a template whose renderings are prefixes of each "
                "other, or convert the data to prompt/completion rows"
            )
        segments += [(before[len(done) :], False), (through[len(before) :], True)]
        done = through
    segments.append((full[len(done) :], False))
    return [(text, trained) for text, trained in segments if text]


def example_segments(example: Example, tokenizer, recipe: RecipeArguments) -> list[tuple[str, bool]]:
    """The example's text as (piece, trained) pieces: prompt then answer and end token, or a chat."""
    if example.messages is not None:
        if not recipe.use_chat_template:
            raise ConfigError(
                "use_chat_template: false, but chat rows (messages/conversations) are rendered with the tokenizer's "
                "chat template; set use_chat_template: true"
            )
        _chat_template(tokenizer)
        return chat_segments(tokenizer, example.messages)
    prompt = render_prompt(tokenizer, example.prompt, recipe.use_chat_template)
    return [(prompt, False), (example.completion + tokenizer.eos_token, True)]
