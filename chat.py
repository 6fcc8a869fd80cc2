"""Chat: a conversation rendered by the checkpoint's own chat template, turn by turn, as tokens the model keeps in its
KV cache.

    template = ChatTemplate(checkpoint_dir)        # chat_template.jinja, or tokenizer_config.json's chat_template
    chat = Chat(template, tokenizer)
    tokens, cached = chat.ask("Write a haiku")     # the whole conversation; its first `cached` are in the cache
    chat.answer(reply_ids)                         # what the model said, its end-of-turn token included

The template runs in Jinja's sandbox, as transformers' apply_chat_template runs it (trim_blocks, lstrip_blocks,
loop controls, raise_exception, strftime_now, a tojson that keeps non-ASCII), with the checkpoint's BOS and EOS
strings. The converter carries a GGUF's tokenizer.chat_template, or a Hugging Face directory's template, into the
checkpoint's tokenizer_config.json.
"""
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from checkpoint import InputError, read_json_object


class ChatTemplate:
    """A checkpoint's chat template, compiled in the sandbox; a missing or broken one is one line (InputError)."""

    def __init__(self, checkpoint_dir):
        checkpoint_dir = Path(checkpoint_dir)
        config_path, jinja_path = checkpoint_dir / "tokenizer_config.json", checkpoint_dir / "chat_template.jinja"
        config = {}
        if config_path.is_file():
            config = read_json_object(config_path, "fix it, or convert the checkpoint again "
                                                   "(scripts/convert_checkpoint.py)")
        template, self.path = config.get("chat_template"), config_path
        if jinja_path.is_file():
            template, self.path = jinja_path.read_text(), jinja_path
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            raise InputError(f"{checkpoint_dir}: no chat template (chat_template.jinja, or tokenizer_config.json's "
                             "chat_template); convert a source that has one with scripts/convert_checkpoint.py, or "
                             "drop --chat")
        self.special = {name: token_text(config.get(name)) for name in ("bos_token", "eos_token")}

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda format: datetime.now().strftime(format))
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise InputError(f"{self.path}: the chat template does not parse ({e})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{k: v for k, v in self.special.items() if v is not None})
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InputError(f"{self.path}: the chat template failed to render ({type(e).__name__}: {e})") from None

    def end_of_turn(self, tokenizer) -> set[int]:
        """The special token the template closes an assistant's turn with (<|im_end|>, <|eot_id|>, </s>...)."""
        marker = "\x1fassistant reply\x1f"
        text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], False)
        after = text[text.index(marker) + len(marker):] if marker in text else ""
        for i in tokenizer.encode(after, bos=False):
            if i in tokenizer.special_ids:
                return {i}
            if tokenizer.decode([i]).strip():
                break
        return set()


def token_text(value):
    """tokenizer_config.json's "bos_token": a string, or an AddedToken's {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class Chat:
    """A conversation and the tokens the model has seen of it: earlier turns as they were fed (the model's own
    replies as it sampled them), then each new turn as the template renders it after them."""

    def __init__(self, template: ChatTemplate, tokenizer):
        self.template, self.tokenizer = template, tokenizer
        self.stop_ids = tokenizer.eos_ids | template.end_of_turn(tokenizer)  # a reply ends at any of these
        self.messages, self.tokens, self.text = [], [], ""

    def ask(self, content: str) -> tuple[list[int], int]:
        """The conversation's tokens with a user message and the assistant's header added, and how many of them lead
        the model's cache: all the earlier ones but the newest, which was sampled and never fed."""
        self.messages.append({"role": "user", "content": content})
        rendered = self.template.render(self.messages, add_generation_prompt=True)
        earlier = self.tokens
        if earlier and rendered.startswith(self.text):
            tokens = earlier + self.tokenizer.encode(rendered[len(self.text):], bos=False)
        else:  # a template that renders earlier turns otherwise than they were fed: as much as still matches
            tokens = self.tokenizer.encode(rendered, bos=False)
        same = next((i for i, (a, b) in enumerate(zip(earlier, tokens)) if a != b), min(len(earlier), len(tokens)))
        self.tokens, self.text = tokens, rendered
        return tokens, min(same, max(len(earlier) - 1, 0))

    def answer(self, ids: list[int]):
        """The model's reply, as sampled (an end-of-turn token included, where it stopped at one)."""
        content = [i for i in ids if i not in self.stop_ids]
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(content)})
        self.tokens = self.tokens + list(ids)
        self.text += self.tokenizer.decode(list(ids))
