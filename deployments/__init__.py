"""Ray Serve application of Xema-Ray (``serve run deployments/xema.yaml``)."""
