"""Video jobs: the job store shared by Router replicas and model groups (SQLite or Redis), per-step
progress reported by workers, and what the Router does for ``/v1/videos``."""
