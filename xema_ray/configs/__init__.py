"""Model configs (real and tiny), copied from shared/model-configs; read with models.base.load_config."""
