"""Text ↔ token ids for the router: the only model artefact a router replica loads.

Owns: the `TextCodec` protocol the router programs against (a completion prompt's ids, the chat
template: its source, whether it renders ``tools``, a chat's ids; per-token text for logprobs, a
fresh incremental detokenizer per request, a structured output's grammar compiled against the
tokenizer) and `EngineTextCodec`, its implementation over `engine.tokenizer.Tokenizer` +
`engine.detokenizer.IncrementalDetokenizer`.
Tests bring a fake as the `router.app.Router`'s ``codec_factory``.

Invariants: a codec is read-only after construction and shared by every request of a replica;
detokenizers are per request; EOS ids are the tokenizer's (``eos_token`` plus ``config.json``'s and
``generation_config.json``'s ``eos_token_id``), used as stop token ids unless the request sets
``ignore_eos``; the model's sampling defaults (its ``generation_config.json``) fill what a request
leaves unset.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from engine.sampling.grammar import GrammarSpec
from engine.sampling.sampler import SamplingDefaults
from router.config import RouterConfig


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TextCodec(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def sampling_defaults(self) -> SamplingDefaults: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int | None: ...

    def encode_prompt(self, text: str) -> list[int]: ...
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    @property
    def chat_template(self) -> str | None:
        """The model's chat template source (which tool-call format it teaches), None without one."""
        ...

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders the request's ``tools``."""
        ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens included (``/detokenize``)."""
        ...

    def token_text(self, token_id: int) -> str: ...

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's spelling in the vocabulary (byte-level, e.g. ``"Ġhello"``), for ``/tokenize``."""
        ...

    def is_special_token(self, text: str) -> bool:
        """Whether ``text`` is one special token (dropped from the text unless ``skip_special_tokens``
        is false)."""
        ...

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer: ...

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` for this tokenizer (cached); raises `GrammarError` naming what fails."""
        ...


class EngineTextCodec:
    """`TextCodec` over the engine's tokenizer of a prepared Hugging Face-style folder."""

    def __init__(self, folder: Path) -> None:
        from engine.model.config import ModelConfig
        from engine.tokenizer import Tokenizer

        self._folder = folder
        self._tok = Tokenizer.from_dir(folder)
        self._max_len = ModelConfig.from_dir(folder).max_context
        self._eos = tuple(self._tok.eos_token_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self._tok.sampling_defaults

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self._max_len

    def encode_prompt(self, text: str) -> list[int]:
        """What the tokenizer's post-processor adds (BOS for Llama-style tokenizers) included, BOS once."""
        return self._tok.encode_prompt(text)
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

    @property
    def renders_tools(self) -> bool:
        return self._tok.renders_tools

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Raises ValueError for conversations the template refuses (its ``raise_exception``)."""
        import jinja2

        try:
            return self._tok.encode_chat(list(messages), add_generation_prompt=add_generation_prompt, tools=tools)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=False)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    def is_special_token(self, text: str) -> bool:
        token_id = self._tok.token_to_id(text)
        return token_id is not None and token_id in self._tok.special_token_ids

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        from engine.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self._tok, skip_special_tokens)

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """The same compile, on the same ``tokenizer.json`` and EOS ids, as the pools' (off the event loop)."""
        from engine.sampling.grammar import load_grammar

        await load_grammar(spec, self._folder, self._eos)


def load_codec(config: RouterConfig) -> TextCodec:
    """The tokenizer of the model folder the config names (prepared once, then cached)."""
    from engine.loading.bundled import prepare_model

    cache = Path(config.model_cache_dir) if config.model_cache_dir else None
    return EngineTextCodec(prepare_model(config.model, cache_dir=cache, progress=False))
