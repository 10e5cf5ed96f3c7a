"""Cluster simulator for the paper's SLO-attainment figures, on the live dispatcher's policy."""
