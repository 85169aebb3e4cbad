"""Request validation, prompt building, context bounds and error shapes (no Ray)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.errors import ContextLengthError, QueueFullError
from engine.sampling.sampler import SamplingDefaults
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
    {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": "ten"}, {"temperature": 3},
    {"top_p": 0}, {"stop": ["a", "b", "c", "d", "e"]}, {"stream": "maybe"},
    {"model": None}, {"logprobs": 9}, {"stop_token_ids": [-1]},
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
    r = comp(whatever={"x": 1}, stop="END", max_completion_tokens=7, max_tokens=3)
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
                     eos_token_ids=(0,), logprobs=False, vocab_size=256)
    assert s.max_tokens == 90 and s.stop_token_ids == (0,) and s.temperature == 1.0
    s = sampling_for(comp(temperature=0, ignore_eos=True), 10, 100, 16, (0,), True, 256)
    assert s.max_tokens == 16 and s.stop_token_ids == () and s.logprobs and s.greedy
    assert sampling_for(comp(max_tokens=90), 10, 100, None, (), False, 256).max_tokens == 90
    for kw, plen in (({"max_tokens": 91}, 10), ({}, 100), ({}, 150)):
        with pytest.raises(APIError) as e:
            sampling_for(comp(**kw), plen, 100, None, (), False, 256)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_model_sampling_defaults_fill_only_what_the_request_left_unset() -> None:
    model = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    s = sampling_for(comp(), 10, 100, None, (0,), False, 256, defaults=model)
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.9, 20)
    # sent, even as the API default
    s = sampling_for(comp(temperature=1.0, top_k=0), 10, 100, None, (0,), False, 256, defaults=model)
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 0.9, 0)
    s = sampling_for(comp(temperature=0), 10, 100, None, (0,), False, 256, defaults=SamplingDefaults(top_p=0.5))
    assert s.greedy and s.top_p == 0.5 and s.top_k == 0
    s = sampling_for(comp(), 10, 100, None, (0,), False, 256, defaults=SamplingDefaults())
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0)  # the model says nothing: the API's defaults
    penalized = SamplingDefaults(min_p=0.05, repetition_penalty=1.1)
    s = sampling_for(comp(), 10, 100, None, (0,), False, 256, defaults=penalized)
    assert (s.min_p, s.repetition_penalty) == (0.05, 1.1)
    s = sampling_for(comp(min_p=0.0, repetition_penalty=1.0), 10, 100, None, (0,), False, 256, defaults=penalized)
    assert (s.min_p, s.repetition_penalty) == (0.0, 1.0)  # sent: the request's


def test_stop_token_ids_join_eos_unless_ignored() -> None:
    s = sampling_for(comp(stop_token_ids=[7, 0]), 10, 100, None, (0,), False, 256)
    assert s.stop_token_ids == (7, 0) and not s.ignore_eos
    s = sampling_for(comp(stop_token_ids=[7], ignore_eos=True), 10, 100, None, (0,), False, 256)
    assert s.stop_token_ids == (7,) and s.ignore_eos
    with pytest.raises(APIError) as e:
        sampling_for(comp(stop_token_ids=[256]), 10, 100, None, (0,), False, 256)
    assert e.value.param == "stop_token_ids"


def test_exception_mapping() -> None:
    qf = from_exception(QueueFullError("full", retry_after_s=2.2))
    assert qf.status == 429 and qf.headers["Retry-After"] == "3"
    assert queue_full(0.0).headers["Retry-After"] == "1"
    assert from_exception(ContextLengthError("too long")).code == "context_length_exceeded"
    err = from_exception(RuntimeError("secret detail"))
    assert err.status == 500 and "secret" not in err.message


@pytest.mark.parametrize(("bad", "param"), [
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias.x.[key]"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": True}, "n"), ({"n": 2.0}, "n"),
])
def test_sampling_fields_are_validated(bad: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as e:
        comp(**bad)
    assert from_validation_errors(e.value.errors()).param == param


def test_n_is_one_when_absent_or_null() -> None:
    assert comp().n == comp(n=None).n == 1 and comp(n=16).n == 16


async def test_n_above_the_configured_bound_is_a_400_naming_it() -> None:
    from types import SimpleNamespace

    from router.app import Router
    from router.config import RouterConfig
    from router.errors import APIError

    router = SimpleNamespace(_config=RouterConfig(max_choices=2))
    with pytest.raises(APIError) as e:
        await Router.func_or_class._run(router, False, (1, 2), comp(n=3), None, None)  # type: ignore[attr-defined]
    assert e.value.status == 400 and e.value.param == "n"


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValidationError):
        comp(min_tokens=5, max_tokens=4)
    assert comp(min_tokens=4, max_tokens=4).min_tokens == 4


def test_sampling_fields_reach_the_params() -> None:
    req = comp(logit_bias={"7": -100, "3": 5.5}, presence_penalty=0.5, frequency_penalty=-0.25,
               repetition_penalty=1.2, min_p=0.1, min_tokens=2, top_k=4)
    s = sampling_for(req, 10, 100, None, (0,), False, 256)
    assert s.logit_bias == ((3, 5.5), (7, -100.0)) and s.min_tokens == 2 and s.top_k == 4
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -0.25, 1.2, 0.1)
    with pytest.raises(APIError) as e:
        sampling_for(comp(logit_bias={"256": 1}), 10, 100, None, (0,), False, 256)
    assert e.value.param == "logit_bias"


def test_message_keys_we_do_not_serve_are_refused_unless_empty() -> None:
    from pydantic import ValidationError

    from router.protocol import ChatCompletionRequest

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    echoed = {"role": "assistant", "content": "hello", "refusal": None, "audio": None, "annotations": []}
    req = ChatCompletionRequest.model_validate({**base, "messages": [*base["messages"], echoed]})
    assert [m.to_template() for m in req.messages][1] == {"role": "assistant", "content": "hello"}
    for key, value in (("audio", {"id": "a1"}), ("refusal", "no"), ("function_call", {"name": "f"})):
        with pytest.raises(ValidationError, match=key):
            ChatCompletionRequest.model_validate({**base, "messages": [{"role": "user", "content": "x", key: value}]})
    ann = {"role": "user", "content": "x", "name": "ann"}
    named = ChatCompletionRequest.model_validate({**base, "messages": [ann]})
    assert named.messages[0].to_template() == {"role": "user", "content": "x", "name": "ann"}


def test_echo_puts_the_prompt_text_first_once() -> None:
    from router.generation import Delta
    from router.openai_format import CompletionFormatter
    from tests.support.pd_fakes import FakeCodec

    deltas = [Delta(" there", (5,), (None,)), Delta(" you", (6,), (None,), finish_reason="length")]
    streamed = CompletionFormatter(model="m", codec=FakeCodec(), prompt_tokens=2, logprobs=False, echo="Hello")
    assert [streamed.chunk(d).choices[0].text for d in deltas] == ["Hello there", " you"]
    whole = CompletionFormatter(model="m", codec=FakeCodec(), prompt_tokens=2, logprobs=False, echo="Hello")
    for d in deltas:
        whole.add(d)
    assert whole.response().choices[0].text == "Hello there you"
