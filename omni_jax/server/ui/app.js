// The voice chat page: the microphone streams to /v1/realtime, server VAD takes the turns, the
// reply plays as it streams and speaking over it interrupts it; with the camera on, a still of it
// goes before each turn. What the page saw is kept in `window.omniStats` (and shown), so a
// person or a test can read it.
import {Mic, Player, RATE, base64ToPcm16, fileToPcm16Base64, pcm16ToBase64} from "./audio.js";
import {Camera} from "./camera.js";
import {Realtime} from "./realtime.js";

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), model: $("model"), notice: $("notice"), log: $("log"), talk: $("talk"), text: $("text"),
  send: $("send"), attach: $("attach"), attached: $("attached"), unattach: $("unattach"), voice: $("voice"),
  speed: $("speed"), speak: $("speak"), ptt: $("ptt"), captions: $("captions"), instructions: $("instructions"),
  key: $("key"), reconnect: $("reconnect"), camera: $("camera"), preview: $("preview"),
  ttfa: $("ttfa"), settings: $("settings"), compose: $("compose"),
};
// items: what the server added to the conversation, in order ({id, role, parts: [type, ...]});
// stills: the camera stills sent ({item, width, height, bytes})
const stats = window.omniStats = {state: "connecting", responses: [], userTurns: [], notices: [], items: [], stills: []};
const camera = new Camera(ui.preview);

let model = null, voices = [], rt = null, ctx = null, mic = null, player = null;
let micOn = false, pttHeld = false, retries = 0, retryTimer = null, attachment = null;
let turnEnd = null;   // when the user's last turn ended (performance.now()): time to first audio counts from it
let active = null;    // the response in progress: its stats record
let playing = null;   // the response whose audio the player holds
const bubbles = new Map();  // item id -> its <li>
const stillUrls = new Map();  // a still's item id -> its data URL, until the server has added it

// ---------------------------------------------------------------- what the user sees

function setState(state, text) {
  stats.state = state;
  ui.status.dataset.state = state;
  ui.status.textContent = text;
  enableControls();
}

/** Talking once connected; typing and sending too, but not for captions (nothing answers). */
function enableControls() {
  const ready = stats.state === "connected";
  ui.talk.disabled = !ready;
  ui.send.disabled = !ready || ui.captions.checked;
  ui.text.disabled = ui.attach.disabled = ui.camera.disabled = ui.captions.checked;
}

function notify(message) {
  stats.notices.push(message);
  ui.notice.textContent = message;
  ui.notice.hidden = !message;
}

function bubble(id, who, text = "") {
  let li = id && bubbles.get(id);
  if (!li) {
    li = document.createElement("li");
    li.className = who;
    li.innerHTML = '<p class="who"></p><p class="text"></p><p class="meta"></p>';
    li.querySelector(".who").textContent = who === "user" ? "You" : "Model";
    ui.log.append(li);
    if (id) bubbles.set(id, li);
  }
  if (text) li.querySelector(".text").textContent = text;
  follow();
  return li;
}

/** Keep the newest words in view (a transcript filled in later must not pull the view back up). */
const follow = () => { ui.log.scrollTop = ui.log.scrollHeight; };
const append = (li, delta) => { li.querySelector(".text").textContent += delta; follow(); };
const meta = (li, text) => { li.querySelector(".meta").textContent = text; };
/** A camera still in its bubble, above any words. */
function showStill(li, url) {
  const img = document.createElement("img");
  img.className = "still";
  img.alt = "What the camera showed";
  img.src = url;
  li.querySelector(".text").before(img);
  follow();
}

/** A reply the user spoke over (or cancelled): dimmed and said so. */
function markCut(item) {
  const li = item && bubbles.get(item);
  if (li) li.classList.add("cut"), meta(li, "interrupted");
}

// ---------------------------------------------------------------- settings

/** The settings of the last visit; the API key from the address (`#key=...`) or this tab. */
function loadSettings() {
  const saved = JSON.parse(localStorage.getItem("omni-jax-ui") || "{}");
  ui.speak.checked = saved.speak ?? true;
  ui.ptt.checked = saved.ptt ?? false;
  ui.captions.checked = saved.captions ?? false;
  ui.instructions.value = saved.instructions ?? "";
  ui.speed.value = saved.speed ?? "1";
  ui.voice.append(new Option(saved.voice ?? "", saved.voice ?? ""));  // chosen again once the list is in
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  ui.key.value = fromHash ?? sessionStorage.getItem("omni-jax-key") ?? "";
}

