"""Answer phone calls with OmniJax: a bridge between Twilio's Media Streams and /v1/realtime.

A call to your Twilio number asks this bridge's /incoming-call for TwiML, which connects the
call's audio to the bridge's /media-stream WebSocket. For each call the bridge opens a realtime
session on the OmniJax server in G.711 mu-law, the phone line's own format (nothing is
transcoded here), and passes audio both ways: the caller's into input_audio_buffer.append, the
reply's back to the call. The server's VAD takes the turns; when the caller speaks over a reply,
the server stops it and the bridge tells Twilio to drop what it still had queued.

    omni-jax serve --model /path/to/Qwen2.5-Omni-7B-converted --api-key KEY
    python examples/phone_call.py --server ws://127.0.0.1:8000/v1/realtime --api-key KEY --port 5050
    # expose port 5050 over https (a reverse proxy, or e.g. `ngrok http 5050`) and set the
    # number's "A call comes in" webhook to https://<that host>/incoming-call
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

import websockets
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response
from starlette.websockets import WebSocketDisconnect

log = logging.getLogger("phone_call")
INSTRUCTIONS = "You are a helpful assistant answering a phone call. Keep your answers short."
G711 = {"format": {"type": "audio/pcmu"}}  # what Twilio's media streams carry, both ways


def build_app(server: str, api_key: str | None = None, instructions: str = INSTRUCTIONS,
              voice: str | None = None) -> FastAPI:
    """The bridge's app: `server` is the OmniJax realtime URL (ws://host:port/v1/realtime)."""
    app = FastAPI()

    @app.post("/incoming-call")
    async def incoming_call(request: Request):
        # Twilio connects the call to the stream on the host it reached this bridge at.
        stream = f"wss://{request.headers['host']}/media-stream"
        return Response(f'<?xml version="1.0" encoding="UTF-8"?><Response><Connect><Stream url="{stream}"/>'
                        f'</Connect></Response>', media_type="application/xml")

    @app.websocket("/media-stream")
    async def media_stream(call: WebSocket):
        await call.accept()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with websockets.connect(server, additional_headers=headers, max_size=None) as omni:
            output = {**G711, **({"voice": voice} if voice else {})}
            await omni.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "instructions": instructions, "audio": {"input": G711, "output": output}}}))
            stream_sid = asyncio.get_running_loop().create_future()  # Twilio's id of this call's stream

            async def caller_to_model():
                try:
                    async for text in call.iter_text():
                        msg = json.loads(text)
                        if msg["event"] == "start":
                            stream_sid.set_result(msg["start"]["streamSid"])
                        elif msg["event"] == "media":  # 20 ms of mu-law, base64, as the server takes it
                            await omni.send(json.dumps({"type": "input_audio_buffer.append",
                                                        "audio": msg["media"]["payload"]}))
                        elif msg["event"] == "stop":
                            return
                except WebSocketDisconnect:
                    return

            async def model_to_caller():
                sid = await stream_sid
                async for text in omni:
                    event = json.loads(text)
                    if event["type"] == "response.output_audio.delta":
                        await call.send_text(json.dumps({"event": "media", "streamSid": sid,
                                                         "media": {"payload": event["delta"]}}))
                    elif event["type"] == "input_audio_buffer.speech_started":  # barge-in
                        await call.send_text(json.dumps({"event": "clear", "streamSid": sid}))
                    elif event["type"] == "error":
                        log.warning("omni-jax: %s", event["error"]["message"])

            tasks = [asyncio.ensure_future(caller_to_model()), asyncio.ensure_future(model_to_caller())]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # the call ended, or the server left
            for t in tasks:
                t.cancel()

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="ws://127.0.0.1:8000/v1/realtime", help="OmniJax's realtime URL")
    parser.add_argument("--api-key", default=None, help="the OmniJax server's --api-key, if it has one")
    parser.add_argument("--instructions", default=INSTRUCTIONS)
    parser.add_argument("--voice", default=None, help="one of the model's voices (default: its first)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5050)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(build_app(args.server, args.api_key, args.instructions, args.voice), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
