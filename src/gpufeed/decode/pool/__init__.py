"""The CPU decode worker processes and what crosses to them: the job board, the ticket and done
pipes, the pixels' shared segments. `worker` runs in the workers (numpy and Pillow, no torch);
this package imports nothing at import."""
