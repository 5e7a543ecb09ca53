"""One module per `mtpkit` command: its options and a call into the library (cli.py registers them)."""
