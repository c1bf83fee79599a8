"""The harmony format (gpt-oss's chat format): conversations rendered as the model was trained on them, and its output
split into channels.

A model speaks harmony when its tokenizer has the format's control tokens (<|start|>, <|channel|>, <|message|>,
<|end|>; is_harmony). Every message is `<|start|>{header}<|message|>{content}` and a terminator: <|end|>, <|call|>
after a tool call, <|return|> after the final answer (those two stop a generation). The header is the author (a role,
or a tool's name), then ` to={recipient}` for a message addressed to a tool (or from a tool, to the assistant),
`<|channel|>{channel}`, and ` <|constrain|>json` for a call's JSON arguments.

render_conversation writes what openai_harmony's render_conversation_for_completion writes for the same
conversation (tests/test_harmony.py checks their tokens are the same):
  system     the model identity, knowledge cutoff, current date, `Reasoning: {effort}` (the request's
             reasoning_effort: low, medium by default, high; none and minimal count as low), the valid channels,
             and with tools the line sending their calls to the commentary channel;
  developer  the request's system and developer messages as `# Instructions`, and the tools as a TypeScript
             namespace `functions` (typescript());
  user       as they are;
  assistant  earlier answers on the final channel, their tool calls each as a message to functions.{name} on the
             commentary channel with JSON arguments (content next to calls: a commentary preamble);
  tool       each result from functions.{name} (the call it answers names it) to the assistant, commentary channel;
  and `<|start|>assistant` for the model to continue.

HarmonyParser splits the output: the `analysis` channel is reasoning, `final` is the answer, `commentary`
addressed to functions.{name} is a tool call whose content is its arguments (commentary to no one: answer text).
It takes the output in any pieces (feed / finish) and returns what became final, holding back a tail that may still
be a control token, so any split of the text gives the same result as the whole. The model's end-of-sequence tokens
(its text keeps them where special tokens are not skipped) end a message as <|return|> does.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass, field

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
CONTROL_TOKENS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
STOP_TOKENS = (RETURN, CALL)  # a generation ends at either: the final answer, or a tool call to run
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
CHANNELS = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
TOOLS_CHANNEL = "Calls to these tools must go to the commentary channel: 'functions'."
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}


def is_harmony(tokenizer) -> bool:
    """Whether the tokenizer has the harmony format's control tokens (gpt-oss's o200k_harmony does)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return all(t in vocab for t in (START, CHANNEL, MESSAGE, END))


# ---------------------------------------------------------------- rendering


def _default_comment(schema: dict) -> str:
    """`default: ...` of a schema's default: a string quoted (bare for an enum's), anything else as compact JSON."""
    default = schema["default"]
    if isinstance(default, str):
        return f'default: "{default}"' if "enum" not in schema else f"default: {default}"
    return f"default: {json.dumps(default, separators=(',', ':'), ensure_ascii=False)}"


