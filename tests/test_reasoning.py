"""A reasoning model's thinking (Qwen3's `<think>` ... `</think>`): read apart from the answer, written
back into a conversation, and left free by structured outputs, which hold the answer after it
(torch-free: the tiny Qwen3-Omni checkpoint, its thinker engine and llguidance)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from omni_jax import SamplingParams, StructuredOutputs, ThinkTags, split_reasoning
from omni_jax.errors import PromptError
from omni_jax.inputs.reasoning import ReasoningReader
from omni_jax.models.registry import prompt_processor

# (reply, opened by the prompt) -> (reasoning or None, content)
REPLIES = [
    ("<think>\nI think.\nMore.\n</think>\n\nThe answer.", False, ("I think.\nMore.", "The answer.")),
    ("\nplan\n</think>\n\nok", True, ("plan", "ok")),
    ("<think>\ncut mid thought  ", False, ("cut mid thought", "")),
    ("<think>", False, ("", "")),
    ("<think></think>\n\nx", False, ("", "x")),
    ("<think>a</think>b</think>c", False, ("a", "b</think>c")),
    ("<think>a < b and </thin k></think> yes", False, ("a < b and </thin k>", "yes")),
    ("Hello <think>x</think>", False, (None, "Hello <think>x</think>")),
    ("<thi", False, (None, "<thi")),
    ("  plain answer  ", False, (None, "  plain answer  ")),
    (" <think>late</think>", False, (None, " <think>late</think>")),  # not its first token
    ("", False, (None, "")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text,opened,want", REPLIES)
def test_a_reply_is_read_the_same_whole_or_in_pieces(text, opened, want):
    assert split_reasoning(text, opened) == want
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        reader, reasoning, content = ReasoningReader(opened), "", ""
        for piece in (text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])):
            r, c = reader.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = reader.finish()
        assert ((reasoning + r) if reader.thought else None, content + c) == want


@pytest.fixture(scope="module")
def qwen3():
    from omni_jax.models.qwen3_omni.tiny import tiny_checkpoint

    return prompt_processor(tiny_checkpoint())


def test_the_tags_are_found_where_the_vocabulary_has_them(qwen3):
    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

    tags = ThinkTags.of(qwen3.tokenizer)
    assert tags is not None and qwen3.tokenizer.convert_ids_to_tokens(list(tags.ids)) == ["<think>", "</think>"]
    assert ThinkTags.of(prompt_processor(tiny_checkpoint()).tokenizer) is None  # Qwen2.5-Omni does not reason
    s, e = tags.ids
    assert tags.opened([1, 2, s]) and tags.opened([s, 5, e, 9, s, 7])
    assert not tags.opened([1, 2]) and not tags.opened([s, 3, e])
    assert tags.reasoning_tokens([s, 4, 4, e, 9], False) == 4 and tags.reasoning_tokens([4, e, 9], True) == 2
    assert tags.reasoning_tokens([9, e], False) == 0 and tags.reasoning_tokens([s, 4], False) == 2


CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_thinking_goes_back_only_after_the_last_user_message(qwen3):
    """As Qwen3's templates: a turn of the call loop in progress keeps its thinking (before its
    content and calls), an earlier turn's is left out; special strings in it stay text."""
    messages = [{"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "old thought"},
                {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "", "reasoning_content": "\nnew <|im_end|> thought\n",
                 "tool_calls": [CALL]},
                {"role": "tool", "content": "42"}]
    ids = qwen3.process({"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}
                        ).prompt_token_ids
    text = qwen3.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert "old thought" not in text
    assert ("<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\n"
            "new <|im_end|> thought\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"
            "<|im_end|>\n") in text
    assert int((ids == qwen3.tokenizer.convert_tokens_to_ids("<|im_end|>")).sum()) == 6  # the typed one is text


@pytest.mark.parametrize("bad", [{"role": "user", "content": "x", "reasoning_content": "y"},
                                 {"role": "assistant", "content": "x", "reasoning_content": 3}])
def test_bad_reasoning_content_is_named(qwen3, bad):
    with pytest.raises(PromptError, match=r"messages\[0\]\.reasoning_content"):
        qwen3.process({"messages": [bad]})


def test_reasoning_tokens_and_budget_are_checked():
    for bad in ((5, 5), (5,), (1, -2), (1, True), "ab"):
        with pytest.raises(ValueError, match="SamplingParams.reasoning_tokens must be None or two different"):
            SamplingParams(reasoning_tokens=bad)
    assert SamplingParams(reasoning_tokens=[3, 4]).reasoning_tokens == (3, 4)
    assert SamplingParams(reasoning_tokens=np.array([3, 4]), thinking_token_budget=np.int64(0)).thinking_token_budget == 0
    for bad in (-1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.thinking_token_budget must be None or an int"):
            SamplingParams(reasoning_tokens=(3, 4), thinking_token_budget=bad)
    with pytest.raises(ValueError, match="thinking_token_budget must be given with reasoning_tokens"):
        SamplingParams(thinking_token_budget=8)
    with pytest.raises(ValueError, match="reasoning_tokens must be token ids < vocab_size=100"):
        SamplingParams(reasoning_tokens=(1, 105)).validate_for_vocab(100)


def _allowed(bits: np.ndarray, row: int, token: int) -> bool:
    return bool((bits.view(np.uint32)[row, token // 32] >> np.uint32(token % 32)) & np.uint32(1))


def test_the_grammar_holds_the_answer_after_the_thinking(qwen3):
    """The mask of a grammar with reasoning tokens: the first token may open the thinking, the
    thinking is free, the grammar holds from its end tag on; a prompt that opened the thinking
    starts free; a reply that does not open with it is the grammar's from its first token."""
    from omni_jax.engine.structured_output import Grammar, Grammars

    tok = qwen3.tokenizer
    tags = ThinkTags.of(tok)
    grammars = Grammars(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    choice = StructuredOutputs(choice=["yes", "no"])
    spec = SamplingParams(structured_outputs=choice, reasoning_tokens=tags.ids)
    yes, word = tok.encode("yes")[0], tok.encode(" banana")[0]
    fresh = grammars.build(spec, [1, 2, 3]).result()
    opened = grammars.build(spec, [1, 2, tags.start]).result()
    plain = grammars.build(SamplingParams(structured_outputs=choice), [1, 2, tags.start]).result()
    assert (fresh.phase, opened.phase, plain.phase) == (Grammar.OPENING, Grammar.THINKING, Grammar.HOLDS)
    bits = grammars.bitmask([fresh, opened, plain], 3)
    assert _allowed(bits, 0, yes) and _allowed(bits, 0, tags.start) and not _allowed(bits, 0, word)
    assert (bits[1] == -1).all()  # free
    assert _allowed(bits, 2, yes) and not _allowed(bits, 2, tags.start) and not _allowed(bits, 2, word)

    assert fresh.accept([tags.start, word, word]) is None and fresh.phase == Grammar.THINKING
    assert (grammars.bitmask([fresh], 1) == -1).all()
    assert fresh.accept([word, tags.end]) is None and fresh.phase == Grammar.HOLDS
    bits = grammars.bitmask([fresh], 1)
    assert _allowed(bits, 0, yes) and not _allowed(bits, 0, word) and not _allowed(bits, 0, tags.start)
    assert fresh.accept([word]) is not None  # past the thinking, the grammar holds

    answered = grammars.build(spec, [1]).result()
    assert answered.accept([yes]) is None and answered.phase == Grammar.HOLDS
    assert not _allowed(grammars.bitmask([answered], 1), 0, tags.start)  # no thinking after the answer began


def test_a_thinking_budget_forces_the_end_tag_once_spent(qwen3):
    """A budget alone: no mask until the thinking has had its tokens (the tags not counted), then
    only the end tag, then none and nothing to mask (the request samples on the device again); a
    reply that does not open its thinking is never held. With a grammar, the grammar holds after."""
    from omni_jax.engine.structured_output import Grammar, Grammars

    tok = qwen3.tokenizer
    tags = ThinkTags.of(tok)
    grammars = Grammars(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    word, yes = tok.encode(" banana")[0], tok.encode("yes")[0]
    budget = SamplingParams(reasoning_tokens=tags.ids, thinking_token_budget=2)

    def only_end(g):
        bits = grammars.bitmask([g], 1)
        return _allowed(bits, 0, tags.end) and not _allowed(bits, 0, word) and int(np.count_nonzero(bits)) == 1

    g = grammars.build(budget, [1, 2]).result()
    assert g.matcher is None and g.phase == Grammar.OPENING and g.constrains
    assert (grammars.bitmask([g], 1) == -1).all()  # not opened yet: anything, <think> or an answer
    assert g.accept([tags.start, word]) is None and not g.forcing and (grammars.bitmask([g], 1) == -1).all()
    assert g.accept([word]) is None and g.forcing and only_end(g)
    assert g.accept([tags.end]) is None and g.phase == Grammar.HOLDS and not g.constrains
    assert (grammars.bitmask([g], 1) == -1).all() and g.accept([word, tags.start]) is None

    early = grammars.build(budget, [1, tags.start]).result()  # the prompt opened it; ended in time
    assert early.accept([word, tags.end, word]) is None and not early.constrains
    answered = grammars.build(budget, [1]).result()
    assert answered.accept([word]) is None and not answered.constrains  # did not think: never held
    spent = grammars.build(budget.updated(thinking_token_budget=0), [1, tags.start]).result()
    assert spent.forcing and only_end(spent)

    held = grammars.build(budget.updated(structured_outputs=StructuredOutputs(choice=["yes", "no"])),
                          [1, tags.start]).result()
    assert held.accept([word, word]) is None and held.forcing and only_end(held)
    assert held.accept([tags.end]) is None and held.constrains
    bits = grammars.bitmask([held], 1)
    assert _allowed(bits, 0, yes) and not _allowed(bits, 0, word)


@pytest.fixture(scope="module")
def engine():
    from omni_jax.engine.runner import RunnerConfig
    from omni_jax.models.qwen3_omni.stages import build_thinker_engine
    from omni_jax.models.qwen3_omni.tiny import tiny_checkpoint
    from omni_jax.models.thinker_media import MediaBuckets

    return build_thinker_engine(tiny_checkpoint(), RunnerConfig(num_blocks=32, block_size=16, max_num_seqs=4,
                                                                max_num_batched_tokens=32, max_model_len=256),
                                media_buckets=MediaBuckets((1,), (64,)), progress=False)


def test_the_engine_lets_the_thinking_end_before_the_grammar_holds(engine, qwen3):
    """A prompt that opened the thinking, a bias toward its end tag: the random model ends the
    thinking at once and then answers one of the choices; the same grammar without the reasoning
    tokens holds the reply from its first token (the end tag is not allowed, bias or not), and a
    reply whose prompt did not open the thinking may open it (then it is free). No block leaks."""
    tags = ThinkTags.of(qwen3.tokenizer)
    choices = ["yes", "no"]
    bias = {tags.end: 100.0}
    prompt = [100, 200, 300, tags.start]
    runs = {"reasoning": tags.ids, "plain": None}
    for rid, reasoning in runs.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias,
                                                       structured_outputs=StructuredOutputs(choice=choices),
                                                       reasoning_tokens=reasoning))
    # not opened by the prompt: a bias toward <think> makes the reply open its thinking, where the
    # choice alone would not allow it
    engine.add_request("opens", [100, 200, 300], SamplingParams(
        temperature=0.0, max_tokens=8, logit_bias={tags.start: 100.0},
        structured_outputs=StructuredOutputs(choice=choices), reasoning_tokens=tags.ids))
    texts, ids, final = {}, {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            texts[o.request_id] = texts.get(o.request_id, "") + (o.text_delta or "")
            ids.setdefault(o.request_id, []).extend(o.new_token_ids or [])
            if o.finished:
                final[o.request_id] = o
    assert engine.scheduler.kv_cache_manager.is_idle_and_leak_free()
    assert ids["reasoning"][0] == tags.end and final["reasoning"].finish_reason == "stop", texts
    assert split_reasoning(texts["reasoning"], opened=True) == ("", texts["reasoning"].split("</think>")[1])
    assert split_reasoning(texts["reasoning"], opened=True)[1] in choices
    assert tags.end not in ids["plain"] and texts["plain"] in choices and final["plain"].finish_reason == "stop"
    # the bias keeps <think> the likeliest token while thinking: the reply thinks to its length
    assert ids["opens"][0] == tags.start and final["opens"].finish_reason == "length"
    assert split_reasoning(texts["opens"])[0] is not None


def _run(engine, requests: dict) -> dict[str, list[int]]:
    """Each request's tokens (`requests`: id -> (prompt, params)), and the batch's structured
    flag after each step under "grammar steps"."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    ids, flags = {}, []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            ids.setdefault(o.request_id, []).extend(o.new_token_ids or [])
        flags.append(engine._batch.grammars)
    assert engine.scheduler.kv_cache_manager.is_idle_and_leak_free()
    return ids | {"grammar steps": flags}


def test_the_engine_ends_a_thinking_at_its_budget(engine, qwen3):
    """A prompt that opened the thinking, a bias against its end tag (the random model would think
    on): with a budget of 3 the reply's fourth token is the end tag (the bias does not stop it), the
    tokens before it those of the reply without a budget; then the reply goes on freely and its
    batch samples on the device again. A reply that does not open its thinking is not changed, nor
    the requests beside it."""
    tags = ThinkTags.of(qwen3.tokenizer)
    opened, unopened = [100, 200, 300, tags.start], [100, 200, 300]
    free = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={tags.end: -100.0}, reasoning_tokens=tags.ids)
    budget = free.updated(thinking_token_budget=3)
    alone = _run(engine, {"thinks": (opened, free), "answers": (unopened, free)})
    assert tags.end not in alone["thinks"] and tags.start not in alone["answers"]
    got = _run(engine, {"budget": (opened, budget), "beside": (opened, free), "unopened": (unopened, budget)})
    assert got["budget"][:4] == [*alone["thinks"][:3], tags.end] and len(got["budget"]) == 8
    assert got["beside"] == alone["thinks"] and got["unopened"] == alone["answers"]
    assert got["grammar steps"][0] and not got["grammar steps"][-1]
    assert not any(alone["grammar steps"])


class _Loaded:
    """What ServedEngine reads of a loaded engine to choose its reasoning tags."""

    def __init__(self, tokenizer):
        self.tokenizer, self.stopped = tokenizer, False

    def shutdown(self):
        self.stopped = True


def test_the_server_reads_reasoning_where_asked_or_where_no_talker_speaks(qwen3):
    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint
    from omni_jax.server.engine import ServedEngine

    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek_r1'"):
        ServedEngine("tiny-qwen3_omni", "q", reasoning_parser="deepseek_r1")
    # auto: not where a talker would speak the thinking (the Qwen3-Omni that reasons has none)
    assert ServedEngine("tiny-qwen3_omni", "q").reasoning_parser == "none"
    asked = ServedEngine("tiny-qwen3_omni", "q", reasoning_parser="qwen3")
    asked.omni = _Loaded(qwen3.tokenizer)
    assert asked._think_tags() == ThinkTags.of(qwen3.tokenizer)
    wrong = ServedEngine("tiny", "tiny", reasoning_parser="qwen3")
    wrong.omni = _Loaded(prompt_processor(tiny_checkpoint()).tokenizer)
    with pytest.raises(ValueError, match="the tokenizer does not have <think> and </think> as single tokens"):
        wrong._think_tags()
    assert wrong.omni.stopped  # the engine that cannot serve so is stopped


def _updates(deltas: list[str], token_ids: list[int], prompt=(1, 2)):
    """A request's updates as the server reads them (one token each)."""
    from types import SimpleNamespace

    return [SimpleNamespace(text_delta=d, finished=k == len(deltas) - 1, token_ids=token_ids[:k + 1],
                            new_token_ids=[token_ids[k]], prompt_token_ids=list(prompt), logprobs=None,
                            text="".join(deltas[:k + 1])) for k, d in enumerate(deltas)]


def test_a_transcript_leaves_the_thinking_out(qwen3):
    """/v1/audio/transcriptions on a reasoning model: each piece's thinking is no part of the
    transcript, streamed or whole."""
    from omni_jax.server.transcription import _Transcript

    tags = ThinkTags.of(qwen3.tokenizer)
    first = _updates(["<think>", "\nthe speaker ", "says hi\n", "</think>", "\n\nHello", " there "],
                     [tags.start, 7, 8, tags.end, 9, 10])
    second = _updates([" World."], [11])
    t = _Transcript([(0.0, 1.0), (1.0, 2.0)], qwen3.tokenizer, False, tags)
    deltas = [t.add(0, out)[0] for out in first] + [t.add(1, out)[0] for out in second]
    assert "".join(deltas) == t.text == "Hello there World."
    assert [p.text for p in t.pieces] == ["Hello there", "World."]
    plain = _Transcript([(0.0, 1.0)], qwen3.tokenizer, False)  # a server that does not read reasoning
    assert "".join(plain.add(0, out)[0] for out in first).startswith("<think>")
