"""Function calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, and the tool turns of a conversation.

The tools go to the chat template (``tools=``), which tells the model how to call them. What
comes back depends on ``tool_choice``:

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained (guided decoding) to that function's ``parameters`` schema and is its arguments;
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}``, one
  of the tools each (one element with ``parallel_tool_calls: false``);
- ``"auto"`` (the default when tools are given): the model decides; its calls are found in the
  text by the server's ``--tool-call-parser`` (without one, a 400 says to start the server with
  one, or to ask for ``"required"`` or a named function);
- ``"none"``: the tools are shown to the model, which answers in text.

Assistant messages with ``tool_calls`` and ``tool`` messages reach the template as HF
templates expect them (arguments as a JSON object where they parse as one, the
``tool_call_id``), instead of being flattened to their text.
"""

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .tool_parsers import KEEP_SPECIAL_TOKENS, NamedCall, RequiredCalls, ToolCallParser, make_parser


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class FunctionDefinition(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = Field(default=None, description="A JSON Schema of the arguments object.")
    strict: Optional[bool] = None


class ChatTool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(_Model):
    name: str
    arguments: str


class MessageToolCall(_Model):
    """A call an earlier assistant message made (sent back by the client with the results)."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolRequestError(ValueError):
    """A tool field that cannot be honoured; ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _parameters(tool: ChatTool) -> Dict[str, Any]:
    # no parameters: the function takes none (OpenAI's reading), so its arguments are {}
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}


_VALUE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # hold JSON values, not schemas


def _moved_refs(schema: Any, root: str) -> Any:
    """``schema`` with its local references (``#...``) rewritten for its new place ``root`` inside
    another schema (a tool's ``#/$defs/Item`` would otherwise resolve against the new whole)."""
    if isinstance(schema, list):
        return [_moved_refs(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {k: v if k in _VALUE_KEYWORDS else _moved_refs(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        moved["$ref"] = root + ref[1:]
    return moved


class ToolSettings:
    """What one request's tool fields amount to: the template's ``tools``, the output
    constraint (``guided``: fields of ``GuidedDecodingParams``) and the parser of each choice."""

    def __init__(self, tools: Optional[List[ChatTool]], choice: Optional[ToolChoice], parallel: Optional[bool]):
        self.tools = list(tools or [])
        self.single = parallel is False
        if not self.tools:
            if choice not in (None, "none"):
                raise ToolRequestError("'tool_choice' needs 'tools' to choose from", "tool_choice")
            self.choice: ToolChoice = "none"
        else:
            self.choice = choice if choice is not None else "auto"
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ToolRequestError("tool names must be unique", "tools")
        if isinstance(self.choice, NamedToolChoice) and self.choice.function.name not in names:
            raise ToolRequestError(f"'tool_choice' names '{self.choice.function.name}', which is not one of the "
                                   f"tools {names}", "tool_choice")

    def template_tools(self) -> Optional[List[Dict[str, Any]]]:
        return template_tools(self.tools)

    def guided(self) -> Optional[Dict[str, Any]]:
        """``GuidedDecodingParams`` fields of a forced choice; None otherwise."""
        if isinstance(self.choice, NamedToolChoice):
            tool = next(t for t in self.tools if t.function.name == self.choice.function.name)
            return {"json": _parameters(tool)}
        if self.choice == "required":  # each tool's schema under $defs, its own references moved there
            calls = [{"type": "object", "required": ["name", "parameters"],
                      "properties": {"name": {"const": t.function.name}, "parameters": {"$ref": f"#/$defs/tool{i}"}}}
                     for i, t in enumerate(self.tools)]
            defs = {f"tool{i}": _moved_refs(_parameters(t), f"#/$defs/tool{i}") for i, t in enumerate(self.tools)}
            array: Dict[str, Any] = {"$defs": defs, "type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if self.single:
                array["maxItems"] = 1
            return {"json": array}
        return None

    def check_parser(self, server_parser: Optional[str]) -> None:
        """``auto`` needs to know how the model writes calls: the server's ``--tool-call-parser``."""
        if self.choice == "auto" and server_parser is None:
            raise ToolRequestError(
                "'tool_choice': 'auto' needs the server started with --tool-call-parser (hermes, llama3_json, "
                "pythonic or mistral: the format the model writes calls in); or ask for 'required' or a named "
                "function, which constrain the output instead", "tool_choice")

    def parser(self, server_parser: Optional[str]) -> Optional[ToolCallParser]:
        """A new parser for one choice of the answer (None: the answer is plain content)."""
        if isinstance(self.choice, NamedToolChoice):
            return NamedCall(self.choice.function.name)
        if self.choice == "required":
            return RequiredCalls(self.single)
        if self.choice == "auto":
            self.check_parser(server_parser)
            return make_parser(server_parser, self.single)  # type: ignore[arg-type]
        return None

    def keeps_special_tokens(self, server_parser: Optional[str]) -> bool:
        """Whether the answer's text must keep special tokens: the parser reads a marker that is one
        (Mistral's ``[TOOL_CALLS]``), as vLLM does for it."""
        return self.choice == "auto" and server_parser in KEEP_SPECIAL_TOKENS

    def finish_reason(self, reason: Optional[str], made_calls: bool) -> Optional[str]:
        """OpenAI's: ``tool_calls`` when the model ended its turn with calls it chose to make (a
        named function is a plain ``stop``, as OpenAI reports it)."""
        if reason == "stop" and made_calls and not isinstance(self.choice, NamedToolChoice):
            return "tool_calls"
        return reason


def template_tools(tools: Optional[List[ChatTool]]) -> Optional[List[Dict[str, Any]]]:
    """The tools as the chat template takes them (OpenAI's shape, which HF templates read)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def template_tool_calls(calls: List[MessageToolCall]) -> List[Dict[str, Any]]:
    """An assistant message's calls as chat templates read them: arguments as the JSON object
    they hold (templates write it with ``tojson``), kept as text when they are not one."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        if not isinstance(arguments, dict):
            arguments = call.function.arguments
        entry: Dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        if call.id is not None:
            entry["id"] = call.id
        out.append(entry)
    return out
