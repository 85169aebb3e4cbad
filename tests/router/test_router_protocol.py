"""Request validation, prompt building, context bounds and error shapes (no Ray)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.errors import ContextLengthError, QueueFullError
from router.errors import APIError, from_exception, from_validation_errors, queue_full
from router.prompt import chat_prompt, completion_prompt, sampling_for
from router.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.pd_fakes import FakeCodec

pytestmark = pytest.mark.timeout(30)
CODEC = FakeCodec()


def comp(**kw: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def test_prompt_forms() -> None:
    assert completion_prompt(comp(prompt="ab"), CODEC) == (97, 98)
    assert completion_prompt(comp(prompt=["ab"]), CODEC) == (97, 98)
    assert completion_prompt(comp(prompt=[5, 6]), CODEC) == (5, 6)
    with pytest.raises(APIError) as e:
        completion_prompt(comp(prompt=[5, 600]), CODEC)
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize("bad", [
    {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]}, {"prompt": [-1]}, {"prompt": 5},
    {"n": 2}, {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": "ten"}, {"temperature": 3},
    {"top_p": 0}, {"stop": ["a", "b", "c", "d", "e"]}, {"stream": "maybe"}, {"echo": True},
    {"model": None}, {"logprobs": 9},
])
def test_invalid_completion_requests(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as e:
        comp(**bad)
    err = from_validation_errors(e.value.errors())
    assert err.status == 400
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_missing_prompt_names_the_field() -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m"})
    assert from_validation_errors(e.value.errors()).param == "prompt"


def test_extra_fields_ignored_and_defaults() -> None:
    r = comp(frequency_penalty=0.5, whatever={"x": 1}, stop="END", max_completion_tokens=7, max_tokens=3)
    assert r.stop_strings == ("END",) and r.requested_max_tokens == 7 and not r.include_usage
    assert comp(stream_options={"include_usage": True}).include_usage


def test_chat_content_forms() -> None:
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})
    assert [m.to_template() for m in r.messages] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "ab"}]
    assert chat_prompt(r, CODEC) == tuple(CODEC.encode("<system>sys<user>ab<assistant>"))
    for bad in ([], [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                [{"role": "wizard", "content": "x"}], [{"content": "x"}]):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"model": "m", "messages": bad})


def test_template_errors_are_400() -> None:
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "assistant",
                                                                          "content": "RAISE"}]})
    with pytest.raises(APIError) as e:
        chat_prompt(r, CODEC)
    assert e.value.status == 400


def test_context_bounds() -> None:
    s = sampling_for(comp(), prompt_len=10, max_model_len=100, default_max_tokens=None,
                     eos_token_ids=(0,), logprobs=False)
    assert s.max_tokens == 90 and s.stop_token_ids == (0,) and s.temperature == 1.0
    s = sampling_for(comp(temperature=0, ignore_eos=True), 10, 100, 16, (0,), True)
    assert s.max_tokens == 16 and s.stop_token_ids == () and s.logprobs and s.greedy
    assert sampling_for(comp(max_tokens=90), 10, 100, None, (), False).max_tokens == 90
    for kw, plen in (({"max_tokens": 91}, 10), ({}, 100), ({}, 150)):
        with pytest.raises(APIError) as e:
            sampling_for(comp(**kw), plen, 100, None, (), False)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_exception_mapping() -> None:
    qf = from_exception(QueueFullError("full", retry_after_s=2.2))
    assert qf.status == 429 and qf.headers["Retry-After"] == "3"
    assert queue_full(0.0).headers["Retry-After"] == "1"
    assert from_exception(ContextLengthError("too long")).code == "context_length_exceeded"
    err = from_exception(RuntimeError("secret detail"))
    assert err.status == 500 and "secret" not in err.message
