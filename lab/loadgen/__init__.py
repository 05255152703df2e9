"""``superinfer bench``: an SLO load generator for any OpenAI-compatible server (``core``: the
client and its timing, ``prompts``: prompts of exact token lengths, ``report``: attainment and
tables, ``cli``: the command)."""
