"""OpenAI-compatible HTTP server on `AsyncOmniJax` (`omni-jax serve`) and its load generator (`omni-jax bench`).

Modules, one job each:
    schemas.py    request bodies (pydantic), shaped like OpenAI's API
    errors.py     OpenAI-shaped errors and the exception handlers
    messages.py   OpenAI chat messages -> an OmniJax prompt (media access rules live here)
    stage_params.py  request fields -> per-stage SamplingParams
    audio.py      waveform -> wav / pcm / mp3 / flac / opus / aac bytes
    engine.py     the served engine: start-up in the background, readiness, stage death
    generation.py one request on the engine: submit, stream its updates, abort, map failures to HTTP
    chat.py       POST /v1/chat/completions (whole and streamed)
    speech.py     POST /v1/audio/speech
    metrics.py    Prometheus metrics
    app.py        the FastAPI app: routes, API key, body size limit
    serve.py      `omni-jax serve`: arguments, uvicorn, signals
    bench.py      `omni-jax bench`: a streaming load run against a server (or the library)
"""
