"""The offline planner (paper §7): SP × DP × batch × mitigation per template, best goodput under the SLO."""
