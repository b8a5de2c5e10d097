"""The voice chat page (`omni-jax serve` at /) in a real headless Chromium, against a real
server on the tiny model, with a fake microphone playing espeak-ng speech.

Everything is asserted from the page: its DOM and what it keeps in `window.omniStats`
(responses with the samples received from the server and handed to the audio context, the
user's turns and transcripts, the notices it showed). Screenshots of each state go to
`tests/.screenshots/` (ignored; the README's is one of them).
"""

from __future__ import annotations

import json
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets.sync.client as ws_client
import yaml

from browser import Browser
from test_realtime import SR, _speech
from test_server import API_KEY, MODEL, env, media_dir, server  # noqa: F401
from test_server import pipeline_yaml as server_pipeline_yaml  # noqa: F401

pytestmark = pytest.mark.server

SHOTS = Path(__file__).parent / ".screenshots"


@pytest.fixture(scope="module")
def pipeline_yaml(server_pipeline_yaml) -> str:  # noqa: F811
    """test_server's pipeline (its compiles are cached) with test_realtime's audio bucket (a 6.4 s
    spoken turn in one encoder call), and replies that take a while: the
    thinker writes 600 tokens whatever it says (the server's reply is still running when the
    user speaks over it: with 300, one CI run on a loaded 2-core machine saw the first reply end
    before the key press that cancels it reached the server) and the talker speaks 60 to 80
    codes (1.2-1.6 s, the vocoder taking up to 96: a reply still plays when the key press that
    speaks over it lands; with 30 to 40, two CI runs on a loaded 2-core machine saw a 0.8 s
    reply end first)."""
    with open(server_pipeline_yaml) as f:
        cfg = yaml.safe_load(f)
    st = {s["name"]: s for s in cfg["stages"]}
    st["thinker"]["audio_chunk_buckets"] = [1, 4, 32]
    st["thinker"]["default_sampling"] = {"temperature": 0.0, "max_tokens": 600, "ignore_eos": True}
    st["talker"]["default_sampling"] = {**st["talker"]["default_sampling"], "min_tokens": 60, "max_tokens": 80}
    st["token2wav"]["token_buckets"] = [96]
    path = server_pipeline_yaml.replace(".yaml", "_page.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _wav(path: Path, audio: np.ndarray) -> str:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return str(path)


@pytest.fixture(scope="module")
def mic_wavs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("mic")
    return {
        # one turn, then silence for longer than a reply takes
        "turn": _wav(d / "turn.wav", _speech("Hello, what can you hear?", lead_s=0.5, tail_s=20.0)),
        # a file to attach
        "short": _wav(d / "short.wav", _speech("Good morning.", lead_s=0.1, tail_s=0.1)),
        # speech over and over: push to talk decides what is sent
        "chatter": _wav(d / "chatter.wav", _speech("Please tell me a story.", lead_s=0.1, tail_s=0.2)),
    }


@pytest.fixture
def browser(request):
    made = []

    def launch(mic_wav: str | None = None, **kw) -> Browser:
        b = Browser(mic_wav, **kw)
        made.append(b)
        return b

    yield launch
    for b in made:
        b.close()


def _open(b: Browser, server, key: str = API_KEY) -> None:
    b.open(f"{server.url}/#key={key}")
    b.wait_for("omniStats.state === 'connected'", 60, "the page connected")


def _stats(b: Browser) -> dict:
    return b.js("JSON.parse(JSON.stringify(omniStats))")


def _status(b: Browser, i: int) -> str:
    return b.js(f"omniStats.responses[{i}].status")


def _text(b: Browser, selector: str) -> list[str]:
    return b.js(f"[...document.querySelectorAll({selector!r})].map(e => e.textContent)")


def _say_and_let_go(b: Browser) -> None:
    """With the push-to-talk key pressed: speak for 2 s, let go (the turn is sent)."""
    b.wait_for("document.getElementById('talk').getAttribute('aria-pressed') === 'true'", 10)
    b.js("new Promise(r => setTimeout(r, 2000))")
    b.key("keyUp")


def test_page_is_served_and_no_ui_turns_it_off(server):
    page = httpx.get(f"{server.url}/", timeout=10)  # no key needed for the page itself
    assert page.status_code == 200 and "content-security-policy" in page.headers
    assert '<script type="module" src="/ui/app.js">' in page.text
    for name in ("app.js", "audio.js", "realtime.js", "capture-worklet.js", "style.css"):
        assert httpx.get(f"{server.url}/ui/{name}", timeout=10).status_code == 200, name
    voices = httpx.get(f"{server.url}/v1/audio/voices", timeout=10, headers={"Authorization": f"Bearer {API_KEY}"})
    assert voices.json()["voices"][0] == "Chelsie"
    assert httpx.get(f"{server.url}/v1/audio/voices", timeout=10).status_code == 401


def test_spoken_turn_is_heard_and_the_reply_plays(browser, server, mic_wavs):
    b = browser(mic_wavs["turn"])
    _open(b, server)
    assert b.js("[...document.querySelectorAll('#voice option')].map(o => o.value)")[0] == "Chelsie"
    b.screenshot(SHOTS / "01-connected.png")
    b.js("document.getElementById('talk').click()")
    b.wait_for("omniStats.userTurns.length > 0", 60, "a spoken turn")
    done = b.wait_for("omniStats.responses.find(r => r.status !== 'in_progress')", 120, "a finished reply")
    b.wait_for("omniStats.userTurns[0].transcript !== null", 60, "the user's transcript")
    s = _stats(b)
    assert done["status"] in ("completed", "incomplete"), done
    assert done["received"] >= 0.5 * SR and done["scheduled"] == done["received"], done
    assert done["ttfaMs"] is not None and done["text"]
    bubbles = _text(b, "#log li .text")
    assert s["userTurns"][0]["transcript"] in bubbles and done["text"] in bubbles
    assert b.js("document.getElementById('ttfa').textContent").endswith(" ms")
    b.wait_for("!document.getElementById('talk').disabled")
    b.screenshot(SHOTS / "02-spoken-turn.png")
    b.phone(390)
    assert b.js("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
    b.screenshot(SHOTS / "03-phone-width.png")
    b.desktop()
    assert not b.console_errors


def test_captions_only_writes_down_what_is_said_and_answers_nothing(browser, server, mic_wavs):
    """Settings > Captions only: the session turns into a transcription session; a spoken turn is
    written down, no reply comes, and the composer (nothing would answer it) is off."""
    b = browser(mic_wavs["turn"])
    _open(b, server)
    b.js("document.getElementById('settings').open = true")
    b.js("document.getElementById('captions').click()")
    b.wait_for("['send', 'text', 'attach'].every(id => document.getElementById(id).disabled)", 10, "no composer")
    b.js("document.getElementById('talk').click()")
    b.wait_for("omniStats.userTurns.length > 0 && omniStats.userTurns[0].transcript !== null", 120, "a caption")
    b.js("new Promise(r => setTimeout(r, 3000))")  # longer than a reply takes to start here
    s = _stats(b)
    assert s["responses"] == [] and s["userTurns"][0]["transcript"] in _text(b, "#log li .text")
    assert not any(s["notices"]), s["notices"]  # the server took the settings: no error shown
    b.js("document.getElementById('settings').open = false")
    b.screenshot(SHOTS / "04-captions.png")
    assert not b.console_errors


def test_push_to_talk_and_barge_in(browser, server, mic_wavs):
    b = browser(mic_wavs["chatter"])
    _open(b, server)
    b.js("document.getElementById('ptt').click()")
    assert b.js("document.getElementById('talk').textContent") == "Hold to talk"

    def say_and_let_go(reply: int) -> None:
        _say_and_let_go(b)
        b.wait_for(f"omniStats.responses.length > {reply}", 60, f"reply {reply}")

    b.key("keyDown")
    say_and_let_go(0)
    # Speaking again while a reply is being made cancels it at the server: pressed as soon as it
    # begins (its first audio is a second away, its end seconds), so it is still running.
    b.key("keyDown")
    first = b.wait_for("omniStats.responses[0].status !== 'in_progress' && omniStats.responses[0]", 60,
                       "the cancelled reply")
    assert first["status"] == "cancelled" and first["reason"] == "client_cancelled", first
    say_and_let_go(1)
    b.wait_for("omniStats.responses[1].received > 0", 120, "the reply's audio")
    # Speaking over a reply that plays stops it at once: nothing more of it is played or taken,
    # and it is marked as interrupted (the server's end of it may come before or after).
    b.key("keyDown")
    heard = b.wait_for("omniStats.responses[1].cut && omniStats.responses[1].received", 10, "the cut")
    assert b.js("document.querySelector('#log li.assistant.cut .meta').textContent") == "interrupted"
    b.screenshot(SHOTS / "04-barge-in.png")
    cut = b.wait_for("omniStats.responses[1].status !== 'in_progress' && omniStats.responses[1]", 60, "its end")
    assert cut["received"] == cut["scheduled"] == heard, cut
    say_and_let_go(2)
    b.wait_for("omniStats.responses[2].status !== 'in_progress'", 120, "the reply to the third turn")
    assert not b.console_errors


# Put in before the page's own scripts: the realtime socket hands the page nothing of a reply from
# its first audio on until a key is pressed after its end, and then all of it just before the page
# sees the key. The page then plays a reply the server has finished, as when a GPU speaks
# faster than real time, and the user speaks over it at once.
LATE_REPLY = """
(() => {
  const late = window.lateReply = {held: [], seen: [], done: false, release: null};
  window.WebSocket = class extends WebSocket {
    set onmessage(handler) {
      super.onmessage = (m) => {
        const type = JSON.parse(m.data).type;
        late.seen.push(type);
        if (late.release && (late.held.length || type === "response.output_audio.delta")) {
          late.held.push(m);
          late.done ||= type === "response.done";
          return;
        }
        handler(m);
      };
      late.release = () => { late.release = null; for (const m of late.held.splice(0)) handler(m); };
    }
  };
  document.addEventListener("keydown", () => late.done && late.release(), {capture: true});
})();
"""


def test_a_finished_reply_spoken_over_stops_at_once(browser, server, mic_wavs):
    """The server has finished the reply the page plays: speaking over it stops it and marks it,
    with nothing to cancel."""
    b = browser(mic_wavs["chatter"])
    b.call("Page.addScriptToEvaluateOnNewDocument", source=LATE_REPLY)
    _open(b, server)
    b.js("document.getElementById('ptt').click()")
    b.key("keyDown")
    _say_and_let_go(b)
    b.wait_for("lateReply.done", 120, "the reply's end at the server")
    assert b.js("omniStats.responses[0].received") == 0
    b.key("keyDown")  # the reply arrives whole, then the key
    reply = _stats(b)["responses"][0]
    assert reply["status"] == "incomplete" and reply["cut"], reply
    assert reply["received"] == reply["scheduled"] > 0, reply
    assert b.js("document.querySelector('#log li.assistant.cut .meta').textContent") == "interrupted"
    # Nothing to cancel; what was heard of it (nothing) is kept in the conversation.
    b.wait_for("lateReply.seen.includes('conversation.item.truncated')", 10, "the truncation")
    assert "error" not in b.js("lateReply.seen") and not b.console_errors


def test_text_image_and_audio_turns_and_text_replies(browser, server, media_dir, mic_wavs):  # noqa: F811
    b = browser()
    _open(b, server)
    b.js("document.getElementById('speak').click()")  # replies as text
    b.js("document.getElementById('text').value = 'Say something.'")
    b.js("document.getElementById('send').click()")
    first = b.wait_for("omniStats.responses.find(r => r.status !== 'in_progress')", 120, "the text reply")
    assert first["received"] == 0 and first["text"]
    doc = b.call("DOM.getDocument")["root"]["nodeId"]
    node = b.call("DOM.querySelector", nodeId=doc, selector="#attach")["nodeId"]
    b.call("DOM.setFileInputFiles", nodeId=node, files=[str(media_dir / "cat.png")])
    b.wait_for("!document.getElementById('attached').hidden", 10, "the attachment")
    b.js("document.getElementById('text').value = 'What is in this picture?'")
    b.js("document.getElementById('send').click()")
    b.wait_for("omniStats.responses.length > 1 && omniStats.responses[1].status !== 'in_progress'", 120,
               "the reply about the image")
    assert "with cat.png" in _text(b, "#log li.user .meta")
    assert b.js("document.getElementById('attached').hidden")
    b.call("DOM.setFileInputFiles", nodeId=node, files=[mic_wavs["short"]])  # an audio file: heard, no text
    b.wait_for("!document.getElementById('attached').hidden", 10, "the audio attachment")
    b.js("document.getElementById('send').click()")
    b.wait_for("omniStats.responses.length > 2 && omniStats.responses[2].status !== 'in_progress'", 120,
               "the reply about the audio")
    assert _status(b, 2) in ("completed", "incomplete") and "with short.wav" in _text(b, "#log li.user .meta")
    b.screenshot(SHOTS / "05-text-and-image.png")
    assert not b.console_errors


def test_camera_stills_go_before_spoken_typed_and_push_to_talk_turns(browser, server, mic_wavs):
    """With the camera on (Chromium's fake one, 640 x 480), a still of it goes before each turn, an
    item of its own: as a spoken turn begins (the server adds it before the turn's audio), before a
    typed turn, and as a push-to-talk turn is let go. Off, the camera stops."""
    b = browser(mic_wavs["turn"])
    _open(b, server)
    b.js("document.getElementById('camera').click()")
    b.wait_for("document.getElementById('preview').videoWidth > 0 && !document.getElementById('preview').hidden", 30,
               "the camera's preview")
    assert b.js("document.getElementById('camera').getAttribute('aria-pressed')") == "true"
    b.js("document.getElementById('talk').click()")
    b.wait_for("omniStats.responses.find(r => r.status !== 'in_progress')", 120, "the reply to the spoken turn")
    s = _stats(b)
    assert [(it["role"], it["parts"]) for it in s["items"][:3]] == [
        ("user", ["input_image"]), ("user", ["input_audio"]), ("assistant", ["output_audio"])], s["items"]
    assert s["responses"][0]["status"] in ("completed", "incomplete") and not any(s["notices"]), s
    assert s["items"][0]["id"] == s["stills"][0]["item"] and s["items"][1]["id"] == s["userTurns"][0]["item"]
    assert (s["stills"][0]["width"], s["stills"][0]["height"]) == (448, 336), s["stills"]
    assert _text(b, "#log li.user .meta")[0] == "camera" and b.js("document.querySelectorAll('#log img.still').length") == 1
    b.js("document.getElementById('talk').click()")  # the microphone off: the next turns are typed or pushed

    b.js("document.getElementById('text').value = 'What do you see?'")
    b.js("document.getElementById('send').click()")
    b.wait_for("omniStats.responses.length > 1 && omniStats.responses[1].status !== 'in_progress'", 120,
               "the reply to the typed turn")
    parts = [it["parts"] for it in _stats(b)["items"]]
    assert parts[parts.index(["input_text"]) - 1] == ["input_image"], parts
    assert b.js("document.querySelectorAll('#log img.still').length") == 2

    b.js("document.getElementById('ptt').click()")
    b.key("keyDown")
    _say_and_let_go(b)
    b.wait_for("omniStats.items.filter(it => it.parts[0] === 'input_audio').length > 1", 60, "the pushed turn")
    parts = [it["parts"] for it in _stats(b)["items"]]
    pushed = max(i for i, p in enumerate(parts) if p == ["input_audio"])
    assert parts[pushed - 1] == ["input_image"], parts
    assert len(_stats(b)["stills"]) == 3
    b.screenshot(SHOTS / "05-camera-stills.png")

    b.js("document.getElementById('camera').click()")
    assert b.js("document.getElementById('preview').hidden && document.getElementById('preview').srcObject === null")
    assert b.js("document.getElementById('camera').getAttribute('aria-pressed')") == "false"
    assert not b.console_errors


def test_a_still_the_server_refuses_loses_nothing_else(browser, server):
    """A still the server cannot read (here the page's canvas made a broken JPEG): the server's
    error is shown, and the typed turn after it is added and answered."""
    b = browser()
    b.call("Page.addScriptToEvaluateOnNewDocument",
           source="HTMLCanvasElement.prototype.toDataURL = () => 'data:image/jpeg;base64,AAAA';")
    _open(b, server)
    b.js("document.getElementById('speak').click()")  # replies as text
    b.js("document.getElementById('camera').click()")
    b.wait_for("document.getElementById('preview').videoWidth > 0", 30, "the camera's preview")
    b.js("document.getElementById('text').value = 'Hello'")
    b.js("document.getElementById('send').click()")
    reply = b.wait_for("omniStats.responses.find(r => r.status !== 'in_progress')", 120, "the reply")
    s = _stats(b)
    assert reply["status"] in ("completed", "incomplete") and reply["text"], reply
    assert any("image_url" in n and "cannot read" in n for n in s["notices"]), s["notices"]
    assert [it["parts"] for it in s["items"] if it["role"] == "user"] == [["input_text"]], s["items"]
    assert b.js("document.querySelectorAll('#log img.still').length") == 0 and not b.console_errors


def test_the_speed_setting_reaches_the_session_and_is_kept(browser, server):
    """Settings' Speed: the session is updated to it (the server's session.updated says so), and the
    page opens with it next time."""
    b = browser()
    _open(b, server)
    assert b.js("document.getElementById('speed').value") == "1"
    b.js("const s = document.getElementById('speed'); s.value = '1.5'; s.dispatchEvent(new Event('change'))")
    b.wait_for("omniStats.session && omniStats.session.audio.output.speed === 1.5", 30, "the session at speed 1.5")
    _open(b, server)
    assert b.js("document.getElementById('speed').value") == "1.5"
    b.wait_for("omniStats.session && omniStats.session.audio.output.speed === 1.5", 30, "the reopened session")
    assert not b.console_errors


def test_a_model_without_speech_is_explained(browser, server):
    """The page's side of a server started with `--modalities text`, whose /v1/audio/voices lists
    none (here answered by the browser: this module's server speaks)."""
    b = browser()
    b.respond("*/v1/audio/voices", {"voices": []})
    _open(b, server)
    assert "no speech output" in b.js("document.getElementById('notice').textContent")
    assert b.js("['speak', 'voice', 'speed'].every(id => document.getElementById(id).disabled)")
    b.js("document.getElementById('text').value = 'Hello'")
    b.js("document.getElementById('send').click()")
    reply = b.wait_for("omniStats.responses.find(r => r.status !== 'in_progress')", 120, "the text reply")
    assert reply["received"] == 0 and reply["text"]  # the session asked for text
    assert not b.console_errors


def test_denied_microphone_and_camera_and_wrong_key_are_explained(browser, server, mic_wavs):
    b = browser(mic_wavs["turn"], allow_mic=False)
    b.open(f"{server.url}/#key=wrong")
    b.wait_for("omniStats.notices.some(n => n.includes('needs an API key'))", 30, "the key notice")
    assert b.js("document.activeElement.id") == "key"
    b.js("document.getElementById('key').value = " + repr(API_KEY))
    b.js("document.getElementById('reconnect').click()")
    b.wait_for("omniStats.state === 'connected'", 60, "the page connected")
    b.js("document.getElementById('talk').click()")
    b.wait_for("omniStats.notices.some(n => n.includes('Microphone access was denied'))", 30, "the microphone notice")
    assert b.js("document.getElementById('talk').getAttribute('aria-pressed')") == "false"
    b.js("document.getElementById('camera').click()")
    b.wait_for("omniStats.notices.some(n => n.includes('Camera access was denied'))", 30, "the camera notice")
    assert b.js("document.getElementById('camera').getAttribute('aria-pressed') === 'false' && document.getElementById('preview').hidden")
    b.screenshot(SHOTS / "06-microphone-denied.png")
    # the open settings (the key notice opened them) scroll within their half of the screen: the
    # notice, the compose bar and the settings do not overlap
    assert b.js("""(() => { const box = (id) => document.getElementById(id).getBoundingClientRect();
        return document.getElementById('settings').open && box('notice').bottom <= box('compose').top
            && box('compose').bottom <= box('settings').top; })()""")
    # the browser's own log line for the 401 is the only error
    assert all("401" in e for e in b.console_errors), b.console_errors


def test_a_full_server_is_explained_and_retried(browser, server):
    url = server.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    held = []
    try:
        for _ in range(16):  # the server's limit (--max-realtime-sessions)
            held.append(ws_client.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}).__enter__())
            assert json.loads(held[-1].recv(timeout=30))["type"] == "session.created"
        b = browser()
        b.open(f"{server.url}/#key={API_KEY}")
        b.wait_for("omniStats.notices.some(n => n.includes('--max-realtime-sessions'))", 30, "the limit notice")
        assert b.js("omniStats.state") != "connected"
        b.screenshot(SHOTS / "07-server-full.png")
    finally:
        for ws in held:
            ws.close()
    b.wait_for("omniStats.state === 'connected'", 60, "the page connected once a session was free")
    assert not b.console_errors


def test_a_stopped_server_is_shown_and_retried(browser, server):
    """Last: it stops the module's server."""
    b = browser()
    _open(b, server)
    server.proc.terminate()
    server.proc.wait(30)
    b.wait_for("omniStats.state === 'disconnected'", 30, "the page saw the server go")
    b.wait_for("omniStats.notices.some(n => n.includes('Cannot reach the server'))", 30, "the retry notice")
    assert "reconnecting in" in b.js("document.getElementById('status').textContent")
    b.screenshot(SHOTS / "08-server-stopped.png")
