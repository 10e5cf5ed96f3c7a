"""Xema-Ray: trace-guided memory mitigation, static layout and planning for diffusion serving."""

__version__ = "0.1.0"
