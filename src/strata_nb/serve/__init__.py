"""OpenAI-compatible chat over HTTP. `strata-nb serve` (app.py) queues requests for the one
thread that owns the engine (worker.py), which resumes each prompt from the conversation
cache (conversations.py); `strata-nb probe` (probe.py) checks any such server from the outside."""
