"""The async reader's side of a request's updates: nothing lost, nothing reordered, and
updates the reader has not taken yet merged into one."""

import asyncio
import threading

import numpy as np

from omni_jax.runtime.outputs import OmniRequestOutput
from omni_jax.update_collector import UpdateCollector


def _update(i: int, audio: bool, finished: bool = False) -> OmniRequestOutput:
    return OmniRequestOutput(request_id="r", token_ids=list(range(i + 1)), text="".join(map(str, range(i + 1))),
                             text_delta=str(i), new_token_ids=[i], finished=finished,
                             audio_delta=np.full(3, i, np.float32) if audio else None)


def test_updates_not_yet_read_merge_into_one():
    async def go():
        c = UpdateCollector(asyncio.get_running_loop())
        for i in range(4):  # nobody reads meanwhile
            c.put(_update(i, audio=i in (1, 3)))
        merged = await c.get()
        assert merged.text_delta == "0123" and merged.new_token_ids == [0, 1, 2, 3]
        assert merged.token_ids == [0, 1, 2, 3] and merged.text == "0123"  # the newest cumulative state
        np.testing.assert_array_equal(merged.audio_delta, [1, 1, 1, 3, 3, 3])
        c.put(_update(4, audio=False, finished=True))
        last = await c.get()
        assert last.text_delta == "4" and last.audio_delta is None and last.finished

    asyncio.run(asyncio.wait_for(go(), 10))


def test_updates_from_another_thread_arrive_whole_and_in_order():
    """A producer thread racing the reader: the deltas read join to exactly what was put."""

    async def go():
        c = UpdateCollector(asyncio.get_running_loop())
        n = 2000

        def produce():
            for i in range(n):
                c.put(_update(i, audio=i % 3 == 0, finished=i == n - 1))

        threading.Thread(target=produce).start()
        tokens, audio, reads = [], [], 0
        while True:
            out = await c.get()
            reads += 1
            tokens += out.new_token_ids
            if out.audio_delta is not None:
                audio.append(out.audio_delta)
            if reads % 7 == 0:
                await asyncio.sleep(0.001)  # a slow reader now and then
            if out.finished:
                break
        assert tokens == list(range(n))
        np.testing.assert_array_equal(np.concatenate(audio), np.repeat(np.arange(0, n, 3), 3))
        assert reads < n  # some were merged

    asyncio.run(asyncio.wait_for(go(), 30))