function saveSettings() {
  localStorage.setItem("omni-jax-ui", JSON.stringify(
    {speak: ui.speak.checked, ptt: ui.ptt.checked, captions: ui.captions.checked, instructions: ui.instructions.value,
     voice: ui.voice.value, speed: ui.speed.value}));
  sessionStorage.setItem("omni-jax-key", ui.key.value);
}

function sessionFields() {
  const speak = ui.speak.checked && voices.length > 0;
  const audio = {input: {turn_detection: ui.ptt.checked ? null : {type: "server_vad"}, transcription: {model}}};
  if (ui.captions.checked) return {type: "transcription", audio};  // a session that only transcribes
  if (speak) audio.output = {voice: ui.voice.value, speed: Number(ui.speed.value)};
  return {type: "realtime", instructions: ui.instructions.value, output_modalities: [speak ? "audio" : "text"], audio};
}

function applySettings() {
  saveSettings();
  ui.talk.textContent = ui.ptt.checked ? "Hold to talk" : micOn ? "Stop talking" : "Start talking";
  enableControls();
  if (rt && rt.open) rt.send({type: "session.update", session: sessionFields()});
}

// ---------------------------------------------------------------- connecting

async function api(path) {
  const headers = ui.key.value ? {Authorization: `Bearer ${ui.key.value}`} : {};
  const r = await fetch(path, {headers});
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw Object.assign(new Error(body.error?.message || `${path}: HTTP ${r.status}`), {status: r.status});
  return body;
}

async function connect() {
  clearTimeout(retryTimer);
  if (rt) rt.close();
  rt = null;
  setState("connecting", "Connecting…");
  try {
    model = (await api("/v1/models")).data[0].id;
    voices = (await api("/v1/audio/voices")).voices;
  } catch (e) {
    if (e.status === 401) {
      setState("disconnected", "Needs an API key");
      notify("This server needs an API key: enter it under Settings and press Reconnect.");
      ui.settings.open = true;
      ui.key.focus();
      return;
    }
    const why = e.status === 503 ? `The server is not ready: ${e.message}` : "Cannot reach the server.";
    return retryLater(why);
  }
  ui.model.textContent = model;
  fillVoices();
  rt = new Realtime(model, ui.key.value);
  rt.on("session.created", () => {
    retries = 0;
    notify(voices.length ? "" : "This model has no speech output: replies come as text.");
    setState("connected", "Connected");
    applySettings();
  });
  rt.on("close", ({reason}) => {
    rt = null;
    stopMic();
    if (player) player.stop();
    active = playing = null;
    retryLater(reason ? `The server closed the session: ${reason}` : "The connection to the server dropped.");
  });
  listen(rt);
}

function retryLater(why) {
  const wait = Math.min(2 ** retries++, 30);
  setState("disconnected", `Disconnected; reconnecting in ${wait} s`);
  notify(`${why.replace(/\.?$/, ".")} Reconnecting in ${wait} s (or press Reconnect under Settings).`);
  retryTimer = setTimeout(connect, wait * 1000);
}

function fillVoices() {
  const want = ui.voice.value;
  ui.voice.replaceChildren(...voices.map((v) => new Option(v, v)));
  if (voices.includes(want)) ui.voice.value = want;
  ui.voice.disabled = ui.speed.disabled = ui.speak.disabled = voices.length === 0;
}

// ---------------------------------------------------------------- audio

function audioContext() {
  if (!ctx) {
    ctx = new AudioContext();
    player = new Player(ctx);
  }
  if (ctx.state === "suspended") ctx.resume();
  return ctx;
}

async function startMic() {
  if (mic) return true;
  const m = new Mic(audioContext(), (buffer) => {
    if (rt && (micOn || pttHeld)) rt.send({type: "input_audio_buffer.append", audio: pcm16ToBase64(buffer)});
  });
  try {
    await m.open();
  } catch (e) {
    notify(e.name === "NotAllowedError" ? "Microphone access was denied: allow it in the browser's site settings, or type instead."
      : e.name === "NotFoundError" ? "No microphone was found: plug one in, or type instead."
      : `The microphone could not start: ${e.message}`);
    return false;
  }
  mic = m;
  return true;
}

function stopMic() {
  micOn = pttHeld = false;
  if (mic) mic.close();
  mic = null;
  ui.talk.setAttribute("aria-pressed", "false");
  applySettings();
}

/** The user speaks over the reply: silence it, keep what was heard of it, stop the rest. */
function interrupt({cancel}) {
  if (playing && player.playing) {
    const heardMs = Math.floor((player.played() * 1000) / RATE);
    player.stop();
    playing.cut = true;
    markCut(playing.item);  // also when the server had finished it: the rest was not heard
    rt.send({type: "conversation.item.truncate", item_id: playing.item, content_index: 0, audio_end_ms: heardMs});
  }
  if (cancel && active) rt.send({type: "response.cancel"});
}

