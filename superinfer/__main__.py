from superinfer.cli import run

run()
