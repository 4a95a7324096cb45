"""Model architectures (one file each), their MTP draft modules, and checkpoint loading."""
