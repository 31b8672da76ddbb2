"""The configuration: TrainConfig, field checks, flags and TOML, prices."""
