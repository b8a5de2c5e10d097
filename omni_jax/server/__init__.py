"""OpenAI-compatible HTTP server on `AsyncOmniJax` (`omni-jax serve`) and its load generator (`omni-jax bench`).

Modules, one job each:
    schemas.py    request bodies (pydantic), shaped like OpenAI's API
    errors.py     OpenAI-shaped errors and the exception handlers
    messages.py   OpenAI chat messages -> an OmniJax prompt (media access rules live here)
    stage_params.py  request fields -> per-stage SamplingParams
    audio.py      waveform -> wav / pcm / mp3 / flac / opus / aac bytes
    engine.py     the served engine: start-up in the background, readiness, stage death
    generation.py one request on the engine: submit, stream its updates, abort, map failures to HTTP
    logprobs.py   token logprobs in OpenAI's shape
    structured.py, tools.py, reasoning.py  what the text APIs share: response formats, function
                  calling (spoken_calls.py: a spoken reply's calls), a reasoning model's thinking
    chat.py       POST /v1/chat/completions (whole and streamed)
    reply_audio.py   spoken chat replies kept for a later turn (multi-turn audio)
    speech.py     POST /v1/audio/speech
    transcription.py /v1/audio/transcriptions and /translations; transcription_form.py their form
    audio_pieces.py  long audio cut at its pauses (a transcription's chunking_strategy)
    vad.py        the server VAD (realtime turns, transcription pieces)
    realtime/     /v1/realtime: OpenAI's Realtime API over WebSocket (its own __init__ lists its modules)
    page.py       the voice chat page at / (ui/: its HTML, CSS and JavaScript)
    metrics.py    Prometheus metrics
    sse.py        server-sent events; timeouts.py: the request-header deadline
    app.py        the FastAPI app: routes, API key, body size limit
    serve.py      `omni-jax serve`: arguments, uvicorn, signals
    bench.py      `omni-jax bench`: a streaming load run against a server (or the library);
                  bench_load.py its load machinery, bench_realtime.py its realtime backend
"""
