"""How a row becomes tokens and a loss mask, per data group: ``text`` (a document), ``instruct`` (a prompt
template + a response) and ``chat`` (the tokenizer's chat template, loss on the assistant turns).

Each encoder turns a list of rows into ``(ids, mask)`` pairs; ``mask[j] == 1`` means token ``j`` is a
training target (its label is the token; every other label is -100, which ``cross_entropy`` ignores).
``key()`` is what the tokenized-set cache must know about the encoder: its template and options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from lightning_nvme.checks import ConfigError
from lightning_nvme.data.sources import Row
from lightning_nvme.data.tokenizers import ByteTokenizer, HFTokenizer

Encoded = tuple[list[int], list[int]]

# Alpaca's prompts (Taori et al. 2023), the default of LitGPT and torchtune's instruct datasets.
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


class Encoder(Protocol):
    def key(self) -> dict[str, Any]: ...

    def encode(self, rows: list[Row]) -> list[Encoded]: ...


def _column(row: Row, mapping: Mapping[str, str], name: str, required: bool = True) -> Any:
    column = mapping.get(name, name)
    if column not in row.fields:
        if not required:
            return ""
        raise ConfigError(f"data.columns.{name}", f"{row.where}: no column {column!r}; the columns found are "
                          f"{sorted(row.fields)}. Fix: data.columns.{name}=<the column that holds the {name}>")
    return row.fields[column]


def _text(row: Row, value: Any, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"data.columns.{name}", f"{row.where}: the {name} is a {type(value).__name__} "
                          f"({str(value)[:60]!r}), not text. Fix: map data.columns.{name} to a text column")
    return value


class TextEncoder:
    """A document: its ``text`` column, followed by the tokenizer's EOS (the separator of joined documents)."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, columns: Mapping[str, str]) -> None:
        self.tokenizer, self.columns = tokenizer, dict(columns)

    def key(self) -> dict[str, Any]:
        return {"group": "text", "columns": self.columns, "eos": self.tokenizer.eos_id}

    def encode(self, rows: list[Row]) -> list[Encoded]:
        texts = [_text(r, _column(r, self.columns, "text"), "text") for r in rows]
        eos = [] if self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        return [(ids + eos, [1] * (len(ids) + len(eos))) for ids in self.tokenizer.encode_batch(texts)]


