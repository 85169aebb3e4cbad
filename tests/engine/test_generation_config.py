"""EOS ids and sampling defaults from a folder's config.json + generation_config.json (written here).

Oracle: the files themselves, and transformers' ``GenerationConfig`` for what the generation config says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from engine.errors import ModelLoadError
from engine.loading.generation_config import GenerationConfig
from engine.sampling.sampler import SamplingDefaults
from engine.tokenizer import Tokenizer
from tests.support.bos_tokenizer import make_bos_tokenizer_dir


def write(folder: Path, config: dict[str, object], generation: dict[str, object] | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.mark.parametrize(("config_eos", "gen_eos", "expected"), [
    (128001, [128001, 128008, 128009], (128001, 128008, 128009)),  # Llama 3.1 Instruct
    ([2, 5], 7, (2, 5, 7)),
    (None, 9, (9,)),
    (3, None, (3,)),
    (None, None, ()),
])
def test_eos_is_the_union_of_both_files(tmp_path: Path, config_eos: object, gen_eos: object,
                                        expected: tuple[int, ...]) -> None:
    gen = GenerationConfig.from_dir(write(tmp_path, {"eos_token_id": config_eos}, {"eos_token_id": gen_eos}))
    assert gen.eos_token_ids == expected


def test_sampling_defaults_are_what_the_file_writes(tmp_path: Path) -> None:
    written = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1, "eos_token_id": [1, 2], "max_new_tokens": 300, "max_length": 4096}
    folder = write(tmp_path, {}, written)
    hf = transformers.GenerationConfig.from_pretrained(folder)
    gen = GenerationConfig.from_dir(folder)
    assert gen.sampling == SamplingDefaults(temperature=hf.temperature, top_p=hf.top_p, top_k=hf.top_k, min_p=hf.min_p,
                                            repetition_penalty=hf.repetition_penalty, max_tokens=hf.max_new_tokens)
    assert gen.sampling == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
                                            max_tokens=300)  # max_length (prompt included) is not vLLM's either
    assert GenerationConfig.from_dir(write(tmp_path / "none", {}, None)) == GenerationConfig()
    assert GenerationConfig.from_dir(write(tmp_path / "eos", {}, {"eos_token_id": 2})).sampling == SamplingDefaults()


@pytest.mark.parametrize(("generation", "field"), [
    ({"eos_token_id": "</s>"}, "eos_token_id"),
    ({"eos_token_id": [1, None]}, "eos_token_id"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 12.5}, "max_new_tokens"),
])
def test_a_bad_value_is_refused_by_name(tmp_path: Path, generation: dict[str, object], field: str) -> None:
    with pytest.raises(ModelLoadError, match=f"generation_config.json.*{field}"):
        GenerationConfig.from_dir(write(tmp_path, {}, generation))


def test_tokenizer_stops_on_every_id(tmp_path: Path) -> None:
    folder = make_bos_tokenizer_dir(tmp_path)  # config.json: eos 2; tokenizer's eos <|im_end|> (2)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "temperature": 0.7}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 7]}))
    tok = Tokenizer.from_dir(folder)
    assert tok.eos_token_ids == (2, 7, 0)
    assert tok.sampling_defaults == SamplingDefaults(temperature=0.7)


def test_bundled_model_is_unchanged(smollm_dir: Path) -> None:
    tok = Tokenizer.from_dir(smollm_dir)
    assert tok.eos_token_ids == (2,) and tok.sampling_defaults == SamplingDefaults()