async function toggleTalk() {
  if (micOn) return stopMic();
  if (!(await startMic())) return;
  micOn = true;
  ui.talk.setAttribute("aria-pressed", "true");
  applySettings();
}

async function pttDown() {
  if (pttHeld || !rt) return;
  pttHeld = true;
  ui.talk.setAttribute("aria-pressed", "true");
  interrupt({cancel: true});
  rt.send({type: "input_audio_buffer.clear"});
  if (!(await startMic())) pttHeld = false;
}

function pttUp() {
  if (!pttHeld) return;
  pttHeld = false;
  ui.talk.setAttribute("aria-pressed", "false");
  turnEnd = performance.now();
  sendStill();
  rt.send({type: "input_audio_buffer.commit"});
  if (!ui.captions.checked) rt.send({type: "response.create"});
}

// ---------------------------------------------------------------- camera

async function toggleCamera() {
  if (camera.open) {
    camera.stop();
  } else {
    try {
      await camera.start();
    } catch (e) {
      camera.stop();
      notify(e.name === "NotAllowedError" ? "Camera access was denied: allow it in the browser's site settings to show the model what it sees."
        : e.name === "NotFoundError" ? "No camera was found."
        : `The camera could not start: ${e.message}`);
    }
  }
  ui.camera.setAttribute("aria-pressed", String(camera.open));
  ui.preview.hidden = !camera.open;
}

/** With the camera on, a still of it goes before the user's turn, an item of its own (one the
 * server refuses loses nothing else): as a spoken turn begins (server VAD) or is let go (push to
 * talk), and before a typed turn. */
