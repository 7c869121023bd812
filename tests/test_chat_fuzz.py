"""Whatever JSON a client sends, rendering either succeeds or raises ChatError (a 400):
never another exception, which the server would answer as a 500."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4.chat import ChatError, render_anthropic, render_chat, render_responses
from ds4.chat.special_tokens import BOS

WORDS = st.sampled_from([
    "user", "assistant", "system", "developer", "tool", "text", "tool_use", "tool_result",
    "thinking", "message", "function", "function_call", "function_call_output", "reasoning",
    "custom", "custom_tool_call", "local_shell", "local_shell_call", "web_search_call",
    "namespace", "input_text", "input_image", "completed", "grammar", "c1", "c2", "", "a"])
LEAF = st.none() | st.booleans() | st.integers(-1, 1) | WORDS
ANY = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(WORDS, inner, max_size=3), max_leaves=8)
IDS = st.sampled_from(["c1", "c2"]) | ANY


def obj(required=None, **fields):
    """Objects holding the required fields and any subset of the others."""
    return st.fixed_dictionaries(required or {}, optional=fields)


PART = obj(type=WORDS | ANY, text=ANY, refusal=ANY)
CONTENT = ANY | st.lists(PART | LEAF, max_size=3)
FUNCTION = obj(name=WORDS | ANY, arguments=ANY | st.just('{"a": 1}'), parameters=ANY)
TOOL = obj(type=WORDS, name=WORDS | ANY, function=FUNCTION | ANY, input_schema=ANY,
           description=LEAF, tools=st.lists(obj(type=WORDS, name=WORDS | ANY), max_size=2) | ANY,
           format=obj(type=WORDS, definition=LEAF, syntax=LEAF) | ANY)
TOOLS = st.none() | st.lists(TOOL, max_size=2)
CHOICE = (st.sampled_from([None, "auto", "none", "required", "any"]) | WORDS
          | obj(type=WORDS | ANY, name=WORDS | ANY, function=FUNCTION | ANY))
CALLS = st.lists(obj(id=IDS, type=WORDS, function=FUNCTION | ANY), max_size=2) | ANY
OPENAI = obj({"role": st.sampled_from(["user", "assistant", "system", "tool", "function"])},
             content=CONTENT, tool_calls=CALLS, tool_call_id=IDS, reasoning_content=CONTENT,
             function_call=FUNCTION | ANY, prefix=LEAF)
BLOCK = obj({"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result"])},
            text=ANY, thinking=ANY, id=IDS, name=WORDS | ANY, input=ANY, tool_use_id=IDS,
            content=ANY | st.lists(obj(type=WORDS, text=ANY), max_size=2))
ANTHROPIC = obj({"role": st.sampled_from(["user", "assistant"]),
                 "content": st.lists(BLOCK, min_size=1, max_size=3) | LEAF})
RESPONSES = obj(type=WORDS, role=WORDS | LEAF, content=CONTENT, call_id=IDS, id=IDS,
                name=WORDS | ANY, namespace=WORDS | ANY, arguments=ANY, input=ANY,
                output=CONTENT, action=ANY, summary=st.lists(PART, max_size=2) | ANY, status=LEAF)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


def renders_or_refuses(render) -> None:
    """Either a prompt (text opening with BOS) or a ChatError saying what is wrong."""
    try:
        prompt = render()
    except ChatError as err:
        assert str(err).strip(), "a refusal must say why"
        return
    assert isinstance(prompt, str) and prompt.startswith(BOS)


@given(messages=st.lists(OPENAI, max_size=5), tools=TOOLS, choice=CHOICE, response_format=ANY)
@FUZZ
def test_openai_chat_input(messages, tools, choice, response_format):
    renders_or_refuses(lambda: render_chat(messages, tools=tools, tool_choice=choice or "auto",
                                           response_format=response_format))


@given(messages=st.lists(ANTHROPIC, max_size=5), tools=TOOLS, choice=CHOICE,
       system=st.none() | WORDS | st.lists(obj(text=LEAF), max_size=2))
@FUZZ
def test_anthropic_input(messages, tools, choice, system):
    renders_or_refuses(lambda: render_anthropic(messages, system=system, tools=tools,
                                                tool_choice=choice))


@given(items=st.lists(RESPONSES, max_size=5) | WORDS, tools=TOOLS, choice=CHOICE)
@FUZZ
def test_responses_input(items, tools, choice):
    renders_or_refuses(lambda: render_responses(items, tools=tools, tool_choice=choice or "auto"))
