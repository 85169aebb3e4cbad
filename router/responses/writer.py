"""One response's Deltas written as output items, the stream's events and the final Response.

Owns: `ResponseWriter`. The chat formatter (`router.openai_format.ChatFormatter`, one choice) reads
each `Delta` exactly as for ``/v1/chat/completions`` (tool calls through `router.tool_stream`);
what it releases becomes output items: text goes into an open ``message`` item (one
``output_text`` part), a tool call opens a ``function_call`` item (closing the message before it),
text after a call opens a new message. The same writer serves the non-streamed response (its events
are dropped), so the streamed and the whole response have the same items.

Event order, as OpenAI sends it and the official client's accumulator expects it:
``response.created`` → ``response.in_progress`` → per message item ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per function call item
``response.output_item.added``, ``response.function_call_arguments.delta``…,
``response.function_call_arguments.done``, ``response.output_item.done``; last
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut the answer.

Invariants: ``sequence_number`` counts every event from 0 with no gap; an item's ``output_index``
is its place in ``output``; every item added is done before the last event; an answer with no text
and no call still has one (empty) message; usage counts the prompt and every generated token.
"""

from __future__ import annotations

from typing import Any

from router.generation import Delta
from router.openai_format import ChatFormatter
from router.responses.objects import (
    FunctionCallOutput,
    IncompleteDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
    new_id,
)
from router.tool_protocol import DeltaToolCall

Event = dict[str, Any]  # one SSE event's JSON: ``type``, ``sequence_number`` and its fields


class ResponseWriter:
    def __init__(self, response: ResponseObject, fmt: ChatFormatter) -> None:
        if fmt.n != 1:
            raise ValueError("a response has one answer")
        self._response = response
        self._fmt = fmt
        self._items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._seq = 0
        self._status: ItemStatus = "in_progress"

    @property
    def id(self) -> str:
        return self._response.id

    @property
    def formatter(self) -> ChatFormatter:
        """The chat formatter that reads the Deltas (its id is the generation's request id)."""
        return self._fmt

    def start(self) -> list[Event]:
        snapshot = self._snapshot()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def add(self, delta: Delta) -> list[Event]:
        """The events ``delta`` releases (with the last Delta: the items closed and the end)."""
        c = self._fmt.add(delta)
        text, calls = (delta.text, []) if c.tools is None else c.released
        events = self._text(text) if text else []
        for call in calls:
            events += self._call(call)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason)
        return events

    def response(self) -> ResponseObject:
        """The response as it stands (after the last Delta: the final one)."""
        return self._snapshot()

    def error(self, code: str | None, message: str, param: str | None = None) -> Event:
        return self._event("error", code=code, message=message, param=param)

    # ---- items ----
    def _text(self, text: str) -> list[Event]:
        events = [] if isinstance(self._open, OutputMessage) else self._new_message()
        assert isinstance(self._open, OutputMessage)
        self._open.content[0].text += text
        events.append(self._event("response.output_text.delta", item_id=self._open.id, output_index=self._index,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _new_message(self) -> list[Event]:
        """Close what is open, open a message item and its one ``output_text`` part."""
        events = self._close("completed")
        item = OutputMessage(id=new_id("msg"))
        events += self._add(item)
        item.content.append(OutputText())
        events.append(self._event("response.content_part.added", item_id=item.id, output_index=self._index,
                                  content_index=0, part=OutputText().model_dump()))
        return events

    def _call(self, call: DeltaToolCall) -> list[Event]:
        events: list[Event] = []
        fn = call.function
        if call.id is not None:  # a new call: its id, name (and maybe its arguments whole)
            events += self._close("completed")
            events += self._add(FunctionCallOutput(id=new_id("fc"), call_id=call.id,
                                                   name=fn.name if fn is not None and fn.name else ""))
        piece = fn.arguments if fn is not None else None
        if piece and isinstance(self._open, FunctionCallOutput):
            self._open.arguments += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=self._open.id,
                                      output_index=self._index, delta=piece))
        return events

    def _add(self, item: OutputItem) -> list[Event]:
        self._items.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=self._index, item=item.model_dump())]

    def _close(self, status: ItemStatus) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        at = self._items.index(item)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [self._event("response.output_text.done", item_id=item.id, output_index=at, content_index=0,
                                  text=part.text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item.id, output_index=at,
                                  content_index=0, part=part.model_dump())]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item.id, output_index=at,
                                  arguments=item.arguments)]
        return [*events, self._event("response.output_item.done", output_index=at, item=item.model_dump())]

    def _finish(self, reason: str) -> list[Event]:
        cut = reason == "length"
        events = [] if self._items else self._new_message()  # an empty answer is an empty message
        events += self._close("incomplete" if cut else "completed")
        self._status = "incomplete" if cut else "completed"
        final = self._snapshot()
        return [*events, self._event("response.incomplete" if cut else "response.completed", response=final)]

    # ---- the response ----
    @property
    def _index(self) -> int:
        return len(self._items) - 1

    def _snapshot(self) -> ResponseObject:
        done = self._status != "in_progress"
        fmt = self._fmt
        return self._response.model_copy(deep=True, update={
            "status": self._status,
            "output": list(self._items) if done else [],
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if self._status == "incomplete"
            else None,
            "usage": ResponseUsage.of(fmt.prompt_tokens, fmt.completion_tokens, fmt.cached_tokens) if done else None,
        })

    def _event(self, kind: str, **fields: Any) -> Event:
        if isinstance(fields.get("response"), ResponseObject):
            fields["response"] = fields["response"].model_dump()
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
