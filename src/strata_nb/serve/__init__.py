"""OpenAI-compatible chat over HTTP: the server (`strata-nb serve`, app.py) and the probe
(`strata-nb probe`, probe.py) that checks any such server from the outside."""
