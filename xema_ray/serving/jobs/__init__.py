"""Video jobs: the job store shared by Router replicas and model groups (SQLite or Redis), per-step
progress reported by workers, and a group's job lifecycle (accept, start, store results, hand back).
The Router's ``/v1/videos`` endpoints over this store are ``api/video_jobs.py``."""