function sendStill() {
  const still = rt && camera.open && !ui.captions.checked ? camera.still() : null;
  if (!still) return;
  const id = `still_${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
  stats.stills.push({item: id, width: still.width, height: still.height, bytes: still.url.length});
  stillUrls.set(id, still.url);
  // the event's id is the item's: an error for it (the server refused the still) forgets its URL
  rt.send({type: "conversation.item.create", event_id: id,
           item: {id, type: "message", role: "user", content: [{type: "input_image", image_url: still.url}]}});
}

// ---------------------------------------------------------------- server events

const responseOf = (id) => stats.responses.find((r) => r.id === id);

function listen(rt) {
  rt.on("session.updated", (e) => { stats.session = e.session; });  // the settings as the server took them
  rt.on("input_audio_buffer.speech_started", () => {
    interrupt({cancel: false});  // the server cancels the reply
    sendStill();  // added before the turn's audio, which the server adds when the turn ends
  });
  rt.on("conversation.item.added", (e) => {
    stats.items.push({id: e.item.id, role: e.item.role ?? null, parts: (e.item.content ?? []).map((p) => p.type)});
    const url = stillUrls.get(e.item.id);
    if (url === undefined) return;
    stillUrls.delete(e.item.id);
    const li = bubble(e.item.id, "user");
    showStill(li, url);
    meta(li, "camera");
  });
  rt.on("input_audio_buffer.speech_stopped", () => { turnEnd = performance.now(); });
  rt.on("input_audio_buffer.committed", (e) => {
    stats.userTurns.push({item: e.item_id, transcript: null});
    meta(bubble(e.item_id, "user", "…"), "spoken");
  });
  rt.on("conversation.item.input_audio_transcription.delta", (e) => {
    const li = bubble(e.item_id, "user");
    if (li.querySelector(".text").textContent === "…") li.querySelector(".text").textContent = "";
    append(li, e.delta);
  });
  rt.on("conversation.item.input_audio_transcription.completed", (e) => {
    const turn = stats.userTurns.find((t) => t.item === e.item_id);
    if (turn) turn.transcript = e.transcript;
    bubble(e.item_id, "user", e.transcript || "(nothing heard)");
  });
  rt.on("conversation.item.input_audio_transcription.failed", (e) => bubble(e.item_id, "user", "(not transcribed)"));
  rt.on("response.created", (e) => {
    active = {id: e.response.id, item: null, status: "in_progress", reason: null, text: "", received: 0, scheduled: 0,
              ttfaMs: null, cut: false};
    stats.responses.push(active);
  });
  rt.on("response.output_item.added", (e) => {
    if (!active || active.id !== e.response_id) return;
    active.item = e.item.id;
    bubble(e.item.id, "assistant");
  });
  const onText = (e) => {
    const r = responseOf(e.response_id);
    if (!r) return;
    r.text += e.delta;
    append(bubble(e.item_id, "assistant"), e.delta);
  };
  rt.on("response.output_audio_transcript.delta", onText);
  rt.on("response.output_text.delta", onText);
  rt.on("response.output_audio.delta", (e) => {
    const r = responseOf(e.response_id);
    if (!r || r.cut) return;
    const pcm = base64ToPcm16(e.delta);
    if (r.received === 0 && turnEnd !== null) {
      r.ttfaMs = Math.round(performance.now() - turnEnd);
      ui.ttfa.textContent = `${r.ttfaMs} ms`;
      meta(bubble(e.item_id, "assistant"), `first audio after ${r.ttfaMs} ms`);
    }
    r.received += pcm.length;
    if (playing !== r) {
      if (!player.playing) player.reset();
      playing = r;
    }
    player.play(pcm);
    r.scheduled += pcm.length;
  });
  rt.on("response.done", (e) => {
    const r = responseOf(e.response.id);
    if (!r) return;
    r.status = e.response.status;
    r.reason = e.response.status_details?.reason ?? null;
    if (r.status === "cancelled") markCut(r.item);
    if (r.status === "failed") notify(`The reply failed: ${e.response.status_details?.error?.message ?? "unknown error"}`);
    if (active === r) active = null;
  });
  rt.on("error", (e) => {
    stillUrls.delete(e.error.event_id);
    if (e.error.code === "response_cancel_not_active") return;  // the reply ended as we cancelled it
    notify(e.error.message);
  });
}

// ---------------------------------------------------------------- typing and attaching

async function sendTurn(ev) {
  ev.preventDefault();
  const text = ui.text.value.trim();
  if (!rt || (!text && !attachment)) return;
  audioContext();  // a click lets the page play the reply
  interrupt({cancel: true});
  sendStill();
  const content = attachment ? [attachment.part] : [];
  if (text) content.push({type: "input_text", text});
  const li = bubble(null, "user", text);
  if (attachment) meta(li, `with ${attachment.name}`);
  rt.send({type: "conversation.item.create", item: {type: "message", role: "user", content}});
  rt.send({type: "response.create"});
  turnEnd = performance.now();
  ui.text.value = "";
  setAttachment(null);
}

async function attach() {
  const file = ui.attach.files[0];
  if (!file) return;
  try {
    if (file.type.startsWith("image/")) {
      const url = await new Promise((ok, fail) => {
        const r = new FileReader();
        r.onload = () => ok(r.result);
        r.onerror = () => fail(r.error);
        r.readAsDataURL(file);
      });
      setAttachment({name: file.name, part: {type: "input_image", image_url: url}});
    } else {
      setAttachment({name: file.name, part: {type: "input_audio", audio: await fileToPcm16Base64(audioContext(), file)}});
    }
  } catch (e) {
    notify(`${file.name} could not be read: ${e.message}`);
  }
  ui.attach.value = "";
}

function setAttachment(a) {
  attachment = a;
  ui.attached.hidden = !a;
  ui.attached.querySelector("span").textContent = a ? `Next turn includes ${a.name}` : "";
}

// ---------------------------------------------------------------- wiring

const typing = (el) => el.matches("input, textarea, select, [contenteditable]");
ui.talk.addEventListener("click", () => { if (!ui.ptt.checked) toggleTalk(); });
ui.talk.addEventListener("pointerdown", () => { if (ui.ptt.checked) pttDown(); });
ui.talk.addEventListener("pointerup", () => { if (ui.ptt.checked) pttUp(); });
ui.talk.addEventListener("pointerleave", () => { if (ui.ptt.checked) pttUp(); });
document.addEventListener("keydown", (e) => {
  if (e.code === "Space" && ui.ptt.checked && !typing(e.target) && !e.repeat) {
    e.preventDefault();
    pttDown();
  }
});
document.addEventListener("keyup", (e) => {
  if (e.code === "Space" && ui.ptt.checked && !typing(e.target)) {
    e.preventDefault();
    pttUp();
  }
});
ui.compose.addEventListener("submit", sendTurn);
ui.attach.addEventListener("change", attach);
ui.camera.addEventListener("click", toggleCamera);
ui.unattach.addEventListener("click", () => setAttachment(null));
ui.ptt.addEventListener("change", () => {  // the open microphone stops streaming: the button sends now
  micOn = false;
  ui.talk.setAttribute("aria-pressed", "false");
});
for (const el of [ui.voice, ui.speed, ui.speak, ui.ptt, ui.captions, ui.instructions]) {
  el.addEventListener("change", applySettings);
}
ui.reconnect.addEventListener("click", () => { retries = 0; saveSettings(); connect(); });

loadSettings();
connect();
