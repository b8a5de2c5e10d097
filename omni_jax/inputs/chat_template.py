"""The Qwen-Omni chat template both families' built-in templates are made from.

Messages are `<|im_start|>role\\n ... <|im_end|>\\n` turns; string or multi-part content, one
placeholder triple per media part, optional "Picture n: " / "Audio n: " / "Video n: " labels;
Qwen2.5-Omni opens with a default system turn when the conversation has none.

Function calling is written as Qwen's other chat models write it (Qwen2.5 and Qwen3 text models,
Qwen3-Omni's released template): with `tools`, the system turn ends with a "# Tools" section
listing each tool as JSON inside `<tools></tools>`; an assistant message's `tool_calls` follow its
content as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks; `tool` messages
(the calls' results) go back as one user turn of `<tool_response>` blocks. inputs/tool_calls.py
reads the blocks back out of a reply.

An assistant message's `reasoning_content` (a reasoning model's thinking, inputs/reasoning.py) is
written back as `<think>\\n...\\n</think>\\n\\n` before its content only after the last user
message, as Qwen3's templates do: earlier turns' thinking is left out.
"""

from __future__ import annotations

# What a model told of tools reads at the end of its system turn (the tools' JSON between).
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _literal(text: str) -> str:
    """`text` as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def qwen_chat_template(image: str, audio: str, video: str, default_system: str | None = None) -> str:
    """The template with these placeholder triples; `default_system`: the system turn a
    conversation without one gets (None: none)."""
    tools = (f"{{{{- {_literal(TOOLS_INTRO)} -}}}}"
             "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
             f"{{{{- {_literal(TOOLS_OUTRO)} -}}}}")
    before_tools = f"{default_system}\n\n" if default_system else ""
    opening = ("{%- if loop.first and message['role'] != 'system' -%}"
               "{%- if tools -%}"
               f"{{{{- {_literal('<|im_start|>system' + chr(10) + before_tools)} -}}}}"
               f"{tools}{{{{- '<|im_end|>\\n' -}}}}")
    if default_system is not None:
        opening += ("{%- else -%}"
                    f"{{{{- {_literal(f'<|im_start|>system{chr(10)}{default_system}<|im_end|>{chr(10)}')} -}}}}")
    opening += "{%- endif -%}{%- endif -%}"
    return (
        "{%- set n = namespace(audio=0, image=0, video=0) -%}"
        "{%- set q = namespace(last=-1) -%}"
        "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set q.last = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}"
        "{%- for message in messages -%}"
        + opening +
        # A run of tool results is one user turn.
        "{%- if message['role'] == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' -}}"
        "{%- else -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        # An assistant turn's thinking goes back only after the last user message (Qwen3's rule:
        # the turns of a call loop in progress), as the model wrote it.
        "{%- if message['role'] == 'assistant' and message['reasoning_content'] is string "
        "and loop.index0 > q.last -%}"
        "{{- '<think>\\n' + message['reasoning_content'].strip('\\n') + '\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
        "{%- endif -%}"
        "{%- if message['content'] is string -%}"
        "{{- message['content'] -}}"
        "{%- else -%}"
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
        "{%- set n.image = n.image + 1 -%}"
        "{%- if add_vision_id -%}{{- 'Picture ' ~ n.image ~ ': ' -}}{%- endif -%}"
        f"{{{{- {_literal(image)} -}}}}"
        "{%- elif part['type'] == 'audio' or 'audio' in part or 'audio_url' in part -%}"
        "{%- set n.audio = n.audio + 1 -%}"
        "{%- if add_audio_id -%}{{- 'Audio ' ~ n.audio ~ ': ' -}}{%- endif -%}"
        f"{{{{- {_literal(audio)} -}}}}"
        "{%- elif part['type'] == 'video' or 'video' in part -%}"
        "{%- set n.video = n.video + 1 -%}"
        "{%- if add_vision_id -%}{{- 'Video ' ~ n.video ~ ': ' -}}{%- endif -%}"
        f"{{{{- {_literal(video)} -}}}}"
        "{%- elif 'text' in part -%}"
        "{{- part['text'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{%- if message['role'] == 'tool' -%}"
        "{{- '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- else -%}"
        "{%- if loop.first and message['role'] == 'system' and tools -%}{{- '\\n\\n' -}}" + tools + "{%- endif -%}"
        "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}"
        "{%- set call = call['function'] if call['function'] is defined else call -%}"
        "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
        "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}"
        "{%- else -%}{{- call['arguments'] | tojson -}}{%- endif -%}"
        "{{- '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
