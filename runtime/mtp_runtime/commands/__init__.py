"""One module per `mtp` subcommand (see mtp_runtime.cli)."""
