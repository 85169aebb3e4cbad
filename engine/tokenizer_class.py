"""The tokenizer class transformers' ``AutoTokenizer`` builds for a model folder, and the text pipeline
that class puts over ``tokenizer.json``'s vocabulary.

Owns: `autotokenizer_class` / `folder_class` (which class, from ``config.json``'s ``model_type`` and the
``tokenizer_class`` the folder declares) and `apply_class_pipeline` (that class's normalizer,
pre-tokenizer, decoder and BPE options, set on the ``tokenizers.Tokenizer`` loaded from
``tokenizer.json``).

Why: transformers 5 builds a model-specific class whenever it picks one (``Qwen2Tokenizer`` for qwen2 and
qwen3, ``GemmaTokenizer`` for Gemma, or the class ``tokenizer_config.json`` names), and such a class keeps
only the vocabulary, merges, added tokens and post-processor of ``tokenizer.json``: its normalizer,
pre-tokenizer, decoder and BPE options are its own. A folder whose ``tokenizer.json`` says otherwise (a
qwen2 config over a plain ByteLevel pre-tokenizer) tokenizes as the class says, so pdserve does the same.

Invariants:
- the choice is ``AutoTokenizer.from_pretrained``'s, as of the transformers release constraints-dev.txt
  pins, for folders without remote code: a declared class is overridden for the model types transformers
  lists as declaring the wrong one, a declared ``LlamaTokenizer`` over a ByteLevel file becomes the generic
  backend, and otherwise the declared class wins over the one registered for the model type;
- the generic classes (``TokenizersBackend``, ``PreTrainedTokenizerFast``) keep ``tokenizer.json`` as saved,
  and a file that already holds its class's pipeline is left as it is;
- a model-specific class pdserve does not mirror, a model type it does not know, or a class whose BPE
  pipeline would run over a non-BPE ``tokenizer.json`` is refused with `ModelLoadError` naming it: pdserve
  never tokenizes with a pipeline transformers would not use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from engine.errors import ModelLoadError
from engine.loading.generation_config import read_json_object

GENERIC = "TokenizersBackend"
#: class names transformers builds as the generic backend over tokenizer.json as saved (``Fast`` dropped)
GENERIC_NAMES = frozenset({GENERIC, "PreTrainedTokenizer", "PythonBackend", "BloomTokenizer"})
#: transformers' registered class per model type, for the types pdserve serves (None: none registered;
#: mistral's is the generic backend where the mistral-common package, not a dependency, is absent)
REGISTERED: dict[str, str | None] = {
    "llama": None, "mistral": GENERIC, "phi3": GENERIC, "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
    "gemma2": "GemmaTokenizer", "gemma3_text": "GemmaTokenizer",
}
#: the model types among those whose declared ``tokenizer_class`` transformers ignores for the registered one
DECLARED_CLASS_IGNORED = frozenset({"qwen2", "phi3"})

#: Qwen2Tokenizer's split pattern (transformers' ``PRETOKENIZE_REGEX``)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class ClassPipeline:
    """What a model-specific class sets over the file's vocabulary: its BPE options (the rest of the BPE
    model, vocabulary and merges, stays the file's) and its normalizer, pre-tokenizer and decoder."""

    bpe: Mapping[str, Any]
    normalizer: normalizers.Normalizer | None
    pre_tokenizer: pre_tokenizers.PreTokenizer
    decoder: decoders.Decoder


def _flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key)
    return default if value is None else bool(value)


def _qwen2(config: Mapping[str, Any]) -> ClassPipeline:
    prefix = _flag(config, "add_prefix_space", False)
    return ClassPipeline(
        bpe=dict(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                 fuse_unk=False, byte_fallback=False, ignore_merges=False),
        normalizer=normalizers.NFC(),
        pre_tokenizer=pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)]),
        decoder=decoders.ByteLevel())


def _gpt2(config: Mapping[str, Any]) -> ClassPipeline:
    return ClassPipeline(
        bpe=dict(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                 fuse_unk=False, byte_fallback=False, ignore_merges=False),
        normalizer=None,
        pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=_flag(config, "add_prefix_space", False)),
        decoder=decoders.ByteLevel())


def _unk(config: Mapping[str, Any], default: str) -> str:
    value = config.get("unk_token", default)
    return str(value.get("content", default) if isinstance(value, dict) else value or default)


def _gemma(config: Mapping[str, Any]) -> ClassPipeline:
    return ClassPipeline(
        bpe=dict(dropout=None, unk_token=_unk(config, "<unk>"), continuing_subword_prefix=None,
                 end_of_word_suffix=None, fuse_unk=True, byte_fallback=True, ignore_merges=False),
        normalizer=normalizers.Replace(" ", "▁"),
        pre_tokenizer=pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False),
        decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]))


