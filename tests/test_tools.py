"""Function calling in Qwen's format, in the library: tools and earlier calls written into the
prompt by both families' chat templates, calls read back out of a reply (whole or in any pieces),
and the grammar that makes the tiny thinker engine's reply a call of a given tool."""

from __future__ import annotations

import json
import random

import pytest

from omni_jax import SamplingParams, StructuredOutputs, ToolCall, call_grammar, read_tool_calls
from omni_jax.errors import PromptError
from omni_jax.inputs.chat_template import TOOLS_INTRO, TOOLS_OUTRO
from omni_jax.inputs.tool_calls import CallPiece, ToolCallReader, gather
from omni_jax.models.registry import prompt_processor

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city <|im_end|>",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Lyon"]}, "unit": {"enum": ["c", "f"]}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "Let me look.", "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
              {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "20 C"},
          {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "noon"}]}]


@pytest.fixture(scope="module", params=["qwen2_5_omni", "qwen3_omni"])
def processor(request):
    if request.param == "qwen2_5_omni":
        from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint
    else:
        from omni_jax.models.qwen3_omni.tiny import tiny_checkpoint
    return prompt_processor(tiny_checkpoint())


def _text(processor, prompt) -> str:
    ids = processor.process(prompt).prompt_token_ids
    return processor.tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def test_tools_and_calls_are_written_as_qwen_writes_them(processor):
    """The system turn ends with the tools' JSON (after the conversation's own system message, or
    the family's default), an assistant's calls follow its words as <tool_call> blocks and a run
    of tool results is one user turn; a special string in a tool's description stays text."""
    text = _text(processor, {"messages": CALLED, "tools": [WEATHER, NOW]})
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in (WEATHER, NOW))
    system = "You are a helpful assistant.\n\n" if processor.SPEECH_SYSTEM_PROMPT else ""
    # Qwen's tool section, as Qwen3-Omni's released template and Qwen's text models write it
    assert (TOOLS_INTRO, TOOLS_OUTRO) == (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        "function signatures within <tools></tools> XML tags:\n<tools>",
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call>")
    assert text == (
        f"<|im_start|>system\n{system}{TOOLS_INTRO}\n{tools}{TOOLS_OUTRO}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n20 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    ids = processor.process({"messages": CALLED, "tools": [WEATHER]}).prompt_token_ids.tolist()
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 4  # the description's <|im_end|> is text, not a turn's end
    # the conversation's own system message comes first in the system turn
    text = _text(processor, {"messages": [{"role": "system", "content": "Be brief."}, CALLED[0]], "tools": [NOW]})
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{TOOLS_INTRO}\n") and text.count("<|im_start|>system") == 1
    # without tools, nothing of them
    assert TOOLS_INTRO not in _text(processor, {"messages": CALLED})


def test_a_final_assistant_message_is_continued(processor):
    """continue_final_message: the prompt ends inside the assistant's turn, with its words and a
    call's opening tag as the tag token (the realtime API's spoken replies continue so)."""
    begun = CALLED[:1] + [{"role": "assistant", "content": "Sure.\n<tool_call>"}]
    ids = processor.process({"messages": begun, "tools": [NOW], "continue_final_message": True}).prompt_token_ids
    assert _text(processor, {"messages": begun, "tools": [NOW], "continue_final_message": True}).endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nSure.\n<tool_call>")
    assert ids[-1] == processor.tokenizer.convert_tokens_to_ids("<tool_call>")
    # typed special strings stay text there too
    typed = processor.process({"messages": CALLED[:1] + [{"role": "assistant", "content": "a<|im_end|>"}],
                               "continue_final_message": True}).prompt_token_ids.tolist()
    assert typed.count(processor.tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1 + bool(processor.SPEECH_SYSTEM_PROMPT)


def test_special_strings_in_calls_and_tools_stay_text(processor):
    """A turn-end string anywhere a client writes (a call's arguments as text or as an object, a
    tool's schema) is text, not the end of a turn."""
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sneaky = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"enum": [["<|im_end|>"]], "description": "<|im_end|>"}}}}}
    for args in ('{"q": "<|im_end|>"}', {"q": ["<|im_end|>"]}):
        msgs = [CALLED[0], {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": args}}]}, {"role": "tool", "content": "ok"}]
        ids = processor.process({"messages": msgs, "tools": [sneaky]}).prompt_token_ids.tolist()
        assert ids.count(im_end) == 4, args  # the system, user, assistant and tool turns' ends


@pytest.mark.parametrize("prompt, says", [
    ({"messages": CALLED[:1], "tools": {"a": 1}}, "'tools' must be a list"),
    ({"messages": CALLED[:1], "tools": [{"type": "function"}]}, r"tools\[0\] must be"),
    ({"messages": CALLED[:1], "tools": [{"type": "function", "function": {"name": "a b"}}]}, "name must be 1 to 64"),
    ({"messages": CALLED[:1], "tools": [NOW, NOW]}, "'now' is given twice"),
    ({"messages": CALLED[:1], "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "parameters must be a JSON schema object"),
    ({"prompt": "hi", "tools": [NOW]}, "'tools' goes with 'messages'"),
    ({"messages": CALLED[:1], "continue_final_message": True}, "needs the last message to be an assistant's text"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "only an assistant message makes tool calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     r"tool_calls\[0\] must be"),
])
def test_bad_tools_or_calls_are_named(processor, prompt, says):
    with pytest.raises(PromptError, match=says):
        processor.process(prompt)


def test_a_template_that_leaves_tools_out_is_replaced_or_refused():
    """A checkpoint template without tools (Qwen2.5-Omni's released one) gives way to the family's
    built-in one when that writes the same conversations (it is then the same template with Qwen's
    tool turns); any other is an error, not a prompt that silently lacks the tools (a model not
    told of its tools cannot call them)."""
    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

    built_in = prompt_processor(tiny_checkpoint())
    want = _text(built_in, {"messages": CALLED, "tools": [NOW]})
    released = prompt_processor(tiny_checkpoint())
    released.chat_template = "{%- set tools = none -%}" + built_in.DEFAULT_CHAT_TEMPLATE  # the same, without tools
    assert TOOLS_INTRO not in released._render(CALLED[:1], [NOW], released.chat_template)  # it leaves them out
    assert _text(released, {"messages": CALLED, "tools": [NOW]}) == want and TOOLS_INTRO in want
    other = prompt_processor(tiny_checkpoint())
    other.chat_template = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                           "'<|im_end|>\\n' }}{%- endfor -%}{{ '<|im_start|>assistant\\n' }}")
    with pytest.raises(PromptError, match="does not write tools into the prompt"):
        other.process({"messages": CALLED[:1], "tools": [NOW]})
    assert other.process({"messages": CALLED[:1]}).prompt_token_ids.size


REPLY = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "now", "parameters": {}}\n</tool_call>\n')


@pytest.mark.parametrize("text, content, calls", [
    (REPLY, "I will check.", [ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'), ToolCall("now", "{}")]),
    ("no calls here <tool and \n", "no calls here <tool and \n", []),
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "", [ToolCall("now", "{}")]),
    # not a call: stays content
    ("a <tool_call>\nnot json\n</tool_call> b", "a<tool_call>\nnot json\n</tool_call> b", []),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    # a block the reply did not close (cut by max_tokens): a call if its JSON is whole
    ('<tool_call>\n{"name": "now", "arguments": "{}"}', "", [ToolCall("now", "{}")]),
    ('x\n<tool_call>\n{"name": "now", "argu', "x<tool_call>\n{\"name\": \"now\", \"argu", []),
    # words after a call are content; whitespace that ends a reply with calls is not, nor that
    # after calls that no words came before
    ('<tool_call>{"name": "now"}</tool_call> then more \n', "then more", [ToolCall("now", "{}")]),
    ('<tool_call>{"name": "now"}</tool_call>\n<tool_call>{"name": "x"}</tool_call>\n\nThen.', "Then.",
     [ToolCall("now", "{}"), ToolCall("x", "{}")]),
    ('Sure.\n<tool_call>{"name": "now"}</tool_call>\n\nThen.', "Sure.\n\nThen.", [ToolCall("now", "{}")]),
    # arguments with braces, "<" and whitespace of their own: given out as written
    ('<tool_call>\n{"name": "f", "arguments": {"a": {"b": "}</x"}, "c": [1, {"d": 2}] }\n}\n</tool_call>', "",
     [ToolCall("f", '{"a": {"b": "}</x"}, "c": [1, {"d": 2}] }')]),
    # cut in a call's arguments: the call with what was written, cut
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2}', "", [ToolCall("f", '{"a": [1, 2', cut=True)]),
])
def test_calls_read_from_a_reply_whole_or_in_pieces(text, content, calls):
    assert read_tool_calls(text) == (content, calls)
    rng = random.Random(len(text))
    for _ in range(20):  # streamed in random pieces: the same content and calls
        reader, got, pieces, pos = ToolCallReader(), "", [], 0
        while pos < len(text):
            step = rng.randint(1, 6)
            more, new = reader.feed(text[pos:pos + step])
            got, pieces, pos = got + more, pieces + new, pos + step
        more, new = reader.finish()
        pieces += new
        assert (got + more, gather(pieces)) == (content, calls)
        # each call: its name first, then its arguments, then done, numbered in order
        for i in range(len(calls)):
            mine = [p for p in pieces if p.index == i]
            assert mine[0].name == calls[i].name and all(p.name is None for p in mine[1:])
            assert [p.done for p in mine] == [False] * (len(mine) - 1) + [True]
        assert [p.index for p in pieces] == sorted(p.index for p in pieces)


def test_a_calls_arguments_come_as_they_are_written():
    """Qwen's head read, the call is given out by name, then its arguments piece by piece before
    its block ends; the call object's own closing brace is held until it cannot be an argument's."""
    reader = ToolCallReader()
    assert reader.feed('Let me look.\n<tool_call>\n{"name": "get_weather", "argu') == ("Let me look.", [])
    assert reader.feed('ments": {"city": "Pa') == ("", [CallPiece(0, "get_weather", "", False),
                                                       CallPiece(0, None, '{"city": "Pa', False)])
    assert reader.feed('ris"}') == ("", [CallPiece(0, None, 'ris"', False)])  # the } may close the call
    assert reader.feed('}\n</tool') == ("", [CallPiece(0, None, "}", False)])  # ... it closed the arguments
    assert reader.feed('_call>\nDone.') == ("\nDone.", [CallPiece(0, None, "", True)])
    assert reader.calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    # a reply cut in a call's arguments (max_tokens): a call with what was written
    reader = ToolCallReader()
    _, pieces = reader.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert reader.finish() == ("", [CallPiece(0, None, "", True, cut=True)])
    assert gather(pieces + [CallPiece(0, None, "", True, cut=True)]) == [ToolCall("get_weather", '{"city": "Par', cut=True)]
    # a name that is not a JSON string waits for the block's end, as any other block
    assert read_tool_calls('<tool_call>{"name": "a\\u00", "arguments": {}}</tool_call>')[1] == []


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from omni_jax.engine.runner import RunnerConfig
    from omni_jax.models.qwen2_5_omni.stages import build_thinker_engine
    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint
    from omni_jax.models.thinker_media import MediaBuckets

    return build_thinker_engine(tiny_checkpoint(), RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4,
                                                                max_num_batched_tokens=64, max_model_len=512),
                                media_buckets=MediaBuckets((1,), (64,)), progress=False)


def test_a_call_grammar_makes_the_reply_a_call(engine):
    """Greedy and sampled, the random tiny model's reply under the grammar of one tool, or of
    either tool, is a call Qwen's way whose arguments fit the tool's schema, and ends by itself."""
    grammars = {"named": call_grammar([WEATHER], parallel=False), "either": call_grammar([WEATHER, NOW], parallel=False)}
    for temp in (0.0, 1.0):
        for kind, grammar in grammars.items():
            rid = f"{kind}{temp}"
            engine.add_request(rid, [100, 200, 300], SamplingParams(
                temperature=temp, seed=3, max_tokens=80, structured_outputs=StructuredOutputs(grammar=grammar)))
    texts, final = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            texts[o.request_id] = texts.get(o.request_id, "") + (o.text_delta or "")
            if o.finished:
                final[o.request_id] = o
    assert engine.scheduler.kv_cache_manager.is_idle_and_leak_free()
    for rid, text in texts.items():
        assert final[rid].finish_reason == "stop", (rid, text)
        content, calls = read_tool_calls(text)
        assert content == "" and len(calls) == 1, (rid, text)
        if rid.startswith("named"):
            assert calls[0].name == "get_weather"
        args = json.loads(calls[0].arguments)
        if calls[0].name == "get_weather":
            assert args["city"] in ("Paris", "Lyon") and args["unit"] in ("c", "f") and len(args) == 2, text
        else:
            assert args == {}, text
