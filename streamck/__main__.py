from streamck.cli import entry

entry()
