// A /v1/realtime connection: JSON events out, server events in as DOM events of their type.

export class Realtime extends EventTarget {
  /** Open a session on this page's server; a browser cannot set headers, so the API key
   *  travels as a WebSocket subprotocol, as OpenAI's browser clients send it. */
  constructor(model, key) {
    super();
    const url = new URL("/v1/realtime", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    url.searchParams.set("model", model);
    const protocols = ["realtime"];
    if (key) protocols.push("openai-insecure-api-key." + key);
    this.ws = new WebSocket(url, protocols);
    this.ws.onmessage = (m) => {
      const event = JSON.parse(m.data);
      this.dispatchEvent(new CustomEvent(event.type, {detail: event}));
      this.dispatchEvent(new CustomEvent("*", {detail: event}));
    };
    this.ws.onclose = (e) => this.dispatchEvent(new CustomEvent("close", {detail: {code: e.code, reason: e.reason}}));
    this.ws.onerror = () => {};  // the close event that follows says what happened
  }

  get open() {
    return this.ws.readyState === WebSocket.OPEN;
  }

  on(type, fn) {
    this.addEventListener(type, (e) => fn(e.detail));
  }

  send(event) {
    if (this.open) this.ws.send(JSON.stringify(event));
  }

  close() {
    this.ws.onclose = null;
    this.ws.close();
  }
}
