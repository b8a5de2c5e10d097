"""The audio encoders' shared host side (models/layers/audio_chunks.py): chunk layout, padding,
feature concatenation, and the errors both families' `prepare_audio_batch` and `encode` give."""

import numpy as np
import pytest

from omni_jax.models.layers.audio_chunks import chunk_audios, concatenated_features, num_chunks_for
from omni_jax.models.qwen2_5_omni.audio_encoder import prepare_audio_batch as prepare_qwen2_5
from omni_jax.models.qwen3_omni.audio_encoder import prepare_audio_batch as prepare_qwen3


def test_chunks_of_audios_in_order_last_one_short():
    c = chunk_audios([5, 8, 3], W=4, num_chunks=6)  # 2 + 2 + 1 chunks, one padding chunk
    assert c.n == 5 and c.per_audio.tolist() == [2, 2, 1] and c.first_chunk.tolist() == [0, 2, 4]
    assert c.audio.tolist() == [0, 0, 1, 1, 2] and c.length.tolist() == [4, 1, 4, 4, 3]
    assert c.frame_mask.sum(1).tolist() == [4, 1, 4, 4, 3, 0]
    # frames of the concatenated features: audio 1 starts at 5, audio 2 at 13
    assert c.frame_index[1].tolist() == [4, 0, 0, 0] and c.frame_index[3].tolist() == [9, 10, 11, 12]
    assert c.frame_index[4].tolist() == [13, 14, 15, 0] and not c.frame_index[5].any()
    assert num_chunks_for([5, 8, 3], 2) == 5


@pytest.mark.parametrize("prepare", [lambda lens, **kw: prepare_qwen2_5(lens, 50, **kw),
                                     lambda lens, **kw: prepare_qwen3(lens, 50, 800, **kw)])
def test_bad_lengths_and_too_small_buckets_are_named(prepare):
    for lens in ([], [30, 0]):
        with pytest.raises(ValueError, match="every audio needs at least one mel frame"):
            prepare(lens)
    with pytest.raises(ValueError, match=r"num_chunks=2 is smaller than the 3 chunks needed"):
        prepare([250], num_chunks=2)
    with pytest.raises(ValueError, match=r"num_tokens=1 is smaller than the"):
        prepare([250], num_tokens=1)
    assert prepare([250], num_chunks=4).frame_mask.shape == (4, 100)


def test_features_concatenated_checked_and_padded():
    a, b = np.ones((2, 3), np.float32), np.full((2, 2), 2, np.float32)
    feats, lens = concatenated_features([a, b], num_frames=8)
    assert lens.tolist() == [3, 2] and feats.shape == (2, 8) and feats[0].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    same, lens2 = concatenated_features(feats[:, :5], [3, 2])
    assert np.array_equal(same, feats[:, :5]) and lens2.tolist() == [3, 2]
    for args, message in [(([a, b], [3, 3]), "feature_lens does not match"),
                          ((feats,), "feature_lens is required"),
                          ((feats[:, :4], [3, 2]), "features have 4 frames, feature_lens need 5"),
                          (([a, b], None, 4), "num_frames=4 is smaller than the 5 frames")]:
        with pytest.raises(ValueError, match=message):
            concatenated_features(*args)
