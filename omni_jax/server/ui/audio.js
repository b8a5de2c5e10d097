// Microphone in and reply audio out, both PCM16 mono at 24 kHz (what /v1/realtime speaks).

export const RATE = 24000;
const LEAD_S = 0.08;  // a reply starts this far ahead, so the next piece is in before this one ends

export function base64ToPcm16(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);
}

export function pcm16ToBase64(buffer) {
  const bytes = new Uint8Array(buffer);
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

/** The microphone, posting 50 ms PCM16 pieces to `onPiece` while open. */
export class Mic {
  constructor(ctx, onPiece) {
    this.ctx = ctx;
    this.onPiece = onPiece;
    this.stream = null;
  }

  async open() {
    // Echo cancellation keeps the reply coming out of the speakers from interrupting itself.
    this.stream = await navigator.mediaDevices.getUserMedia(
      {audio: {channelCount: 1, echoCancellation: true, noiseSuppression: true}});
    await this.ctx.audioWorklet.addModule("/ui/capture-worklet.js");
    this.source = this.ctx.createMediaStreamSource(this.stream);
    this.node = new AudioWorkletNode(this.ctx, "pcm16-capture");
    this.node.port.onmessage = (e) => this.onPiece(e.data);
    this.source.connect(this.node);
  }

  close() {
    if (!this.stream) return;
    this.source.disconnect();
    this.node.port.onmessage = null;
    this.stream.getTracks().forEach((t) => t.stop());
    this.stream = null;
  }
}

/** Gapless playback of a reply's pieces as they arrive: each starts where the last one ends. */
export class Player {
  constructor(ctx) {
    this.ctx = ctx;
    this.sources = new Set();
    this.end = 0;          // context time the scheduled audio runs to
    this.start = null;     // context time the current reply's first sample plays
    this.scheduled = 0;    // samples of the current reply handed to the audio context
  }

  get playing() {
    return this.sources.size > 0;
  }

  /** Samples of the current reply heard so far (what a truncation keeps). */
  played() {
    if (this.start === null) return 0;
    return Math.min(this.scheduled, Math.max(0, Math.round((this.ctx.currentTime - this.start) * RATE)));
  }

  play(pcm) {
    const buf = this.ctx.createBuffer(1, pcm.length, RATE);
    const ch = buf.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
    const src = this.ctx.createBufferSource();
    src.buffer = buf;
    src.connect(this.ctx.destination);
    const at = Math.max(this.end, this.ctx.currentTime + LEAD_S);
    if (this.start === null) this.start = at;
    else if (at > this.end) this.start += at - this.end;  // a piece came late: the gap is not heard audio
    src.start(at);
    this.end = at + buf.duration;
    this.scheduled += pcm.length;
    this.sources.add(src);
    src.onended = () => this.sources.delete(src);
  }

  /** Stop at once (barge-in); the next reply starts afresh. */
  stop() {
    for (const src of this.sources) {
      src.onended = null;
      src.stop();
    }
    this.sources.clear();
    this.reset();
  }

  reset() {
    this.end = 0;
    this.start = null;
    this.scheduled = 0;
  }
}

/** An audio file the user attached, as base64 PCM16 at 24 kHz mono. */
export async function fileToPcm16Base64(ctx, file) {
  const decoded = await ctx.decodeAudioData(await file.arrayBuffer());
  const frames = Math.ceil(decoded.duration * RATE);
  const offline = new OfflineAudioContext(1, frames, RATE);
  const src = offline.createBufferSource();
  src.buffer = decoded;
  src.connect(offline.destination);
  src.start();
  const x = (await offline.startRendering()).getChannelData(0);
  const pcm = new Int16Array(x.length);
  for (let i = 0; i < x.length; i++) pcm[i] = Math.max(-1, Math.min(1, x[i])) * 32767;
  return pcm16ToBase64(pcm.buffer);
}
