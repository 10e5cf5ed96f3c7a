"""Model configs, read with models.base.load_config: the real ones are the models' published
``config.json`` files (or, where a repository publishes none, what diffusers' conversion scripts
build), the tiny ones scaled-down versions of them for CI; a config's ``_source`` key names its origin."""
