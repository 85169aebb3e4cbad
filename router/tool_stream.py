"""One chat answer's text turned into OpenAI's ``content`` and ``tool_calls``, streamed or whole.

Owns: `ToolCallStream`, which the chat formatter feeds each new piece of the answer's text (`push`)
and which returns the content to send and the tool-call deltas, keeping the calls and content of
the whole answer for a non-streamed response (`calls`, `content`) and mapping the finish reason.

By mode (`router.tools.ToolPlan`):
- ``auto``: the model family's parser (`router.tool_parsers`); a call is sent whole in one delta
  (``index``, ``id``, ``type``, ``function.name`` and ``function.arguments``) once its JSON closes,
  since only then is it known to be a call; text around calls streams as content.
- ``required``: the grammar-constrained calls (`ForcedCalls`), each sent whole as it closes.
- named: the output is the function's arguments: the first delta carries ``id``, ``type`` and
  ``function.name``, then every piece of text is an ``arguments`` piece, as it comes.
- ``none``: not built; the text is content.

Invariants: call ``index`` counts from 0 in the order calls were made and ids are ``call_<24 hex>``,
one per call; without ``parallel_tool_calls`` only the first call is kept (as vLLM does); the
concatenated deltas equal the non-streamed message; the content's trailing whitespace is held back
until text follows it, and dropped at the end of an answer that made calls (so whitespace between
calls never makes a ``content``: it is ``null``).
Finish reasons follow OpenAI's: ``tool_calls`` when ``auto`` or ``required`` made calls,
``stop`` for a named function (OpenAI reports a forced named call as ``stop``), and ``length`` /
``abort`` / ``error`` always as they are (an output cut short is not a finished call).
"""

from __future__ import annotations

import uuid

from router.tool_parsers import PARSERS, ParsedCall, ToolCallParser
from router.tool_parsers.forced import ForcedCalls
from router.tool_protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from router.tools import ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        if not plan.reads_calls:
            raise ValueError("tool_choice 'none' reads no calls")
        self._plan = plan
        self._parser: ToolCallParser | None = None
        if plan.mode == "auto":
            assert plan.parser is not None
            self._parser = PARSERS[plan.parser]()
        elif plan.mode == "required":
            self._parser = ForcedCalls(plan.parallel)
        self._text: list[str] = []  # the content sent so far
        self._blank = ""  # trailing whitespace held back: sent when text follows, dropped after calls
        self._calls: list[ToolCall] = []
        self._arguments: list[str] = []  # named: the arguments' pieces so far

    def push(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and call deltas that ``text`` releases (``final``: the answer ends with it)."""
        if self._parser is None:
            return "", self._named(text, final)
        pieces = self._parser.feed(text)
        if final:
            pieces += self._parser.finish()
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        for piece in pieces:
            if isinstance(piece, str):
                content.append(piece)
            elif self._plan.parallel or not self._calls:
                deltas.append(self._add(piece))
        return self._send("".join(content), final), deltas

    def _send(self, content: str, final: bool) -> str:
        content = self._blank + content
        self._blank = ""
        if not (final and not self._calls):
            kept = content.rstrip()
            self._blank = "" if final else content[len(kept):]
            content = kept
        if content:
            self._text.append(content)
        return content

    def _named(self, text: str, final: bool) -> list[DeltaToolCall]:
        assert self._plan.function is not None
        if not self._calls and (text or final):
            self._arguments.append(text)
            self._calls.append(ToolCall(id=new_call_id(), function=FunctionCall(name=self._plan.function,
                                                                               arguments="")))
            return [DeltaToolCall(index=0, id=self._calls[0].id, type="function",
                                  function=DeltaFunctionCall(name=self._plan.function, arguments=text))]
        if not text:
            return []
        self._arguments.append(text)
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]

    def _add(self, call: ParsedCall) -> DeltaToolCall:
        index = len(self._calls)
        self._calls.append(ToolCall(id=new_call_id(), function=FunctionCall(name=call.name,
                                                                           arguments=call.arguments)))
        return DeltaToolCall(index=index, id=self._calls[index].id, type="function",
                             function=DeltaFunctionCall(name=call.name, arguments=call.arguments))

    @property
    def calls(self) -> list[ToolCall]:
        if self._plan.mode == "named" and self._calls:
            first = self._calls[0]
            return [first.model_copy(update={"function": FunctionCall(name=first.function.name,
                                                                      arguments="".join(self._arguments))})]
        return list(self._calls)

    @property
    def content(self) -> str | None:
        text = "".join(self._text)
        return None if self._calls and not text else text

    def finish_reason(self, reason: str) -> str:
        if reason != "stop" or self._plan.mode == "named" or not self._calls:
            return reason
        return "tool_calls"
