"""`mtp` subcommands contributed by the operator package (entry-point group mtp.commands)."""