def _llama(config: Mapping[str, Any]) -> ClassPipeline:
    prefix = _flag(config, "add_prefix_space", True)
    scheme = ("first" if not _flag(config, "legacy", False) else "always") if prefix else "never"
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return ClassPipeline(
        bpe=dict(dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                 fuse_unk=True, byte_fallback=True, ignore_merges=False),
        normalizer=None,
        pre_tokenizer=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False),
        decoder=decoders.Sequence([*steps, decoders.Strip(content=" ", left=1)] if prefix else steps))


#: the model-specific classes pdserve mirrors (their ``__init__`` in transformers builds these pipelines)
PIPELINES: dict[str, Callable[[Mapping[str, Any]], ClassPipeline]] = {
    "Qwen2Tokenizer": _qwen2, "GPT2Tokenizer": _gpt2, "GemmaTokenizer": _gemma, "LlamaTokenizer": _llama,
}


def _base_name(name: str) -> str:
    return name if name == "PreTrainedTokenizerFast" else name.removesuffix("Fast")


def _resolved(name: str) -> str:
    base = _base_name(name)
    return GENERIC if base in GENERIC_NAMES or base == "PreTrainedTokenizerFast" else base


def autotokenizer_class(model_type: str | None, declared: str | None, byte_level: bool, source: str) -> str:
    """The class AutoTokenizer builds (`GENERIC` for the generic backend). ``declared``: the folder's
    ``tokenizer_class`` (tokenizer_config.json's, else config.json's); ``byte_level``: tokenizer.json names
    a ByteLevel step."""
    if model_type is not None and model_type not in REGISTERED:
        raise ModelLoadError(f"{source}: config.json's model_type {model_type!r} is not one pdserve knows the "
                             f"tokenizer class of (known: {', '.join(sorted(REGISTERED))})")
    registered = REGISTERED.get(model_type) if model_type else None
    if declared is not None and _base_name(declared) == "LlamaTokenizer" and byte_level \
            and model_type not in DECLARED_CLASS_IGNORED:
        return GENERIC  # transformers: a Llama-3 style file under a LlamaTokenizer label
    if declared is not None and registered is not None and _base_name(registered) != _base_name(declared):
        if registered == GENERIC:
            return GENERIC
        return registered if model_type in DECLARED_CLASS_IGNORED else _resolved(declared)
    if declared is not None:
        return _resolved(declared)
    return registered or GENERIC


def folder_class(folder: Path, tokenizer_config: Mapping[str, Any], tokenizer_json: str) -> str:
    """`autotokenizer_class` for a model folder: its config.json and tokenizer_config.json, and the text of
    its tokenizer.json (transformers' ByteLevel test is a search of that text)."""
    config = read_json_object(folder / "config.json")
    auto_map = tokenizer_config.get("auto_map")
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    remote = auto_map if isinstance(auto_map, list) else (auto_map or {}).get("AutoTokenizer")
    if remote and model_type not in DECLARED_CLASS_IGNORED:
        raise ModelLoadError(f"{folder}: tokenizer_config.json's auto_map names remote code for the tokenizer "
                             f"({remote}), which transformers runs and pdserve does not")
    declared = tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
    return autotokenizer_class(model_type, declared if isinstance(declared, str) else None,
                               '"ByteLevel"' in tokenizer_json, str(folder))


def apply_class_pipeline(tok: HFTokenizer, cls: str, config: Mapping[str, Any], source: str) -> None:
    """Set class ``cls``'s pipeline on ``tok`` (in place); nothing for the generic backend."""
    if cls == GENERIC:
        return
    build = PIPELINES.get(cls)
    if build is None:
        raise ModelLoadError(
            f"{source}: transformers builds this folder's tokenizer as {cls}, whose own pre-tokenizer and "
            f"decoder replace tokenizer.json's, and pdserve mirrors only {', '.join(sorted(PIPELINES))}; set "
            f"tokenizer_config.json's tokenizer_class to PreTrainedTokenizerFast to use tokenizer.json as saved")
    if not isinstance(tok.model, BPE):
        raise ModelLoadError(f"{source}: transformers builds this folder's tokenizer as {cls}, a BPE tokenizer, "
                             f"but tokenizer.json holds a {type(tok.model).__name__} model")
    pipeline = build(config)
    for key, value in pipeline.bpe.items():
        setattr(tok.model, key, value)
    tok.normalizer = pipeline.normalizer  # type: ignore[assignment]  # None: no normalizer, as the class has
    tok.pre_tokenizer = pipeline.pre_tokenizer
    tok.decoder = pipeline.decoder