class InstructEncoder:
    """``prompt_template.format(instruction=..., input=...)`` + the response + EOS; the prompt's tokens are not
    targets unless ``train_on_prompt``. ``prompt_template="alpaca"``: Alpaca's two prompts (with and without
    an input); any other string is one template with ``{instruction}`` and ``{input}`` fields."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, columns: Mapping[str, str], prompt_template: str,
                 train_on_prompt: bool) -> None:
        self.tokenizer, self.columns, self.train_on_prompt = tokenizer, dict(columns), train_on_prompt
        if prompt_template == "alpaca":
            self.with_input, self.without_input = ALPACA, ALPACA_NO_INPUT
        else:
            try:
                prompt_template.format(instruction="", input="")
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError("data.prompt_template", f"{prompt_template!r} is not a template with the fields "
                                  f"{{instruction}} and {{input}} ({type(e).__name__}: {e}). Fix: "
                                  "data.prompt_template='### Q: {instruction} {input}\\n### A: ' or alpaca") from None
            self.with_input = self.without_input = prompt_template

    def key(self) -> dict[str, Any]:
        return {"group": "instruct", "columns": self.columns, "templates": [self.with_input, self.without_input],
                "train_on_prompt": self.train_on_prompt, "eos": self.tokenizer.eos_id}

    def template_tokens(self) -> int:
        """Tokens of the shortest prompt (empty fields) + EOS: what every example costs before its content."""
        empty = min(self.with_input, self.without_input, key=len).format(instruction="", input="")
        return len(self.tokenizer.encode_batch([empty])[0]) + 1

    def encode(self, rows: list[Row]) -> list[Encoded]:
        prompts, responses = [], []
        for r in rows:
            instruction = _text(r, _column(r, self.columns, "instruction"), "instruction")
            extra = _text(r, _column(r, self.columns, "input", required=False), "input")
            responses.append(_text(r, _column(r, self.columns, "output"), "output"))
            template = self.with_input if extra else self.without_input
            prompts.append(template.format(instruction=instruction, input=extra))
        eos = [] if self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        out = []
        for p, a in zip(self.tokenizer.encode_batch(prompts), self.tokenizer.encode_batch(responses)):
            ids = p + a + eos
            out.append((ids, [1] * len(ids) if self.train_on_prompt else [0] * len(p) + [1] * (len(a) + len(eos))))
        return out


class ChatEncoder:
    """``messages: [{role, content}, ...]`` rendered by the tokenizer's ``apply_chat_template``; the targets are
    the assistant turns (from the end of the generation prompt before each to the end of the turn, its
    end-of-turn tokens included), or every token with ``train_on_prompt``.

    How the turns are found: the template renders ``messages[:i]`` with the generation prompt and
    ``messages[:i+1]``; both must be prefixes of the whole conversation's text (true of the usual templates,
    refused by name otherwise), and the tokens whose characters lie between are the assistant's.
    """

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, columns: Mapping[str, str], chat_template: str | None,
                 train_on_prompt: bool) -> None:
        if not isinstance(tokenizer, HFTokenizer):
            raise ConfigError("data.tokenizer", "data=chat renders conversations with a Hugging Face tokenizer's chat "
                              "template; the byte tokenizer has none. Fix: data.tokenizer=<a model directory with "
                              "tokenizer files> (the hf_local, lora and sft recipes use model.path)")
        if chat_template:
            if os.path.isfile(os.path.expanduser(chat_template)):
                with open(os.path.expanduser(chat_template), encoding="utf-8") as f:
                    chat_template = f.read()
            tokenizer.hf.chat_template = chat_template
        if not tokenizer.chat_template:
            raise ConfigError("data.chat_template", f"the tokenizer of {tokenizer.path!r} has no chat template. Fix: "
                              "data.chat_template=<a Jinja template string, or the path of a .jinja file> (e.g. the "
                              "template of the instruct model this base belongs to), or data=instruct")
        if not getattr(tokenizer.hf, "is_fast", False):
            raise ConfigError("data.tokenizer", f"{tokenizer.path!r}: data=chat needs a fast tokenizer (character "
                              "offsets of tokens); save one with tokenizer.json")
        self.tokenizer, self.columns, self.train_on_prompt = tokenizer, dict(columns), train_on_prompt

    def key(self) -> dict[str, Any]:
        return {"group": "chat", "columns": self.columns, "template": self.tokenizer.chat_template,
                "train_on_prompt": self.train_on_prompt}

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        text = self.tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert isinstance(text, str)
        return text

    def template_tokens(self) -> int:
        text = self.render([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}])
        return len(self.tokenizer.encode_batch([text])[0])

    def _messages(self, row: Row) -> list[dict[str, str]]:
        value = _column(row, self.columns, "messages")
        if not isinstance(value, list) or not value:
            raise ConfigError("data.columns.messages", f"{row.where}: messages is a {type(value).__name__}, not a "
                              "non-empty list. Fix: each row needs messages: [{\"role\": \"user\", \"content\": ...}, "
                              "{\"role\": \"assistant\", \"content\": ...}]")
        out = []
        for n, m in enumerate(value):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ConfigError("data.columns.messages", f"{row.where}: message {n} is {str(m)[:80]!r}, not "
                                  "{\"role\": <str>, \"content\": <str>}. Fix: give every message a role and a "
                                  "text content")
            out.append({"role": m["role"], "content": m["content"]})
        return out

    def _spans(self, row: Row, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start_text = self.render(messages[:i], generation_prompt=True) if i else ""
            if not text.startswith(start_text):
                start_text = self.render(messages[:i]) if i else ""
            end_text = self.render(messages[:i + 1])
            if not (text.startswith(start_text) and text.startswith(end_text)):
                raise ConfigError("data.chat_template", f"{row.where}: the chat template does not render a "
                                  "conversation's beginning as a prefix of the whole, so the assistant turns cannot be "
                                  "located. Fix: data.train_on_prompt=true (loss on every token), or another template")
            spans.append((len(start_text), len(end_text)))
        return spans

    def encode(self, rows: list[Row]) -> list[Encoded]:
        out = []
        for r in rows:
            messages = self._messages(r)
            text = self.render(messages)
            enc = self.tokenizer.hf(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            if self.train_on_prompt:
                out.append((ids, [1] * len(ids)))
                continue
            spans = self._spans(r, messages, text)
            mask = [1 if any(a <= start < b for a, b in spans) else 0 for start, _end in enc["offset_mapping"]]
            out.append((ids, mask))
        return out
