"""Offline tools, run by no service process: the simulator (``lab.sim``: the real engine, KV
tiers and policies in virtual time), the GPU cost model and its profiles (``lab.costmodel``,
``lab/profiles``), cost-profile fitting (``lab.profile``), trace readers (``lab.traces``), SLO
metrics (``lab.metrics``) and the load generator behind ``superinfer bench`` (``lab.loadgen``).

Only the CLI (``superinfer``), ``bench/`` and the tests import it
(tests/test_import_rules.py)."""
