"""Tokenizer and chat template of one model folder.

Owns: `Tokenizer`, a thin typed wrapper over a ``tokenizers.Tokenizer`` (``tokenizer.json``) plus the
parts of ``tokenizer_config.json`` / ``generation_config.json`` that serving needs: the chat template,
the bos/eos/pad tokens, the ids that end a generation and the model's sampling defaults.

Invariants:
- `encode` / `decode` / `apply_chat_template` give what ``transformers.AutoTokenizer`` gives on the
  same folder (``add_special_tokens=False``, ``clean_up_tokenization_spaces=False``); where transformers
  builds a model-specific class over ``tokenizer.json``, its pipeline is used (`engine.tokenizer_class`),
  and a folder whose class pdserve cannot mirror is refused; the template is rendered in the same
  sandboxed Jinja environment transformers uses.
- `encode_prompt` (a completion prompt) adds what the tokenizer's own post-processor adds, as
  ``tokenizer(text)`` does (BOS for Llama- and Mistral-style tokenizers, nothing for SmolLM2's), but
  never a second BOS when the text already starts with the BOS token; `encode_chat` adds nothing:
  the chat template decides.
- A message's ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts; parts
  are joined (no separator) before rendering, so templates only ever see strings. Its other keys
  (``name``, ``tool_calls``, ``tool_call_id``) reach the template as given, and ``tools`` (JSON
  schemas, ``{"type": "function", "function": {...}}``) as the ``tools`` variable, as transformers
  passes them; `renders_tools` says whether the template reads that variable at all.
- `eos_token_ids` is the tokenizer's eos token, then `GenerationConfig`'s ids (``config.json``'s and
  ``generation_config.json``'s ``eos_token_id``); never empty for a folder that names one, no duplicates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelLoadError
from engine.loading.generation_config import GenerationConfig, read_json_object
from engine.sampling.sampler import SamplingDefaults
from engine.tokenizer_class import apply_class_pipeline, folder_class

Message = Mapping[str, Any]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not, and templates rely on that.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _compile_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its context (``messages``, ``tools``, ...)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))


def _token_content(value: Any) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (both appear in tokenizer_config.json) → ``"<s>"``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _text_content(content: Any, index: int) -> Any:
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        is_text = isinstance(part, Mapping) and part.get("type") == "text"
        if not (is_text and isinstance(part.get("text"), str)):
            raise ValueError(f"message {index}: only text content parts are supported, got {part!r}")
        texts.append(part["text"])
    return "".join(texts)


class Tokenizer:
    """Encode, decode and chat-format text for one model; build with `Tokenizer.from_dir`."""

    def __init__(self, tokenizer: HFTokenizer, config: Mapping[str, Any],
                 generation_eos: Sequence[int] = (), source: str = "<memory>",
                 sampling: SamplingDefaults | None = None) -> None:
        self._tok = tokenizer
        self._source = source
        self.sampling_defaults = sampling if sampling is not None else SamplingDefaults()
        self.chat_template: str | None = config.get("chat_template") or None
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        eos = [] if self.eos_token is None else [self.token_to_id(self.eos_token)]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in (*eos, *generation_eos) if i is not None))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{tok_file}: tokenizer.json not found")
        text = tok_file.read_text()
        try:
            tok = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{tok_file}: cannot load tokenizer: {e}") from None
        config = read_json_object(folder / "tokenizer_config.json")
        apply_class_pipeline(tok, folder_class(folder, config, text), config, str(folder))
        generation = GenerationConfig.from_dir(folder)
        return cls(tok, config, generation.eos_token_ids, source=str(folder), sampling=generation.sampling)

    # ---- vocabulary ----
    @cached_property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_to_id(self.pad_token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token's string in the vocabulary (byte-level spelling, e.g. ``"Ġhello"``), or None."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    # ---- text ----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt: the post-processor's special tokens added, BOS at most once."""
        ids = self.encode(text, add_special_tokens=True)
        bos = self.bos_token_id
        if bos is not None and self.bos_token and text.startswith(self.bos_token) and ids[:2] == [bos, bos]:
            return ids[1:]  # the text's own BOS, and the one the post-processor put before it
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # ---- chat ----
    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(f"{self._source}: the model has no chat template (tokenizer_config.json "
                             f"has no 'chat_template'); use a plain completion prompt instead")
        return _compile_template(self.chat_template)

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template reads ``tools`` (can tell the model which functions it may call)."""
        return self.chat_template is not None and "tools" in template_variables(self.chat_template)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``), rendered as ``transformers`` renders it."""
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"message {i}: expected a mapping, got {type(message).__name__}")
            plain.append({**message, "content": _text_content(message.get("content"), i)})
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                    "unk_token": self.unk_token}
        return self._template.render(messages=plain, tools=list(tools) if tools else None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in specials.items() if v is not None})

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat; special tokens in the text map to their ids, none are added."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)
