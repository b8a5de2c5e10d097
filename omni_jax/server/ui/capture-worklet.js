// The microphone as PCM16 at 24 kHz, in 50 ms pieces posted to the page: the rate /v1/realtime
// takes. The audio context runs at the device's rate (`sampleRate`); linear interpolation is
// enough for speech going to a VAD and an audio encoder that hears 16 kHz.
const OUT_RATE = 24000;
const PIECE = OUT_RATE / 20;

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / OUT_RATE;  // input samples per output sample
    this.pos = 0;                       // where the next output sample falls in `last` + input
    this.last = 0;                      // the previous block's final sample
    this.out = new Int16Array(PIECE);
    this.n = 0;
  }

  process(inputs) {
    const x = inputs[0] && inputs[0][0];
    if (!x) return true;
    // Output sample at input position p interpolates x[p-1]..x[p] (x[-1] is `last`).
    while (this.pos < x.length) {
      const i = Math.floor(this.pos), f = this.pos - i;
      const a = i === 0 ? this.last : x[i - 1], b = x[i];
      const v = Math.max(-1, Math.min(1, a + (b - a) * f));
      this.out[this.n++] = v < 0 ? v * 32768 : v * 32767;
      if (this.n === PIECE) {
        this.port.postMessage(this.out.buffer, [this.out.buffer]);
        this.out = new Int16Array(PIECE);
        this.n = 0;
      }
      this.pos += this.step;
    }
    this.pos -= x.length;
    this.last = x[x.length - 1];
    return true;
  }
}

registerProcessor("pcm16-capture", Capture);
