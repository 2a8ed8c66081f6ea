"""The multi-process runtime: the job's description, the one door into it, and its waits."""
