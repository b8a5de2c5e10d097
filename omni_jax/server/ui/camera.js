// The camera: a live preview on the page, and a still of it (a JPEG data URL) for each turn.

// A still's longer side, in pixels: what Qwen-Omni's processor would bring a larger one down
// toward anyway (448 x 336 is 192 image tokens on the 7B), a few tens of KB on the wire.
export const FRAME_SIDE = 448;

export class Camera {
  constructor(video) {
    this.video = video;     // the <video> the preview plays in
    this.stream = null;
  }

  get open() {
    return this.stream !== null;
  }

  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({video: {width: {ideal: 640}, height: {ideal: 480}}});
    this.video.srcObject = this.stream;
    await this.video.play();
  }

  stop() {
    if (!this.stream) return;
    this.stream.getTracks().forEach((t) => t.stop());
    this.video.srcObject = null;
    this.stream = null;
  }

  /** What the camera shows now, as {url, width, height}; null before its first frame. */
  still(side = FRAME_SIDE) {
    const {videoWidth: w, videoHeight: h} = this.video;
    if (!this.stream || !w || !h) return null;
    const scale = Math.min(1, side / Math.max(w, h));
    const canvas = document.createElement("canvas");
    canvas.width = Math.round(w * scale);
    canvas.height = Math.round(h * scale);
    canvas.getContext("2d").drawImage(this.video, 0, 0, canvas.width, canvas.height);
    return {url: canvas.toDataURL("image/jpeg", 0.85), width: canvas.width, height: canvas.height};
  }
}
