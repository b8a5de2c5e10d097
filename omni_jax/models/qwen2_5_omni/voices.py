"""Voices and the fixed embeddings of the thinker -> talker handoff, torch-free.

The HF checkpoint keeps voices in `spk_dict.pt` (a torch pickle: per voice a text
bos token, a `cond` speaker vector and a reference mel). Conversion reads it once,
without torch (models/torch_file.py), and writes `voices.safetensors`, so neither
conversion nor serving needs torch. The same file carries the few embedding rows the
handoff needs outside the stage that owns them (the thinker's embeddings of each voice's
bos token, of tts_text_end and tts_text_pad; the talker's codec pad/bos embeddings), so
the orchestrator can build talker inputs without either model's weights.
"""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np

from ...errors import CheckpointError
from .. import torch_file
from ..torch_file import TorchFileError

VOICES_FILE = "voices.safetensors"


@dataclasses.dataclass(frozen=True)
class Voice:
    """One speaker: the thinker token that starts its speech, and the vocoder's conditioning."""

    name: str
    bos_token: int
    bos_embed: np.ndarray  # [thinker hidden]
    cond: np.ndarray       # [1, enc_emb_dim]
    ref_mel: np.ndarray    # [1, frames, mel_dim]


class Voices:
    """The voices of a checkpoint plus the handoff's fixed embedding rows."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self._t = tensors
        self.names = sorted({k.split(".")[1] for k in tensors if k.startswith("voice.")})

    @classmethod
    def load(cls, ckpt_dir: str) -> "Voices":
        path = os.path.join(ckpt_dir, VOICES_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{ckpt_dir} has no {VOICES_FILE}: speech output needs the voices "
                                    f"(reconvert the checkpoint with torch installed to read spk_dict.pt)")
        import safetensors.numpy

        return cls(safetensors.numpy.load_file(path))

    def get(self, name: str | None) -> Voice:
        """The named voice (default: the first); an unknown name lists the available ones."""
        name = name or self.default
        if name not in self.names:
            raise ValueError(f"unknown voice {name!r}; available voices: {', '.join(self.names)}")
        p = f"voice.{name}."
        return Voice(name, int(self._t[p + "bos_token"][0]), self._t[p + "bos_embed"], self._t[p + "cond"],
                     self._t[p + "ref_mel"])

    @property
    def default(self) -> str:
        return "Chelsie" if "Chelsie" in self.names else self.names[0]

    def row(self, name: str) -> np.ndarray:
        """One of text_eos_embed, text_pad_embed, codec_pad_embed, codec_bos_embed."""
        return self._t[name]


def write_voices(out_dir: str, speakers: dict, thinker_embed, talker_embed, talker_cfg) -> None:
    """Write voices.safetensors.

    speakers: {name: {"bos_token": int, "cond": array, "ref_mel": array}};
    thinker_embed / talker_embed: callables giving embedding rows [n, width] for ids.
    """
    import safetensors.numpy

    t: dict[str, np.ndarray] = {}
    for name, spk in speakers.items():
        if "." in name:
            raise ValueError(f"voice name {name!r} must not contain '.'")
        bos = int(spk["bos_token"])
        t[f"voice.{name}.bos_token"] = np.array([bos], np.int64)
        t[f"voice.{name}.bos_embed"] = np.asarray(thinker_embed([bos])[0], np.float32)
        t[f"voice.{name}.cond"] = np.asarray(spk["cond"], np.float32).reshape(1, -1)
        ref = np.asarray(spk["ref_mel"], np.float32)
        t[f"voice.{name}.ref_mel"] = ref.reshape((1,) + ref.shape[-2:])
    eos, pad = thinker_embed([talker_cfg.text_eos, talker_cfg.text_pad])
    t["text_eos_embed"], t["text_pad_embed"] = np.asarray(eos, np.float32), np.asarray(pad, np.float32)
    cpad, cbos = talker_embed([talker_cfg.codec_pad, talker_cfg.codec_bos])
    t["codec_pad_embed"], t["codec_bos_embed"] = np.asarray(cpad, np.float32), np.asarray(cbos, np.float32)
    safetensors.numpy.save_file(t, os.path.join(out_dir, VOICES_FILE))


def read_spk_dict(hf_dir: str) -> dict | None:
    """spk_dict.pt as plain numpy, or None if absent. Read without torch (models/torch_file.py:
    tensors only, no code runs); a file that reader cannot read needs torch (weights_only load)."""
    path = os.path.join(hf_dir, "spk_dict.pt")
    if not os.path.isfile(path):
        return None
    try:
        raw = torch_file.load(path)
    except (TorchFileError, OSError, EOFError, pickle.UnpicklingError) as e:
        raw = _torch_load(path, f"{e}")
    try:
        return {name: {"bos_token": int(spk["bos_token"]), "cond": np.asarray(spk["cond"], np.float32),
                       "ref_mel": np.asarray(spk["ref_mel"], np.float32)} for name, spk in raw.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a voices file: each voice needs bos_token, cond and ref_mel ({e!r})") \
            from None


def _torch_load(path: str, why: str) -> dict:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path} holds the voices in a torch file that cannot be read without torch ({why}): "
                              "install torch (CPU is enough) to convert them; the converted checkpoint needs no "
                              "torch") from None
    raw = torch.load(path, weights_only=True, map_location="cpu")
    return {name: {k: v.float().numpy() if hasattr(v, "numpy") else v for k, v in spk.items()}
            for name, spk in raw.items()}