def typescript(schema: dict, indent: str = "") -> str:
    """A JSON schema as the TypeScript type harmony describes a tool's parameters with: objects as `{ ... }` with
    each property's description (and title, examples) as comments above it, `?` on the ones not required, its
    default as a comment after it; strings (or their enum's literals), number (integers too), boolean, arrays as
    `T[]`, unions of oneOf variants and of type lists; anything else `any`."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        return "".join(f"\n{indent} | {_variant(v, indent + '   ')}" for v in schema["oneOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if kind == "object":
        out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
        out += "{\n"
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = set(schema.get("required") or [])
        for name, prop in properties.items():
            prop = prop if isinstance(prop, dict) else {}
            optional = "" if name in required else "?"
            if isinstance(prop.get("title"), str):
                out += f"{indent}// {prop['title']}\n{indent}//\n"
            if "oneOf" not in prop and isinstance(prop.get("description"), str):
                out += f"{indent}// {prop['description']}\n"
            examples = prop.get("examples")
            if isinstance(examples, list) and examples:
                out += f"{indent}// Examples:\n"
                out += "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
            if isinstance(prop.get("oneOf"), list):
                out += _one_of_property(name, optional, prop, indent)
                continue
            out += f"{indent}{name}{optional}: {_nullable(prop, typescript(prop, indent + '    '))},"
            if "default" in prop:
                out += f" // {_default_comment(prop)}"
            out += "\n"
        return out + f"{indent}}}"
    if kind == "string":
        literals = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(literals) if literals else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _nullable(schema: dict, text: str) -> str:
    return f"{text} | null" if schema.get("nullable") is True and "null" not in text else text


def _variant(variant: dict, indent: str, skip_description: bool = False, above: str | None = None) -> str:
    """One oneOf variant and its trailing comments (description unless skipped or the property's, default)."""
    variant = variant if isinstance(variant, dict) else {}
    text = _nullable(variant, typescript(variant, indent))
    comments = []
    description = variant.get("description")
    if not skip_description and isinstance(description, str) and description != above:
        comments.append(description)
    if "default" in variant:
        comments.append(_default_comment(variant))
    return text + (f" // {' '.join(comments)}" if comments else "")


def _one_of_property(name: str, optional: str, prop: dict, indent: str) -> str:
    """A property whose schema is a oneOf: its description and default above it, then a line per variant."""
    variants = prop["oneOf"]
    description = prop.get("description") if isinstance(prop.get("description"), str) else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    above = description is not None and first.get("description") != description
    out = f"{indent}// {description}\n" if above else ""
    if "default" in prop:
        out += f"{indent}// {_default_comment(prop)}\n"
    out += f"{indent}{name}{optional}:\n"
    for i, variant in enumerate(variants):
        out += f"{indent} | {_variant(variant, indent + '   ', skip_description=i == 0 and above, above=description)}\n"
    return out + f"{indent},\n"


def tools_section(tools: list[dict]) -> str:
    """The `# Tools` section of the developer message: each function tool's description and parameters' type."""
    lines = ["## functions\n", "namespace functions {\n"]
    for tool in tools:
        fn = tool.get("function", tool)
        lines += [f"// {line}" for line in (fn.get("description") or "").splitlines()]
        parameters = fn.get("parameters")
        if parameters is None:
            lines.append(f"type {fn['name']} = () => any;\n")
        else:
            lines.append(f"type {fn['name']} = (_: {typescript(parameters)}) => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _text(content) -> str:
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _arguments(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def render_conversation(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    reasoning_effort: str | None = None,
    date: str | None = None,
) -> str:
    """The conversation (chat messages as templates read them: role, content, tool_calls, tool_call_id) as harmony
    text, ending with `<|start|>assistant` (add_generation_prompt); see the module's docstring. ValueError naming
    what cannot be rendered (an unknown effort, a tool result answering no call)."""
    effort = EFFORTS.get(reasoning_effort or "medium")
    if effort is None:
        raise ValueError(f"reasoning_effort {reasoning_effort!r} is not one of {', '.join(EFFORTS)}")
    date = date or _dt.date.today().isoformat()
    system = f"{MODEL_IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}\n\nReasoning: {effort}"
    system += f"\n\n{CHANNELS}" + (f"\n{TOOLS_CHANNEL}" if tools else "")
    out = [f"{START}system{MESSAGE}{system}{END}"]
    instructions = "\n\n".join(_text(m["content"]) for m in messages if m["role"] in ("system", "developer"))
    developer = ([f"# Instructions\n\n{instructions}"] if instructions else []) + (
        [tools_section(tools)] if tools else []
    )
    if developer:
        out.append(f"{START}developer{MESSAGE}" + "\n\n".join(developer) + END)
    names: dict[str, str] = {}  # tool call id -> the function it called
    for i, m in enumerate(messages):
        role = m["role"]
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(f"{START}user{MESSAGE}{_text(m['content'])}{END}")
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            content = _text(m.get("content"))
            if content:
                channel = "commentary" if calls else "final"
                out.append(f"{START}assistant{CHANNEL}{channel}{MESSAGE}{content}{END}")
            for call in calls:
                fn = call["function"]
                names[call.get("id") or ""] = fn["name"]
                out.append(
                    f"{START}assistant to=functions.{fn['name']}{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}"
                    f"{_arguments(fn['arguments'])}{CALL}"
                )
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "") or m.get("name")
            if name is None:
                raise ValueError(f"messages[{i}]: a tool result must answer an earlier tool call (tool_call_id)")
            out.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{_text(m['content'])}{END}")
    if add_generation_prompt:
        out.append(f"{START}assistant")
    return "".join(out)


# ---------------------------------------------------------------- parsing


@dataclass
class HarmonyCall:
    name: str
    arguments: str


@dataclass
class CallFragment:
    index: int  # which call of the output
    name: str | None  # on a call's first fragment only
    arguments: str


@dataclass
class HarmonyOutput:
    reasoning: str = ""
    content: str = ""
    calls: list[HarmonyCall] = field(default_factory=list)
    fragments: list[CallFragment] = field(default_factory=list)

    def __iadd__(self, other: HarmonyOutput) -> HarmonyOutput:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)
        self.fragments.extend(other.fragments)
        return self


_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_TERMINATORS = (END, CALL, RETURN, START)


def _held(text: str, tokens: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the tokens."""
    for n in range(min(len(text), max(map(len, tokens)) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tokens):
            return n
    return 0


class HarmonyParser:
    """The output's channels, incrementally (see the module's docstring). The prompt ends with `<|start|>assistant`,
    so the output opens with the first message's header."""

    def __init__(self, end_tokens: tuple[str, ...] = ()):
        """end_tokens: the model's end-of-sequence tokens' text, terminators too."""
        self.terminators = tuple(dict.fromkeys((*_TERMINATORS, *(t for t in end_tokens if t))))
        self.held = tuple(dict.fromkeys((*CONTROL_TOKENS, *self.terminators)))
        self.buffer = ""
        self.state = "header"  # header -> content -> header ...
        self.kind = "content"  # the open message's: reasoning, content, or call
        self.num_calls = 0
        self.messages = 0
        self.call_arguments = ""

    def feed(self, piece: str) -> HarmonyOutput:
        self.buffer += piece
        return self._advance(final=False)

    def finish(self) -> HarmonyOutput:
        return self._advance(final=True)

    def _open(self, header: str, out: HarmonyOutput) -> None:
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        channel = re.split(r"\s|<\|", channel.strip(), maxsplit=1)[0] if channel.strip() else ""
        recipient = _RECIPIENT.search(header)
        target = recipient.group(1) if recipient else None
        self.messages += 1
        if target is not None and target != "assistant":
            self.kind = "call"
            self.call_arguments = ""
            name = target.removeprefix("functions.")
            out.fragments.append(CallFragment(self.num_calls, name, ""))
            self.call_name = name
        elif channel == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _emit(self, text: str, out: HarmonyOutput) -> None:
        if not text:
            return
        if self.kind == "reasoning":
            out.reasoning += text
        elif self.kind == "call":
            self.call_arguments += text
            out.fragments.append(CallFragment(self.num_calls, None, text))
        else:
            out.content += text

    def _close(self, out: HarmonyOutput) -> None:
        if self.kind == "call":
            out.calls.append(HarmonyCall(self.call_name, self.call_arguments))
            self.num_calls += 1
        self.kind = "content"

    def _advance(self, final: bool) -> HarmonyOutput:
        out = HarmonyOutput()
        while True:
            if self.state == "header":
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    if final:  # no header closed: a model that wrote no harmony at all answers in plain text
                        if self.messages == 0:
                            out.content += self.buffer.removeprefix(START)
                        self.buffer = ""
                    return out
                header = self.buffer[:at]
                header = header[header.rfind(START) + len(START) :] if START in header else header
                self.buffer = self.buffer[at + len(MESSAGE) :]
                self._open(header, out)
                self.state = "content"
                continue
            ends = [(self.buffer.find(t), t) for t in self.terminators]
            found = [(i, t) for i, t in ends if i >= 0]
            if found:
                at, token = min(found)
                self._emit(self.buffer[:at], out)
                self._close(out)
                self.buffer = self.buffer[at + (0 if token == START else len(token)) :]
                self.state = "header"
                continue
            keep = 0 if final else _held(self.buffer, self.held)
            self._emit(self.buffer[: len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep :]
            if final:
                self._close(out)
            return out


def split_output(text: str, end_tokens: tuple[str, ...] = ()) -> HarmonyOutput:
    """The whole output at once (a non-streamed response)."""
    parser = HarmonyParser(end_tokens)
    out = parser.feed(text)
    out += parser.finish()
    return out
