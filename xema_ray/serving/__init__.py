"""Serving runtime: dispatch policy shared by the live deployment and the simulator."""
