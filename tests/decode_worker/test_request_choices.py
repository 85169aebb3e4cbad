"""One shape for a request's choices: `DecodeRequest.choices` always lists them (one for ``n == 1``),
refuses an empty or ambiguous list, and a decode worker runs one sequence per choice named
``{request_id}#{index}`` whatever ``n`` is; `PrefillResult.choices` carries token 0 of each."""

from __future__ import annotations

import pytest

from decode_worker.choices import ChoiceGroup
from decode_worker.types import DecodeChoice, DecodeRequest
from engine.sampling.sampler import SamplingParams
from prefill_worker.types import FirstToken, PrefillResult

pytestmark = pytest.mark.timeout(30)

PROMPT = (5, 6, 7)
PARAMS = SamplingParams(max_tokens=4)


def test_the_default_is_choice_zero_colocated() -> None:
    assert DecodeRequest("r", PROMPT, PARAMS).choices == (DecodeChoice(0, None),)


@pytest.mark.parametrize(("indices", "match"), [
    ((), "at least one choice"),
    ((0, 1, 1), "distinct"),
    ((0, -1), ">= 0"),
])
def test_a_request_without_one_shape_of_choices_is_refused(indices: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DecodeRequest("r", PROMPT, PARAMS, choices=tuple(DecodeChoice(i) for i in indices))


@pytest.mark.parametrize("indices", [(0,), (0, 1, 2), (2, 5)])
def test_every_choice_is_a_sequence_named_by_its_index(indices: tuple[int, ...]) -> None:
    req = DecodeRequest("r", PROMPT, PARAMS, choices=tuple(DecodeChoice(i, 10 + i) for i in indices))
    group = ChoiceGroup.new(req, eos_ids=[2])
    assert [st.seq_id for st in group.streams] == [f"r#{i}" for i in indices]
    assert [st.index for st in group.streams] == list(indices)
    # token 0 from the prefill is each stream's first generated token and the next one fed
    assert [(st.generated, st.next_token) for st in group.streams] == [([10 + i], 10 + i) for i in indices]


def test_colocated_choices_start_with_no_token() -> None:
    group = ChoiceGroup.new(DecodeRequest("c", PROMPT, PARAMS), eos_ids=[2])
    assert [(st.seq_id, st.generated, st.next_token) for st in group.streams] == [("c#0", [], None)]


def test_a_prefill_result_carries_at_least_one_choice() -> None:
    with pytest.raises(ValueError, match="at least one choice"):
        PrefillResult("p", choices=(), handle=None)
    res = PrefillResult("p", choices=(FirstToken(9, -0.5),), handle=None)
    assert [ft.token_id for ft in res.choices] == [9]
